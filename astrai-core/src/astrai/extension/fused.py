"""Fused kernels that backend plugins may install per device type, and the model-facing ops.

The model's glue between the linears (RMSNorm, the residual add before a norm, SiLU-and-
multiply, RoPE) is a handful of small ATen ops per call; on a CPU each costs a few
microseconds of dispatch, which at batch 1 adds up to a third of a decode step. A plugin
(astrai-backend-cpu, astrai-backend-cuda) installs one-call kernels with
``register_kernel(op, kernel, device_type)``; the functions here use the kernel for a
tensor on that device type while grad is disabled, and the PyTorch formulation otherwise.
Kernels must round where the PyTorch formulation rounds (documented per op below).
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F

#: The ops a kernel may be registered for. ``linear`` is an object with ``pack(weight)`` (the
#: ``[N, K]`` weight in the kernel's own layout, made once per weight), ``__call__(x, packed,
#: bias, float_out=False)`` for bf16 rows ``x [M, K]``, ``F.linear``'s result (one rounding of the
#: float32 sum, after the bias; with ``float_out`` the float32 sums unrounded, any number of rows:
#: an LM head's logits), and ``max_rows``: the most rows it takes (``None``: any number);
#: ``PackedLinear`` (astrai.model.cpu_linear) gives it every input up to that and larger ones to oneDNN.
#: ``decoder_layers`` is called by a model's forward as ``kernel(model,
#: x, freqs, kv_cache)`` with the embeddings ``x [T, hidden]``, the rotary table rows ``freqs [1, T,
#: head_dim / 2, 2]`` and the step's ``KVCache``: it runs all of ``model``'s decoder layers (writing
#: the step's K/V as they would) and returns the hidden states after the last one, or returns
#: ``None`` without side effects when it cannot run this model or step (the model then runs its
#: layers one by one). Its result must be the layers' own on the same kernels.
#: ``quant_linear`` runs ``QuantizedLinear`` (astrai.model.quant: GGUF weights kept in its tile
#: layout): ``__call__(x, packed, layout, bias, float_out=False)`` for bf16 or float32 rows
#: ``x [M, K]`` (the dequantized weight's product, summed in float32, the bias added, one rounding
#: to x's dtype; with ``float_out``, float32 and any number of rows: an LM head); ``max_rows``:
#: the most bf16 rows it takes (more go to ``weight_t(packed, layout, dtype)``, the weight
#: dequantized and transposed ``[K, N]``, and oneDNN's GEMM); ``rows(packed, layout, ids, dtype)``:
#: rows of the weight dequantized (embedding lookups).
OPS = ("rotary", "rms_norm", "add_rms_norm", "silu_and_mul", "linear", "decoder_layers", "quant_linear")

_table: dict[tuple[str, str], Callable] = {}


def register_kernel(op: str, kernel: Callable | None, device_type: str) -> Callable | None:
    """Install ``kernel`` for ``op`` on ``device_type`` (``None`` removes it); returns the previous one.

    ``op`` is one of ``OPS``; the kernel has the contract of the function of that name here
    (``rotary``: ``apply_rotary_emb``'s). Raises ``ValueError`` for an unknown op.
    """
    if op not in OPS:
        raise ValueError(f"unknown fused op {op!r}; known: {', '.join(OPS)}")
    previous = _table.pop((op, device_type), None)
    if kernel is not None:
        _table[(op, device_type)] = kernel
    return previous


def kernel_for(op: str, x: torch.Tensor) -> Callable | None:
    """The kernel installed for ``op`` on ``x``'s device type, unless grad is enabled; else ``None``."""
    if not _table:  # nothing installed: the common fast path
        return None
    kernel = _table.get((op, x.device.type))
    if kernel is None or torch.is_grad_enabled():
        return None
    return kernel


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """``F.rms_norm(x) * weight``: float32 inside, rounded to ``x``'s dtype, then the weight product
    rounded."""
    kernel = kernel_for("rms_norm", x)
    if kernel is not None and x.dim() == 2:
        return kernel(x, weight, eps)
    return F.rms_norm(x, (x.shape[-1],), eps=eps) * weight


def add_rms_norm(
    x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(s, rms_norm(s, weight, eps))`` with ``s = x + residual`` (rounded to the dtype first)."""
    kernel = kernel_for("add_rms_norm", x)
    if kernel is not None and x.dim() == 2:
        return kernel(x, residual, weight, eps)
    s = x + residual
    return s, rms_norm(s, weight, eps)


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    """``F.silu(gate) * up`` for ``x = [gate | up]`` along the last dim (each rounded to the dtype)."""
    kernel = kernel_for("silu_and_mul", x)
    if kernel is not None and x.dim() == 2:
        return kernel(x)
    gate, up = x.chunk(2, dim=-1)
    return F.silu(gate) * up
