"""A decoder's layers described for a whole-stack kernel (``decoder_layers`` of ``astrai.extension.fused``).

``describe(model)`` says what every layer computes when all of them are one of the two layer shapes
a whole-stack kernel replicates, with the same sizes and options in every layer:

- ``DecoderLayer``: pre-norm attention and MLP, the residual add fused with the next norm (Llama,
  SmolLM2, Qwen2 with its q/k/v bias, Qwen3 with its per-head q/k norms, Mistral's windows);
- ``SandwichDecoderLayer``: Gemma's norms before and after each block (Gemma 3: per-head q/k
  norms, local and global layers turning by their own RoPE tables).

Either with a gated MLP or a mixture of experts (``SparseMoE``: Qwen3-MoE, Mixtral, Qwen2-MoE's
shared expert) whose experts are quantized in one layout per projection.

Otherwise (partial rotary, soft-capped scores, other MLPs or experts held otherwise, unfused
projections, a tensor-parallel shard, norms of both kinds in one model) it is ``None`` and the
model runs its layers one by one. Gemma's ``1 + weight`` norms on bf16 rows compute in float32 and
round once (``OffsetRMSNorm``): the stack gets them as float32 weights (``float_norms``), which its
norm applies in the same way.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from astrai.model.cpu_linear import PackedLinear
from astrai.model.layers import (
    Attention,
    DecoderLayer,
    GatedMLP,
    OffsetRMSNorm,
    RMSNorm,
    SandwichDecoderLayer,
)
from astrai.model.moe import SparseMoE

__all__ = ["DecoderStack", "Experts", "describe"]

#: a gated MLP's activation -> whether the stack runs it as tanh-approximated GELU (else SiLU)
_ACTIVATIONS = {"silu": False, "gelu_pytorch_tanh": True, "gelu_tanh": True}


@dataclass(frozen=True)
class Experts:
    """A mixture-of-experts MLP (``SparseMoE``) as a whole-stack kernel runs it: every expert's fused
    gate_up and its down in one quantized layout each (``SparseMoE._grouped``)."""

    router: torch.Tensor  # [experts, hidden], the model's dtype
    #: the router as ``prepack_linears`` left it: a ``PackedLinear`` (the kernel runs its packed
    #: weight, as the layer does) or an ``nn.Linear`` (``at::linear``)
    router_linear: nn.Module
    gate_up: tuple[torch.Tensor, ...]  # per expert, packed
    gate_up_layout: tuple[int, ...]  # quant_linear's 8 integers
    down: tuple[torch.Tensor, ...]
    down_layout: tuple[int, ...]
    shared_gate: torch.Tensor | None  # [1, hidden]: the shared expert's gate (its projections: linears 2, 3)


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
    # per layer: qkv_proj, o_proj, gate_up_proj, down_proj (a mixture of experts: its shared
    # expert's, or None, None)
    linears: tuple[nn.Module | None, ...]
    qkv_biases: tuple[torch.Tensor, ...]  # per layer, or () when no layer has one
    # per layer: its sliding window (0: every position), or () when no layer has one
    windows: tuple[int, ...] = ()
    sandwich: bool = False  # Gemma's norms after attention and after the MLP
    qk_norm: bool = False  # a norm on each query and key head before RoPE
    gelu: bool = False  # GeGLU (tanh-approximated GELU) rather than SwiGLU
    # per layer: which RoPE table turns it (0: the model's, 1: its local layers'), or () for all 0
    tables: tuple[int, ...] = ()
    # per layer: its experts, or None for a dense MLP; () when every MLP is dense
    experts: tuple[Experts | None, ...] = ()
    # (experts, top_k, norm_topk, expert intermediate, shared intermediate) of every mixture
    expert_sizes: tuple[int, ...] = ()
    # the norm weights are float32 on a model of narrower dtype (Gemma's ``1 + weight``)
    float_norms: bool = False

    @property
    def dtype(self) -> torch.dtype:
        """The model's dtype: its rows, K/V and biases."""
        return torch.bfloat16 if self.float_norms else self.norms[0].dtype


def _norm_weight(norm: nn.Module, dtype: torch.dtype) -> torch.Tensor | None:
    """What ``norm`` multiplies by, when the stack's norm (rounding as the layers' kernel does in
    ``dtype``) is what it computes: ``weight`` of an ``RMSNorm``; ``1 + weight`` of Gemma's
    ``OffsetRMSNorm`` in float32 (on bf16 rows it rounds once, from float32: ``float_norms``)."""
    if type(norm) is RMSNorm:
        return norm.weight
    if type(norm) is OffsetRMSNorm and dtype in (torch.float32, torch.bfloat16):
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


