"""Host-side launch planning of the kernels: prefill Q tiles, the decode split-K ranges and split count.

Shared by ``CudaBackend`` (which picks ``num_splits`` and builds the tile maps in ``prepare``)
and the reference (which must cut the sequence exactly where the kernel does).
"""

from __future__ import annotations

import math

#: Query rows per prefill tile (kernels.h kPrefillTileQ); ``KVCache.q_tile_to_batch``/``q_tile_to_index``
#: are in these units.
PREFILL_Q_TILE = 64
#: Split-K partial slots per request and head in ``KVCache.decode_o_part``/``decode_ml_part``.
DECODE_MAX_SPLITS = 32

#: Positions per decode pipeline stage; a split's length is a multiple of it (kernels.h kDecodeTile).
DECODE_TILE = 32
#: No split shorter than this: below it, a split's fixed cost (q load, pipeline fill, combine) dominates.
MIN_SPLIT_POSITIONS = 128
#: A split's fixed cost, in positions' worth of streaming time (for the wave model below).
SPLIT_COST_POSITIONS = 64
#: Head dims and query heads per KV head that the kernels are compiled for.
HEAD_DIMS = (64, 128)
MAX_GROUP = 16


def window_start(seq_len: int, window: int) -> int:
    """The first position a request of ``seq_len`` attends in a sliding window of ``window`` (0: none)."""
    return max(0, seq_len - window) if window else 0


def decode_chunk(max_len: int, num_splits: int) -> int:
    """Positions per split: ``ceil(max_len / num_splits)`` rounded up to ``DECODE_TILE``."""
    return math.ceil(math.ceil(max_len / num_splits) / DECODE_TILE) * DECODE_TILE


def decode_split_range(
    max_len: int, num_splits: int, split: int, seq_len: int, first: int = 0
) -> tuple[int, int]:
    """``[start, end)`` positions of ``split`` for a request of ``seq_len`` attending positions ``first``
    onwards (a sliding window's first; 0 without one); empty when start >= end.

    The last split runs to ``seq_len``, so every position is covered whatever ``max_len`` is.
    """
    chunk = decode_chunk(max_len, num_splits)
    start = first + split * chunk
    end = seq_len if split == num_splits - 1 else min(seq_len, start + chunk)
    return start, end


def decode_num_splits(
    batch: int, n_kv_heads: int, max_len: int, num_sms: int, blocks_per_sm: int, max_splits: int
) -> int:
    """How many splits make a decode step fastest, by a wave model of the GPU.

    The grid has ``batch * n_kv_heads * s`` blocks, of which ``num_sms * blocks_per_sm``
    run at once; each streams ``chunk(s)`` positions plus a fixed cost. The estimated time
    ``waves(s) * (chunk(s) + SPLIT_COST_POSITIONS)`` is minimised over ``1 <= s <=
    max_splits`` with splits of at least ``MIN_SPLIT_POSITIONS``: a small batch gets many
    splits to fill the GPU, a large one few (whole waves, little combine traffic).
    """
    slots = max(1, num_sms * blocks_per_sm)
    limit = max(1, min(max_splits, math.ceil(max_len / MIN_SPLIT_POSITIONS)))
    best, best_cost = 1, math.inf
    for s in range(1, limit + 1):
        waves = math.ceil(batch * n_kv_heads * s / slots)
        cost = waves * (decode_chunk(max_len, s) + SPLIT_COST_POSITIONS)
        if cost < best_cost:
            best, best_cost = s, cost
    return best


def prefill_tiles(q_lens: tuple[int, ...] | list[int]) -> tuple[list[int], list[int]]:
    """``(q_tile_to_batch, q_tile_to_index)`` of a step: one entry per ``PREFILL_Q_TILE`` rows of each
    request."""
    to_batch, to_index = [], []
    for b, n in enumerate(q_lens):
        tiles = -(-n // PREFILL_Q_TILE)
        to_batch += [b] * tiles
        to_index += range(tiles)
    return to_batch, to_index
