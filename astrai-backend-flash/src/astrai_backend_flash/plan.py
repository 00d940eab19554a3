"""astrai's KV layout seen as flash-attn's paged layout, prepared once per step.

flash-attn 2 reads a paged cache as ``[num_blocks, BLOCK, n_kv_heads, head_dim]`` through
a block table ``[batch, blocks per request]`` of int32 block ids, and ``BLOCK`` must be a
multiple of 256. astrai's pool is ``[size, n_kv_heads, head_dim]`` per layer with
``req_to_token[row, pos]`` giving the slot of each position. When the pool hands out
slots in aligned runs of a multiple of ``BLOCK`` (engine ``page_size`` 256, 512, ...),
the layer buffer viewed as ``[size // BLOCK, BLOCK, ...]`` *is* a flash-attn paged cache
(no copy), and block ``j`` of a request is ``req_to_token[row, j * BLOCK] // BLOCK``.
The backend's ``supports()`` checks that alignment; this module assumes it.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, NamedTuple

import torch

if TYPE_CHECKING:
    from astrai.extension.api import KVCache

#: flash-attn 2's paged block size (``page_block_size`` must be a multiple of 256).
BLOCK = 256


class FlashPlan(NamedTuple):
    """What every layer of one step hands to flash-attn (device tensors)."""

    #: "decode": every request brings one token; flash_attn_with_kvcache appends it and attends.
    #: "fresh": prefill with no cached prefix; flash_attn_varlen_func over this step's K/V alone.
    #: "paged": anything else; K/V written to the pool, then flash_attn_varlen_func over the pool.
    mode: str
    block_table: torch.Tensor | None  # [B, ceil(max_len / BLOCK)] int32 block ids; None in "fresh"
    cache_seqlens: torch.Tensor | None  # [B] int32, "decode" only: KV length before this step's token


def paged_view(layer_buffer: torch.Tensor) -> torch.Tensor:
    """``[size, Hkv, D]`` -> ``[size // BLOCK, BLOCK, Hkv, D]``, a view of the same memory."""
    return layer_buffer.view(-1, BLOCK, *layer_buffer.shape[1:])


def block_table(kv: KVCache) -> torch.Tensor:
    """``[B, ceil(max_len / BLOCK)]`` int32: block id of each request's ``j``-th BLOCK positions.

    One gather of ``req_to_token`` at positions ``0, BLOCK, 2 * BLOCK, ...``; entries past a
    request's own blocks are 0 (flash-attn never reads them, and 0 is a valid block).
    """
    first_slots = kv.req_to_token[kv.req_pool_indices, : kv.max_len : BLOCK]  # [B, n_blocks]
    starts = torch.arange(first_slots.shape[1], device=first_slots.device) * BLOCK
    used = starts[None, :] < kv.seq_lens[:, None]
    return torch.where(used, first_slots // BLOCK, 0).to(torch.int32).contiguous()


def build_plan(kv: KVCache) -> FlashPlan:
    """The step's plan from host facts (``max_q_len``, ``q_lens_host``) and one index gather."""
    if kv.max_q_len == 1:
        cache_seqlens = (kv.seq_lens - 1).to(torch.int32)
        return FlashPlan("decode", block_table(kv), cache_seqlens)
    if kv.q_lens_host and kv.q_lens_host == kv.seq_lens_host:
        return FlashPlan("fresh", None, None)
    return FlashPlan("paged", block_table(kv), None)
