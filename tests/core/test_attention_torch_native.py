"""TorchNativeBackend against a dense per-request float64 reference on random ragged batches."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from astrai.extension.backend import torch_native
from astrai.extension.backend.torch_native import TorchNativeBackend
from astrai.kvcache.cache import KVCache


def make_step(q_lens, prefix_lens, n_kv_heads, head_dim, dtype, gen, n_layers=2):
    """A hand-built KVCache: each request's slots are a random scattering of the pool.

    Returns (kv_cache, slots) where slots[i] is request i's slot per position.
    Columns of req_to_token past seq_len hold random (stale) slots, as a reused row would.
    """
    seq_lens = [p + q for p, q in zip(prefix_lens, q_lens, strict=True)]
    n_req, n_rows = len(q_lens), len(q_lens) + 3
    size = sum(seq_lens) + 17
    max_ctx = max(seq_lens) + 5
    perm = torch.randperm(size, generator=gen)
    req_to_token = torch.randint(0, size, (n_rows, max_ctx), generator=gen, dtype=torch.int32)
    rows = torch.randperm(n_rows, generator=gen)[:n_req]
    slots, start = [], 0
    for i, n in enumerate(seq_lens):
        slots.append(perm[start : start + n])
        req_to_token[rows[i], :n] = slots[-1].to(torch.int32)
        start += n
    shape = (n_layers, size, n_kv_heads, head_dim)
    kv = KVCache(
        k_buffer=torch.randn(shape, generator=gen).to(dtype),
        v_buffer=torch.randn(shape, generator=gen).to(dtype),
        req_to_token=req_to_token,
        req_pool_indices=rows.long(),
        seq_lens=torch.tensor(seq_lens),
        out_cache_loc=torch.cat([s[p:] for s, p in zip(slots, prefix_lens, strict=True)]).long(),
        max_len=max(seq_lens),
        kv_indptr=torch.tensor([0, *seq_lens]).cumsum(0).to(torch.int32),
        qo_indptr=torch.tensor([0, *q_lens]).cumsum(0).to(torch.int32),
        max_q_len=max(q_lens),
        num_tokens=sum(q_lens),
        q_lens_host=tuple(q_lens),
        seq_lens_host=tuple(seq_lens),
    )
    return kv, slots


def reference(q, k, v, k_old, v_old, slots, q_lens, prefix_lens, scale, window=0, softcap=0.0):
    """Per request, in float64: cached prefix (read before the call) + new K/V, causal with offset;
    in a sliding window (``window > 0``) position ``p`` sees ``p - window + 1 .. p``; ``softcap > 0``:
    scores through ``softcap * tanh(s / softcap)``."""
    group = q.shape[1] // k.shape[1]
    outs, row = [], 0
    for s, n, p in zip(slots, q_lens, prefix_lens, strict=True):
        keys = torch.cat([k_old[s[:p]], k[row : row + n]]).double().repeat_interleave(group, dim=1)
        vals = torch.cat([v_old[s[:p]], v[row : row + n]]).double().repeat_interleave(group, dim=1)
        scores = torch.einsum("qhd,khd->hqk", q[row : row + n].double(), keys) * scale
        if softcap:
            scores = torch.tanh(scores / softcap) * softcap
        allowed = torch.arange(p + n)[None, :] <= (p + torch.arange(n))[:, None]
        if window:
            allowed &= torch.arange(p + n)[None, :] > (p + torch.arange(n))[:, None] - window
        scores = scores.masked_fill(~allowed, float("-inf"))
        outs.append(torch.einsum("hqk,khd->qhd", scores.softmax(-1), vals))
        row += n
    return torch.cat(outs)


def run_and_check(
    q_lens,
    prefix_lens,
    n_kv_heads,
    group,
    head_dim,
    dtype,
    seed,
    layers=(1,),
    backend=None,
    window=0,
    softcap=0.0,
):
    """``backend`` (default ``TorchNativeBackend()``) against ``reference``, the layers given ``window``
    and ``softcap`` when set; returns the KVCache."""
    options = {"window": window, "softcap": softcap} if window or softcap else {}
    gen = torch.Generator().manual_seed(seed)
    kv, slots = make_step(q_lens, prefix_lens, n_kv_heads, head_dim, dtype, gen)
    backend = backend or TorchNativeBackend()
    scale = head_dim**-0.5
    # bf16: inputs are the same bf16 values in both paths, but SDPA rounds the probabilities
    # and the output to bf16 (relative step 2**-8), so compare at ~2 bf16 ulps of an O(1) value.
    tol = {"atol": 2e-5, "rtol": 1e-4} if dtype == torch.float32 else {"atol": 2e-2, "rtol": 2e-2}
    t = sum(q_lens)
    for layer in layers:
        q = torch.randn(t, n_kv_heads * group, head_dim, generator=gen).to(dtype)
        k = torch.randn(t, n_kv_heads, head_dim, generator=gen).to(dtype)
        v = torch.randn(t, n_kv_heads, head_dim, generator=gen).to(dtype)
        k_before, v_before = kv.k_buffer.clone(), kv.v_buffer.clone()
        out = backend.forward(q, k, v, layer, kv, scale, **options)
        want = reference(
            q, k, v, k_before[layer], v_before[layer], slots, q_lens, prefix_lens, scale, window, softcap
        )
        assert out.shape == (t, n_kv_heads * group, head_dim) and out.dtype == dtype
        torch.testing.assert_close(out.double(), want, **tol)
        # K/V landed exactly at out_cache_loc of this layer, and nowhere else.
        k_expect, v_expect = k_before.clone(), v_before.clone()
        k_expect[layer, kv.out_cache_loc] = k
        v_expect[layer, kv.out_cache_loc] = v
        assert torch.equal(kv.k_buffer, k_expect) and torch.equal(kv.v_buffer, v_expect)
    return kv


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["f32", "bf16"])
@pytest.mark.parametrize("head_dim", [64, 128])
@pytest.mark.parametrize("group", [1, 3], ids=["mha", "gqa3"])
def test_mixed_ragged_batch(dtype, head_dim, group):
    gen = torch.Generator().manual_seed(head_dim * 7 + group)
    q_lens = torch.randint(1, 41, (7,), generator=gen).tolist() + [1, 1]  # prefill and decode rows
    prefix_lens = torch.randint(0, 50, (9,), generator=gen).tolist()
    prefix_lens[0] = 0
    run_and_check(q_lens, prefix_lens, 2, group, head_dim, dtype, seed=head_dim + group)


@pytest.mark.parametrize("group", [1, 3], ids=["mha", "gqa3"])
def test_pure_decode_with_different_lengths(group):
    kv = run_and_check([1] * 6, [0, 3, 17, 40, 8, 1], 2, group, 64, torch.float32, seed=1)
    assert kv.plan["torch_native"].prefill is None  # took the decode path only


def test_large_bf16_decode_batch_multiplies_in_bf16_within_tolerance():
    # 12 requests x ~450 positions is past _DECODE_F32_POSITIONS: bf16 bmm, float32 softmax.
    prefix = [400 + 9 * i for i in range(12)]
    assert 12 * (max(prefix) + 1) > torch_native._DECODE_F32_POSITIONS
    run_and_check([1] * 12, prefix, 3, 3, 64, torch.bfloat16, seed=11, layers=(0, 1))


def test_decode_with_equal_lengths_needs_no_mask():
    kv = run_and_check([1] * 4, [9] * 4, 3, 3, 64, torch.float32, seed=2)
    assert kv.plan["torch_native"].decode.mask is None


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["f32", "bf16"])
def test_fresh_prompts_attend_to_their_own_kv(dtype):
    kv = run_and_check([12, 30, 5], [0, 0, 0], 1, 3, 64, dtype, seed=3)
    plan = kv.plan["torch_native"]
    assert plan.fresh == ((0, 12), (12, 30), (42, 5)) and plan.decode is None and plan.prefill is None


def test_long_prompt_among_decodes_runs_apart_from_them():
    kv = run_and_check([1] * 10 + [40], [5] * 10 + [3], 1, 3, 64, torch.float32, seed=8)
    plan = kv.plan["torch_native"]
    # Decodes are not padded to 40 query rows: they take the decode path, the prompt its tile.
    assert (
        plan.decode.max_len == 6
        and plan.decode.flat_rows.numel() == 10 * 6
        and plan.decode.tok_rows.tolist() == list(range(10))
    )
    assert plan.prefill.kv_slots.shape[0] == 1 and plan.prefill.mask.shape[2] == 40


def test_decodes_interleaved_with_prompts_of_different_lengths():
    q_lens, prefix = [1, 23, 1, 70, 1, 1, 5, 1], [30, 0, 2, 9, 0, 61, 4, 7]
    kv = run_and_check(q_lens, prefix, 2, 3, 64, torch.bfloat16, seed=10, layers=(0, 1))
    plan = kv.plan["torch_native"]
    assert plan.decode.tok_rows.tolist() == [0, 24, 95, 96, 102]
    assert plan.fresh == ((1, 23),)  # the only prompt without a cached prefix
    # the chunks of 70 and 5 rows after cached positions share the tiled path
    assert plan.prefill.tok_rows.tolist() == list(range(25, 95)) + list(range(97, 102))


def test_without_host_facts():
    # q_lens_host/seq_lens_host left at their defaults: one tile per request, always masked.
    gen = torch.Generator().manual_seed(9)
    kv, slots = make_step([7, 2, 12], [4, 0, 9], 2, 64, torch.float32, gen)
    kv = dataclasses.replace(kv, q_lens_host=(), seq_lens_host=())
    q = torch.randn(21, 2, 64, generator=gen)
    k, v = torch.randn(21, 2, 64, generator=gen), torch.randn(21, 2, 64, generator=gen)
    k_old, v_old = kv.k_buffer[0].clone(), kv.v_buffer[0].clone()
    out = TorchNativeBackend().forward(q, k, v, 0, kv, 0.125)
    want = reference(q, k, v, k_old, v_old, slots, [7, 2, 12], [4, 0, 9], 0.125)
    torch.testing.assert_close(out.double(), want, atol=2e-5, rtol=1e-4)
    assert kv.plan["torch_native"].prefill.kv_slots.shape[0] == 3


def test_single_long_prefill_over_cached_prefix():
    run_and_check([40], [33], 2, 1, 128, torch.float32, seed=4)


def test_plan_built_once_and_reused_by_other_layers():
    gen = torch.Generator().manual_seed(5)
    kv, _ = make_step([5, 1, 9], [3, 7, 0], 1, 64, torch.float32, gen)
    backend = TorchNativeBackend()
    q = torch.randn(15, 3, 64, generator=gen)
    k = v = torch.randn(15, 1, 64, generator=gen)
    backend.forward(q, k, v, 0, kv, 0.125)
    plan = kv.plan["torch_native"]
    backend.forward(q, k, v, 1, kv, 0.125)
    assert kv.plan["torch_native"] is plan and set(kv.plan) == {"torch_native"}
    # Both layers are right with the shared plan (a fresh cache per layer is checked above).
    run_and_check([5, 1, 9], [3, 7, 0], 1, 3, 64, torch.float32, seed=6, layers=(0, 1))


def test_padded_rows_do_not_leak_nan():
    # One long and one 1-token request: most padded query rows of the short one exist only as padding.
    gen = torch.Generator().manual_seed(7)
    kv, _ = make_step([30, 1], [0, 0], 1, 64, torch.float32, gen)
    q = torch.randn(31, 2, 64, generator=gen)
    k = v = torch.randn(31, 1, 64, generator=gen)
    out = TorchNativeBackend().forward(q, k, v, 0, kv, 0.125)
    assert torch.isfinite(out).all()
    # The 1-token request with no prefix attends only to itself: its output is its own v.
    torch.testing.assert_close(out[30], v[30].expand(2, 64))


def test_capabilities():
    backend = TorchNativeBackend()
    assert TorchNativeBackend.is_available() == (True, "")
    assert backend.name == "torch_native" and backend.priority == 100
    assert backend.supports(torch.zeros(1, 1, 80, dtype=torch.float16), None) is None
