"""``TorchNativeBackend``: K/V gather through ``req_to_token`` plus one SDPA call per layer.

Runs anywhere PyTorch runs (any dtype, device and head dim), so it is the
always-available fallback. A step's ragged batch (prefill and decode mixed) is
cut into query tiles of ``C`` rows (one tile per decode request; a long prompt
spans several), padded into ``[E, heads, C, D]`` queries over ``[E, kv_heads,
max_len, D]`` keys with an additive mask, ``E`` = number of tiles. ``C`` is the
candidate that minimises padded rows plus K/V gathers, so a batch mixing one
long prompt with many decodes does not pad every decode to the prompt length.
The indices and the mask depend only on the step, so they are built once, on
the first layer, and kept in ``kv_cache.plan["torch_native"]`` for the others.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, NamedTuple

import torch
import torch.nn.functional as F

from astrai.extension.backend.base import AttentionBackend

if TYPE_CHECKING:
    from astrai.kvcache.cache import KVCache

#: Rough cost of gathering one tile's K and V, in units of one query row's attention.
_GATHER_COST_ROWS = 8


class _StepPlan(NamedTuple):
    """Per-step metadata shared by every layer."""

    kv_slots: torch.Tensor  # [E, max_len] int64: slot per position of the tile's request; padding -> 0
    mask: torch.Tensor | None  # [E, 1, C, max_len] q dtype: 0 = may attend, -inf = hidden; None = no mask
    is_causal: bool  # no padding and no cached prefix anywhere: SDPA's own causal mask suffices
    q_rows: torch.Tensor | None  # [E * C] int64: row of q for each padded query row (None: decode)
    out_rows: torch.Tensor | None  # [T] int64: padded output row of each token (None: decode)


def _tiling(kv: KVCache) -> tuple[int, torch.Tensor, int]:
    """Host-side choice of the tile size ``C``: ``(C, tiles per request [B] (CPU), E)``."""
    max_q = kv.max_q_len
    if not kv.q_lens_host:  # no host facts: one tile per request
        n_req = kv.req_pool_indices.shape[0]
        return max_q, torch.ones(n_req, dtype=torch.int64), n_req
    q_lens = torch.tensor(kv.q_lens_host)
    sizes = torch.tensor(sorted({max_q} | {1 << i for i in range(max_q.bit_length()) if 1 << i < max_q}))
    tiles = (q_lens[None, :] + sizes[:, None] - 1) // sizes[:, None]  # [candidates, B]
    entries = tiles.sum(1)
    best = int(torch.argmin(entries * sizes + entries * _GATHER_COST_ROWS))
    return int(sizes[best]), tiles[best], int(entries[best])


def _plan(kv: KVCache, dtype: torch.dtype) -> _StepPlan:
    """Build the step's gather indices and mask with tensor ops (no loop over requests or tokens)."""
    device = kv.seq_lens.device
    max_len, max_q = kv.max_len, kv.max_q_len
    seq = kv.seq_lens.long()
    pos = torch.arange(max_len, device=device)
    valid = pos[None, :] < seq[:, None]  # [B, L]: position holds this request's KV
    # Columns past seq_len may hold stale or invalid slots: point them at slot 0 (masked anyway).
    kv_slots = torch.where(valid, kv.req_to_token[kv.req_pool_indices, :max_len].long(), 0)
    uniform = bool(kv.seq_lens_host) and all(s == max_len for s in kv.seq_lens_host)
    hidden = torch.tensor(float("-inf"), dtype=dtype, device=device)
    zero = torch.tensor(0.0, dtype=dtype, device=device)

    if max_q == 1:  # pure decode: row b of q is request b, it sees all of its KV
        mask = None if uniform else torch.where(valid, zero, hidden)[:, None, None, :]
        return _StepPlan(kv_slots, mask, False, None, None)

    size, tiles_host, n_entries = _tiling(kv)
    tiles = tiles_host.to(device)
    n_req = tiles.shape[0]
    qo = kv.qo_indptr.long()
    q_len = qo[1:] - qo[:-1]
    first_entry = torch.cumsum(tiles, 0) - tiles  # [B]: first tile of each request
    entry_req = torch.repeat_interleave(torch.arange(n_req, device=device), tiles, output_size=n_entries)
    entry_tile = torch.arange(n_entries, device=device) - first_entry[entry_req]
    local = entry_tile[:, None] * size + torch.arange(size, device=device)[None, :]  # [E, C]: row in request
    # Padded rows (local >= q_len) read some valid row of q and are dropped at the end.
    q_rows = (qo[entry_req][:, None] + local).clamp_(max=kv.num_tokens - 1).reshape(-1)
    # Row `local` of request b is the token at position seq - q_len + local; it sees positions up
    # to its own. A padded row's "position" is >= seq, so it sees every valid key: never a fully
    # masked row, hence no NaN from the softmax (and its output is discarded anyway).
    q_pos = (seq - q_len)[entry_req][:, None] + local  # [E, C]
    allowed = (pos[None, None, :] <= q_pos[:, :, None]) & valid[entry_req][:, None, :]  # [E, C, L]
    tok = torch.arange(kv.num_tokens, device=device)
    req_of_tok = torch.repeat_interleave(torch.arange(n_req, device=device), q_len, output_size=kv.num_tokens)
    out_rows = first_entry[req_of_tok] * size + (tok - qo[req_of_tok])
    fresh = uniform and size == max_q == max_len and all(n == max_q for n in kv.q_lens_host)
    # An additive mask in q's dtype: SDPA would otherwise convert a boolean one in every layer.
    mask = None if fresh else torch.where(allowed, zero, hidden)[:, None]
    return _StepPlan(kv_slots[entry_req], mask, fresh, q_rows, out_rows)


