"""``TorchNativeBackend``: K/V gathered through ``req_to_token``, attention in plain PyTorch.

Runs anywhere PyTorch runs (any dtype, device and head dim), so it is the
always-available fallback. A step's ragged batch is split in three on the host:

- decode rows (``q_len == 1``): K/V gathered head-major into ``[kv_heads * B, L, D]``
  and two batched matmuls (GQA as ``group`` query rows per K/V head), float32 up to
  ``_DECODE_F32_POSITIONS`` positions and the model dtype beyond, softmax in float32,
  with an additive length mask. For one query row per request this is several times
  faster than SDPA's CPU kernel;
- fresh prompts (no cached prefix): one causal SDPA call per prompt over this step's own
  K/V, no gather and no mask (the causal kernel skips the blocks above the diagonal);
- the other prefill rows (chunks after cached positions): cut into query tiles of ``C``
  rows (a long chunk spans several), padded into ``[E, heads, C, D]`` queries over
  ``[E, kv_heads, max_len, D]`` keys with an additive causal mask, ``E`` = number of
  tiles, one SDPA call. ``C`` is the candidate that minimises padded rows plus K/V
  gathers.

The indices and masks depend only on the step, so ``prepare`` builds them once per step
(``plan_step``) and keeps them in ``kv_cache.plan["torch_native"]`` for every layer; a sliding-window
layer's plan gathers only the positions its window reaches and masks the older ones, made once per
step and window. Soft-capped scores (Gemma 2) take the same plans through plain ops.

Over 300 lines because the three kinds of rows are planned and attended together: a change to the
step's layout changes the plan and the attention of each, and they are reviewed side by side.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, NamedTuple

import torch
import torch.nn.functional as F

from astrai.extension.backend.base import AttentionBackend
from astrai.kvcache.quant import dequantize, quantize

if TYPE_CHECKING:
    from astrai.kvcache.cache import KVCache

#: Rough cost of gathering one tile's K and V, in units of one query row's attention.
_GATHER_COST_ROWS = 8


class _Subset(NamedTuple):
    """Some of the step's requests, described for planning (device tensors unless noted)."""

    rows: torch.Tensor  # [b] req_to_token row
    seq: torch.Tensor  # [b] int64 KV length after this step
    q_start: torch.Tensor  # [b] int64 first token row in the step
    q_len: torch.Tensor  # [b] int64
    q_lens_host: torch.Tensor | None  # [b] CPU int64, None when the KVCache has no host facts
    max_len: int
    max_q: int
    uniform: bool  # every seq equals max_len (known on the host)


class _DecodePlan(NamedTuple):
    tok_rows: torch.Tensor | None  # [b] token row of each decode request; None: all rows, in order
    flat_rows: torch.Tensor  # [Hkv * b * L] int64 rows of the [size * Hkv, D] pool view, head-major
    mask: torch.Tensor | None  # [Hkv * b, 1, L] float32 additive; None: no padding
    max_len: int


class _PrefillPlan(NamedTuple):
    tok_rows: torch.Tensor | None  # [Tp] token rows of these requests; None: all rows, in order
    kv_slots: torch.Tensor  # [E, L] int64
    mask: torch.Tensor  # [E, 1, C, L] q dtype additive
    q_rows: torch.Tensor  # [E * C] int64: row of q for each padded query row
    out_rows: torch.Tensor  # [Tp] int64: padded output row of each of these tokens


class NativePlan(NamedTuple):
    """torch_native's plan of one step (``plan_step``): what each kind of row needs, for every layer
    of one sliding window (or of full attention)."""

    decode: _DecodePlan | None  # requests with one new token
    fresh: tuple[tuple[int, int], ...]  # (first row, rows) of prompts with no cached prefix
    prefill: _PrefillPlan | None  # the other prefill requests (chunks after cached positions)
    # per fresh prompt: None (plain causal) or its [rows, rows] boolean window mask
    fresh_masks: tuple[torch.Tensor | None, ...] = ()


