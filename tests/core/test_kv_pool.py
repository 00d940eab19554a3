"""PagePool: modes, sizing, slot mapping, extend, bind_tasks, capacity and stats."""

from __future__ import annotations

import pytest
import torch

from astrai.errors import CapacityExceeded
from astrai.kvcache import (
    KVConfig,
    KVStorage,
    PagePool,
    assert_nothing_held,
    check_pool_invariants,
)

N_LAYERS, N_HEADS, N_KV_HEADS, HEAD_DIM = 2, 4, 2, 8


def make_pool(config: KVConfig, dtype: torch.dtype = torch.float32) -> PagePool:
    return PagePool(N_LAYERS, N_HEADS, N_KV_HEADS, HEAD_DIM, config, dtype, "cpu")


def test_contiguous_is_the_default_with_a_linear_map():
    pool = make_pool(KVConfig(max_batch_size=3, max_seq_len=10))
    assert not pool.paged and pool.radix is None and pool.allocator is None
    assert pool.size == 30 and pool.max_ctx_len == 10
    assert pool.k_buffer.shape == (N_LAYERS, 30, N_KV_HEADS, HEAD_DIM) == pool.v_buffer.shape
    expected = [[row * 10 + pos for pos in range(10)] for row in range(3)]
    assert pool.req_to_token.dtype == torch.int32
    assert pool.req_to_token.tolist() == expected
    row = pool.task_alloc()
    assert pool.match_prefix(row, [1, 2, 3, 4, 5]) == 0
    assert pool.extend(row, 10)
    assert pool.req_len(row) == 10
    with pytest.raises(CapacityExceeded):
        pool.extend(row, 11)
    assert pool.stats() == {
        "kv_tokens_total": 30,
        "kv_tokens_in_use": 10,
        "kv_tokens_cached": 0,
        "kv_cache_dtype_k": "float32",
        "kv_cache_dtype_v": "float32",
        "kv_bytes_per_token": 2 * N_LAYERS * N_KV_HEADS * HEAD_DIM * 4,
    }
    assert pool.available_tokens() == 20
    assert pool.can_ever_fit(10) and not pool.can_ever_fit(11)
    pool.task_free(row)
    check_pool_invariants(pool)
    assert_nothing_held(pool)


def test_task_alloc_raises_when_every_row_is_live_and_rows_are_reused():
    pool = make_pool(KVConfig(max_batch_size=2, max_seq_len=4))
    rows = [pool.task_alloc(), pool.task_alloc()]
    assert sorted(rows) == [0, 1]
    with pytest.raises(CapacityExceeded):
        pool.task_alloc()
    pool.task_free(rows[0])
    assert pool.task_alloc() == rows[0]
    with pytest.raises(ValueError):
        pool.task_free(5)


def test_task_free_twice_raises():
    pool = make_pool(KVConfig(max_batch_size=2, max_seq_len=4, n_tokens=8))
    row = pool.task_alloc()
    pool.task_free(row)
    with pytest.raises(ValueError):
        pool.task_free(row)
    with pytest.raises(ValueError):
        pool.extend(row, 1)


@pytest.mark.parametrize("dtype", [torch.float16, torch.float32], ids=["f16", "f32"])
def test_memory_budget_becomes_whole_pages(dtype):
    per_token = 2 * N_LAYERS * N_KV_HEADS * HEAD_DIM * dtype.itemsize
    assert KVStorage.bytes_per_token(N_LAYERS, N_KV_HEADS, HEAD_DIM, dtype) == per_token
    pool = make_pool(KVConfig(page_size=4, memory_budget_bytes=per_token * 39 + 7), dtype)
    assert pool.paged and pool.size == 36 and pool.allocator.n_pages == 9
    assert pool.storage.nbytes() == 36 * per_token
    with pytest.raises(ValueError):
        make_pool(KVConfig(page_size=4, memory_budget_bytes=per_token * 3), dtype)


def test_config_rejects_nonsense():
    with pytest.raises(ValueError):
        KVConfig(n_tokens=64, memory_budget_bytes=1 << 20)
    with pytest.raises(ValueError):
        KVConfig(page_size=0)
    with pytest.raises(ValueError):
        KVConfig(n_tokens=0)


