"""``use_int8_activations``: a model's GGUF-quantized linears multiply 8-bit activations.

llama.cpp's CPU path quantizes each row of activations to int8 per block of 32 (a float scale
each) and takes the products of the weights' integer codes with those in integer arithmetic. The
float32 path (astrai's default) keeps the activations exact, so that the quantized model equals its
dequantized float32 twin up to the order of the sums (the oracle tests). With
``EngineConfig.activations = "int8"`` (``astrai serve --activations int8``) the engine switches the
model's ``QuantizedLinear`` layouts to ``int8_rows`` before its first forward, and a kernel that
implements them (astrai-backend-cpu's ``quant_linear``: ``csrc/quant_q8_avx2.cpp`` on AVX2 builds,
float32 rows; ``csrc/quant_q8_avx512.cpp`` on AVX512-BF16 builds for CPUs with AVX512-VNNI, bf16
and float32 rows, four columns of 16 outputs a ``vpdpbusd``) runs every product so, prefill included (a row's result must not depend on the rows beside it,
and on 2 AVX2 cores the kernel at 128-512 rows is within about 10% of the float32 sgemm path).
Each row is quantized per group of the weight's columns (32, or Q6_K's 16), ``scale = amax /
127``, codes rounded to nearest: at most half a step of error per value, and a row's result
depends on that row alone. ``benchmarks/activations_ppl.py`` measures what it costs in perplexity.
"""

from __future__ import annotations

from dataclasses import replace

import torch
from torch import nn

from astrai.extension.fused import kernel_for
from astrai.model.moe import SparseMoE
from astrai.model.quant import QuantizedLinear

__all__ = ["ACTIVATIONS", "use_int8_activations"]

#: ``EngineConfig.activations``' values: "auto" (the model's dtype) or "int8"
ACTIVATIONS = ("auto", "int8")


def use_int8_activations(model: nn.Module) -> int:
    """Switch every ``QuantizedLinear`` of ``model`` to 8-bit activations; how many there were.

    Raises ValueError where nothing would run so: a model with no GGUF-quantized linear (a dense
    checkpoint, or ``--weights dense``), one whose dtype is not float32, or no loaded kernel that
    takes int8 rows (``quant_linear`` with ``int8_rows`` among its ``features``). Call it before
    the model's first forward: kernels that build per-model state (the whole-step decode stack,
    a mixture's grouped experts) read the layouts then.
    """
    linears = [m for m in model.modules() if isinstance(m, QuantizedLinear)]
    if not linears:
        raise ValueError(
            "int8 activations apply to GGUF-quantized weights kept quantized; this model has none "
            "(serve a GGUF file with --weights gguf or auto)"
        )
    dtype = next(model.parameters()).dtype
    probe = torch.empty(0, dtype=dtype, device=next(model.parameters()).device)
    with torch.no_grad():  # (kernel_for lends none while grad is on)
        kernel = kernel_for("quant_linear", probe)
    if kernel is None or "int8_rows" not in getattr(kernel, "features", ()):
        raise ValueError(
            "int8 activations need a quant_linear kernel that takes them: astrai-backend-cpu built "
            "for AVX2 (float32 rows) or for AVX512-BF16 with AVX512-VNNI (bf16 and float32 rows); "
            "none is loaded for this model's device here"
        )
    if dtype not in kernel.int8_dtypes:
        names = " or ".join(str(d).removeprefix("torch.") for d in kernel.int8_dtypes)
        raise ValueError(f"int8 activations run on {names} models here; this one runs in {dtype}")
    for linear in linears:
        linear.layouts = [replace(lay, int8_rows=True) for lay in linear.layouts]
    for module in model.modules():
        if isinstance(module, SparseMoE):
            module.forget_layouts()
    return len(linears)
