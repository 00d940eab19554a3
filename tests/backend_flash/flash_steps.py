"""Ragged steps over real ``PagePool`` layouts (pages scattered, prefix hits shared), for the flash tests.

The pool's own allocator and radix decide every slot, so the block tables are checked
against the layout the engine really produces, not one the test imagined.
"""

from __future__ import annotations

import dataclasses

import torch

from astrai.extension.backend.torch_native import TorchNativeBackend
from astrai.kvcache import KVConfig, PagePool


def make_pool(
    page_size,
    n_pages,
    n_kv_heads,
    head_dim,
    dtype,
    gen,
    *,
    paged=True,
    max_seq_len=2048,
    n_layers=2,
    device="cpu",
):
    """A pool with random K/V in every slot (a slot read before this step holds some earlier token's K/V).

    Paged: ``n_pages`` pages of ``page_size``. Contiguous (``paged=False``): 12 rows of ``max_seq_len``.
    """
    if paged:
        config = KVConfig(
            max_batch_size=12, max_seq_len=max_seq_len, page_size=page_size, n_tokens=n_pages * page_size
        )
    else:
        config = KVConfig(max_batch_size=12, max_seq_len=max_seq_len)
    pool = PagePool(n_layers, n_kv_heads, n_kv_heads, head_dim, config, dtype=dtype, device=device)
    for buf in (pool.k_buffer, pool.v_buffer):
        buf.copy_(torch.randn(buf.shape, generator=gen).to(dtype))
    return pool


def scatter(pool, gen, rounds=6):
    """Allocate and free requests of random lengths so that later pages come out of order."""
    rows = []
    for _ in range(rounds):
        row = pool.task_alloc()
        pool.extend(row, int(torch.randint(1, 3 * pool.page_size, (1,), generator=gen)))
        rows.append(row)
    for i in torch.randperm(len(rows), generator=gen).tolist():
        pool.task_free(rows[i])


def layout_page_size(pool) -> int:
    """The KVCache.page_size fact of this pool: its page size, or a whole row in contiguous mode."""
    return pool.page_size if pool.paged else pool.max_ctx_len


def ragged_step(pool, q_lens, prefix_lens, gen, hits=()):
    """Bind one step: request ``i`` brings ``q_lens[i]`` tokens after ``prefix_lens[i]`` cached ones.

    Requests listed in ``hits`` get their prefix (a whole number of pages) from the radix: a donor
    request's pages, shared, as a prefix hit in the engine does. Returns ``(kv, rows)``.
    """
    donor = torch.randint(
        2, 300, (max([prefix_lens[i] for i in hits], default=0) + 1,), generator=gen
    ).tolist()
    if hits:
        row = pool.task_alloc()
        pool.extend(row, len(donor))
        pool.record(row, donor)
        pool.task_free(row)
    rows = []
    for i, (q_len, prefix) in enumerate(zip(q_lens, prefix_lens, strict=True)):
        row = pool.task_alloc()
        if i in hits:
            assert pool.match_prefix(row, donor[: prefix + 1]) == prefix, "prefix must be whole pages"
        pool.extend(row, prefix + q_len)
        rows.append(row)
    seq_lens = [p + q for p, q in zip(prefix_lens, q_lens, strict=True)]
    kv = pool.bind_tasks(rows, q_lens, seq_lens)
    # What PagePool.bind_tasks records once KVCache carries page_size (see the package README).
    kv.page_size = layout_page_size(pool)
    return kv, rows


def random_qkv(kv, n_heads, gen, dtype):
    """This step's q [T, Hq, D], k/v [T, Hkv, D] (RoPE notionally applied), on the pool's device."""
    _, _, n_kv_heads, head_dim = kv.k_buffer.shape
    device = kv.k_buffer.device
    t = kv.num_tokens
    q = torch.randn(t, n_heads, head_dim, generator=gen).to(dtype).to(device)
    k = torch.randn(t, n_kv_heads, head_dim, generator=gen).to(dtype).to(device)
    v = torch.randn(t, n_kv_heads, head_dim, generator=gen).to(dtype).to(device)
    return q, k, v


def torch_native_twin(kv):
    """The same step over copies of the buffers, for TorchNativeBackend (its own plan)."""
    return dataclasses.replace(kv, k_buffer=kv.k_buffer.clone(), v_buffer=kv.v_buffer.clone(), plan={})


def compare_with_torch_native(backend, kv, n_heads, gen, layers=(0, 1), window=0, softcap=0.0):
    """Run ``backend`` and TorchNativeBackend on the same step, layer after layer; assert they agree.

    Both the outputs (bf16/fp16 tolerance: torch_native rounds its prefill probabilities to the
    model dtype, flash-attn keeps them in float32) and the pools after the K/V write (exactly).
    ``window``/``softcap``: the layers' sliding window and soft-cap (0: none), given to both.
    """
    options = {"window": window, "softcap": softcap} if window or softcap else {}
    native, native_kv = TorchNativeBackend(), torch_native_twin(kv)
    dtype = kv.k_buffer.dtype
    scale = kv.k_buffer.shape[-1] ** -0.5
    for layer in layers:
        q, k, v = random_qkv(kv, n_heads, gen, dtype)
        assert backend.supports(q, kv) is None
        out = backend.forward(q, k, v, layer, kv, scale, **options)
        want = native.forward(q, k, v, layer, native_kv, scale, **options)
        assert out.shape == want.shape and out.dtype == dtype
        torch.testing.assert_close(out.float(), want.float(), atol=2e-2, rtol=2e-2)
        assert torch.equal(kv.k_buffer, native_kv.k_buffer) and torch.equal(kv.v_buffer, native_kv.v_buffer)
