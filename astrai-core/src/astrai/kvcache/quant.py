"""Quantized KV: the types a pool may keep K or V in, and the rounding every backend shares.

``auto`` keeps K (or V) in the model's dtype. ``int8`` keeps each slot's vector of each KV head
as 8-bit integers with one float32 scale: ``q = round(x * (127 / amax))`` clamped to [-127, 127],
``scale = amax / 127`` (a head of zeros: scale 0, all zeros), read back as ``q * scale``. A head
dim of 64 then takes 68 bytes where bf16 takes 128 and float32 256. Why int8 and not fp8 e4m3
(vLLM's, SGLang's): its 8 bits of magnitude per head hold a K/V vector's values more closely
than e4m3's 3-bit mantissa, a CPU without AVX512-FP16 converts it with one widening and one
int-to-float instruction, and the scale folds into the score (K) and into the probability (V),
so dequantizing costs no extra pass; llama.cpp's q8_0 (32 values per fp16 scale) is the same
idea. The scale is per token and head, so writing a slot never rescales another.

``quantize`` is the reference: the CPU kernels' writes (``astrai_cpu::store_kv``) give the same
bytes, and every attention path (torch_native's gathers, the CPU decode kernel) reads ``q * scale``.
"""

from __future__ import annotations

import torch

from astrai.config import KV_CACHE_DTYPES

__all__ = ["KV_CACHE_DTYPES", "check_kv_dtype", "dequantize", "quantize", "slot_bytes"]


def check_kv_dtype(name: str) -> str:
    """``name`` if it is one of ``KV_CACHE_DTYPES``; else ValueError naming them."""
    if name not in KV_CACHE_DTYPES:
        raise ValueError(f"KV cache dtype must be one of {', '.join(KV_CACHE_DTYPES)}, got {name!r}")
    return name


def slot_bytes(kind: str, n_kv_heads: int, head_dim: int, dtype: torch.dtype) -> int:
    """Bytes one layer's K (or V) of one slot takes in a pool of ``kind`` for a model of ``dtype``."""
    if kind == "int8":
        return n_kv_heads * (head_dim + 4)  # the values and a float32 scale per head
    return n_kv_heads * head_dim * dtype.itemsize


def quantize(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``x [..., D]`` (any float dtype) as ``(int8 [..., D], float32 scale [...])``, one scale per vector."""
    xf = x.float()
    amax = xf.abs().amax(-1)
    scale = amax / 127.0
    # a tensor over a tensor: one IEEE quotient (``127.0 / amax`` multiplies by a rounded reciprocal)
    inv = torch.where(amax > 0, amax.new_tensor(127.0) / amax, torch.zeros_like(amax))
    q = torch.round(xf * inv[..., None]).clamp_(-127, 127).to(torch.int8)
    return q, scale


def dequantize(q: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """``q * scale`` in ``dtype`` (the product in float32, rounded once)."""
    return (q.float() * scale[..., None]).to(dtype)
