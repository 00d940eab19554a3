"""Linear layers with packed bf16 weights (a plugin's kernel, or oneDNN), for CPU inference.

On CPUs with native bf16 (AVX512-BF16 / AMX) a plain ``F.linear`` on bf16
weights re-lays the weight matrix out on every call; for the tiny activations
of a decode step that reordering costs as much as the multiply itself. Packing
the weight once into oneDNN's blocked layout (what PyTorch's inductor does when
it freezes a CPU graph) halves the time of a decode step's GEMVs.
"""

from __future__ import annotations

import logging

import torch
from torch import nn

from astrai.extension.fused import kernel_for

logger = logging.getLogger(__name__)


def prepack_supported(device: torch.device | str, dtype: torch.dtype) -> bool:
    """True when bf16 weights on the CPU can use oneDNN's packed linear."""
    return (
        torch.device(device).type == "cpu"
        and dtype == torch.bfloat16
        and torch.backends.mkldnn.is_available()
        and hasattr(torch.ops.mkldnn, "_linear_pointwise")
        and (torch.cpu._is_avx512_bf16_supported() or torch.cpu._is_amx_tile_supported())
    )


class PackedLinear(nn.Module):
    """Inference-only stand-in for an ``nn.Linear`` whose weight is packed for a faster GEMM.

    A plugin's ``linear`` kernel (``astrai.extension.fused``) takes every input it accepts, on
    its own copy of the weight, packed on first use; oneDNN's packed copy is made only when an
    input goes to oneDNN (no kernel, or more rows than the kernel's ``max_rows``). The original
    parameter stays registered (state dicts and tied embeddings keep working). Not
    differentiable.
    """

    def __init__(self, linear: nn.Linear) -> None:
        super().__init__()
        self.in_features, self.out_features = linear.in_features, linear.out_features
        self.weight = linear.weight
        self.bias = linear.bias
        self._onednn: torch.Tensor | None = None  # oneDNN's layout of the weight, made when first needed
        self._small: tuple[object, object] | None = (
            None  # (a plugin's linear kernel, the weight packed for it)
        )
        self._op = (
            torch.ops.mkldnn._linear_pointwise.default
        )  # the overload itself: no overload resolution per call
        # an LM head (prepack_linears): float32 outputs from the plugin's kernel, the sums unrounded
        # (two logits a few hundredths apart would tie in bf16); oneDNN's bf16 result without one
        self.float_out = False

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        rows = x if x.dim() == 2 else x.reshape(-1, x.shape[-1])  # the model's [tokens, features]: no reshape
        kernel = kernel_for("linear", rows)
        if kernel is not None and self.float_out:  # logits: float32, on the kernel whatever the rows
            y = kernel(rows, self.packed_for(kernel), self.bias, float_out=True)
        elif kernel is not None and (kernel.max_rows is None or rows.shape[0] <= kernel.max_rows):
            y = kernel(rows, self.packed_for(kernel), self.bias)
        else:
            y = self._op(rows, self.onednn_weight(), self.bias, "none", [], "")
        return y if x.dim() == 2 else y.view(*x.shape[:-1], self.out_features)

    def onednn_weight(self) -> torch.Tensor:
        """The weight in oneDNN's packed layout (made on first use)."""
        if self._onednn is None:
            with torch.no_grad():
                self._onednn = torch.ops.mkldnn._reorder_linear_weight(self.weight.detach(), None)
        return self._onednn

    def packed_for(self, kernel) -> object:
        """The weight in ``kernel``'s layout, packed on first use (``astrai.extension.fused``'s
        ``linear``)."""
        if self._small is None or self._small[0] is not kernel:
            with torch.no_grad():
                self._small = (kernel, kernel.pack(self.weight.detach()))
        return self._small[1]

    def extra_repr(self) -> str:
        return (
            f"in_features={self.in_features}, out_features={self.out_features}, "
            f"bias={self.bias is not None}, packed"
        )


def prepack_linears(model: nn.Module) -> int:
    """Replace every ``nn.Linear`` of ``model`` by a ``PackedLinear``; returns how many. The LM
    head's gives float32 logits (``float_out``) where a plugin's kernel runs it. A mixture of
    experts' shared-expert gate (``SparseMoE.UNPACKED``, one output) stays ``nn.Linear``, which the
    whole-step decode kernel computes with ``at::linear`` as the layer does; its router is packed,
    and the kernel runs it on the same packed weight (the same routing): one row of a Qwen3-MoE
    router (32 x 1,024) took oneDNN 20-26 us, the ``linear`` kernel a few."""
    from astrai.model.moe import SparseMoE

    keep = {
        id(getattr(mod, attr))
        for mod in model.modules()
        if isinstance(mod, SparseMoE)
        for attr in SparseMoE.UNPACKED
        if getattr(mod, attr, None) is not None
    }
    targets = [
        (name, mod) for name, mod in model.named_modules() if type(mod) is nn.Linear and id(mod) not in keep
    ]
    for name, mod in targets:
        parent_name, _, attr = name.rpartition(".")
        parent = model.get_submodule(parent_name) if parent_name else model
        setattr(parent, attr, PackedLinear(mod))
    if isinstance(getattr(model, "lm_head", None), PackedLinear):
        model.lm_head.float_out = True
    logger.debug("prepacked %d linear layers for oneDNN", len(targets))
    return len(targets)
