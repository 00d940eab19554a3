"""Counter-based noise: random numbers that are a pure function of (seed, step, token id).

A seeded request must draw the same token whatever else shares its batch, so its
randomness cannot come from a stateful generator consumed row after row. Instead
every (row, token) cell hashes its own counter: ``u = hash(seed, step, token)``.
The hash is a 32-bit integer mixer (Wellons' "lowbias32") evaluated with
vectorised int64 tensor ops, so it gives the same bits on every device.

A draw is an exponential race: with ``E = -log(u)`` exponential, ``argmax(p / E)`` is
an exact draw from the probabilities ``p``, and it needs no state and no normalisation,
so a row's winner depends on that row alone. :func:`categorical` runs the race in two
levels (blocks of tokens weighted by their total probability, then tokens inside the
winning block), which is the same distribution while hashing about sqrt(V) cells per
row instead of V.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

__all__ = ["mix32", "row_keys", "uniform_noise", "exponential_noise", "categorical"]

BLOCK = 256
"""Tokens per block of the two-level race in :func:`categorical`."""

_MASK32 = 0xFFFFFFFF
_GOLDEN = 0x9E3779B9  # 2^32 / phi: the Weyl increment that spreads token ids over 32 bits
# lowbias32 multipliers. The second exceeds 2^31, so it is stored as its negative residue
# modulo 2^32: x * c then stays inside int64 for any 32-bit x (no signed overflow) and the
# low 32 bits of the product are unchanged.
_M1 = 0x7FEB352D
_M2 = 0x846CA68B - (1 << 32)
# Distinct salts keep seed 0 / step 0 away from the mixer's fixed point at 0 and separate the words.
_SEED_LO_SALT = 0x3C6EF372
_SEED_HI_SALT = 0xA54FF53A
_STEP_SALT = 0x510E527F
_STREAM_SALT = 0x1F83D9AB
_INV_2_23 = 1.0 / (1 << 23)


def mix32(x: torch.Tensor) -> torch.Tensor:
    """Bijective 32-bit avalanche mix of ``x``.

    Args:
        x: int64 tensor, any shape and device, values in ``[0, 2**32)``. Overwritten in place.

    Returns:
        ``x`` itself, holding the mixed values (still in ``[0, 2**32)``).
    """
    x.bitwise_xor_(x >> 16)
    x.mul_(_M1).bitwise_and_(_MASK32)
    x.bitwise_xor_(x >> 15)
    x.mul_(_M2).bitwise_and_(_MASK32)
    x.bitwise_xor_(x >> 16)
    return x


def row_keys(seeds: torch.Tensor, steps: torch.Tensor, stream: int = 0) -> torch.Tensor:
    """One 32-bit key per row from a 64-bit seed, a step counter and a stream number.

    Args:
        seeds: int64 ``[B]``, any value (the full 64 bits are used).
        steps: int64 ``[B]``, non-negative step counters (low 32 bits are used), same device.
        stream: independent noise streams of the same (seed, step), e.g. one per sampling level.

    Returns:
        int64 ``[B]`` keys in ``[0, 2**32)``, on the same device.
    """
    lo = (seeds & _MASK32) ^ _SEED_LO_SALT
    hi = ((seeds >> 32) & _MASK32) ^ _SEED_HI_SALT
    key = mix32(lo)
    key = mix32(key.bitwise_xor_(hi))
    key = mix32(key.bitwise_xor_((steps & _MASK32) ^ _STEP_SALT))
    return mix32(key.bitwise_xor_(((stream * _GOLDEN) & _MASK32) ^ _STREAM_SALT))


def _cell_hash(
    seeds: torch.Tensor, steps: torch.Tensor, token_ids: torch.Tensor, stream: int
) -> torch.Tensor:
    key = row_keys(seeds, steps, stream).unsqueeze(1)
    if token_ids.dim() == 1:
        token_ids = token_ids.unsqueeze(0)
    # key + token * golden (mod 2^32), then mixed twice with the key folded in again, so
    # two keys' noise fields are not shifted copies of each other.
    x = (token_ids * _GOLDEN + key).bitwise_and_(_MASK32)
    x = mix32(x)
    return mix32(x.bitwise_xor_(key))


def uniform_noise(
    seeds: torch.Tensor, steps: torch.Tensor, token_ids: torch.Tensor, stream: int = 0
) -> torch.Tensor:
    """Uniform numbers in the open interval (0, 1), one per (row, token) cell.

    Args:
        seeds: int64 ``[B]``.
        steps: int64 ``[B]``.
        token_ids: int64 ``[V]`` (the same ids for every row) or ``[B, K]`` (per-row ids),
            values in ``[0, 2**31)``; same device as ``seeds``.
        stream: selects an independent noise stream (see :func:`row_keys`).

    Returns:
        float32 ``[B, V]`` or ``[B, K]``: ``u[b, j] = hash(seeds[b], steps[b], token_ids[.., j])``,
        on the same device; equal inputs give bit-identical outputs.
    """
    x = _cell_hash(seeds, steps, token_ids, stream)
    # 23 high bits + 1/2: exactly representable in float32 and never 0 or 1.
    return (x >> 9).to(torch.float32).add_(0.5).mul_(_INV_2_23)


def exponential_noise(
    seeds: torch.Tensor, steps: torch.Tensor, token_ids: torch.Tensor, stream: int = 0
) -> torch.Tensor:
    """Exponential(1) noise ``E = -log(u)`` per (row, token) cell, strictly positive.

    Shapes, dtypes and devices as :func:`uniform_noise`. ``argmax(p / E)`` over a row of
    probabilities ``p`` draws index ``j`` with probability ``p[j] / sum(p)``.
    """
    return uniform_noise(seeds, steps, token_ids, stream).log_().neg_()


def categorical(probs: torch.Tensor, seeds: torch.Tensor, steps: torch.Tensor) -> torch.Tensor:
    """Draw one token per row from ``probs`` with counter-based noise.

    Two-level exponential race: block ``b`` (tokens ``[b * BLOCK, (b + 1) * BLOCK)``)
    wins with probability ``sum(p[block])`` (noise stream 1, counter = block index), then
    a token wins inside it with probability ``p[t] / sum(p[block])`` (stream 0, counter =
    token id); the product is ``p[t]``. The result is a pure function of the row's
    probabilities, seed and step.

    Args:
        probs: float32 ``[B, V]``, non-negative, each row with a positive entry (e.g. a
            softmax); zero entries are never drawn. Not modified.
        seeds: int64 ``[B]``, same device.
        steps: int64 ``[B]``, same device.

    Returns:
        int64 ``[B]`` token ids in ``[0, V)``, on the same device. No device synchronisation.
    """
    n_rows, vocab = probs.shape
    pad = -vocab % BLOCK
    if pad:
        probs = F.pad(probs, (0, pad))
    blocks = probs.view(n_rows, -1, BLOCK)
    device = probs.device
    block_ids = torch.arange(blocks.shape[1], device=device)
    mass = blocks.sum(dim=-1)  # [B, n_blocks]
    block = mass.div_(exponential_noise(seeds, steps, block_ids, stream=1)).argmax(dim=-1)
    inner = blocks[torch.arange(n_rows, device=device), block]  # [B, BLOCK], a copy
    token_ids = block.unsqueeze(1) * BLOCK + torch.arange(BLOCK, device=device)
    pick = inner.div_(exponential_noise(seeds, steps, token_ids, stream=0)).argmax(dim=-1)
    return block * BLOCK + pick