def _subset(kv: KVCache, pick: torch.Tensor | None) -> _Subset:
    """The requests ``pick`` (CPU int64 indices; ``None`` = all) of the step."""
    qo = kv.qo_indptr.long()
    q_start, q_len, seq, rows = qo[:-1], qo[1:] - qo[:-1], kv.seq_lens.long(), kv.req_pool_indices
    host_q = torch.tensor(kv.q_lens_host) if kv.q_lens_host else None
    host_seq = torch.tensor(kv.seq_lens_host) if kv.seq_lens_host else None
    if pick is None:
        max_len, max_q = kv.max_len, kv.max_q_len
    else:
        dev = pick.to(seq.device)
        q_start, q_len, seq, rows = q_start[dev], q_len[dev], seq[dev], rows[dev]
        host_q, host_seq = host_q[pick], host_seq[pick]  # a split is only made with host facts
        max_len, max_q = int(host_seq.max()), int(host_q.max())
    uniform = host_seq is not None and bool((host_seq == max_len).all())
    return _Subset(rows, seq, q_start, q_len, host_q, max_len, max_q, uniform)


def _gather_slots(kv: KVCache, sub: _Subset, window: int = 0) -> tuple[torch.Tensor, ...]:
    """``(kv_slots [b, L], valid [b, L], positions [b, L])``: the positions the step's rows may see,
    from 0 (or, in a sliding window, from the first one the request's first new row sees) up to
    the request's length; columns past it point at slot 0."""
    reach = sub.max_q + window - 1  # positions the rows of one request see at most
    if window and reach < sub.max_len:
        start = (sub.seq - sub.q_len - window + 1).clamp(min=0)
        pos = start[:, None] + torch.arange(reach, device=sub.seq.device)[None, :]
    else:
        pos = torch.arange(sub.max_len, device=sub.seq.device)[None, :].expand(sub.seq.shape[0], -1)
    valid = pos < sub.seq[:, None]
    slots = kv.req_to_token[sub.rows[:, None], pos.clamp(max=sub.max_len - 1)].long()
    # Columns past seq_len may hold stale or invalid slots: point them at slot 0 (masked anyway).
    return torch.where(valid, slots, 0), valid, pos


def _decode_plan(kv: KVCache, sub: _Subset, whole: bool, window: int = 0) -> _DecodePlan:
    kv_slots, valid, _ = _gather_slots(kv, sub, window)
    width = kv_slots.shape[1]
    n_kv = kv.k_buffer.shape[2]
    # Row (slot * Hkv + h) of the pool seen as [size * Hkv, D] is head h of a slot: gathering in
    # (head, request, position) order gives K/V ready for one bmm per head and request, no copy.
    heads = torch.arange(n_kv, device=kv_slots.device)[:, None, None]
    flat_rows = (kv_slots[None] * n_kv + heads).view(-1)
    mask = None
    if not sub.uniform:  # (uniform: every column valid, in a window too: each request is past it)
        mask = torch.where(valid, 0.0, float("-inf"))[None, :, None, :].expand(n_kv, -1, -1, -1)
        mask = mask.reshape(-1, 1, width)
    return _DecodePlan(None if whole else sub.q_start, flat_rows, mask, width)


def _tiling(sub: _Subset) -> tuple[int, torch.Tensor, int]:
    """Host-side choice of the tile size ``C``: ``(C, tiles per request [b] (CPU), E)``."""
    max_q, n_req = sub.max_q, sub.rows.shape[0]
    if sub.q_lens_host is None:  # no host facts: one tile per request
        return max_q, torch.ones(n_req, dtype=torch.int64), n_req
    sizes = torch.tensor(sorted({max_q} | {1 << i for i in range(max_q.bit_length()) if 1 << i < max_q}))
    tiles = (sub.q_lens_host[None, :] + sizes[:, None] - 1) // sizes[:, None]  # [candidates, b]
    entries = tiles.sum(1)
    best = int(torch.argmin(entries * sizes + entries * _GATHER_COST_ROWS))
    return int(sizes[best]), tiles[best], int(entries[best])


