"""Random ragged steps for the CUDA backend's tests, and the checks every implementation must pass.

An "implementation" is anything with ``attn_paged_decode``, ``attn_paged_prefill`` and
``rotary_emb`` in the signatures of ``astrai.extension.ops``: the ops themselves on a GPU,
the kernels on the CPU emulator, or ``astrai_backend_cuda.reference``. The checks run one
against the reference with poisoned (NaN) outputs, so an element the implementation
should write but does not shows up, and bound the error as the package README states.
"""

from __future__ import annotations

import copy
import math

import torch

from astrai.kvcache.cache import KVCache
from astrai.kvcache.quant import quantize
from astrai_backend_cuda import reference
from astrai_backend_cuda.plan import DECODE_MAX_SPLITS, PREFILL_Q_TILE, decode_split_range, window_start


def unit_roundoff(dtype: torch.dtype) -> float:
    """2^-p for p bits of significand: bfloat16 2^-8, float16 2^-11, float32 2^-24."""
    return {torch.bfloat16: 2.0**-8, torch.float16: 2.0**-11, torch.float32: 2.0**-24}[dtype]


def output_bound(dtype: torch.dtype) -> float:
    """Elementwise |kernel - exact| / max|V| for attention outputs (README: 2 u, u the unit roundoff)."""
    return 2 * unit_roundoff(dtype)


#: fp32 partials (o_part relative to max|V|, ml_part absolute): summation order and exp2 vs exp.
PARTIAL_TOL = 2e-5


def make_step(
    q_lens,
    prefix_lens,
    n_heads,
    n_kv_heads,
    head_dim,
    dtype,
    seed,
    device="cpu",
    n_layers=2,
    poison_free=True,
    kinds=("auto", "auto"),
):
    """A hand-built step: each request's slots a random scattering of the pool, slot 0 never used.

    Returns ``(kv, q, k, v)``: ``q [T, Hq, D]`` and this step's ``k``/``v [T, Hkv, D]``.
    Columns of req_to_token past seq_len hold random stale slots, as a reused row would;
    the pool holds random K/V in used slots (the new positions' old contents too) and, with
    ``poison_free``, NaN in every other slot, so a read of a slot it should not read shows.
    ``kinds`` (K's, V's): ``"int8"`` keeps that side quantized (``astrai.kvcache.quant``), its free
    slots' scales NaN.
    """
    gen = torch.Generator().manual_seed(seed)
    seq_lens = [p + q for p, q in zip(prefix_lens, q_lens, strict=True)]
    n_req, n_rows = len(q_lens), len(q_lens) + 3
    size = sum(seq_lens) + 17
    max_ctx = max(seq_lens) + 5
    perm = torch.randperm(size - 1, generator=gen) + 1
    req_to_token = torch.randint(0, size, (n_rows, max_ctx), generator=gen, dtype=torch.int32)
    rows = torch.randperm(n_rows, generator=gen)[:n_req]
    new_slots, start = [], 0
    for i, n in enumerate(seq_lens):
        req_to_token[rows[i], :n] = perm[start : start + n].to(torch.int32)
        new_slots.append(perm[start + prefix_lens[i] : start + n])
        start += n
    tiles = [(b, t) for b, n in enumerate(q_lens) for t in range(math.ceil(n / PREFILL_Q_TILE))]
    shape = (n_layers, size, n_kv_heads, head_dim)
    t = sum(q_lens)

    def rand(*s):
        return torch.randn(s, generator=gen).to(dtype).to(device)

    pools = [rand(*shape), rand(*shape)]
    scales = [None, None]
    for i, kind in enumerate(kinds):
        if kind == "int8":
            pools[i], scales[i] = quantize(pools[i])
    free = torch.ones(size, dtype=torch.bool)
    free[perm[: sum(seq_lens)]] = False
    if poison_free:
        for pool, s in zip(pools, scales, strict=True):
            (pool if s is None else s)[:, free.to(device)] = float("nan")
    kv = KVCache(
        k_buffer=pools[0],
        v_buffer=pools[1],
        k_scale=scales[0],
        v_scale=scales[1],
        req_to_token=req_to_token.to(device),
        req_pool_indices=rows.long().to(device),
        seq_lens=torch.tensor(seq_lens, device=device),
        out_cache_loc=torch.cat(new_slots).long().to(device),
        max_len=max(seq_lens),
        kv_indptr=torch.tensor([0, *seq_lens]).cumsum(0).to(torch.int32).to(device),
        qo_indptr=torch.tensor([0, *q_lens]).cumsum(0).to(torch.int32).to(device),
        q_tile_to_batch=torch.tensor([b for b, _ in tiles], dtype=torch.int32, device=device),
        q_tile_to_index=torch.tensor([i for _, i in tiles], dtype=torch.int32, device=device),
        decode_o_part=torch.zeros(n_req, n_heads, DECODE_MAX_SPLITS, head_dim, device=device),
        decode_ml_part=torch.zeros(n_req, n_heads, DECODE_MAX_SPLITS, device=device),
        decode_out=torch.zeros(n_req, n_heads, head_dim, dtype=dtype, device=device),
        max_q_len=max(q_lens),
        num_tokens=t,
        q_lens_host=tuple(q_lens),
        seq_lens_host=tuple(seq_lens),
    )
    return kv, rand(t, n_heads, head_dim), rand(t, n_kv_heads, head_dim), rand(t, n_kv_heads, head_dim)


