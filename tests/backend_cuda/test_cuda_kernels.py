"""The CUDA kernels against the reference on random ragged batches, outputs poisoned first.

Each case runs on the CPU emulator (the kernel sources compiled with g++, the warp-level
instructions emulated) and, when a GPU is present, on the real ops. Sizes are chosen not to
be multiples of the tiles (32 positions in decode, 64 in prefill), and to reach every
branch: GQA groups from 1 to 16, both head dims and storage types, one split (output
written directly) and many (combine pass), empty splits, prefix hits; and sliding windows
(shorter than a tile, across tiles, wider than the sequence, of one position) with soft-capped
scores, where a prefill row may see nothing of the first K/V tiles its Q tile loads; and int8
pools (K, V or both) with their scales.
"""

from __future__ import annotations

import pytest
import torch
from cuda_steps import check_decode, check_prefill, check_rotary, make_step

BF16, FP16 = torch.bfloat16, torch.float16

# id: (prefix_lens, n_heads, n_kv_heads, head_dim, dtype, num_splits, max_len (None: max(seq_lens)))
DECODE = {
    "smollm2-heads-9-over-3": ([0, 37, 300], 9, 3, 64, BF16, 3, None),
    "gqa4-d128": ([5, 64, 200], 8, 2, 128, BF16, 2, None),
    "mha-d64-fp16": ([100, 1], 2, 2, 64, FP16, 2, None),
    "group16-d128": ([70, 33], 16, 1, 128, BF16, 2, None),
    "group12-d128-fp16": ([40], 12, 1, 128, FP16, 3, None),
    "one-split-direct-output": ([31, 95, 0], 4, 2, 64, BF16, 1, None),
    "empty-splits": ([0, 2, 39], 4, 2, 64, BF16, 4, None),
    "max-len-short-last-split-runs-on": ([130, 12], 4, 1, 64, BF16, 2, 40),
    "max-len-bucket-above": ([20, 50], 4, 2, 128, FP16, 3, 512),
}


@pytest.mark.parametrize("case", list(DECODE.values()), ids=list(DECODE))
def test_decode(kernels, case):
    impl, device = kernels
    prefix, n_heads, n_kv, head_dim, dtype, splits, max_len = case
    kv, q, k, v = make_step(
        [1] * len(prefix), prefix, n_heads, n_kv, head_dim, dtype, seed=len(prefix), device=device
    )
    check_decode(impl, kv, q, k, v, splits, max_len)


# id: (prefix_lens, n_heads, n_kv_heads, head_dim, dtype, num_splits, max_len (None: max(seq_lens)),
#      window, softcap)
DECODE_WINDOWED = {
    "window-below-a-tile-one-split": ([0, 37, 300], 9, 3, 64, BF16, 1, 20, 20, 0.0),
    "window-split-in-three": ([0, 37, 300], 9, 3, 64, BF16, 3, 100, 100, 0.0),
    "window-splits-from-max-len-many-empty": ([5, 200, 130], 4, 2, 128, BF16, 4, None, 70, 0.0),
    "window-of-one-position": ([12, 0, 64], 4, 1, 64, FP16, 2, 1, 1, 0.0),
    "window-wider-than-every-request": ([31, 95], 8, 2, 64, BF16, 2, 96, 500, 0.0),
    "softcap": ([31, 95, 0], 4, 2, 64, BF16, 2, None, 0, 2.0),
    "window-and-softcap-group16-fp16": ([70, 33, 250], 16, 1, 128, FP16, 3, 90, 90, 1.5),
}


@pytest.mark.parametrize("case", list(DECODE_WINDOWED.values()), ids=list(DECODE_WINDOWED))
def test_decode_windowed(kernels, case):
    impl, device = kernels
    prefix, n_heads, n_kv, head_dim, dtype, splits, max_len, window, softcap = case
    kv, q, k, v = make_step(
        [1] * len(prefix), prefix, n_heads, n_kv, head_dim, dtype, seed=len(prefix) + window, device=device
    )
    check_decode(impl, kv, q, k, v, splits, max_len, window=window, softcap=softcap)


def test_decode_strided_new_kv(kernels):
    """new_k/new_v as views of a fused qkv projection (token stride > heads * head_dim)."""
    impl, device = kernels
    kv, q, _, _ = make_step([1, 1], [9, 70], 4, 2, 64, BF16, seed=3, device=device)
    qkv = torch.randn(2, (4 + 2 + 2) * 64, generator=torch.Generator().manual_seed(3)).to(BF16).to(device)
    k, v = qkv[:, 256:384].view(2, 2, 64), qkv[:, 384:].view(2, 2, 64)
    check_decode(impl, kv, q, k, v, num_splits=2)


