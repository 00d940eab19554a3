"""Index preparation: block tables, cu_seqlens and cache_seqlens against the real KV layout."""

from __future__ import annotations

import pytest
import torch
from flash_steps import make_pool, ragged_step, scatter

from astrai_backend_flash.plan import BLOCK, block_table, build_plan, paged_view


def slots_through_table(kv, table):
    """Slot of every (request, position < max_len) as flash-attn computes it: table[p // B] * B + p % B."""
    pos = torch.arange(kv.max_len)
    return table.long()[:, pos // BLOCK] * BLOCK + pos % BLOCK


def assert_table_matches_layout(kv, table):
    assert table.dtype == torch.int32 and table.is_contiguous()
    n_blocks = -(-kv.max_len // BLOCK)
    assert table.shape == (len(kv.seq_lens_host), n_blocks)
    want = kv.req_to_token[kv.req_pool_indices, : kv.max_len].long()
    got = slots_through_table(kv, table)
    valid = torch.arange(kv.max_len)[None, :] < kv.seq_lens[:, None]
    assert torch.equal(got[valid], want[valid])
    # Blocks past a request's own hold 0: never read, and still a valid block id.
    unused = torch.arange(n_blocks)[None, :] * BLOCK >= kv.seq_lens[:, None]
    assert (table[unused] == 0).all()


def random_batch(gen, n, page_size):
    """Ragged q_lens/prefix_lens with decodes, long prompts, chunk continuations and page-aligned hits."""
    q_lens = torch.randint(1, 300, (n,), generator=gen).tolist()
    prefix = torch.randint(0, 700, (n,), generator=gen).tolist()
    for i in range(0, n, 3):
        q_lens[i] = 1  # decode rows among the prompts
    hits = tuple(range(1, n, 4))
    for i in hits:
        prefix[i] = page_size * int(torch.randint(1, 3, (1,), generator=gen))
    return q_lens, prefix, hits


@pytest.mark.parametrize("page_size", [256, 512])
@pytest.mark.parametrize("seed", range(4))
def test_block_table_addresses_every_position_of_every_request(page_size, seed):
    gen = torch.Generator().manual_seed(seed)
    pool = make_pool(page_size, 96 * 256 // page_size, 2, 8, torch.bfloat16, gen)
    scatter(pool, gen)
    q_lens, prefix, hits = random_batch(gen, 7, page_size)
    kv, rows = ragged_step(pool, q_lens, prefix, gen, hits)
    plan = build_plan(kv)
    assert plan.mode == "paged" and plan.cache_seqlens is None
    assert_table_matches_layout(kv, plan.block_table)
    # Hits really share the donor's pages: two rows, same blocks.
    shared = plan.block_table[list(hits), 0]
    assert (shared == shared[0]).all()


def test_contiguous_pool_rows_are_runs_of_blocks():
    gen = torch.Generator().manual_seed(7)
    pool = make_pool(1, 0, 2, 8, torch.float16, gen, paged=False, max_seq_len=512)
    kv, rows = ragged_step(pool, [5, 1, 300], [0, 200, 40], gen)
    table = block_table(kv)
    assert_table_matches_layout(kv, table)
    assert table[:, 0].tolist() == [row * 2 for row in rows]


def test_decode_plan_appends_at_seq_len_minus_one():
    gen = torch.Generator().manual_seed(3)
    pool = make_pool(256, 40, 2, 8, torch.bfloat16, gen)
    scatter(pool, gen)
    kv, _ = ragged_step(pool, [1] * 5, [0, 255, 256, 700, 3], gen, hits=(2,))
    plan = build_plan(kv)
    assert plan.mode == "decode"
    assert plan.cache_seqlens.dtype == torch.int32 and plan.cache_seqlens.tolist() == [0, 255, 256, 700, 3]
    assert_table_matches_layout(kv, plan.block_table)
    # The appended token's slot through the table is the step's out_cache_loc.
    pos = plan.cache_seqlens.long()
    rows = torch.arange(5)
    appended = plan.block_table.long()[rows, pos // BLOCK] * BLOCK + pos % BLOCK
    assert torch.equal(appended, kv.out_cache_loc)


def test_fresh_prefill_needs_no_table_and_uses_qo_indptr_for_keys():
    gen = torch.Generator().manual_seed(4)
    pool = make_pool(256, 16, 2, 8, torch.bfloat16, gen)
    kv, _ = ragged_step(pool, [30, 1, 290], [0, 0, 0], gen)
    plan = build_plan(kv)
    assert plan == ("fresh", None, None)
    # cu_seqlens the backend passes: int32, contiguous prefix sums of the q lengths.
    assert kv.qo_indptr.dtype == torch.int32 and kv.qo_indptr.is_contiguous()
    assert kv.qo_indptr.tolist() == [0, 30, 31, 321]


def test_cu_seqlens_k_is_kv_indptr_of_the_seq_lens():
    gen = torch.Generator().manual_seed(5)
    pool = make_pool(256, 24, 2, 8, torch.bfloat16, gen)
    kv, _ = ragged_step(pool, [30, 1, 12], [256, 9, 0], gen, hits=(0,))
    assert build_plan(kv).mode == "paged"
    assert kv.kv_indptr.dtype == torch.int32 and kv.kv_indptr.is_contiguous()
    assert kv.kv_indptr.tolist() == [0, 286, 296, 308]


def test_paged_view_is_the_pool_itself():
    gen = torch.Generator().manual_seed(6)
    pool = make_pool(256, 4, 3, 16, torch.bfloat16, gen)
    layer = pool.k_buffer[1]
    view = paged_view(layer)
    assert view.shape == (4, 256, 3, 16) and view.data_ptr() == layer.data_ptr()
    view[2, 7] = 5.0
    assert (pool.k_buffer[1, 2 * 256 + 7] == 5.0).all()


def test_pages_smaller_than_a_block_break_the_mapping():
    """Why supports() demands page sizes that are multiples of 256: with 16-slot pages scattered by
    the allocator, a 256-position block is no longer 256 consecutive slots."""
    gen = torch.Generator().manual_seed(8)
    pool = make_pool(16, 256, 2, 8, torch.bfloat16, gen)
    scatter(pool, gen)
    kv, _ = ragged_step(pool, [300], [0], gen)
    got = slots_through_table(kv, block_table(kv))
    want = kv.req_to_token[kv.req_pool_indices, : kv.max_len].long()
    assert not torch.equal(got, want)