class TorchNativeBackend(AttentionBackend):
    """SDPA over K/V gathered through ``req_to_token``; see ``AttentionBackend.forward``."""

    name = "torch_native"
    priority = 100

    @classmethod
    def is_available(cls) -> tuple[bool, str]:
        """Always ``(True, "")``."""
        return True, ""

    def supports(self, q: torch.Tensor, kv_cache: KVCache) -> str | None:
        """Always ``None``: every dtype, device and head dim."""
        return None

    def forward(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        layer_id: int,
        kv_cache: KVCache,
        scale: float,
    ) -> torch.Tensor:
        """Write ``k``/``v`` at ``out_cache_loc``, then one SDPA call for the whole ragged batch.

        ``q [T, Hq, D]``, ``k``/``v [T, Hkv, D]`` -> ``[T, Hq, D]`` in ``q``'s dtype.
        """
        k_buf, v_buf = kv_cache.k_buffer[layer_id], kv_cache.v_buffer[layer_id]
        # index_copy_ rather than `k_buf[loc] = k`: on CPU, index_put is ~10x slower for this.
        k_buf.index_copy_(0, kv_cache.out_cache_loc, k.to(k_buf.dtype))
        v_buf.index_copy_(0, kv_cache.out_cache_loc, v.to(v_buf.dtype))

        plan = kv_cache.plan.get(self.name)
        if plan is None:
            plan = kv_cache.plan[self.name] = _plan(kv_cache, q.dtype)

        n_entries = plan.kv_slots.shape[0]
        n_heads, head_dim = q.shape[1], q.shape[2]
        # index_select over flat slots rather than k_buf[kv_slots]: on CPU, advanced indexing
        # is ~4x slower for this gather, which dominates large decode batches.
        flat, gathered = plan.kv_slots.view(-1), (*plan.kv_slots.shape, *k_buf.shape[1:])
        keys = k_buf.index_select(0, flat).view(gathered).transpose(1, 2)  # [E, Hkv, L, D]
        values = v_buf.index_select(0, flat).view(gathered).transpose(1, 2)
        if plan.q_rows is None:
            queries = q[:, :, None, :]  # [B, Hq, 1, D]
        else:
            queries = q[plan.q_rows].view(n_entries, -1, n_heads, head_dim).transpose(1, 2)  # [E, Hq, C, D]
        out = F.scaled_dot_product_attention(
            queries,
            keys.to(q.dtype),
            values.to(q.dtype),
            attn_mask=plan.mask,
            is_causal=plan.is_causal,
            scale=scale,
            enable_gqa=n_heads != keys.shape[1],
        )
        if plan.out_rows is None:
            return out[:, :, 0, :]
        return out.transpose(1, 2).reshape(-1, n_heads, head_dim)[plan.out_rows]
