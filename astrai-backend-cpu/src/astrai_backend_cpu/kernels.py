"""The plugin's fused kernels: rotary, the norms, ``silu_and_mul``, ``linear``, ``decoder_layers``,
``quant_linear``, ``quant_experts``, ``lora``, ``encoder_attention``, ``argmax``, ``categorical``, ``top_p``.

``fused_kernels(CpuBackend)`` makes them; ``CpuBackend.kernels("cpu")`` lends them to the model
(the contract of each op is ``AttentionBackend.kernels``'s).
"""

from __future__ import annotations

import torch

from astrai.extension.api import Kernel, rotate_torch
from astrai_backend_cpu.stack import DecoderLayersKernel


def rotary_kernel(x: torch.Tensor, freqs: torch.Tensor) -> torch.Tensor:
    """``apply_rotary_emb``'s contract on ``astrai_cpu::rotary`` (``[..., heads, D]`` with contiguous
    heads)."""
    heads, dim = x.shape[-2:]
    if x.stride(-1) != 1 or x.stride(-2) != dim or freqs.shape[:-2] != x.shape[:-2] or x.dim() < 3:
        return rotate_torch(x, freqs)  # broadcasting or exotic strides: the torch path
    rows = x.reshape(-1, heads, dim)  # a view for the model's [1, T, H, D] slices of the fused QKV
    out = torch.ops.astrai_cpu.rotary(rows, freqs.reshape(-1, dim // 2, 2).float().contiguous())
    return out.view(x.shape)


class LinearKernel:
    """The ``linear`` kernel on ``astrai_cpu::linear_pack``/``linear_packed`` (bf16 rows).

    ``max_rows``: any number where the CPU has no AMX (the kernel matches oneDNN from 256 rows
    and beats it below); with AMX, inputs over 64 rows go to oneDNN's tile GEMMs. Measured on 2
    vCPUs of an AMX Xeon, oneDNN wins from 3-4 rows on SmolLM2's linears (its 3072x576 one at 32
    rows in 87 against 488 us), and whole decode steps (which over ``max_rows`` leave the C++
    stack, ``stack.py``, for the layers from Python) break even at 17 rows: a threshold of 16
    made 24- and 32-row steps 13% and 20% faster. 64 is kept so that a row's result does not
    depend on the batch in steps of up to 64 rows (mixed prefill and decode steps included).
    """

    def __init__(self) -> None:
        self.max_rows: int | None = 64 if torch.cpu._is_amx_tile_supported() else None

    def pack(self, weight: torch.Tensor) -> tuple[torch.Tensor, int]:
        """The ``[N, K]`` weight in 16-row tiles by pairs of k, and ``N``."""
        return torch.ops.astrai_cpu.linear_pack(weight.contiguous()), weight.shape[0]

    def __call__(
        self,
        x: torch.Tensor,
        packed: tuple[torch.Tensor, int],
        bias: torch.Tensor | None,
        float_out: bool = False,
    ) -> torch.Tensor:
        return torch.ops.astrai_cpu.linear_packed(x, packed[0], packed[1], bias, float_out)


class QuantLinearKernel:
    """The ``quant_linear`` kernel on ``astrai_cpu::quant_linear`` (see ``csrc/quant.cpp``).

    ``dtypes``: bf16 and float32 rows on a build for AVX512-BF16; float32 only on one for AVX2 +
    FMA (``csrc/quant_avx2.cpp``). Float32 inputs over ``max_rows`` go to ``wide``: the weight
    dequantized whole to float32 (``quant_weight_t``) into torch's sgemm. On 2 vCPUs of an AVX2
    EPYC, one thread, the kernel against that: Gemma 3's 4096x640 Q4_K gate/up at 8 rows 0.72
    against 2.0 ms, 32 rows 2.9 against 3.5, 64 rows 10.0 against 9.5, 512 rows 105 against 71.

    ``features``: "int8_rows" where layouts may ask for 8-bit activations (``int8_dtypes``: float32
    rows on AVX2 builds, ``csrc/quant_q8_avx2.cpp``; bf16 and float32 rows on AVX512-BF16 builds for
    a CPU with AVX512-VNNI, ``csrc/quant_q8_avx512.cpp``); such rows stay on the kernel at any width.
    "narrow_codes" where int8 layouts may hold 5- and 6-bit codes and K-quant factors
    (``astrai.model.quant.narrow_codes`` and ``narrow_scales``: the VNNI kernel;
    ``use_int8_activations`` narrows the weights for it).

    ``max_rows``: inputs up to 64 rows (decode steps) run on the kernel, which reads the
    quantized weight once per step; larger bf16 ones (prefill) go to ``wide``: the weight as the bf16
    model holds it (each weight rounded to bf16 once), float32 sums. Without AMX that is
    ``astrai_cpu::quant_linear_wide`` (each pair of 16-row tiles dequantized to bf16 into a buffer
    the size of the L2 cache, then ``linear_packed``'s loops for every row over it: no copy of the
    whole weight). With AMX, up to ``amx_rows`` rows it is ``astrai_cpu::quant_linear_amx`` (four
    tiles at a time dequantized so, then AMX tile products of every 16 rows); more rows take the
    weight dequantized whole (``quant_weight_t``) into oneDNN's tile GEMMs, as before that kernel.
    On 2 vCPUs of an AMX Xeon (``benchmarks/quant_step_bench.py``), one-token requests of the
    default model against every prefill step the old way: 100 prompt tokens 41 against 78 ms, 400
    129 against 147 ms, 1,000 431 against 439 ms, 2,000 1,383 against 1,231 ms (oneDNN's cache
    blocking wins on large products).
    """

    max_rows = 64
    amx_rows = 1024

    def __init__(self) -> None:
        ops = torch.ops.astrai_cpu
        bf16 = ops.has_quant_linear_bf16()
        self.dtypes = (torch.bfloat16, torch.float32) if bf16 else (torch.float32,)
        # layouts with int8_rows (astrai.model.activations): float32 rows on AVX2 builds, both
        # dtypes where the CPU has AVX512-VNNI too
        int8 = ops.has_quant_linear_int8()
        # "narrow_codes": int8 layouts of 5- and 6-bit codes (astrai.model.quant.narrow_codes)
        narrow = int8 and ops.has_quant_narrow_codes()
        self.features = ("int8_rows",) + (("narrow_codes",) if narrow else ()) if int8 else ()
        self.int8_dtypes = self.dtypes if int8 else ()
        # what activations="auto" takes int8 for (astrai.model.activations.int8_by_default): bf16
        # models on the VNNI kernel; float32 ones stay exact (their int8 perplexity missed the bar)
        self.int8_default_dtypes = (torch.bfloat16,) if int8 and bf16 else ()
        self.amx = bf16 and torch.cpu._is_amx_tile_supported()
        self.amx_kernel = self.amx and ops.has_quant_linear_amx()

    def wide(
        self, x: torch.Tensor, packed: torch.Tensor, layout: list[int], bias: torch.Tensor | None
    ) -> torch.Tensor:
        ops = torch.ops.astrai_cpu
        if x.dtype == torch.float32:  # the float32 model's weight, torch's sgemm
            wt = ops.quant_weight_t(packed, layout, x.dtype)
            return torch.matmul(x, wt) if bias is None else torch.addmm(bias, x, wt)
        if not self.amx:
            return ops.quant_linear_wide(x, packed, layout, bias)
        if self.amx_kernel and x.shape[0] <= self.amx_rows and layout[1] % 32 == 0:
            return ops.quant_linear_amx(x, packed, layout, bias)
        wt = ops.quant_weight_t(packed, layout, x.dtype)
        return torch.matmul(x, wt) if bias is None else torch.addmm(bias, x, wt)

    def __call__(
        self,
        x: torch.Tensor,
        packed: torch.Tensor,
        layout: list[int],
        bias: torch.Tensor | None,
        float_out: bool = False,
    ) -> torch.Tensor:
        return torch.ops.astrai_cpu.quant_linear(x, packed, layout, bias, float_out)

    @staticmethod
    def weight_t(packed: torch.Tensor, layout: list[int], dtype: torch.dtype) -> torch.Tensor:
        return torch.ops.astrai_cpu.quant_weight_t(packed, layout, dtype)

    @staticmethod
    def rows(packed: torch.Tensor, layout: list[int], ids: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        return torch.ops.astrai_cpu.quant_dequant(packed, layout, ids, dtype)


class QuantExpertsKernel:
    """The ``quant_experts`` kernel on ``astrai_cpu::quant_experts`` (see ``csrc/experts.cpp``): one
    projection of every chosen expert of a mixture-of-experts layer in one call, on the rows of
    each sorted by expert; the dtypes of ``quant_linear``'s build."""

    def __init__(self, quant: QuantLinearKernel) -> None:
        self.dtypes = quant.dtypes

    def __call__(
        self, x: torch.Tensor, offsets: torch.Tensor, packed: list[torch.Tensor], layout: list[int]
    ) -> torch.Tensor:
        return torch.ops.astrai_cpu.quant_experts(x, offsets, packed, layout)


class LoraKernel:
    """The ``lora`` kernel on ``astrai_cpu::lora_apply`` (see ``csrc/lora.cpp``): float32 and bf16 rows."""

    dtypes = (torch.float32, torch.bfloat16)

    def __call__(self, y, x, rows, a, b, spans) -> None:
        torch.ops.astrai_cpu.lora_apply(y, x, rows, a, b, spans)


class EncoderAttentionKernel:
    """The ``encoder_attention`` kernel on ``astrai_cpu::encoder_attention`` (AVX512-BF16 builds):
    a BERT layer's attention over the packed sequences, read from its fused QKV rows in place."""

    head_dims = (32, 64, 128)

    def __call__(self, qkv: torch.Tensor, lengths: torch.Tensor, heads: int, scale: float) -> torch.Tensor:
        return torch.ops.astrai_cpu.encoder_attention(qkv, lengths, heads, scale)


def fused_kernels(backend: type) -> dict[str, Kernel]:
    """``{op: kernel}`` of the fused CPU kernels (rotary: bf16 only, by its dispatch rule); new
    kernel objects on each call (the backend asks once per instance).

    The kernels must be loaded (``build.load_kernels``). ``backend`` is the attention backend
    whose steps the whole-step decode kernel may run (see ``stack.DecoderLayersKernel``).
    """
    ops = torch.ops.astrai_cpu
    lent: dict[str, Kernel] = {
        "rotary": rotary_kernel,
        "rms_norm": lambda x, w, eps: ops.rms_norm(x.contiguous(), w.to(x.dtype), eps),
        "add_rms_norm": lambda x, r, w, eps: ops.add_rms_norm(
            x.contiguous(), r.contiguous(), w.to(x.dtype), eps
        ),
    }
    lent["argmax"] = ops.argmax
    lent["categorical"] = ops.categorical
    lent["top_p"] = ops.top_p
    if ops.has_silu_and_mul():  # (AVX512-BF16 builds: ATen's two ops elsewhere)
        lent["silu_and_mul"] = ops.silu_and_mul
    lent["lora"] = LoraKernel()
    if ops.has_prefill_attention():
        lent["encoder_attention"] = EncoderAttentionKernel()
    quant = QuantLinearKernel() if ops.has_quant_linear() else None
    if quant is not None:
        lent["quant_linear"] = quant
        lent["quant_experts"] = QuantExpertsKernel(quant)
    linear = None
    if ops.has_linear_packed():  # the compiler targeted AVX512-BF16: small-batch GEMMs at the read bandwidth
        linear = lent["linear"] = LinearKernel()
    if linear is not None or quant is not None:  # on the same packed weights
        lent["decoder_layers"] = DecoderLayersKernel(linear, quant, backend, lent.get("quant_experts"))
    return lent
