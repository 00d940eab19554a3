"""The pure-PyTorch reference of each op (astrai_backend_cuda.reference) verifies the contract on CPU.

Against the torch-native backend on random ragged batches (decode and prefill, prefix
hits, GQA, head dims 64 and 128, sliding windows and soft-capped scores), and, for the split-K
partials, against a float64 attention over each split's own range. If the reference holds, the kernels, which are
tested against it, implement the backend contract.
"""

from __future__ import annotations

import math

import pytest
import torch
from cuda_steps import clone_step, make_step, split_partial, split_ranges
from hypothesis import given, settings
from hypothesis import strategies as st

from astrai.extension.backend.rotary import rotate_torch
from astrai.extension.backend.torch_native import TorchNativeBackend
from astrai_backend_cuda import reference
from astrai_backend_cuda.plan import MIN_SPLIT_POSITIONS, decode_chunk, decode_num_splits

LAYER = 1


def torch_native(kv, q, k, v, scale, window=0, softcap=0.0):
    """TorchNativeBackend.forward on a clone: ``(output, the clone)``."""
    mine = clone_step(kv)
    out = TorchNativeBackend().forward(q, k, v, LAYER, mine, scale, window=window, softcap=softcap)
    return out, mine


def reference_decode(kv, q, k, v, scale, num_splits, max_len=None, window=0, softcap=0.0):
    mine = clone_step(kv)
    reference.attn_paged_decode(
        q,
        k,
        v,
        mine.k_buffer,
        mine.v_buffer,
        LAYER,
        mine.req_to_token,
        mine.req_pool_indices,
        mine.seq_lens,
        mine.out_cache_loc,
        mine.max_len if max_len is None else max_len,
        num_splits,
        mine.decode_o_part,
        mine.decode_ml_part,
        mine.decode_out,
        scale,
        window,
        softcap,
    )
    return mine


@pytest.mark.parametrize(
    ("prefix", "n_heads", "n_kv", "head_dim", "splits", "dtype"),
    [
        ([0, 37, 300], 9, 3, 64, 4, torch.float32),
        ([0, 37, 300], 9, 3, 64, 4, torch.bfloat16),
        ([5, 64, 200, 31], 8, 2, 128, 3, torch.float32),
        ([100], 4, 4, 64, 1, torch.float32),
        ([12, 3], 16, 1, 128, 5, torch.float32),
    ],
    ids=[
        "smollm2-heads",
        "smollm2-heads-bf16",
        "gqa4-d128",
        "mha-one-split",
        "group16-more-splits-than-positions",
    ],
)
def test_decode_matches_torch_native(prefix, n_heads, n_kv, head_dim, splits, dtype):
    kv, q, k, v = make_step([1] * len(prefix), prefix, n_heads, n_kv, head_dim, dtype, 7, poison_free=False)
    scale = head_dim**-0.5
    expected, native = torch_native(kv, q, k, v, scale)
    ref = reference_decode(kv, q, k, v, scale, splits)
    tol = 1e-5 if dtype == torch.float32 else 2.0**-8  # bf16: the two roundings of the output may differ
    torch.testing.assert_close(ref.decode_out.float(), expected.float(), rtol=tol, atol=tol)
    assert torch.equal(ref.k_buffer, native.k_buffer) and torch.equal(ref.v_buffer, native.v_buffer)


@pytest.mark.parametrize(
    ("prefix", "n_heads", "n_kv", "head_dim", "splits", "max_len", "window", "softcap"),
    [
        ([0, 37, 300], 9, 3, 64, 3, 50, 50, 0.0),
        ([5, 64, 200, 31], 8, 2, 128, 4, None, 40, 0.0),
        ([100, 1], 4, 4, 64, 2, 1, 1, 0.0),
        ([12, 300], 4, 2, 64, 2, None, 0, 1.5),
        ([70, 33, 250], 16, 1, 128, 3, 90, 90, 3.0),
    ],
    ids=["window-50", "window-40-splits-of-max-len", "window-1", "softcap", "window-and-softcap"],
)
def test_windowed_decode_matches_torch_native(
    prefix, n_heads, n_kv, head_dim, splits, max_len, window, softcap
):
    kv, q, k, v = make_step(
        [1] * len(prefix), prefix, n_heads, n_kv, head_dim, torch.float32, 8, poison_free=False
    )
    scale = head_dim**-0.5
    expected, native = torch_native(kv, q, k, v, scale, window, softcap)
    ref = reference_decode(kv, q, k, v, scale, splits, max_len, window, softcap)
    torch.testing.assert_close(ref.decode_out, expected, rtol=1e-5, atol=1e-5)
    assert torch.equal(ref.k_buffer, native.k_buffer) and torch.equal(ref.v_buffer, native.v_buffer)


