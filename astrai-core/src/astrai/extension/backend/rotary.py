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

#: The scaling types whose frequencies transformers computes (``modeling_rope_utils``): its
#: functions are the reference, and the tables here take their float32 inverse frequencies.
_FROM_TRANSFORMERS = ("yarn", "longrope")


def _hf_inv_freq(kind: str, dim: int, theta: float, scaling: Mapping[str, Any], long: bool) -> tuple:
    """``(inv_freq [dim/2] float64, attention factor)`` from transformers' function for ``kind``;
    ``long``: LongRoPE's long factors (else its short ones)."""
    from transformers import PretrainedConfig
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    params = {k: v for k, v in scaling.items() if k not in ("type", "rope_type")}
    original = params.get("original_max_position_embeddings")
    factor = float(params.get("factor") or 1.0)
    config = PretrainedConfig()
    config.rope_parameters = {"rope_type": kind, "rope_theta": theta, "factor": factor, **params}
    config.head_dim, config.hidden_size, config.num_attention_heads = dim, dim, 1
    config.max_position_embeddings = int((original or 0) * factor) or 1
    seq_len = original + 1 if long and original else None
    inv_freq, attention_factor = ROPE_INIT_FUNCTIONS[kind](config, None, seq_len=seq_len)
    return inv_freq.to(torch.float64), float(attention_factor)


def _inv_freq(dim: int, theta: float, rope_scaling: Mapping[str, Any] | None) -> torch.Tensor:
    """``[dim/2]`` float64 inverse frequencies, scaled as ``rope_scaling`` says."""
    inv_freq = 1.0 / theta ** (torch.arange(0, dim, 2, dtype=torch.float64) / dim)
    if not rope_scaling:
        return inv_freq
    kind = _kind(rope_scaling)
    if kind == "default":
        return inv_freq
    if kind in _FROM_TRANSFORMERS:
        return _hf_inv_freq(kind, dim, theta, rope_scaling, long=False)[0]
    if kind == "linear":
        return inv_freq / float(rope_scaling["factor"])
    if kind == "freq_factors":  # llama.cpp's rope_freqs tensor: each frequency's own divisor
        factors = torch.tensor(rope_scaling["freq_factors"], dtype=torch.float64)
        if factors.shape != inv_freq.shape:
            raise AstraiError(f"{len(factors)} freq_factors for {len(inv_freq)} rotary frequencies")
        return inv_freq / factors
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
    raise AstraiError(
        f"unsupported rope_scaling type {kind!r} (supported: default, linear, llama3, freq_factors, "
        f"{', '.join(_FROM_TRANSFORMERS)})"
    )


def _kind(rope_scaling: Mapping[str, Any] | None) -> str:
    return (rope_scaling or {}).get("rope_type", (rope_scaling or {}).get("type", "default"))


def _table(angles: torch.Tensor, factor: float = 1.0) -> torch.Tensor:
    """``[positions, dim/2, 2]`` float32 ``[cos, sin] * factor`` of float64 angles."""
    return (torch.stack([angles.cos(), angles.sin()], dim=-1) * factor).float()


class RotaryEmbedding(nn.Module):
    """Precomputed RoPE table.

    ``freqs_cis``: non-persistent buffer ``[max_len, dim/2, 2]`` float32, the
    ``[cos, sin]`` of ``pos * inv_freq[i]`` (angles computed in float64).
    ``rope_scaling``: None, ``{"rope_type": "linear", "factor"}``,
    ``{"rope_type": "llama3", "factor", "low_freq_factor", "high_freq_factor",
    "original_max_position_embeddings"}``, ``{"rope_type": "freq_factors", "freq_factors": [dim/2]}``
    (llama.cpp's ``rope_freqs``: each frequency divided by its factor), or transformers' ``yarn`` and
    ``longrope`` (HF's ``"type"`` key is accepted too).
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
        # On the host whatever device context the module is built under (a model moves the table
        # with its ``.to(device)``): on the meta device (``DecoderLM.parameter_shapes``) these ops
        # would go through torch's Python decompositions, about 1.5 s to set up the first time.
        with torch.device("cpu"):
            self.register_buffer("freqs_cis", self._make_table(rope_scaling), persistent=False)

    def _make_table(self, rope_scaling: Mapping[str, Any] | None) -> torch.Tensor:
        dim, theta, max_len = self.dim, self.theta, self.max_len
        positions = torch.arange(max_len, dtype=torch.float64)
        if _kind(rope_scaling) in _FROM_TRANSFORMERS:
            # cos and sin scaled by the attention factor. LongRoPE (Phi-3, Phi-4-mini): its long
            # factors for every position when the context served (``max_len``) passes the original
            # one, else its short ones, as llama.cpp (n_ctx) and vLLM (max_model_len) choose: one
            # table for the whole context, so a position's rotation never depends on the sequence
            # it is in (transformers switches by the length of the sequence of each forward)
            original = rope_scaling.get("original_max_position_embeddings")
            long = _kind(rope_scaling) == "longrope" and bool(original) and max_len > original
            inv_freq, factor = _hf_inv_freq(_kind(rope_scaling), dim, theta, rope_scaling, long=long)
            table = _table(torch.outer(positions, inv_freq), factor)
            return table
        return _table(torch.outer(positions, _inv_freq(dim, theta, rope_scaling)))

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
    ``freqs [batch, seq, rotary_dim/2, 2]`` (a ``rotary_dim`` below ``head_dim`` turns the first dims
    alone) (``[..., head_dim/2, 2]``, f32 ``[cos, sin]``)
    -> a tensor of ``x``'s shape and dtype. Uses the ``rotary`` kernel a loaded backend lends
    for ``x``'s device type (``astrai.extension.fused.kernel_for``) when ``x`` is bf16 and grad
    is disabled, else the torch path.
    """
    rotated = 2 * freqs.shape[-2]
    if rotated < x.shape[-1]:  # partial rotary: the head's first dims turn, the rest pass through
        return torch.cat([rotate_torch(x[..., :rotated], freqs), x[..., rotated:]], dim=-1)
    kernel = kernel_for("rotary", x)
    if kernel is not None and x.dtype == torch.bfloat16:
        return kernel(x, freqs)
    return rotate_torch(x, freqs)
