"""A Llama-family decoder (Llama 2/3, SmolLM2, Qwen2) over astrai's paged KV cache.

The forward takes one flattened ragged batch (see ``KVCache``): prefill chunks
and decode tokens of many requests in a single call, with attention routed
through the ``astrai.extension`` policy API so any backend can run it.

Over 300 lines because the layers, the fused decode stack that replays them on the CPU and the
checkpoint's parameter shapes and loading describe one architecture and change together.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F
from torch import nn

from astrai.extension import RotaryEmbedding, apply_rotary_emb, attention, bind_step
from astrai.extension.fused import add_rms_norm, kernel_for, rms_norm, silu_and_mul
from astrai.model.quant import QuantizedLinear

if TYPE_CHECKING:
    from astrai.kvcache import KVCache
    from astrai.model.config import ModelConfig


class RMSNorm(nn.Module):
    """Root-mean-square norm computed in float32, cast back to the input dtype."""

    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # ATen's rms_norm upcasts bf16/fp16 to float32 inside and rounds once at the end: the
        # same bits as an explicit x.float() ... .to(x.dtype); a plugin's fused kernel, when
        # one is installed for x's device (astrai.extension.fused), rounds at the same places.
        return rms_norm(x, self.weight, self.eps)


class Attention(nn.Module):
    # tensor parallel: the sum over ranks of o_proj's partial outputs (astrai.distributed.tp); None: one rank
    reduce = None

    def __init__(self, config: ModelConfig, layer_id: int) -> None:
        super().__init__()
        self.layer_id = layer_id
        self.n_heads = config.num_attention_heads
        self.n_kv_heads = config.num_key_value_heads
        self.head_dim = config.head_dim
        self.scale = self.head_dim**-0.5
        bias = config.attention_bias
        h = config.hidden_size
        self.q_proj = nn.Linear(h, self.n_heads * self.head_dim, bias=bias)
        self.k_proj = nn.Linear(h, self.n_kv_heads * self.head_dim, bias=bias)
        self.v_proj = nn.Linear(h, self.n_kv_heads * self.head_dim, bias=bias)
        self.o_proj = nn.Linear(self.n_heads * self.head_dim, h, bias=False)
        kv = self.n_kv_heads * self.head_dim
        self._split = [self.n_heads * self.head_dim, kv, kv]

    def fuse(self) -> None:
        """Merge q/k/v into one ``qkv_proj`` (one GEMM instead of three); after loading weights."""
        parts = [self.q_proj, self.k_proj, self.v_proj]
        if all(isinstance(p, QuantizedLinear) for p in parts):  # GGUF weights kept quantized
            self.qkv_proj = QuantizedLinear.concat(parts)
            del self.q_proj, self.k_proj, self.v_proj
            return
        fused = nn.Linear(
            parts[0].in_features, sum(p.out_features for p in parts), bias=parts[0].bias is not None
        )
        with torch.no_grad():
            fused.weight = nn.Parameter(torch.cat([p.weight for p in parts]))
            if fused.bias is not None:
                fused.bias = nn.Parameter(torch.cat([p.bias for p in parts]))
        self.qkv_proj = fused
        del self.q_proj, self.k_proj, self.v_proj

    def forward(self, x: torch.Tensor, freqs: torch.Tensor, kv_cache: KVCache) -> torch.Tensor:
        t = x.shape[0]
        if hasattr(self, "qkv_proj"):
            qkv = self.qkv_proj(x)
            n_qk = self._split[0] + self._split[1]
            # RoPE before the K/V write: cached keys carry their absolute position. Queries and
            # keys sit side by side in the fused output: one rotation covers both.
            qk = apply_rotary_emb(qkv[:, :n_qk].view(1, t, -1, self.head_dim), freqs)[0]
            q, k = qk.split([self.n_heads, self.n_kv_heads], dim=1)
            v = qkv[:, n_qk:].view(t, self.n_kv_heads, self.head_dim)
        else:
            q = apply_rotary_emb(self.q_proj(x).view(1, t, self.n_heads, self.head_dim), freqs)[0]
            k = apply_rotary_emb(self.k_proj(x).view(1, t, self.n_kv_heads, self.head_dim), freqs)[0]
            v = self.v_proj(x).view(t, self.n_kv_heads, self.head_dim)
        o = attention(q, k, v, self.layer_id, kv_cache, self.scale)
        out = self.o_proj(o.reshape(t, self.n_heads * self.head_dim))
        return out if self.reduce is None else self.reduce(out)


class MLP(nn.Module):
    """SwiGLU: down(silu(gate(x)) * up(x))."""

    reduce = None  # tensor parallel: the sum over ranks of down_proj's partial outputs

    def __init__(self, hidden: int, intermediate: int) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(hidden, intermediate, bias=False)
        self.up_proj = nn.Linear(hidden, intermediate, bias=False)
        self.down_proj = nn.Linear(intermediate, hidden, bias=False)

    def fuse(self) -> None:
        """Merge gate/up into one ``gate_up_proj`` (one GEMM instead of two); after loading weights."""
        if isinstance(self.gate_proj, QuantizedLinear) and isinstance(self.up_proj, QuantizedLinear):
            self.gate_up_proj = QuantizedLinear.concat([self.gate_proj, self.up_proj])
            del self.gate_proj, self.up_proj
            return
        fused = nn.Linear(self.gate_proj.in_features, 2 * self.gate_proj.out_features, bias=False)
        with torch.no_grad():
            fused.weight = nn.Parameter(torch.cat([self.gate_proj.weight, self.up_proj.weight]))
        self.gate_up_proj = fused
        del self.gate_proj, self.up_proj

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if hasattr(self, "gate_up_proj"):
            out = self.down_proj(silu_and_mul(self.gate_up_proj(x)))
        else:
            out = self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))
        return out if self.reduce is None else self.reduce(out)


class DecoderLayer(nn.Module):
    def __init__(self, config: ModelConfig, layer_id: int) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.self_attn = Attention(config, layer_id)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.mlp = MLP(config.hidden_size, config.intermediate_size)

    def forward(self, x: torch.Tensor, freqs: torch.Tensor, kv_cache: KVCache) -> torch.Tensor:
        attn = self.self_attn(self.input_layernorm(x), freqs, kv_cache)
        norm = self.post_attention_layernorm
        x, h = add_rms_norm(
            x, attn, norm.weight, norm.eps
        )  # the residual add and the next norm, fused when a kernel is installed
        return x + self.mlp(h)


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


class LlamaBody(nn.Module):
    """``model.*`` in HF naming: embeddings, layers, final norm."""

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(config, i) for i in range(config.num_hidden_layers))
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)


class LlamaForCausalLM(nn.Module):
    """Llama-family causal LM whose parameter names match HF checkpoints.

    Q/K projection rows are in llama.cpp's interleaved RoPE layout (the loaders
    see to it), matching ``apply_rotary_emb``'s complex-pair convention.
    """

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.config = config
        self.model = LlamaBody(config)
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        if config.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight
        self.rotary = RotaryEmbedding(
            config.head_dim, config.max_position_embeddings, config.rope_theta, config.rope_scaling
        )

    @staticmethod
    def parameter_shapes(config: ModelConfig) -> dict[str, tuple[int, ...]]:
        """Name -> shape of every parameter ``LlamaForCausalLM(config)`` has (HF names, unfused; no tied
        ``lm_head.weight``), without building it: what the loaders check a checkpoint against first."""
        h, ffn, vocab = config.hidden_size, config.intermediate_size, config.vocab_size
        q, kv = config.num_attention_heads * config.head_dim, config.num_key_value_heads * config.head_dim
        shapes = {"model.embed_tokens.weight": (vocab, h), "model.norm.weight": (h,)}
        if not config.tie_word_embeddings:
            shapes["lm_head.weight"] = (vocab, h)
        layer = {"input_layernorm.weight": (h,), "post_attention_layernorm.weight": (h,)}
        attn, mlp = {"q": (q, h), "k": (kv, h), "v": (kv, h), "o": (h, q)}, {"gate": (ffn, h), "up": (ffn, h)}
        layer |= {f"self_attn.{p}_proj.weight": s for p, s in attn.items()}
        layer |= {f"mlp.{p}_proj.weight": s for p, s in {**mlp, "down": (h, ffn)}.items()}
        if config.attention_bias:
            layer |= {f"self_attn.{p}_proj.bias": (n,) for p, n in (("q", q), ("k", kv), ("v", kv))}
        for i in range(config.num_hidden_layers):
            shapes |= {f"model.layers.{i}.{name}": shape for name, shape in layer.items()}
        return shapes

    @torch.inference_mode()
    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        kv_cache: KVCache,
        logits_indices: torch.Tensor,
    ) -> torch.Tensor:
        """Run one ragged step.

        ``input_ids``/``positions``: ``[T]`` int64, flattened request after request
        (the layout of ``kv_cache``). ``logits_indices``: ``[B]`` int64 rows of ``T``
        whose next-token logits are wanted; the LM head runs on those rows only.
        Returns ``[B, vocab]`` float32. Writes this step's K/V into the pool.
        """
        x = self.model.embed_tokens(input_ids)
        if (
            kv_cache.backend is None
        ):  # a direct call (no ModelRunner bound the step): resolve its backend once
            bind_step(kv_cache, x.new_empty((0, self.config.num_attention_heads, self.config.head_dim)))
        freqs = self.rotary(positions.unsqueeze(0))
        stack = kernel_for("decoder_layers", x)  # a plugin's whole-stack kernel (astrai.extension.fused)
        out = stack(self, x, freqs, kv_cache) if stack is not None else None
        if out is None:
            for layer in self.model.layers:
                x = layer(x, freqs, kv_cache)
        else:
            x = out
        x = self.model.norm(x.index_select(0, logits_indices))
        return self.lm_head(x).float()

    def decoder_stack(self) -> DecoderStack | None:
        """The decoder layers as a whole-stack kernel may run them in place of ``forward``'s loop.

        ``None`` unless every layer is the stock ``DecoderLayer`` (stock attention, MLP and
        norms, projections fused by ``fuse_projections``) with the same shapes and eps, and
        o/gate_up/down have no bias: then running the layers one by one computes exactly
        what the description says. A tensor-parallel shard (``reduce`` set) has none: a whole-stack
        kernel would skip its all-reduces.
        """
        layers = list(self.model.layers)
        if not layers:
            return None
        first = layers[0]
        shape = (
            first.self_attn.n_heads,
            first.self_attn.n_kv_heads,
            first.self_attn.head_dim,
            first.mlp.down_proj.in_features,
            first.input_layernorm.eps,
            first.self_attn.scale,
        )
        norms, linears, biases = [], [], []
        for layer in layers:
            attn, mlp = layer.self_attn, layer.mlp
            stock = (
                type(layer) is DecoderLayer
                and type(attn) is Attention
                and type(mlp) is MLP
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
        if len(biases) not in (0, len(layers)):
            return None
        return DecoderStack(*shape, tuple(norms), tuple(linears), tuple(biases))

    def fuse_projections(self) -> None:
        """Merge q/k/v and gate/up projections for inference; call once weights are final.

        Afterwards the state dict holds ``qkv_proj``/``gate_up_proj`` instead of the HF
        names, so ``load_weights`` must come first.
        """
        for layer in self.model.layers:
            layer.self_attn.fuse()
            layer.mlp.fuse()

    def load_weights(self, state_dict: dict[str, torch.Tensor]) -> None:
        """Copy a loader's state dict in; raises ``ValueError`` on missing or unexpected names."""
        own = dict(self.named_parameters(remove_duplicate=True))
        if self.config.tie_word_embeddings:
            own.pop("lm_head.weight", None)
            state_dict = {k: v for k, v in state_dict.items() if k != "lm_head.weight"}
        missing = sorted(set(own) - set(state_dict))
        unexpected = sorted(set(state_dict) - set(own))
        if missing or unexpected:
            raise ValueError(
                f"weights do not fit the model: missing {missing[:5]}, unexpected {unexpected[:5]}"
            )
        with torch.no_grad():
            for name, param in own.items():
                src = state_dict[name]
                if src.shape != param.shape:
                    raise ValueError(
                        f"{name}: checkpoint shape {tuple(src.shape)} != model {tuple(param.shape)}"
                    )
                param.copy_(src)