def _experts(mlp: SparseMoE) -> tuple[Experts, tuple, nn.Module | None, nn.Module | None] | None:
    """``mlp`` as ``Experts``, its sizes and activation, and the shared expert's projections."""
    grouped = mlp._grouped()
    router, shared = mlp.gate, mlp.shared_expert
    if grouped is None or type(router) not in (nn.Linear, PackedLinear) or router.bias is not None:
        return None
    act = mlp.experts[0].act_name
    if any(e.act_name != act for e in mlp.experts) or act not in _ACTIVATIONS:
        return None
    gate_up, gate_up_layout, down, down_layout = grouped
    shared_parts: tuple = (None, None)
    shared_gate = None
    if shared is not None:
        gate = mlp.shared_expert_gate
        if (
            type(shared) is not GatedMLP
            or shared.act_name != act
            or not hasattr(shared, "gate_up_proj")
            or type(gate) is not nn.Linear
            or gate.bias is not None
        ):
            return None
        shared_parts = (shared.gate_up_proj, shared.down_proj)
        shared_gate = gate.weight.detach().contiguous()
    experts = Experts(
        mlp.gate.weight.detach().contiguous(),
        mlp.gate,
        tuple(gate_up),
        tuple(gate_up_layout),
        tuple(down),
        tuple(down_layout),
        shared_gate,
    )
    sizes = (
        mlp.num_experts,
        mlp.top_k,
        int(mlp.norm_topk),
        gate_up_layout[0] // 2,
        0 if shared is None else shared.down_proj.in_features,
    )
    return experts, (sizes, _ACTIVATIONS[act]), *shared_parts


def describe(model: nn.Module) -> DecoderStack | None:
    """``model``'s decoder layers as a ``DecoderStack``, or ``None`` when a whole-stack kernel
    would not compute exactly what they do (see the module docstring)."""
    config = model.config
    layers = list(model.model.layers)
    if not layers or (config.rotary_dim or config.head_dim) != config.head_dim:
        return None  # (a whole-stack kernel rotates whole heads)
    dtype = next(model.parameters()).dtype
    norms: list[torch.Tensor] = []
    linears: list[nn.Module | None] = []
    biases: list[torch.Tensor] = []
    windows: list[int] = []
    experts: list[Experts | None] = []
    options: set[tuple] = set()  # what every layer must share
    dense: set[tuple] = set()  # (intermediate, gelu) of every dense MLP
    mixtures: set[tuple] = set()  # (sizes, gelu) of every mixture of experts
    for layer in layers:
        found = _layer_norms(layer)
        attn, mlp = getattr(layer, "self_attn", None), getattr(layer, "mlp", None)
        if (
            found is None
            or type(attn) is not Attention
            or attn.softcap
            or not hasattr(attn, "qkv_proj")
            or attn.reduce is not None
            or getattr(mlp, "reduce", True) is not None  # a tensor-parallel shard sums over ranks
            or attn.o_proj.bias is not None
        ):
            return None
        if type(mlp) is GatedMLP and mlp.act_name in _ACTIVATIONS and hasattr(mlp, "gate_up_proj"):
            if mlp.gate_up_proj.bias is not None or mlp.down_proj.bias is not None:
                return None
            dense.add((mlp.down_proj.in_features, _ACTIVATIONS[mlp.act_name]))
            parts = (attn.qkv_proj, attn.o_proj, mlp.gate_up_proj, mlp.down_proj)
            experts.append(None)
        elif type(mlp) is SparseMoE and (moe := _experts(mlp)) is not None:
            mixture, shape, shared_gate_up, shared_down = moe
            mixtures.add(shape)
            parts = (attn.qkv_proj, attn.o_proj, shared_gate_up, shared_down)
            experts.append(mixture)
        else:
            return None
        block_norms, sandwich = found
        qk_norm = hasattr(attn, "q_norm")
        if qk_norm:
            block_norms += [attn.q_norm, attn.k_norm]
        weights = [_norm_weight(n, dtype) for n in block_norms]
        offset = {type(n) is OffsetRMSNorm for n in block_norms}
        if any(w is None for w in weights) or len(offset) != 1:
            return None  # (one dtype for every norm weight)
        float_norms = offset.pop() and dtype != torch.float32
        if float_norms and not sandwich:
            return None  # (the stack's fused residual add and norm rounds in the model's dtype)
        options.add(
            (
                attn.n_heads,
                attn.n_kv_heads,
                attn.head_dim,
                attn.scale,
                sandwich,
                qk_norm,
                float_norms,
                *(n.eps for n in block_norms),
            )
        )
        norms += [w.detach().to(torch.float32 if float_norms else dtype).contiguous() for w in weights]
        linears += parts
        if attn.qkv_proj.bias is not None:
            biases.append(attn.qkv_proj.bias.detach().to(dtype).contiguous())
        windows.append(int(attn.window))
    acts = {gelu for _, gelu in dense | mixtures}
    if len(options) != 1 or len(dense) > 1 or len(mixtures) > 1 or len(acts) != 1:
        return None
    if len(biases) not in (0, len(layers)):
        return None
    (n_heads, n_kv_heads, head_dim, scale, sandwich, qk_norm, float_norms, *eps) = options.pop()
    if len(set(eps)) != 1:
        return None
    tables = tuple(1 if w else 0 for w in windows) if hasattr(model, "rotary_local") else ()
    return DecoderStack(
        n_heads,
        n_kv_heads,
        head_dim,
        next(iter(dense))[0] if dense else 0,
        eps[0],
        scale,
        tuple(norms),
        tuple(linears),
        tuple(biases),
        tuple(windows) if any(windows) else (),
        sandwich,
        qk_norm,
        acts.pop(),
        tables if any(tables) else (),
        tuple(experts) if mixtures else (),
        next(iter(mixtures))[0] if mixtures else (),
        float_norms,
    )
