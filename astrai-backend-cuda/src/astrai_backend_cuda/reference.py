"""Pure-PyTorch reference of each compiled op: the same arguments, the same writes, float32 math.

Each function has the contract of its ``astrai.extension.ops`` namesake (see there),
including what it mutates: the decode reference writes the new K/V into the pool, every
split's partial output and log-sum-exp at the kernel's split boundaries (``plan``), and
the combined output; the prefill reference writes only the rows of the listed Q tiles.
It runs on any device and synchronises freely (it is for tests and checks, not speed). An int8
pool (``k_scale``/``v_scale`` given) is read as ``q * scale`` in float32, and decode quantizes
the new K/V with ``astrai.kvcache.quant.quantize``.
The kernels differ from it only by rounding: float32 accumulation order, base-2
exponentials, and (prefill) probabilities rounded to the storage type before P.V.
"""

from __future__ import annotations

import torch

from astrai.extension.api import quantize_kv
from astrai_backend_cuda.plan import PREFILL_Q_TILE, decode_split_range, window_start


def _side(buf: torch.Tensor, scales: torch.Tensor | None, layer_id: int) -> torch.Tensor:
    """Layer ``layer_id`` of a pool's K (V) as the kernels read it: its values, or an int8 pool's
    ``q * scale`` in float32."""
    if scales is None:
        return buf[layer_id]
    return buf[layer_id].float() * scales[layer_id][..., None]


def write_kv(
    buf: torch.Tensor, scales: torch.Tensor | None, layer_id: int, loc: torch.Tensor, x: torch.Tensor
) -> None:
    """``x`` into slots ``loc`` of layer ``layer_id`` of a pool's K (V): as is, or quantized with its
    ``scales`` (``quantize_kv``). CudaBackend writes a prefill step's K/V with it."""
    if scales is None:
        buf[layer_id].index_copy_(0, loc, x.to(buf.dtype))
        return
    q, s = quantize_kv(x)
    buf[layer_id].index_copy_(0, loc, q)
    scales[layer_id].index_copy_(0, loc, s)


def _attend(
    q: torch.Tensor,
    keys: torch.Tensor,
    values: torch.Tensor,
    allowed: torch.Tensor,
    scale: float,
    softcap: float = 0.0,
):
    """Float32 attention of ``q [n, Hq, D]`` over ``keys``/``values [L, Hkv, D]`` where ``allowed [n, L]``,
    scores soft-capped (``softcap * tanh(s / softcap)``) when ``softcap > 0``.

    Returns ``(o [n, Hq, D], lse [n, Hq])``; a row with nothing allowed gets ``o = 0``, ``lse = -inf``.
    """
    group = q.shape[1] // keys.shape[1]
    k = keys.float().repeat_interleave(group, dim=1)
    v = values.float().repeat_interleave(group, dim=1)
    scores = torch.einsum("nhd,lhd->nhl", q.float(), k) * scale
    if softcap:
        scores = torch.tanh(scores / softcap) * softcap
    scores = scores.masked_fill(~allowed[:, None, :], float("-inf"))
    m = scores.amax(-1, keepdim=True)
    p = torch.exp(scores - torch.where(torch.isinf(m), 0.0, m))
    l = p.sum(-1)  # noqa: E741 - the softmax denominator's usual name
    o = torch.einsum("nhl,lhd->nhd", p, v) / torch.where(l > 0, l, 1.0)[..., None]
    return o, m[..., 0] + torch.log(l)