def test_n_tokens_is_floored_to_whole_pages():
    pool = make_pool(KVConfig(page_size=4, n_tokens=30))
    assert pool.size == 28 and pool.allocator.n_pages == 7


@pytest.mark.parametrize("page_size", [1, 2, 4], ids=lambda p: f"ps{p}")
def test_paged_positions_map_into_their_pages(page_size):
    pool = make_pool(KVConfig(max_batch_size=3, max_seq_len=16, page_size=page_size, n_tokens=48))
    rows = [pool.task_alloc() for _ in range(3)]
    for step in range(1, 12):  # interleaved growth, as decode does
        for row in rows:
            assert pool.extend(row, step)
    used = set()
    for row in rows:
        pages = pool.req_pages(row)
        assert len(pages) == -(-11 // page_size)
        expected = [pages[pos // page_size] * page_size + pos % page_size for pos in range(11)]
        assert pool.req_to_token[row, :11].tolist() == expected
        assert not used & set(expected)
        used |= set(expected)
    check_pool_invariants(pool)
    assert pool.stats()["kv_tokens_in_use"] == 3 * len(pages) * page_size
    for row in rows:
        pool.task_free(row)
    assert pool.allocator.num_free == pool.allocator.n_pages
    assert_nothing_held(pool)


def test_extend_is_all_or_nothing():
    pool = make_pool(KVConfig(max_batch_size=2, max_seq_len=32, page_size=4, n_tokens=16))
    r1, r2 = pool.task_alloc(), pool.task_alloc()
    assert pool.extend(r1, 10)
    assert pool.extend(r1, 12)  # still within its third page: no allocation
    assert pool.allocator.num_free == 1
    table = pool.req_to_token.clone()
    assert not pool.extend(r2, 5)
    assert pool.req_len(r2) == 0 and pool.req_pages(r2) == ()
    assert pool.allocator.num_free == 1 and torch.equal(pool.req_to_token, table)
    assert pool.extend(r2, 4)
    assert pool.extend(r2, 2)  # shrinking is a no-op
    assert pool.req_len(r2) == 4
    with pytest.raises(CapacityExceeded):
        pool.extend(r2, 33)
    check_pool_invariants(pool)


def test_capacity_queries_in_paged_mode():
    pool = make_pool(KVConfig(max_batch_size=2, max_seq_len=64, page_size=4, n_tokens=32))
    assert pool.can_ever_fit(32) and not pool.can_ever_fit(33)
    row = pool.task_alloc()
    pool.extend(row, 5)
    assert pool.available_tokens() == 24
    pool.record(row, [1] * 5)
    pool.task_free(row)
    assert pool.available_tokens() == 32  # the cached page is evictable
    tokens = {k: v for k, v in pool.stats().items() if k.startswith("kv_tokens")}
    assert tokens == {"kv_tokens_total": 32, "kv_tokens_in_use": 0, "kv_tokens_cached": 4}


def test_match_prefix_after_extend_is_rejected():
    pool = make_pool(KVConfig(page_size=4, n_tokens=32))
    row = pool.task_alloc()
    pool.extend(row, 3)
    with pytest.raises(ValueError):
        pool.match_prefix(row, [1, 2, 3, 4, 5])


def reference_bind(pool: PagePool, rows, q_lens, seq_lens):
    """Per-token loops: an independent statement of what bind_tasks must produce."""
    out, kv_indptr, qo_indptr = [], [0], [0]
    for row, q, s in zip(rows, q_lens, seq_lens, strict=True):
        for pos in range(s - q, s):
            out.append(int(pool.req_to_token[row, pos]))
        kv_indptr.append(kv_indptr[-1] + s)
        qo_indptr.append(qo_indptr[-1] + q)
    return out, kv_indptr, qo_indptr


CONFIGS = {
    "contiguous": KVConfig(max_batch_size=4, max_seq_len=160),
    "paged_ps1": KVConfig(max_batch_size=4, max_seq_len=160, n_tokens=512),
    "paged_ps4": KVConfig(max_batch_size=4, max_seq_len=160, page_size=4, n_tokens=512),
}


@pytest.mark.parametrize("name", list(CONFIGS))
@pytest.mark.parametrize(
    "q_lens,seq_lens", [([150, 3, 1], [150, 10, 7]), ([1, 1, 1], [9, 130, 2])], ids=["prefill", "decode"]
)
def test_bind_tasks_matches_a_per_token_reference(name, q_lens, seq_lens):
    pool = make_pool(CONFIGS[name], torch.bfloat16)
    rows = [pool.task_alloc() for _ in range(4)][1:]  # row 0 live but not in this step
    for row, s in zip(rows, seq_lens, strict=True):
        assert pool.extend(row, s)
    kv = pool.bind_tasks(rows, q_lens, seq_lens)
    out, kv_indptr, qo_indptr = reference_bind(pool, rows, q_lens, seq_lens)
    assert kv.out_cache_loc.dtype == torch.int64 and kv.out_cache_loc.tolist() == out
    assert kv.req_pool_indices.dtype == torch.int64 and kv.req_pool_indices.tolist() == rows
    assert kv.seq_lens.dtype == torch.int64 and kv.seq_lens.tolist() == seq_lens
    assert kv.kv_indptr.dtype == torch.int32 and kv.kv_indptr.tolist() == kv_indptr
    assert kv.qo_indptr.dtype == torch.int32 and kv.qo_indptr.tolist() == qo_indptr
    assert kv.max_len == max(seq_lens) and kv.max_q_len == max(q_lens)
    assert kv.num_tokens == sum(q_lens)
    assert kv.q_lens_host == tuple(q_lens) and kv.seq_lens_host == tuple(seq_lens)
    assert kv.k_buffer is pool.k_buffer and kv.v_buffer is pool.v_buffer
    assert kv.req_to_token is pool.req_to_token and kv.plan == {} and kv.backend is None
    # what only one backend reads is that backend's to fill (astrai-backend-cuda's prepare)
    for name in ("q_tile_to_batch", "q_tile_to_index", "decode_o_part", "decode_ml_part", "decode_out"):
        assert getattr(kv, name) is None, name


def test_bind_tasks_rejects_inconsistent_input():
    pool = make_pool(KVConfig(max_batch_size=3, max_seq_len=16, page_size=4, n_tokens=64))
    r1, r2 = pool.task_alloc(), pool.task_alloc()
    pool.extend(r1, 6)
    pool.extend(r2, 3)
    bad = [
        ([r1], [7], [6]),  # q_len > seq_len
        ([r1], [0], [6]),  # no new token
        ([r1, r2], [1, 1], [6, 4]),  # position 3 of r2 has no slot
        ([2], [1], [1]),  # row not live
        ([r1, r1], [1, 1], [6, 6]),  # same request twice
        ([r1, r2], [1], [6, 3]),  # mismatched lists
        ([], [], []),
    ]
    for rows, q_lens, seq_lens in bad:
        with pytest.raises(ValueError):
            pool.bind_tasks(rows, q_lens, seq_lens)


def test_written_kv_is_read_back_through_req_to_token():
    # what an attention backend does with the KVCache: write at out_cache_loc, gather via req_to_token.
    pool = make_pool(KVConfig(max_batch_size=2, max_seq_len=16, page_size=2, n_tokens=32))
    r1, r2 = pool.task_alloc(), pool.task_alloc()
    pool.extend(r1, 5)
    pool.extend(r2, 3)
    kv = pool.bind_tasks([r1, r2], [5, 3], [5, 3])
    k = torch.arange(8, dtype=torch.float32).view(8, 1, 1).expand(8, N_KV_HEADS, HEAD_DIM)
    kv.k_buffer[1, kv.out_cache_loc] = k
    got = kv.k_buffer[1, kv.req_to_token[r1, :5].long(), 0, 0].tolist()
    assert got == [0.0, 1.0, 2.0, 3.0, 4.0]
    assert kv.k_buffer[1, kv.req_to_token[r2, :3].long(), 1, 7].tolist() == [5.0, 6.0, 7.0]
