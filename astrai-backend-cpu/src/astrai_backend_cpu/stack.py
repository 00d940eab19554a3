"""The ``decoder_layers`` kernel: a decode step's decoder layers in one C++ call.

Run layer by layer from Python, a SmolLM2 decode step at batch 1 spends about as long dispatching
the dozen small calls of each of its 30 layers as in its GEMVs (7 ms each on 2 AVX2 cores, float32).
``astrai_cpu.DecodeStack`` (``csrc/decode_stack.cpp``) makes the same calls from C++, with
the GIL released: bit for bit the layers' result on this plugin's kernels.

It runs a step only when the layer-by-layer path would run it on these same kernels: bf16 or
float32 (the model's dtype, with the K/V pool in it or in int8), tokens that all decode (no more than its linears' kernels take: ``DecoderLayersKernel``), the step's attention
backend this plugin's own (``KVCache.backend``), and a model whose ``decoder_stack()``
describes its layers (``astrai.model.stack``: Llama-family and Gemma layers) with fused projections
on bf16 ``PackedLinear``s or GGUF weights kept quantized, in one or more formats (sliding-window
layers and layer groups included: each layer's window goes to the stack, which starts
their ``paged_decode`` at each request's first position in it, as the backend's decode rows do);
otherwise it returns ``None`` and the model runs its layers.

"Tokens that all decode" takes in a speculative verify step whose other rows decode: the CPU
backend's plan (``backend._cpu_plan``) then lays every token out as a decode row over the
positions up to its own (a row's drafts after its decode token, in order). The stack writes a
layer's K/V for all tokens before it attends, so each draft sees the K/V of those before it: the
layer-by-layer result, at the cost of a decode step of ``1 + drafts`` rows, where the layers run
from Python cost half as much again as the whole decode step.
"""

from __future__ import annotations

import weakref
from typing import TYPE_CHECKING

import torch

from astrai.extension.api import PackedLinear, QuantizedLinear

if TYPE_CHECKING:
    from astrai.extension.api import KVCache