def _prefill_plan(
    kv: KVCache, sub: _Subset, whole: bool, dtype: torch.dtype, window: int = 0
) -> _PrefillPlan:
    """Tiles, gather indices and causal (and window) mask with tensor ops (no loop over requests or
    tokens)."""
    device = sub.seq.device
    kv_slots, valid, pos = _gather_slots(kv, sub, window)
    size, tiles_host, n_entries = _tiling(sub)
    tiles = tiles_host.to(device)
    n_req = tiles.shape[0]
    n_tok = int(sub.q_lens_host.sum()) if sub.q_lens_host is not None else kv.num_tokens
    first_entry = torch.cumsum(tiles, 0) - tiles  # [b]: first tile of each request
    entry_req = torch.repeat_interleave(torch.arange(n_req, device=device), tiles, output_size=n_entries)
    entry_tile = torch.arange(n_entries, device=device) - first_entry[entry_req]
    local = entry_tile[:, None] * size + torch.arange(size, device=device)[None, :]  # [E, C]: row in request
    # Padded rows (local >= q_len) read the request's last row and are dropped at the end.
    q_rows = (sub.q_start[entry_req][:, None] + local.minimum(sub.q_len[entry_req][:, None] - 1)).reshape(-1)
    # Row `local` of request b is the token at position seq - q_len + local; it sees positions up
    # to its own. A padded row's "position" is >= seq, so it sees every valid key: never a fully
    # masked row, hence no NaN from the softmax (and its output is discarded anyway).
    q_pos = (sub.seq - sub.q_len)[entry_req][:, None] + local  # [E, C]
    pos = pos[entry_req][:, None, :]
    allowed = (pos <= q_pos[:, :, None]) & valid[entry_req][:, None, :]  # [E, C, L]
    if window:  # a padded row sees the last `window` positions: never fully masked either
        allowed &= pos > q_pos[:, :, None] - window
    req_of_tok = torch.repeat_interleave(torch.arange(n_req, device=device), sub.q_len, output_size=n_tok)
    local_tok = torch.arange(n_tok, device=device) - (torch.cumsum(sub.q_len, 0) - sub.q_len)[req_of_tok]
    out_rows = first_entry[req_of_tok] * size + local_tok
    # An additive mask in q's dtype: SDPA would otherwise convert a boolean one in every layer.
    hidden = torch.tensor(float("-inf"), dtype=dtype, device=device)
    mask = torch.where(allowed, torch.zeros((), dtype=dtype, device=device), hidden)[:, None]
    tok_rows = None if whole else sub.q_start[req_of_tok] + local_tok
    return _PrefillPlan(tok_rows, kv_slots[entry_req], mask, q_rows, out_rows)


def _window_mask(n: int, window: int, device: torch.device) -> torch.Tensor | None:
    """``[n, n]`` boolean: row ``i`` sees columns ``i - window + 1 .. i``; None when ``n <= window``
    (plain causal attention)."""
    if not window or n <= window:
        return None
    i = torch.arange(n, device=device)
    return (i[None, :] <= i[:, None]) & (i[None, :] > i[:, None] - window)


def layer_scales(kv: KVCache, layer_id: int) -> _Scales:
    """The K and V scales of layer ``layer_id`` (index in ``k_buffer``) of a quantized pool, None where
    that buffer is in the model dtype."""
    return tuple(None if s is None else s[layer_id] for s in (kv.k_scale, kv.v_scale))