def test_windowed_decode_partials_cover_exactly_the_window():
    """In a window, the splits partition the request's last ``window`` positions (all of them when
    shorter), each partial the float64 attention (soft-capped) over its own range."""
    prefix, window, softcap, splits, max_len = [0, 40, 95, 250], 70, 2.0, 3, 70
    kv, q, k, v = make_step([1] * 4, prefix, 6, 2, 64, torch.float32, 12, poison_free=False)
    scale = 0.125
    ref = reference_decode(kv, q, k, v, scale, splits, max_len, window, softcap)
    for b, seq_len in enumerate(ref.seq_lens.tolist()):
        ranges = split_ranges(max_len, splits, seq_len, window)
        covered = [p for start, end in ranges for p in range(start, end)]
        assert covered == list(range(max(0, seq_len - window), seq_len))
        for s, (start, end) in enumerate(ranges):
            if start >= end:
                assert torch.isneginf(ref.decode_ml_part[b, :, s]).all()
                continue
            for h in range(q.shape[1]):
                o64, lse64 = split_partial(ref, q, LAYER, b, h, start, end, scale, softcap)
                torch.testing.assert_close(ref.decode_o_part[b, h, s].double(), o64, rtol=1e-5, atol=1e-5)
                torch.testing.assert_close(ref.decode_ml_part[b, h, s].double(), lse64, rtol=1e-5, atol=1e-5)