I8, AUTO = "int8", "auto"
# id: (prefix_lens, n_heads, n_kv_heads, head_dim, dtype, num_splits, window, softcap, kinds of K and V)
DECODE_INT8 = {
    "int8-kv-smollm2-heads-many-splits": ([0, 37, 300], 9, 3, 64, BF16, 3, 0, 0.0, (I8, I8)),
    "int8-kv-gqa4-d128-one-split": ([5, 64, 200], 8, 2, 128, BF16, 1, 0, 0.0, (I8, I8)),
    "int8-k-only-fp16-group16": ([70, 33], 16, 1, 128, FP16, 2, 0, 0.0, (I8, AUTO)),
    "int8-v-only-empty-splits": ([0, 2, 39], 4, 2, 64, BF16, 4, 0, 0.0, (AUTO, I8)),
    "int8-kv-window-and-softcap-fp16": ([70, 33, 250], 16, 1, 128, FP16, 3, 90, 1.5, (I8, I8)),
}


@pytest.mark.parametrize("case", list(DECODE_INT8.values()), ids=list(DECODE_INT8))
def test_decode_int8_pool(kernels, case):
    """An int8 K and/or V pool: the new token quantized into the pool byte for byte as
    ``astrai.kvcache.quant.quantize`` writes it (scale beside it), the pool read as ``q * scale``."""
    impl, device = kernels
    prefix, n_heads, n_kv, head_dim, dtype, splits, window, softcap, kinds = case
    kv, q, k, v = make_step(
        [1] * len(prefix),
        prefix,
        n_heads,
        n_kv,
        head_dim,
        dtype,
        seed=len(prefix) + 7,
        device=device,
        kinds=kinds,
    )
    check_decode(impl, kv, q, k, v, splits, window=window, softcap=softcap)


# id: (q_lens, prefix_lens, n_heads, n_kv_heads, head_dim, dtype, window, softcap, kinds of K and V)
PREFILL_INT8 = {
    "int8-kv-prefix-hits-several-tiles": ([33, 130], [64, 7], 2, 1, 64, BF16, 0, 0.0, (I8, I8)),
    "int8-kv-gqa4-d128": ([65, 3], [0, 100], 8, 2, 128, BF16, 0, 0.0, (I8, I8)),
    "int8-k-only-mixed-decode-rows-fp16": ([1, 1, 20], [50, 3, 0], 4, 4, 128, FP16, 0, 0.0, (I8, AUTO)),
    "int8-v-only-window-across-tiles": ([33, 130], [64, 200], 2, 1, 64, BF16, 70, 0.0, (AUTO, I8)),
    "int8-kv-window-and-softcap-fp16": ([1, 1, 20, 90], [50, 3, 0, 77], 4, 4, 128, FP16, 8, 3.0, (I8, I8)),
}


@pytest.mark.parametrize("case", list(PREFILL_INT8.values()), ids=list(PREFILL_INT8))
def test_prefill_int8_pool(kernels, case):
    impl, device = kernels
    q_lens, prefix, n_heads, n_kv, head_dim, dtype, window, softcap, kinds = case
    kv, q, k, v = make_step(
        q_lens, prefix, n_heads, n_kv, head_dim, dtype, seed=sum(q_lens) + 1, device=device, kinds=kinds
    )
    check_prefill(impl, kv, q, k, v, window=window, softcap=softcap)


# id: (q_lens, prefix_lens, n_heads, n_kv_heads, head_dim, dtype)
PREFILL = {
    "fresh-ragged-d64": ([70, 1, 5], [0, 0, 0], 4, 2, 64, BF16),
    "prefix-hits-several-tiles": ([33, 130], [64, 7], 2, 1, 64, BF16),
    "gqa4-d128": ([65, 3], [0, 100], 8, 2, 128, BF16),
    "mixed-decode-rows-fp16": ([1, 1, 20], [50, 3, 0], 4, 4, 128, FP16),
}