def plan_step(kv: KVCache, dtype: torch.dtype, window: int = 0) -> NativePlan:
    """Split the step on the host into decodes, fresh prompts and the rest; plan each (masks in
    ``dtype``) for layers of sliding window ``window`` (0: full attention)."""
    if kv.max_q_len == 1:
        return NativePlan(_decode_plan(kv, _subset(kv, None), True, window), (), None)
    if not kv.q_lens_host:  # no host facts: everything through the tiled path, one tile each
        return NativePlan(None, (), _prefill_plan(kv, _subset(kv, None), True, dtype, window))
    q_lens, seq_lens = torch.tensor(kv.q_lens_host), torch.tensor(kv.seq_lens_host)
    starts = torch.cumsum(q_lens, 0) - q_lens
    is_decode = q_lens == 1
    is_fresh = (q_lens == seq_lens) & ~is_decode
    is_tiled = ~(is_decode | is_fresh)
    decode = None
    if bool(is_decode.any()):
        sub = _subset(kv, is_decode.nonzero()[:, 0])
        decode = _decode_plan(kv, sub, bool(is_decode.all()), window)
    fresh = tuple(zip(starts[is_fresh].tolist(), q_lens[is_fresh].tolist(), strict=True))
    prefill = None
    if bool(is_tiled.any()):
        whole = bool(is_tiled.all())
        sub = _subset(kv, None if whole else is_tiled.nonzero()[:, 0])
        prefill = _prefill_plan(kv, sub, whole, dtype, window)
    masks = tuple(_window_mask(n, window, kv.seq_lens.device) for _, n in fresh)
    return NativePlan(decode, fresh, prefill, masks)


#: A layer's K and V scales (``KVCache.k_scale[layer]``, ``[size, Hkv]``) where they are int8, else None.
_Scales = tuple["torch.Tensor | None", "torch.Tensor | None"]


def _read(
    rows: torch.Tensor, scale: torch.Tensor | None, index: torch.Tensor, dtype: torch.dtype
) -> torch.Tensor:
    """Pool rows ``[N, D]`` gathered at ``index`` (of the ``[size * Hkv]`` head rows) in ``dtype``:
    int8 ones times their scale (``astrai.kvcache.quant.dequantize``)."""
    if scale is None:
        return rows.to(dtype)
    return dequantize(rows, scale.view(-1).index_select(0, index), dtype)


def _gather(
    buf: torch.Tensor,
    slots: torch.Tensor,
    scale: torch.Tensor | None = None,
    dtype: torch.dtype | None = None,
) -> torch.Tensor:
    """``buf[slots]`` as ``[E, kv_heads, L, D]`` (in ``dtype``, int8 rows times their ``scale``);
    index_select over flat slots is ~4x faster on CPU."""
    flat = slots.view(-1)
    rows = buf.index_select(0, flat)
    if scale is not None:
        rows = dequantize(rows, scale.index_select(0, flat), dtype)
    return rows.view(*slots.shape, *buf.shape[1:]).transpose(1, 2)


#: Below this many K/V positions in a decode step, scores and values are multiplied in
#: float32 even for bf16 models (cheap there); above it in the model dtype, whose batched
#: matmul on the CPU is several times faster than float32's. Softmax is always float32.
_DECODE_F32_POSITIONS = 1024


def _decode_attention(
    q, k_buf, v_buf, plan: _DecodePlan, scale: float, softcap: float = 0.0, scales: _Scales = (None, None)
) -> torch.Tensor:
    """One query row per request: ``[b, Hq, D]``, as one bmm per (kv head, request) pair; an int8
    K or V (``scales``: its layer's, ``[size, Hkv]``) is read as ``q * scale``."""
    if plan.tok_rows is not None:
        q = q.index_select(0, plan.tok_rows)
    n_req, n_heads, head_dim = q.shape
    n_kv = k_buf.shape[1]
    group = n_heads // n_kv
    rows, shape = plan.flat_rows, (n_kv * n_req, plan.max_len, head_dim)
    compute = torch.float32 if n_req * plan.max_len <= _DECODE_F32_POSITIONS else q.dtype
    keys, values = (
        _read(buf.view(-1, head_dim).index_select(0, rows), s, rows, compute).view(shape)
        for buf, s in zip((k_buf, v_buf), scales, strict=True)
    )
    # [b, Hkv, group, D] -> [Hkv * b, group, D], scaled first so the scores need no extra pass
    queries = (q.view(n_req, n_kv, group, head_dim).transpose(0, 1).float() * scale).to(compute)
    queries = queries.reshape(n_kv * n_req, group, head_dim)
    scores = torch.bmm(queries, keys.to(compute).transpose(1, 2)).float()
    if softcap:
        scores = torch.tanh(scores / softcap) * softcap
    if plan.mask is not None:
        scores += plan.mask
    probs = torch.softmax(scores, -1).to(compute)
    out = torch.bmm(probs, values.to(compute))  # [Hkv * b, group, D]
    out = out.view(n_kv, n_req, group, head_dim).transpose(0, 1)
    return out.reshape(n_req, n_heads, head_dim).to(q.dtype)


