"""The Llama family (Llama 2/3.x, SmolLM2, Qwen2, Mistral and Ministral): pre-norm layers of
grouped-query attention and a SwiGLU MLP, from ``astrai.model.layers``.

Qwen2 adds q/k/v biases (``ModelConfig.attention_bias``), Mistral and Ministral sliding windows
(``ModelConfig.window``); Llama 3.x's RoPE scaling, tied embeddings and end-of-turn ids come with
the config. The stock layer may run on a backend's whole-stack kernel (``decoder_layers``).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
from torch import nn

from astrai.extension.fused import kernel_for
from astrai.model.decoder import DecoderLM
from astrai.model.layers import Attention, DecoderLayer, GatedMLP, RMSNorm

if TYPE_CHECKING:
    from astrai.kvcache import KVCache
    from astrai.model.config import ModelConfig

__all__ = ["Attention", "DecoderLayer", "DecoderStack", "LlamaForCausalLM", "MLP", "RMSNorm"]

MLP = GatedMLP  # the SwiGLU MLP under its older name


@dataclass(frozen=True)
class DecoderStack:
    """A model's decoder layers described for a whole-stack kernel (``decoder_layers`` of
    ``astrai.extension.fused``): the stock Llama layer, the same shapes in every layer."""

    n_heads: int
    n_kv_heads: int
    head_dim: int
    intermediate_size: int
    eps: float  # of both norms of every layer
    scale: float  # attention's softmax scale
    norms: tuple[torch.Tensor, ...]  # per layer: input_layernorm.weight, post_attention_layernorm.weight
    linears: tuple[nn.Module, ...]  # per layer: qkv_proj, o_proj, gate_up_proj, down_proj
    qkv_biases: tuple[torch.Tensor, ...]  # per layer, or () when no layer has one
    # per layer: its sliding window (0: every position; Mistral, Ministral), or () when no layer has one
    windows: tuple[int, ...] = ()


class LlamaForCausalLM(DecoderLM):
    """Llama-family causal LM whose parameter names match HF checkpoints."""

    def make_layer(self, config: ModelConfig, layer_id: int) -> nn.Module:
        return DecoderLayer(config, layer_id)

    def run_stack(self, x: torch.Tensor, freqs: torch.Tensor, kv_cache: KVCache) -> torch.Tensor | None:
        if kv_cache.groups:  # layer groups (astrai.kvcache.layout): a layer's K/V is not at its index
            return None
        lora = getattr(self, "lora", None)
        if lora is not None and lora.rows is not None:  # adapter rows: the layers' LoRA wrappers run them
            return None
        stack = kernel_for("decoder_layers", x)  # a plugin's whole-stack kernel (astrai.extension.fused)
        return stack(self, x, freqs, kv_cache) if stack is not None else None

    def decoder_stack(self) -> DecoderStack | None:
        """The decoder layers as a whole-stack kernel may run them in place of ``forward``'s loop.

        ``None`` unless every layer is the stock ``DecoderLayer`` (stock attention, MLP and
        norms, projections fused by ``fuse_projections``, no soft-cap; a sliding window goes in
        ``windows``) with the same shapes and eps, and o/gate_up/down have no bias: then running
        the layers one by one computes exactly what the description says. A tensor-parallel shard (``reduce`` set) has none: a whole-stack
        kernel would skip its all-reduces.
        """
        layers = list(self.model.layers)
        if not layers or (self.config.rotary_dim or self.config.head_dim) != self.config.head_dim:
            return None  # (a whole-stack kernel rotates whole heads)
        first = layers[0]
        shape = (
            first.self_attn.n_heads,
            first.self_attn.n_kv_heads,
            first.self_attn.head_dim,
            first.mlp.down_proj.in_features,
            first.input_layernorm.eps,
            first.self_attn.scale,
        )
        norms, linears, biases, windows = [], [], [], []
        for layer in layers:
            attn, mlp = layer.self_attn, layer.mlp
            stock = (
                type(layer) is DecoderLayer
                and type(attn) is Attention
                and type(mlp) is GatedMLP
                and mlp.act_name == "silu"
                and not attn.softcap
                and not hasattr(attn, "q_norm")
                and type(layer.input_layernorm) is RMSNorm
                and type(layer.post_attention_layernorm) is RMSNorm
                and hasattr(attn, "qkv_proj")
                and hasattr(mlp, "gate_up_proj")
                and attn.reduce is None
                and mlp.reduce is None  # a tensor-parallel shard sums over ranks
            )
            if not stock:
                return None
            eps = layer.input_layernorm.eps
            if (
                attn.n_heads,
                attn.n_kv_heads,
                attn.head_dim,
                mlp.down_proj.in_features,
                eps,
                attn.scale,
            ) != shape:
                return None
            if layer.post_attention_layernorm.eps != eps:
                return None
            parts = (attn.qkv_proj, attn.o_proj, mlp.gate_up_proj, mlp.down_proj)
            if any(lin.bias is not None for lin in parts[1:]):
                return None
            norms += [layer.input_layernorm.weight, layer.post_attention_layernorm.weight]
            linears += parts
            if attn.qkv_proj.bias is not None:
                biases.append(attn.qkv_proj.bias)
            windows.append(int(attn.window))
        if len(biases) not in (0, len(layers)):
            return None
        windows = tuple(windows) if any(windows) else ()
        return DecoderStack(*shape, tuple(norms), tuple(linears), tuple(biases), windows)
