"""``decoder_layers`` of ``astrai.extension.fused``: a decode step's decoder layers in one C++ call.

Run layer by layer from Python, a SmolLM2 decode step at batch 1 spends about 6 ms in its GEMVs
and another 1.5-2 ms dispatching the dozen small calls of each of its 30 layers.
``astrai_cpu.DecodeStack`` (``csrc/decode_stack.cpp``) makes the same calls from C++, with
the GIL released: bit for bit the layers' result on this plugin's kernels.

It runs a step only when the layer-by-layer path would run it on these same kernels: bf16,
rows that all decode (no more than the ``linear`` kernel's ``max_rows``), the ``cpu`` attention
backend selected for the step, and a stock ``LlamaForCausalLM`` with fused projections on
``PackedLinear``s; otherwise it returns ``None`` and the model runs its layers.
"""

from __future__ import annotations

import weakref
from typing import TYPE_CHECKING

import torch

from astrai.errors import AstraiError
from astrai.extension.backend.policy import get_registry

if TYPE_CHECKING:
    from astrai.kvcache.cache import KVCache


class DecoderLayersKernel:
    """``kernel(model, x, freqs, kv_cache)``: the contract of ``decoder_layers`` in ``astrai.extension.fused``.

    ``linear`` is the plugin's ``linear`` kernel: the stack shares the weights it packs for
    ``PackedLinear`` (no further copy). One ``DecodeStack`` per model, built on first use.
    """

    def __init__(self, linear) -> None:
        self._linear = linear
        self._stacks: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()

    def __call__(self, model, x: torch.Tensor, freqs: torch.Tensor, kv_cache: KVCache) -> torch.Tensor | None:
        t = x.shape[0]
        if (
            x.dtype != torch.bfloat16
            or kv_cache.max_q_len != 1
            or (self._linear.max_rows is not None and t > self._linear.max_rows)
            or kv_cache.k_buffer.dtype != torch.bfloat16
            or not self._cpu_backend_runs(x, kv_cache)
        ):
            return None
        try:
            stack = self._stacks[model]
        except KeyError:
            stack = self._stacks[model] = self._build(model)
        if stack is None:
            return None
        return stack.forward(
            x, freqs.reshape(t, -1, 2), kv_cache.k_buffer, kv_cache.v_buffer, kv_cache.req_to_token,
            kv_cache.req_pool_indices, kv_cache.seq_lens, kv_cache.out_cache_loc,
        )  # fmt: skip

    @staticmethod
    def _cpu_backend_runs(x: torch.Tensor, kv_cache: KVCache) -> bool:
        """Whether the policy gives this step's attention to ``CpuBackend`` itself (not a subclass,
        not another backend); a selection error is the layers' to raise."""
        from astrai_backend_cpu.backend import CpuBackend

        try:
            backend = get_registry().select(x.unsqueeze(1), kv_cache)
        except AstraiError:
            return False
        return type(backend) is CpuBackend

    def _build(self, model) -> object | None:
        """The model's ``DecodeStack``, or ``None`` when its layers are not the stock ones it replicates."""
        from astrai.model.cpu_linear import PackedLinear
        from astrai.model.llama import MLP, Attention, DecoderLayer, LlamaForCausalLM, RMSNorm

        if type(model) is not LlamaForCausalLM:
            return None
        layers = list(model.model.layers)
        if not layers:
            return None
        first = layers[0].self_attn
        shape = (first.n_heads, first.n_kv_heads, first.head_dim, first.scale, layers[0].input_layernorm.eps)
        norms, packed, biases = [], [], []
        for layer in layers:
            attn, mlp = layer.self_attn, layer.mlp
            if not (
                type(layer) is DecoderLayer
                and type(attn) is Attention
                and type(mlp) is MLP
                and type(layer.input_layernorm) is RMSNorm
                and type(layer.post_attention_layernorm) is RMSNorm
                and hasattr(attn, "qkv_proj")
                and hasattr(mlp, "gate_up_proj")
                and (attn.n_heads, attn.n_kv_heads, attn.head_dim, attn.scale, layer.input_layernorm.eps) == shape
                and layer.post_attention_layernorm.eps == shape[-1]
            ):
                return None
            linears = (attn.qkv_proj, attn.o_proj, mlp.gate_up_proj, mlp.down_proj)
            if any(type(lin) is not PackedLinear or lin.weight.dtype != torch.bfloat16 for lin in linears):
                return None
            if any(lin.bias is not None for lin in linears[1:]):
                return None
            norms += [n.weight.detach().to(torch.bfloat16).contiguous() for n in (layer.input_layernorm, layer.post_attention_layernorm)]
            packed.extend(lin._packed_for(self._linear)[0] for lin in linears)
            if attn.qkv_proj.bias is not None:
                biases.append(attn.qkv_proj.bias.detach().contiguous())
        if len(biases) not in (0, len(layers)):
            return None
        return torch.classes.astrai_cpu.DecodeStack(
            first.n_heads, first.n_kv_heads, first.head_dim, layers[0].mlp.down_proj.in_features,
            shape[-1], first.scale, norms, packed, biases,
        )  # fmt: skip
