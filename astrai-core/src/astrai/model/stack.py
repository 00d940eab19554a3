"""A decoder's layers described for a whole-stack kernel (``decoder_layers`` of ``astrai.extension.fused``).

``describe(model)`` says what every layer computes when all of them are one of the two layer shapes
a whole-stack kernel replicates, with the same sizes and options in every layer:

- ``DecoderLayer``: pre-norm attention and MLP, the residual add fused with the next norm (Llama,
  SmolLM2, Qwen2 with its q/k/v bias, Qwen3 with its per-head q/k norms, Mistral's windows);
- ``SandwichDecoderLayer``: Gemma's norms before and after each block (Gemma 3: per-head q/k
  norms, local and global layers turning by their own RoPE tables).

Otherwise (partial rotary, soft-capped scores, mixture-of-experts or other MLPs, unfused
projections, a tensor-parallel shard, Gemma's ``1 + weight`` norms on a model not in float32,
where the layers round in float32 between the model's bf16 steps) it is ``None`` and the model
runs its layers one by one.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from astrai.model.layers import (
    Attention,
    DecoderLayer,
    GatedMLP,
    OffsetRMSNorm,
    RMSNorm,
    SandwichDecoderLayer,
)

if TYPE_CHECKING:
    from torch import nn

__all__ = ["DecoderStack", "describe"]

#: a gated MLP's activation -> whether the stack runs it as tanh-approximated GELU (else SiLU)
_ACTIVATIONS = {"silu": False, "gelu_pytorch_tanh": True, "gelu_tanh": True}


@dataclass(frozen=True)
class DecoderStack:
    """Every layer of a decoder, the same shapes and options in each."""

    n_heads: int
    n_kv_heads: int
    head_dim: int
    intermediate_size: int
    eps: float  # of every norm of every layer
    scale: float  # attention's softmax scale
    # per layer: input norm, post-attention norm; (sandwich) pre- and post-feed-forward norms;
    # (qk_norm) the q and k norms: each the weight the layer multiplies by, in the model's dtype
    norms: tuple[torch.Tensor, ...]
    linears: tuple[nn.Module, ...]  # per layer: qkv_proj, o_proj, gate_up_proj, down_proj
    qkv_biases: tuple[torch.Tensor, ...]  # per layer, or () when no layer has one
    # per layer: its sliding window (0: every position), or () when no layer has one
    windows: tuple[int, ...] = ()
    sandwich: bool = False  # Gemma's norms after attention and after the MLP
    qk_norm: bool = False  # a norm on each query and key head before RoPE
    gelu: bool = False  # GeGLU (tanh-approximated GELU) rather than SwiGLU
    # per layer: which RoPE table turns it (0: the model's, 1: its local layers'), or () for all 0
    tables: tuple[int, ...] = ()


def _norm_weight(norm: nn.Module, dtype: torch.dtype) -> torch.Tensor | None:
    """What ``norm`` multiplies by, when the stack's norm (rounding as the layers' kernel does in
    ``dtype``) is what it computes: ``weight`` of an ``RMSNorm``; ``1 + weight`` of Gemma's
    ``OffsetRMSNorm`` on float32 rows only (on bf16 ones it rounds once, from float32)."""
    if type(norm) is RMSNorm:
        return norm.weight
    if type(norm) is OffsetRMSNorm and dtype == torch.float32:
        return norm.scale()
    return None


def _layer_norms(layer: nn.Module) -> tuple[list[nn.Module], bool] | None:
    """The layer's block norms in the stack's order and whether it is a sandwich layer."""
    if type(layer) is DecoderLayer:
        return [layer.input_layernorm, layer.post_attention_layernorm], False
    if type(layer) is SandwichDecoderLayer:
        names = (
            "input_layernorm",
            "post_attention_layernorm",
            "pre_feedforward_layernorm",
            "post_feedforward_layernorm",
        )
        return [getattr(layer, n) for n in names], True
    return None


def describe(model: nn.Module) -> DecoderStack | None:
    """``model``'s decoder layers as a ``DecoderStack``, or ``None`` when a whole-stack kernel
    would not compute exactly what they do (see the module docstring)."""
    config = model.config
    layers = list(model.model.layers)
    if not layers or (config.rotary_dim or config.head_dim) != config.head_dim:
        return None  # (a whole-stack kernel rotates whole heads)
    dtype = next(model.parameters()).dtype
    norms: list[torch.Tensor] = []
    linears: list[nn.Module] = []
    biases: list[torch.Tensor] = []
    windows: list[int] = []
    options: set[tuple] = set()
    for layer in layers:
        found = _layer_norms(layer)
        attn, mlp = getattr(layer, "self_attn", None), getattr(layer, "mlp", None)
        if (
            found is None
            or type(attn) is not Attention
            or type(mlp) is not GatedMLP
            or mlp.act_name not in _ACTIVATIONS
            or attn.softcap
            or not hasattr(attn, "qkv_proj")
            or not hasattr(mlp, "gate_up_proj")
            or attn.reduce is not None
            or mlp.reduce is not None  # a tensor-parallel shard sums over ranks
        ):
            return None
        block_norms, sandwich = found
        qk_norm = hasattr(attn, "q_norm")
        if qk_norm:
            block_norms += [attn.q_norm, attn.k_norm]
        weights = [_norm_weight(n, dtype) for n in block_norms]
        if any(w is None for w in weights):
            return None
        parts = (attn.qkv_proj, attn.o_proj, mlp.gate_up_proj, mlp.down_proj)
        if any(lin.bias is not None for lin in parts[1:]):
            return None
        options.add(
            (
                attn.n_heads,
                attn.n_kv_heads,
                attn.head_dim,
                mlp.down_proj.in_features,
                attn.scale,
                sandwich,
                qk_norm,
                _ACTIVATIONS[mlp.act_name],
                *(n.eps for n in block_norms),
            )
        )
        norms += [w.detach().to(dtype).contiguous() for w in weights]
        linears += parts
        if attn.qkv_proj.bias is not None:
            biases.append(attn.qkv_proj.bias.detach().to(dtype).contiguous())
        windows.append(int(attn.window))
    if len(options) != 1 or len(biases) not in (0, len(layers)):
        return None
    (n_heads, n_kv_heads, head_dim, intermediate, scale, sandwich, qk_norm, gelu, *eps) = options.pop()
    if len(set(eps)) != 1:
        return None
    tables = tuple(1 if w else 0 for w in windows) if hasattr(model, "rotary_local") else ()
    return DecoderStack(
        n_heads,
        n_kv_heads,
        head_dim,
        intermediate,
        eps[0],
        scale,
        tuple(norms),
        tuple(linears),
        tuple(biases),
        tuple(windows) if any(windows) else (),
        sandwich,
        qk_norm,
        gelu,
        tables if any(tables) else (),
    )
