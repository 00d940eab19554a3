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
Where the kernel reads them (``"narrow_codes"`` among its ``features``), the switch also gives it
the file's bits back (``_narrow``): the 5- and 6-bit codes that the loader widened to int8 in 5 and
6 bits, a K-quant's scales as the file's factors; the same products, 1.4-3 bits a weight fewer.
Each row is quantized per group of the weight's columns (32, or Q6_K's 16), ``scale = amax /
127``, codes rounded to nearest: at most half a step of error per value, and a row's result
depends on that row alone. ``benchmarks/activations_ppl.py`` measures what it costs in perplexity.
"""

from __future__ import annotations

from dataclasses import replace

import torch
from torch import nn

from astrai.extension.fused import kernel_for
from astrai.malloc import trim_heap
from astrai.model.moe import SparseMoE
from astrai.model.quant import (
    QuantizedEmbedding,
    QuantizedLinear,
    QuantLayout,
    narrow_bits,
    narrow_codes,
    narrow_scales,
)

__all__ = ["ACTIVATIONS", "int8_by_default", "use_int8_activations"]

#: ``EngineConfig.activations``' values: "auto" (``int8_by_default``), "int8" or "dtype" (exact)
ACTIVATIONS = ("auto", "int8", "dtype")


def _quant_kernel(model: nn.Module):
    param = next(model.parameters())
    probe = torch.empty(0, dtype=param.dtype, device=param.device)
    with torch.no_grad():  # (kernel_for lends none while grad is on)
        return kernel_for("quant_linear", probe)


def int8_by_default(model: nn.Module) -> bool:
    """Whether ``activations="auto"`` switches ``model`` to int8: it has GGUF-quantized linears
    and its dtype is among the kernel's ``int8_default_dtypes``, those for which the int8 path was
    measured to keep the model's quality (``benchmarks/activations_ppl.py`` and
    ``activations_lmeval.py``: against bf16 activations, perplexity of a held text +0.67% on the
    default model and +0.35% on gemma3-270m, lm-eval's multiple-choice items all the same; against
    float32 the default model's moved +1.06%, over issue 37's 1% bar, so float32 models stay exact)."""
    if not any(isinstance(m, QuantizedLinear) for m in model.modules()):
        return False
    kernel = _quant_kernel(model)
    return next(model.parameters()).dtype in getattr(kernel, "int8_default_dtypes", ())


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
    kernel = _quant_kernel(model)
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
    if "narrow_codes" in getattr(kernel, "features", ()):
        _narrow(model, linears)
    for module in model.modules():
        if isinstance(module, SparseMoE):
            module.forget_layouts()
    return len(linears)


def _narrow(model: nn.Module, linears: list[QuantizedLinear]) -> None:
    """Give the int8 kernel the file's bits back: the 5- and 6-bit codes that the loader widened to
    int8 (Q5_0, Q5_1, Q5_K, Q6_K) in 5 and 6 bits (``astrai.model.quant.narrow_codes``), and a
    K-quant's scales and mins, which it multiplied out to float32, as the file's int8 and float16
    factors (``narrow_scales``): the same products to the bit, 1.4 to 3 bits a weight fewer to read
    each step. A segment shared with an embedding table (a tied LM head) stays as it is (two copies
    would cost more than the bits save); a mixture's experts narrow only all alike (their grouped
    kernel takes one layout). The heap this frees goes back to the system (``trim_heap``)."""
    tables = {m.packed.data_ptr() for m in model.modules() if isinstance(m, QuantizedEmbedding)}
    narrowed: dict[tuple[int, int], tuple[torch.Tensor, QuantLayout]] = {}
    for linear in linears:
        for i, (packed, lay) in enumerate(linear.segments):
            if packed.data_ptr() in tables:
                continue
            bits = narrow_bits(packed, lay)
            if bits is not None:
                packed, lay = narrow_codes(packed, lay, bits)
            packed, lay = narrow_scales(packed, lay) or (packed, lay)
            if lay != linear.layouts[i]:
                narrowed[id(linear), i] = (packed, lay)
    for module in model.modules():
        if isinstance(module, SparseMoE):
            for name in ("gate_up_proj", "down_proj"):
                keys = [(id(getattr(e, name, None)), 0) for e in module.experts]
                if len({narrowed[key][1] if key in narrowed else None for key in keys}) > 1:
                    for key in keys:
                        narrowed.pop(key, None)
    for linear in linears:
        layouts = list(linear.layouts)
        for i in range(len(layouts)):
            if (id(linear), i) in narrowed:
                packed, layouts[i] = narrowed[id(linear), i]
                setattr(linear, f"packed{i}", packed)
        linear.layouts = layouts
    if narrowed:  # the int8 layouts and the copies made on the way back to the system
        trim_heap()