def test_decode_partials_are_per_split_attention():
    """o_part/ml_part of split s: softmax output and log-sum-exp over exactly that split's positions."""
    prefix = [0, 40, 95, 250]
    kv, q, k, v = make_step([1] * 4, prefix, 6, 2, 64, torch.float32, 11, poison_free=False)
    kv.decode_o_part.fill_(float("nan")), kv.decode_ml_part.fill_(float("nan"))
    scale, splits, max_len = 0.125, 3, 200  # max_len below the longest request: its last split runs on
    ref = reference_decode(kv, q, k, v, scale, splits, max_len)
    assert ref.decode_o_part[:, :, splits:].isnan().all() and ref.decode_ml_part[:, :, splits:].isnan().all()
    for b, seq_len in enumerate(ref.seq_lens.tolist()):
        ranges = split_ranges(max_len, splits, seq_len)
        assert ranges[0][0] == 0 and ranges[-1][1] == seq_len  # every position in exactly one split
        assert all(r0[1] == r1[0] or r1[0] >= r1[1] for r0, r1 in zip(ranges, ranges[1:], strict=False))
        for s, (start, end) in enumerate(ranges):
            o, lse = ref.decode_o_part[b, :, s], ref.decode_ml_part[b, :, s]
            if start >= end:
                assert (o == 0).all() and torch.isneginf(lse).all()
                continue
            for h in range(q.shape[1]):
                o64, lse64 = split_partial(ref, q, LAYER, b, h, start, end, scale)
                torch.testing.assert_close(o[h].double(), o64, rtol=1e-5, atol=1e-5)
                torch.testing.assert_close(lse[h].double(), lse64, rtol=1e-5, atol=1e-5)
    # the combine is the exp(lse)-weighted mean of the partials
    lse = ref.decode_ml_part[:, :, :splits]
    w = torch.softmax(lse.double(), -1)
    combined = (w[..., None] * ref.decode_o_part[:, :, :splits].double()).sum(2)
    torch.testing.assert_close(ref.decode_out.double(), combined, rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize(
    ("q_lens", "prefix", "n_heads", "n_kv", "head_dim"),
    [([70, 1, 5], [0, 0, 0], 4, 2, 64), ([33, 130], [64, 7], 2, 1, 64), ([65, 3, 1], [0, 100, 9], 8, 2, 128)],
    ids=["fresh-ragged", "prefix-hits-several-tiles", "gqa4-d128-mixed"],
)
def test_prefill_matches_torch_native(q_lens, prefix, n_heads, n_kv, head_dim):
    kv, q, k, v = make_step(q_lens, prefix, n_heads, n_kv, head_dim, torch.float32, 5, poison_free=False)
    scale = head_dim**-0.5
    expected, native = torch_native(kv, q, k, v, scale)  # writes k/v into the clone's pool
    out = reference.attn_paged_prefill(
        q,
        native.k_buffer,
        native.v_buffer,
        LAYER,
        native.req_to_token,
        native.req_pool_indices,
        native.qo_indptr,
        native.kv_indptr,
        native.q_tile_to_batch,
        native.q_tile_to_index,
        scale,
    )
    torch.testing.assert_close(out, expected, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize(
    ("q_lens", "prefix", "n_heads", "n_kv", "head_dim", "window", "softcap"),
    [
        ([130, 5], [0, 0], 4, 2, 64, 20, 0.0),
        ([33, 130], [64, 200], 2, 1, 64, 70, 0.0),
        ([65, 3, 1], [0, 100, 9], 8, 2, 128, 1, 0.0),
        ([70, 1, 5], [0, 40, 0], 4, 2, 64, 0, 2.0),
        ([1, 20, 90], [50, 0, 77], 4, 4, 128, 8, 3.0),
    ],
    ids=["fresh-window-20", "prefix-hits-window-70", "window-1", "softcap", "window-and-softcap-mixed"],
)
def test_windowed_prefill_matches_torch_native(q_lens, prefix, n_heads, n_kv, head_dim, window, softcap):
    kv, q, k, v = make_step(q_lens, prefix, n_heads, n_kv, head_dim, torch.float32, 6, poison_free=False)
    scale = head_dim**-0.5
    expected, native = torch_native(kv, q, k, v, scale, window, softcap)
    out = reference.attn_paged_prefill(
        q,
        native.k_buffer,
        native.v_buffer,
        LAYER,
        native.req_to_token,
        native.req_pool_indices,
        native.qo_indptr,
        native.kv_indptr,
        native.q_tile_to_batch,
        native.q_tile_to_index,
        scale,
        window=window,
        softcap=softcap,
    )
    torch.testing.assert_close(out, expected, rtol=1e-5, atol=1e-5)


def test_rotary_matches_apply_rotary_emb():
    gen = torch.Generator().manual_seed(0)
    angles = torch.rand(2, 5, 32, generator=gen) * 6.28
    freqs = torch.stack([angles.cos(), angles.sin()], -1)
    x = torch.randn(2, 5, 3, 64, generator=gen).to(torch.bfloat16)
    torch.testing.assert_close(reference.rotary_emb(x, freqs), rotate_torch(x, freqs), rtol=0, atol=0)
    y = x.clone()
    assert reference.rotary_emb(y, freqs, out=y) is y and torch.equal(y, rotate_torch(x, freqs))


@settings(max_examples=200, deadline=None)
@given(
    max_len=st.integers(1, 20000),
    splits=st.integers(1, 32),
    seq_len=st.integers(1, 20000),
    window=st.sampled_from([0, 1, 7, 32, 100, 4096]),
)
def test_split_ranges_partition_every_sequence(max_len, splits, seq_len, window):
    ranges = split_ranges(max_len, splits, seq_len, window)
    first = max(0, seq_len - window) if window else 0
    covered = [p for start, end in ranges for p in range(start, end)] if seq_len < 3000 else None
    if covered is not None:
        assert covered == list(range(first, seq_len))
    assert ranges[0][0] == first and ranges[-1][1] == seq_len and decode_chunk(max_len, splits) % 32 == 0


@settings(max_examples=200, deadline=None)
@given(
    batch=st.integers(1, 256),
    n_kv=st.integers(1, 16),
    max_len=st.integers(1, 32768),
    sms=st.integers(1, 160),
    blocks=st.integers(1, 8),
    max_splits=st.integers(1, 32),
)
def test_split_count_is_valid(batch, n_kv, max_len, sms, blocks, max_splits):
    s = decode_num_splits(batch, n_kv, max_len, sms, blocks, max_splits)
    assert 1 <= s <= max_splits
    assert s <= max(1, math.ceil(max_len / MIN_SPLIT_POSITIONS))  # no split below MIN_SPLIT_POSITIONS


def test_split_count_fills_the_gpu_for_small_batches():
    h200 = {"num_sms": 132, "blocks_per_sm": 3, "max_splits": 32}
    assert decode_num_splits(1, 8, 8192, **h200) == 32  # 256 blocks: every SM busy
    assert decode_num_splits(64, 8, 4096, **h200) <= 4  # 512 blocks already: whole waves, little combine
    assert decode_num_splits(64, 8, 100, **h200) == 1  # short sequences are not split