def attn_paged_decode(
    q,
    new_k,
    new_v,
    k_buffer,
    v_buffer,
    layer_id,
    req_to_token,
    req_pool_indices,
    seq_lens,
    out_cache_loc,
    max_len,
    num_splits,
    o_part,
    ml_part,
    out,
    scale,
    window=0,
    softcap=0.0,
    k_scale=None,
    v_scale=None,
) -> torch.Tensor:
    """Reference of ``ops.attn_paged_decode``: pool write, split-K partials, combine into ``out``."""
    write_kv(k_buffer, k_scale, layer_id, out_cache_loc, new_k)
    write_kv(v_buffer, v_scale, layer_id, out_cache_loc, new_v)
    k_layer, v_layer = _side(k_buffer, k_scale, layer_id), _side(v_buffer, v_scale, layer_id)
    rows = req_pool_indices.tolist()
    for b, seq_len in enumerate(seq_lens.tolist()):
        slots = req_to_token[rows[b], :seq_len].long()
        keys, values = k_layer[slots], v_layer[slots]
        pos = torch.arange(seq_len, device=q.device)
        first = window_start(seq_len, window)
        for s in range(num_splits):
            start, end = decode_split_range(max_len, num_splits, s, seq_len, first)
            allowed = ((pos >= start) & (pos < end))[None, :]
            o, lse = _attend(q[b : b + 1], keys, values, allowed, scale, softcap)
            o_part[b, :, s] = o[0]
            ml_part[b, :, s] = lse[0]
    lse = ml_part[:, :, :num_splits]
    w = torch.exp(lse - lse.amax(-1, keepdim=True))
    combined = (w[..., None] * o_part[:, :, :num_splits]).sum(2) / w.sum(-1)[..., None]
    return out.copy_(combined)


def attn_paged_prefill(
    q,
    k_buffer,
    v_buffer,
    layer_id,
    req_to_token,
    req_pool_indices,
    qo_indptr,
    kv_indptr,
    q_tile_to_batch,
    q_tile_to_index,
    scale,
    out=None,
    window=0,
    softcap=0.0,
    k_scale=None,
    v_scale=None,
) -> torch.Tensor:
    """Reference of ``ops.attn_paged_prefill``: causal attention tile by tile, offset ``kv_len - q_len``
    (in a sliding window, a row at position ``p`` sees ``p - window + 1 .. p``)."""
    out = torch.empty_like(q) if out is None else out
    k_layer, v_layer = _side(k_buffer, k_scale, layer_id), _side(v_buffer, v_scale, layer_id)
    qo, kv, rows = qo_indptr.tolist(), kv_indptr.tolist(), req_pool_indices.tolist()
    for b, tile in zip(q_tile_to_batch.tolist(), q_tile_to_index.tolist(), strict=True):
        q_start, q_len, kv_len = qo[b], qo[b + 1] - qo[b], kv[b + 1] - kv[b]
        r0, r1 = tile * PREFILL_Q_TILE, min((tile + 1) * PREFILL_Q_TILE, q_len)
        if r1 <= r0 or kv_len < q_len:
            continue  # outside the contract: the kernel writes nothing either
        positions = torch.arange(kv_len - q_len + r0, kv_len - q_len + r1, device=q.device)
        slots = req_to_token[rows[b], : int(positions[-1]) + 1].long()
        cols = torch.arange(len(slots), device=q.device)[None, :]
        allowed = cols <= positions[:, None]
        if window:
            allowed &= cols > positions[:, None] - window
        rows_q = q[q_start + r0 : q_start + r1]
        o, _ = _attend(rows_q, k_layer[slots], v_layer[slots], allowed, scale, softcap)
        out[q_start + r0 : q_start + r1] = o.to(out.dtype)
    return out


def rotary_emb(x: torch.Tensor, freqs: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
    """Reference of ``ops.rotary_emb``: pairs ``(x[2i], x[2i+1])`` times ``cos_i + j sin_i`` in float32."""
    out = torch.empty_like(x) if out is None else out
    pairs = x.float().unflatten(-1, (-1, 2))
    cos, sin = freqs[..., None, :, 0].float(), freqs[..., None, :, 1].float()
    x0, x1 = pairs[..., 0], pairs[..., 1]
    rotated = torch.stack([x0 * cos - x1 * sin, x0 * sin + x1 * cos], dim=-1).flatten(-2)
    return out.copy_(rotated)