@pytest.mark.parametrize("case", list(PREFILL.values()), ids=list(PREFILL))
def test_prefill(kernels, case):
    impl, device = kernels
    q_lens, prefix, n_heads, n_kv, head_dim, dtype = case
    kv, q, k, v = make_step(q_lens, prefix, n_heads, n_kv, head_dim, dtype, seed=sum(q_lens), device=device)
    check_prefill(impl, kv, q, k, v)


# id: (q_lens, prefix_lens, n_heads, n_kv_heads, head_dim, dtype, window, softcap)
PREFILL_WINDOWED = {
    # rows 64..127 see 20 positions: their first K/V tile (from position 45's) is all masked for the
    # later rows, whose running max stays -inf through it
    "fresh-window-below-a-tile": ([130, 5], [0, 0], 4, 2, 64, BF16, 20, 0.0),
    "prefix-hits-window-across-tiles": ([33, 130], [64, 200], 2, 1, 64, BF16, 70, 0.0),
    "window-of-a-tile-gqa4-d128": ([65, 3, 100], [0, 100, 300], 8, 2, 128, BF16, 64, 0.0),
    "window-of-one-position": ([70, 2], [10, 0], 4, 4, 64, FP16, 1, 0.0),
    "window-wider-than-the-request": ([40, 9], [20, 0], 2, 2, 64, BF16, 1000, 0.0),
    "softcap": ([70, 1, 5], [0, 40, 0], 4, 2, 64, BF16, 0, 2.0),
    "window-and-softcap-mixed-decode-rows-fp16": ([1, 1, 20, 90], [50, 3, 0, 77], 4, 4, 128, FP16, 8, 3.0),
}


@pytest.mark.parametrize("case", list(PREFILL_WINDOWED.values()), ids=list(PREFILL_WINDOWED))
def test_prefill_windowed(kernels, case):
    impl, device = kernels
    q_lens, prefix, n_heads, n_kv, head_dim, dtype, window, softcap = case
    kv, q, k, v = make_step(
        q_lens, prefix, n_heads, n_kv, head_dim, dtype, seed=sum(q_lens) + window, device=device
    )
    check_prefill(impl, kv, q, k, v, window=window, softcap=softcap)


def test_prefill_writes_only_listed_tiles(kernels):
    impl, device = kernels
    kv, q, k, v = make_step([70, 10], [0, 5], 2, 1, 64, BF16, seed=5, device=device)
    kv.q_tile_to_batch, kv.q_tile_to_index = kv.q_tile_to_batch[1:], kv.q_tile_to_index[1:]  # drop rows 0..63
    out = torch.full_like(q, float("nan"))
    kv.k_buffer[0].index_copy_(0, kv.out_cache_loc, k)
    kv.v_buffer[0].index_copy_(0, kv.out_cache_loc, v)
    impl.attn_paged_prefill(
        q,
        kv.k_buffer,
        kv.v_buffer,
        0,
        kv.req_to_token,
        kv.req_pool_indices,
        kv.qo_indptr,
        kv.kv_indptr,
        kv.q_tile_to_batch,
        kv.q_tile_to_index,
        0.125,
        out,
    )
    assert out[:64].isnan().all() and not out[64:].isnan().any()


@pytest.mark.parametrize("dtype", [BF16, FP16], ids=["bf16", "fp16"])
@pytest.mark.parametrize("in_place", [False, True], ids=["out", "in-place"])
def test_rotary_vectorised(kernels, dtype, in_place):
    impl, device = kernels
    gen = torch.Generator().manual_seed(0)
    angles = torch.rand(1, 7, 32, generator=gen) * 6.28
    freqs = torch.stack([angles.cos(), angles.sin()], -1).to(device)
    x = torch.randn(1, 7, 3, 64, generator=gen).to(dtype).to(device)
    check_rotary(impl, x, freqs, in_place)


def test_rotary_strided_and_unaligned(kernels):
    """A view into a fused projection (16-byte path), then one offset by a pair (one pair per thread)."""
    impl, device = kernels
    gen = torch.Generator().manual_seed(1)
    angles = torch.rand(5, 16, generator=gen) * 6.28
    freqs = torch.stack([angles.cos(), angles.sin()], -1).to(device)
    fused = torch.randn(5, 4 * 32 + 2, generator=gen).to(BF16).to(device)
    check_rotary(impl, fused[:, : 3 * 32].view(5, 3, 32), freqs, in_place=False)
    check_rotary(impl, fused[:, 2 : 2 + 3 * 32].view(5, 3, 32), freqs, in_place=False)
