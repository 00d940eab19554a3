"""Rotary position embedding: the ``freqs_cis`` table and its dispatched application.

Convention: llama.cpp/GGUF interleaved pairs. Pair ``i`` of a head is
``(x[2i], x[2i+1])``, read as the complex number ``x[2i] + j x[2i+1]`` and
multiplied by ``exp(j * pos * inv_freq[i])``.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

import torch
from torch import nn

from astrai.errors import AstraiError
from astrai.extension.fused import kernel_for


def _inv_freq(dim: int, theta: float, rope_scaling: Mapping[str, Any] | None) -> torch.Tensor:
    """``[dim/2]`` float64 inverse frequencies, scaled as ``rope_scaling`` says."""
    inv_freq = 1.0 / theta ** (torch.arange(0, dim, 2, dtype=torch.float64) / dim)
    if not rope_scaling:
        return inv_freq
    kind = rope_scaling.get("rope_type", rope_scaling.get("type", "default"))
    if kind == "default":
        return inv_freq
    if kind == "linear":
        return inv_freq / float(rope_scaling["factor"])
    if kind == "llama3":
        # Llama 3.1: long wavelengths are slowed by `factor`, short ones kept, the band between
        # interpolated smoothly (HF transformers' _compute_llama3_parameters).
        factor = float(rope_scaling["factor"])
        low, high = float(rope_scaling["low_freq_factor"]), float(rope_scaling["high_freq_factor"])
        old_len = float(rope_scaling["original_max_position_embeddings"])
        wavelen = 2 * math.pi / inv_freq
        smooth = ((old_len / wavelen - low) / (high - low)).clamp(0.0, 1.0)
        mixed = (1 - smooth) * inv_freq / factor + smooth * inv_freq
        return torch.where(
            wavelen < old_len / high, inv_freq, torch.where(wavelen > old_len / low, inv_freq / factor, mixed)
        )
    raise AstraiError(f"unsupported rope_scaling type {kind!r} (supported: default, linear, llama3)")


class RotaryEmbedding(nn.Module):
    """Precomputed RoPE table.

    ``freqs_cis``: non-persistent buffer ``[max_len, dim/2, 2]`` float32, the
    ``[cos, sin]`` of ``pos * inv_freq[i]`` (angles computed in float64).
    ``rope_scaling``: None, ``{"rope_type": "linear", "factor"}`` or
    ``{"rope_type": "llama3", "factor", "low_freq_factor", "high_freq_factor",
    "original_max_position_embeddings"}`` (HF's ``"type"`` key is accepted too).
    Raises ``AstraiError`` for an odd ``dim`` or another scaling type.
    """

    freqs_cis: torch.Tensor

    def __init__(
        self, dim: int, max_len: int, theta: float = 10000.0, rope_scaling: Mapping[str, Any] | None = None
    ) -> None:
        super().__init__()
        if dim <= 0 or dim % 2:
            raise AstraiError(f"rotary dim must be a positive even number, got {dim}")
        self.dim, self.max_len, self.theta = dim, max_len, theta
        angles = torch.outer(torch.arange(max_len, dtype=torch.float64), _inv_freq(dim, theta, rope_scaling))
        table = torch.stack([angles.cos(), angles.sin()], dim=-1).float()
        self.register_buffer("freqs_cis", table, persistent=False)

    def forward(self, position_ids: torch.Tensor) -> torch.Tensor:
        """``position_ids [batch, seq]`` int64 (any shape works) -> ``[batch, seq, dim/2, 2]`` float32."""
        return self.freqs_cis[position_ids]


def rotate_torch(x: torch.Tensor, freqs: torch.Tensor) -> torch.Tensor:
    """Complex-multiply path in float32; differentiable."""
    pairs = torch.view_as_complex(x.float().reshape(*x.shape[:-1], -1, 2).contiguous())
    rot = torch.view_as_complex(freqs.float().contiguous()).unsqueeze(-2)  # broadcast over heads
    return torch.view_as_real(pairs * rot).flatten(-2).to(x.dtype)


def apply_rotary_emb(x: torch.Tensor, freqs: torch.Tensor) -> torch.Tensor:
    """Rotate interleaved pairs of ``x`` by ``freqs``.

    ``x [batch, seq, heads, head_dim]`` (more generally ``[..., heads, head_dim]``),
    ``freqs [batch, seq, head_dim/2, 2]`` (``[..., head_dim/2, 2]``, f32 ``[cos, sin]``)
    -> a tensor of ``x``'s shape and dtype. Uses the ``rotary`` kernel a loaded backend lends
    for ``x``'s device type (``astrai.extension.fused.kernel_for``) when ``x`` is bf16 and grad
    is disabled, else the torch path.
    """
    kernel = kernel_for("rotary", x)
    if kernel is not None and x.dtype == torch.bfloat16:
        return kernel(x, freqs)
    return rotate_torch(x, freqs)