def clone_step(kv: KVCache) -> KVCache:
    """A deep copy (own pool and scratch buffers)."""
    return copy.deepcopy(kv)


def poisoned(t: torch.Tensor) -> torch.Tensor:
    """``t`` filled with NaN (every element an implementation must write)."""
    return t.fill_(float("nan"))


def _values(kv: KVCache, side: str, layer: int | None = None) -> torch.Tensor:
    """The pool's K or V (``side``) as attention reads it: its values, or an int8 pool's ``q * scale``."""
    buf, scales = getattr(kv, f"{side}_buffer"), getattr(kv, f"{side}_scale")
    values = buf if scales is None else buf.float() * scales[..., None]
    return values if layer is None else values[layer]


def _max_abs(t: torch.Tensor) -> float:
    """max |t| over its non-NaN elements (the pool's free slots are NaN)."""
    return float(t.float().nan_to_num(0.0).abs().max())


def _same(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Bitwise-equal values, NaN equal to NaN."""
    return torch.equal(a.isnan(), b.isnan()) and torch.equal(a.nan_to_num(0.0), b.nan_to_num(0.0))


def check_decode(
    impl,
    kv: KVCache,
    q,
    k,
    v,
    num_splits: int,
    max_len: int | None = None,
    layer: int = 1,
    window: int = 0,
    softcap: float = 0.0,
) -> dict:
    """``impl.attn_paged_decode`` against the reference on clones of one step; returns error stats.

    Poisons every partial slot and the output first: slots ``< num_splits`` must be written,
    those above left alone. Asserts the pool writes are exact, the partials within
    PARTIAL_TOL, empty splits (0, -inf), and the output within ``output_bound``. ``window`` and
    ``softcap`` go to both (0: off).
    """
    max_len = kv.max_len if max_len is None else max_len
    mine, ref = clone_step(kv), clone_step(kv)
    for step in (mine, ref):
        poisoned(step.decode_o_part), poisoned(step.decode_ml_part), poisoned(step.decode_out)
    scale = q.shape[-1] ** -0.5
    for fn, s in ((impl.attn_paged_decode, mine), (reference.attn_paged_decode, ref)):
        fn(
            q,
            k,
            v,
            s.k_buffer,
            s.v_buffer,
            layer,
            s.req_to_token,
            s.req_pool_indices,
            s.seq_lens,
            s.out_cache_loc,
            max_len,
            num_splits,
            s.decode_o_part,
            s.decode_ml_part,
            s.decode_out,
            scale,
            window,
            softcap,
            s.k_scale,
            s.v_scale,
        )
    assert _same(mine.k_buffer, ref.k_buffer) and _same(mine.v_buffer, ref.v_buffer), "pool writes differ"
    for got, want in ((mine.k_scale, ref.k_scale), (mine.v_scale, ref.v_scale)):
        assert got is None or _same(got, want), "the scales written differ"
    o_m, o_r = mine.decode_o_part[:, :, :num_splits].cpu(), ref.decode_o_part[:, :, :num_splits].cpu()
    ml_m, ml_r = mine.decode_ml_part[:, :, :num_splits].cpu(), ref.decode_ml_part[:, :, :num_splits].cpu()
    assert not o_m.isnan().any() and not ml_m.isnan().any(), "a partial slot below num_splits was not written"
    assert mine.decode_o_part[:, :, num_splits:].isnan().all(), "a partial slot above num_splits was written"
    vmax = max(_max_abs(v), _max_abs(_values(kv, "v")))
    empty = torch.isinf(ml_r)
    assert torch.equal(torch.isinf(ml_m), empty), "empty splits differ"
    assert (o_m[empty] == 0).all()
    o_err = float((o_m - o_r).abs().max()) / vmax
    ml_err = float((ml_m[~empty] - ml_r[~empty]).abs().max()) if (~empty).any() else 0.0
    out_err = float((mine.decode_out.float() - ref.decode_out.float()).abs().max().cpu()) / vmax
    assert o_err <= PARTIAL_TOL and ml_err <= PARTIAL_TOL * max(1.0, _max_abs(ml_r[~empty])), (o_err, ml_err)
    assert out_err <= output_bound(q.dtype), (
        f"decode output error {out_err:.2e} > {output_bound(q.dtype):.2e}"
    )
    return {"o_part": o_err, "ml_part": ml_err, "out": out_err}


def check_prefill(impl, kv: KVCache, q, k, v, layer: int = 0, window: int = 0, softcap: float = 0.0) -> dict:
    """``impl.attn_paged_prefill`` (K/V written first) against the reference; every row must be written.
    ``window`` and ``softcap`` go to both (0: off)."""
    kv = clone_step(kv)
    write_step(kv, k, v, layer)
    scale = q.shape[-1] ** -0.5
    outs = []
    for fn in (impl.attn_paged_prefill, reference.attn_paged_prefill):
        out = poisoned(torch.empty_like(q))
        fn(
            q,
            kv.k_buffer,
            kv.v_buffer,
            layer,
            kv.req_to_token,
            kv.req_pool_indices,
            kv.qo_indptr,
            kv.kv_indptr,
            kv.q_tile_to_batch,
            kv.q_tile_to_index,
            scale,
            out,
            window,
            softcap,
            kv.k_scale,
            kv.v_scale,
        )
        outs.append(out.float().cpu())
    assert not outs[0].isnan().any(), "a query row was not written"
    err = float((outs[0] - outs[1]).abs().max()) / _max_abs(_values(kv, "v", layer))
    assert err <= output_bound(q.dtype), f"prefill output error {err:.2e} > {output_bound(q.dtype):.2e}"
    return {"out": err}


def write_step(kv: KVCache, k, v, layer: int) -> None:
    """This step's ``k``/``v`` into ``kv``'s pool at ``out_cache_loc`` (quantized into an int8 side)."""
    reference.write_kv(kv.k_buffer, kv.k_scale, layer, kv.out_cache_loc, k)
    reference.write_kv(kv.v_buffer, kv.v_scale, layer, kv.out_cache_loc, v)


def check_rotary(impl, x: torch.Tensor, freqs: torch.Tensor, in_place: bool) -> dict:
    """``impl.rotary_emb`` against the reference: one rounding of the float32 rotation."""
    expected = reference.rotary_emb(x, freqs).float()
    out = impl.rotary_emb(x, freqs, x if in_place else poisoned(torch.empty_like(x)))
    assert out.shape == x.shape and out.dtype == x.dtype
    err = float(((out.float() - expected).abs() / expected.abs().clamp_min(1e-3)).max())
    assert err <= unit_roundoff(x.dtype), f"rotary relative error {err:.2e}"
    return {"out": err}


def split_partial(
    kv: KVCache, q, layer: int, b: int, h: int, start: int, end: int, scale: float, softcap: float = 0.0
):
    """Float64 ``(o, lse)`` of query head ``h`` of request ``b`` over positions ``[start, end)``, scores
    soft-capped when ``softcap > 0``."""
    row = int(kv.req_pool_indices[b])
    slots = kv.req_to_token[row, start:end].long()
    group = q.shape[1] // kv.k_buffer.shape[2]
    keys = kv.k_buffer[layer, slots, h // group].double()
    vals = kv.v_buffer[layer, slots, h // group].double()
    scores = keys @ q[b, h].double() * scale
    if softcap:
        scores = torch.tanh(scores / softcap) * softcap
    return torch.softmax(scores, 0) @ vals, torch.logsumexp(scores, 0)


def split_ranges(max_len: int, num_splits: int, seq_len: int, window: int = 0) -> list[tuple[int, int]]:
    """Each split's ``[start, end)`` (see ``plan.decode_split_range``) in a sliding window of ``window``
    (0: none)."""
    first = window_start(seq_len, window)
    return [decode_split_range(max_len, num_splits, s, seq_len, first) for s in range(num_splits)]
