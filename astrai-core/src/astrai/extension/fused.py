"""The model's fused ops, and ``kernel_for``: where the model finds a loaded backend's kernel for one.

``rms_norm``, ``add_rms_norm`` and ``silu_and_mul`` (and ``apply_rotary_emb``, the model's
``PackedLinear``, ``QuantizedLinear`` and whole-step decode) run the kernel a loaded backend lends
for the tensor's device type (``AttentionBackend.kernels``, whose docstring is each op's contract)
while grad is disabled, and the PyTorch formulation otherwise. ``kernel_for`` is the one place the
model looks those kernels up: in the process registry's ``KernelTable`` (``astrai.extension.kernels``
says why there is one).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F

from astrai.extension.backend import policy

if TYPE_CHECKING:
    from astrai.extension.backend.base import Kernel


def kernel_for(op: str, x: torch.Tensor) -> Kernel | None:
    """The kernel a loaded backend lends for ``op`` (``astrai.extension.kernels.OPS``) on ``x``'s
    device type, unless grad is enabled; else ``None``.

    The kernels of the process registry (``policy.current_registry()``): none before a registry is
    discovered and a backend loaded for use (an engine loads them all when it starts).
    """
    registry = policy.current_registry()
    if registry is None:
        return None
    kernel = registry.kernels.get(op, x.device.type)
    if kernel is None or torch.is_grad_enabled():
        return None
    return kernel


def greedy_tokens(logits: torch.Tensor) -> torch.Tensor:
    """Each row's argmax of float ``logits [B, V]``, int64 ``[B]``: ``logits.max(dim=-1).indices``
    (the first maximal position; the first NaN's where a row holds one; max's indices are argmax's,
    ~2.5x faster on the CPU over a vocabulary), on a backend's ``argmax`` kernel where one is lent
    (float32 rows)."""
    kernel = kernel_for("argmax", logits)
    if kernel is not None and logits.dtype == torch.float32 and logits.dim() == 2 and logits.stride(-1) == 1:
        return kernel(logits)
    return logits.max(dim=-1).indices


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """``F.rms_norm(x) * weight`` over the last dim of ``x`` (any leading dims: per-head q/k norms
    are ``[tokens, heads, head_dim]``): float32 inside, rounded to ``x``'s dtype, then the weight
    product rounded."""
    kernel = kernel_for("rms_norm", x)
    if kernel is not None and x.dim() >= 2:  # the kernel takes rows: a view where x is contiguous
        return kernel(x.reshape(-1, x.shape[-1]), weight, eps).view(x.shape)
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