class DecoderLayersKernel:
    """``kernel(model, x, freqs, kv_cache)``: ``decoder_layers``'s contract (``AttentionBackend.kernels``).

    ``linear`` is the plugin's ``linear`` kernel (``None``: the build has none, no AVX512-BF16): the
    stack shares the weights it packs for ``PackedLinear`` (no further copy); ``quant`` its ``quant_linear`` kernel (``None``: the build
    has none), which the model's quantized linears run on; ``experts`` its ``quant_experts`` kernel
    (a mixture of experts' projections). ``backend`` is the attention backend
    class whose steps it runs (``CpuBackend``; not a subclass, which may attend differently). One
    ``DecodeStack`` per model, built on first use. A step runs on it when it has no more rows
    than each kind of its linears' kernels takes: ``linear``'s ``max_rows`` for dense ones
    (16 on an AMX CPU, where oneDNN's tile GEMMs then win), ``quant_linear``'s for quantized ones.
    """

    #: It takes a step's LoRA rows (``model.stack_lora()``): each projection's updates added after
    #: it by ``astrai_cpu::lora_apply``, as the layers' LoRA wrappers add them, from the slots'
    #: weights the stack keeps (``set_lora``, again whenever the lists' version moves).
    lora = True

    def __init__(self, linear, quant, backend: type, experts=None) -> None:
        self._linear = linear
        self._quant = quant
        self._experts = experts
        self._backend = backend
        self._stacks: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
        self._lora_versions: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # model -> set_lora's

    def __call__(
        self, model, x: torch.Tensor, freqs: list[torch.Tensor], kv_cache: KVCache
    ) -> torch.Tensor | None:
        t = x.shape[0]
        if (
            x.dtype not in (torch.bfloat16, torch.float32)
            or any(  # K/V in the model's dtype, or int8 with their scales (astrai.kvcache.quant)
                buf.dtype != (x.dtype if scale is None else torch.int8)
                for buf, scale in (
                    (kv_cache.k_buffer, kv_cache.k_scale),
                    (kv_cache.v_buffer, kv_cache.v_scale),
                )
            )
            or type(kv_cache.backend) is not self._backend
        ):
            return None
        if kv_cache.max_q_len == 1:
            rows, seq_lens = kv_cache.req_pool_indices, kv_cache.seq_lens
        else:  # a verify step: every token a decode row of the backend's plan, or not the stack's
            plan = kv_cache.plan.get(self._backend.name)
            if (
                plan is None
                or plan.tok_rows is not None
                or plan.native is not None
                or plan.chunks is not None
            ):
                return None
            rows, seq_lens = plan.rows, plan.seq_lens
        try:
            stack, kinds, dtype = self._stacks[model]
        except KeyError:
            stack, kinds, dtype = self._stacks[model] = self._build(model)
        if (
            stack is None
            or dtype != x.dtype
            or any(limit is not None and t > limit for limit in self._row_limits(kinds))
        ):
            return None
        groups = getattr(kv_cache, "groups", None) or (kv_cache,)  # layer groups (astrai.kvcache.layout)
        slots = [i for slot in getattr(kv_cache, "layer_slots", None) or () for i in slot]
        adapters = model.stack_lora() if hasattr(model, "stack_lora") else None
        lora_rows = None
        if adapters is not None:
            lora_rows, version, *weights = adapters
            if self._lora_versions.get(model) != version:
                stack.set_lora(*weights)
                self._lora_versions[model] = version
        return stack.forward(
            x,
            [f.reshape(t, -1, 2) for f in freqs],
            kv_cache.k_buffer,
            kv_cache.v_buffer,
            [g.req_to_token for g in groups],
            rows,
            seq_lens,
            [g.out_cache_loc for g in groups],
            slots,
            kv_cache.k_scale,
            kv_cache.v_scale,
            lora_rows,
        )

    def _row_limits(self, kinds: frozenset[str]) -> list[int | None]:
        """The most rows each kind of linear kernel the stack calls takes (None: any number)."""
        limits = []
        if "dense" in kinds:
            limits.append(self._linear.max_rows)
        if "quant" in kinds:
            limits.append(0 if self._quant is None else self._quant.max_rows)
        return limits

    def _build(self, model) -> tuple[object | None, frozenset[str], torch.dtype | None]:
        """The model's ``DecodeStack`` (``None`` when its ``decoder_stack()`` is not what it runs),
        the kinds of its linears ("dense", "quant") and the dtype it runs in."""
        describe = getattr(model, "decoder_stack", None)
        spec = describe() if callable(describe) else None
        if spec is None:
            return None, frozenset(), None
        dtype = spec.dtype
        packed, layouts, segments, kinds = [], [], [], set()
        for lin in spec.linears:
            if lin is None:  # a mixture of experts without a shared expert: no linears 2 and 3
                segments.append(0)
            elif (
                isinstance(lin, PackedLinear)
                and lin.weight.dtype == torch.bfloat16
                and self._linear is not None
            ):
                packed.append(lin.packed_for(self._linear)[0])
                layouts += [0] * 8
                segments.append(1)
                kinds.add("dense")
            elif isinstance(lin, QuantizedLinear) and self._quant is not None and dtype in self._quant.dtypes:
                for part, layout in lin.segments:  # each format's rows: one kernel call
                    packed.append(part)
                    layouts += layout.ints()
                segments.append(len(lin.layouts))
                kinds.add("quant")
            else:
                return None, frozenset(), None
        moe_layers, moe_tensors, moe_ints = [], [], list(spec.expert_sizes)
        if spec.experts:
            if self._experts is None or dtype not in self._experts.dtypes:
                return None, frozenset(), None
            kinds.add("quant")
            for mix in spec.experts:
                moe_layers.append(int(mix is not None))
                if mix is not None:
                    router = mix.router  # an nn.Linear's weight (at::linear), or a PackedLinear's packing
                    if isinstance(mix.router_linear, PackedLinear):
                        if self._linear is None or router.dtype != torch.bfloat16:
                            return None, frozenset(), None
                        router = mix.router_linear.packed_for(self._linear)[0]
                    shared = mix.shared_gate if mix.shared_gate is not None else torch.empty(0, dtype=dtype)
                    moe_tensors += [router, shared, *mix.gate_up, *mix.down]
                    moe_ints += [*mix.gate_up_layout, *mix.down_layout]
        stack = torch.classes.astrai_cpu.DecodeStack(
            spec.n_heads,
            spec.n_kv_heads,
            spec.head_dim,
            spec.intermediate_size,
            spec.eps,
            spec.scale,
            list(spec.norms),
            packed,
            list(spec.qkv_biases),
            layouts,
            list(spec.windows),
            [int(spec.sandwich), int(spec.qk_norm), int(spec.gelu), int(spec.float_norms)],
            segments,
            list(spec.tables),
            moe_layers,
            moe_tensors,
            moe_ints,
        )
        return stack, frozenset(kinds), dtype