def _sdpa(q, k, v, mask, scale: float, softcap: float, causal: bool = False) -> torch.Tensor:
    """``F.scaled_dot_product_attention`` over ``[..., heads, rows, D]``; with ``softcap`` the same in
    plain ops (float32 scores, capped before the mask and the softmax). ``mask``: additive or boolean."""
    gqa = q.shape[-3] != k.shape[-3]
    if not softcap:
        return F.scaled_dot_product_attention(
            q, k, v, attn_mask=mask, scale=scale, is_causal=causal, enable_gqa=gqa
        )
    if gqa:
        k, v = (x.repeat_interleave(q.shape[-3] // k.shape[-3], dim=-3) for x in (k, v))
    scores = torch.matmul(q.float() * scale, k.float().transpose(-1, -2))
    scores = torch.tanh(scores / softcap) * softcap
    if causal:
        n = scores.shape[-1]
        mask = torch.ones(n, n, dtype=torch.bool, device=q.device).tril()
    if mask is not None:
        scores = scores.masked_fill(~mask, float("-inf")) if mask.dtype == torch.bool else scores + mask
    return torch.matmul(torch.softmax(scores, -1), v.float()).to(q.dtype)


def _prefill_attention(
    q, k_buf, v_buf, plan: _PrefillPlan, scale: float, softcap: float = 0.0, scales: _Scales = (None, None)
) -> torch.Tensor:
    """Tiled ragged prefill through one SDPA call: ``[Tp, Hq, D]`` (int8 K/V read as in decode)."""
    n_entries, (n_heads, head_dim) = plan.kv_slots.shape[0], q.shape[1:]
    keys, values = (
        _gather(buf, plan.kv_slots, s, q.dtype) for buf, s in zip((k_buf, v_buf), scales, strict=True)
    )
    queries = q[plan.q_rows].view(n_entries, -1, n_heads, head_dim).transpose(1, 2)  # [E, Hq, C, D]
    out = _sdpa(queries, keys.to(q.dtype), values.to(q.dtype), plan.mask, scale, softcap)
    return out.transpose(1, 2).reshape(-1, n_heads, head_dim)[plan.out_rows]


class TorchNativeBackend(AttentionBackend):
    """Attention over K/V gathered through ``req_to_token``; see ``AttentionBackend.forward``."""

    name = "torch_native"
    priority = 100
    features = frozenset({"window", "softcap", "kv_int8"})

    @classmethod
    def is_available(cls) -> tuple[bool, str]:
        """Always ``(True, "")``."""
        return True, ""

    def supports(self, q: torch.Tensor, kv_cache: KVCache) -> str | None:
        """Always ``None``: every dtype, device and head dim."""
        return None

    def prepare(self, q: torch.Tensor, kv_cache: KVCache) -> None:
        """``plan_step`` for the step, kept in ``kv_cache.plan["torch_native"]`` (the plans of
        sliding-window layers are made by their first layer, under ``"torch_native:w{window}"``)."""
        kv_cache.plan[self.name] = plan_step(kv_cache, q.dtype)

    def forward(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        layer_id: int,
        kv_cache: KVCache,
        scale: float,
        *,
        window: int = 0,
        softcap: float = 0.0,
    ) -> torch.Tensor:
        """Write ``k``/``v`` at ``out_cache_loc``, then attend: decode and prefill rows apart.

        ``q [T, Hq, D]``, ``k``/``v [T, Hkv, D]`` -> ``[T, Hq, D]`` in ``q``'s dtype.
        """
        k_buf, v_buf = kv_cache.k_buffer[layer_id], kv_cache.v_buffer[layer_id]
        scales = layer_scales(kv_cache, layer_id)
        k, v = (
            self.store(x, buf, s, kv_cache) for x, buf, s in zip((k, v), (k_buf, v_buf), scales, strict=True)
        )
        return self.attend_step(q, k, v, k_buf, v_buf, kv_cache, scale, window, softcap, scales)

    def store(
        self, x: torch.Tensor, buf: torch.Tensor, scale: torch.Tensor | None, kv_cache: KVCache
    ) -> torch.Tensor:
        """Write one layer's new K (or V) rows ``x [T, Hkv, D]`` at the step's slots of ``buf`` (int8
        rows quantized, their scales into ``scale``); returns the rows as attention reads them back
        (``x``, or the int8 rows dequantized: a fresh prompt attends to what its cache holds)."""
        loc = kv_cache.out_cache_loc
        # index_copy_ rather than `buf[loc] = x`: on CPU, index_put is ~10x slower for this.
        if scale is None:
            buf.index_copy_(0, loc, x.to(buf.dtype))
            return x
        q8, s = quantize(x)
        buf.index_copy_(0, loc, q8)
        scale.index_copy_(0, loc, s)
        return dequantize(q8, s, x.dtype)

    def native_plan(self, q: torch.Tensor, kv_cache: KVCache, window: int = 0) -> NativePlan:
        """torch_native's plan of the step for layers of window ``window``, made once per step."""
        key = f"torch_native:w{window}" if window else self.name
        plan = kv_cache.plan.get(key)
        if not isinstance(plan, NativePlan):  # a direct call, without prepare(); or a subclass's plan
            plan = kv_cache.plan[key] = plan_step(kv_cache, q.dtype, window)
        return plan

    def attend_step(
        self,
        q,
        k,
        v,
        k_buf,
        v_buf,
        kv_cache: KVCache,
        scale: float,
        window: int = 0,
        softcap: float = 0.0,
        scales: _Scales = (None, None),
    ) -> torch.Tensor:
        """Attention of every row of the step, once its K/V are written (subclasses may take rows over);
        ``scales``: the layer's K and V scales where they are int8 (``layer_scales``)."""
        plan = self.native_plan(q, kv_cache, window)
        return self.attend(q, k, v, k_buf, v_buf, plan, scale, softcap, scales)

    @staticmethod
    def attend(
        q,
        k,
        v,
        k_buf,
        v_buf,
        plan: NativePlan,
        scale: float,
        softcap: float = 0.0,
        scales: _Scales = (None, None),
    ) -> torch.Tensor:
        """Attention of the rows ``plan`` covers (K/V already written); other rows are left unset."""
        if plan.decode is not None and plan.decode.tok_rows is None:  # every row decodes
            return _decode_attention(q, k_buf, v_buf, plan.decode, scale, softcap, scales)
        if plan.prefill is not None and plan.prefill.tok_rows is None:  # every row is a tiled prefill row
            return _prefill_attention(q, k_buf, v_buf, plan.prefill, scale, softcap, scales)
        out = torch.empty_like(q)
        if plan.decode is not None:
            decoded = _decode_attention(q, k_buf, v_buf, plan.decode, scale, softcap, scales)
            out.index_copy_(0, plan.decode.tok_rows, decoded)
        # A prompt with no cached prefix attends only to this step's own K/V: no gather, no
        # mask, and SDPA's causal kernel skips the blocks above the diagonal. One call per
        # prompt (a step holds few; vLLM's CPU backend does the same).
        masks = plan.fresh_masks or (None,) * len(plan.fresh)
        for (start, n), mask in zip(plan.fresh, masks, strict=True):
            rows = slice(start, start + n)
            # [1, heads, n, D] views: SDPA's fused CPU kernel wants 4-D inputs (3-D ones take
            # the unfused math path)
            qkv = [x[rows].to(q.dtype).transpose(0, 1)[None] for x in (q, k, v)]
            out[rows] = _sdpa(*qkv, mask, scale, softcap, causal=mask is None)[0].transpose(0, 1)
        if plan.prefill is not None:
            prefill = _prefill_attention(q, k_buf, v_buf, plan.prefill, scale, softcap, scales)
            out.index_copy_(0, plan.prefill.tok_rows, prefill)
        return out
