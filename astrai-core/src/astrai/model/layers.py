"""The decoder's building blocks, shared by every family (``astrai.model.llama``, ``qwen3``, ``gemma``,
``phi3``): norms, gated MLPs, attention over the paged KV cache, and the two layer shapes.

A family module composes these and says nothing twice; options (a sliding window, logit soft-capping,
per-head q/k norms, the activation, the softmax scale) are constructor arguments read from the
``ModelConfig``, never a test on the architecture's name.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterator
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F
from torch import nn

from astrai.extension import apply_rotary_emb, attention
from astrai.extension.fused import add_rms_norm, rms_norm, silu_and_mul
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


class OffsetRMSNorm(RMSNorm):
    """Gemma's norm: ``x / rms(x) * (1 + weight)``, all in float32 and rounded once.

    The weight is the checkpoint's (zero-centred, starting at zero); llama.cpp's GGUF files store
    ``1 + weight`` and the loader takes the one back (``Architecture.gguf_tensor``).
    """

    def __init__(self, dim: int, eps: float) -> None:
        super().__init__(dim, eps)
        nn.init.zeros_(self.weight)
        self._scale: tuple[tuple[int, int], torch.Tensor] | None = None

    def scale(self) -> torch.Tensor:
        """``1 + weight`` in float32, made once per weight (a decode step runs six of these norms a
        layer: at batch 1 the two extra ops each were a tenth of Gemma 3 270M's step)."""
        w = self.weight
        key = (w.data_ptr(), w._version)
        if self._scale is None or self._scale[0] != key:
            self._scale = key, 1.0 + w.detach().float()
        return self._scale[1]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # on float32 rows the fused norm rounds nothing until the .to(): HF's single rounding, in one
        # pass where a plugin lends the kernel (F.rms_norm's composite takes five: 13x slower in prefill)
        return rms_norm(x.float(), self.scale(), self.eps).to(x.dtype)


def _gelu_tanh(x: torch.Tensor) -> torch.Tensor:
    return F.gelu(x, approximate="tanh")


#: HF ``hidden_act`` / ``hidden_activation`` -> the gate's activation.
ACTIVATIONS = {"silu": F.silu, "gelu_pytorch_tanh": _gelu_tanh, "gelu_tanh": _gelu_tanh, "gelu": F.gelu}


class GatedMLP(nn.Module):
    """``down(act(gate(x)) * up(x))``: SwiGLU with ``silu``, GeGLU with a gelu."""

    reduce = None  # tensor parallel: the sum over ranks of down_proj's partial outputs

    def __init__(self, hidden: int, intermediate: int, act: str = "silu") -> None:
        super().__init__()
        self.gate_proj = nn.Linear(hidden, intermediate, bias=False)
        self.up_proj = nn.Linear(hidden, intermediate, bias=False)
        self.down_proj = nn.Linear(intermediate, hidden, bias=False)
        self.act_name, self.act = act, ACTIVATIONS[act]

    def fuse(self) -> None:
        """Merge gate/up into one ``gate_up_proj`` (one GEMM instead of two); after loading weights."""
        self.gate_up_proj = fuse_linears([self.gate_proj, self.up_proj])
        del self.gate_proj, self.up_proj

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not hasattr(self, "gate_up_proj"):
            out = self.down_proj(self.act(self.gate_proj(x)) * self.up_proj(x))
        elif self.act_name == "silu":
            out = self.down_proj(silu_and_mul(self.gate_up_proj(x)))
        else:
            gate, up = self.gate_up_proj(x).chunk(2, dim=-1)
            out = self.down_proj(self.act(gate) * up)
        return out if self.reduce is None else self.reduce(out)


def fuse_linears(parts: list[nn.Module]) -> nn.Module:
    """One linear whose output rows are ``parts``' outputs side by side (quantized ones concatenated)."""
    if all(isinstance(p, QuantizedLinear) for p in parts):  # GGUF weights kept quantized
        return QuantizedLinear.concat(parts)
    fused = nn.Linear(  # on meta: no random init of what the concatenation replaces
        parts[0].in_features,
        sum(p.out_features for p in parts),
        bias=parts[0].bias is not None,
        device="meta",
    )
    with torch.no_grad():
        fused.weight = nn.Parameter(torch.cat([p.weight for p in parts]))
        if fused.bias is not None:
            fused.bias = nn.Parameter(torch.cat([p.bias for p in parts]))
    return fused


class Attention(nn.Module):
    """Grouped-query attention over the paged KV cache, with the options the families need.

    ``window``: the positions a query sees, itself included (a sliding-window layer; 0: all of
    them). ``softcap``: scores pass through ``softcap * tanh(s / softcap)`` (Gemma 2; 0: off).
    ``qk_norm``: a norm class applied to each query and key head before RoPE (Qwen3, Gemma 3).
    ``scale``: the softmax scale (default ``head_dim ** -0.5``).
    """

    # tensor parallel: the sum over ranks of o_proj's partial outputs (astrai.distributed.tp); None: one rank
    reduce = None

    def __init__(
        self,
        config: ModelConfig,
        layer_id: int,
        *,
        window: int = 0,
        softcap: float = 0.0,
        qk_norm: type[RMSNorm] | None = None,
        scale: float | None = None,
    ) -> None:
        super().__init__()
        self.layer_id = layer_id
        self.n_heads = config.num_attention_heads
        self.n_kv_heads = config.num_key_value_heads
        self.head_dim = config.head_dim
        self.scale = self.head_dim**-0.5 if scale is None else scale
        self.window, self.softcap = window, softcap
        bias = config.attention_bias
        h = config.hidden_size
        self.q_proj = nn.Linear(h, self.n_heads * self.head_dim, bias=bias)
        self.k_proj = nn.Linear(h, self.n_kv_heads * self.head_dim, bias=bias)
        self.v_proj = nn.Linear(h, self.n_kv_heads * self.head_dim, bias=bias)
        self.o_proj = nn.Linear(self.n_heads * self.head_dim, h, bias=False)
        if qk_norm is not None:
            self.q_norm = qk_norm(self.head_dim, config.rms_norm_eps)
            self.k_norm = qk_norm(self.head_dim, config.rms_norm_eps)
        kv = self.n_kv_heads * self.head_dim
        self._split = [self.n_heads * self.head_dim, kv, kv]

    def fuse(self) -> None:
        """Merge q/k/v into one ``qkv_proj`` (one GEMM instead of three); after loading weights."""
        self.qkv_proj = fuse_linears([self.q_proj, self.k_proj, self.v_proj])
        del self.q_proj, self.k_proj, self.v_proj

    def _qkv(self, x: torch.Tensor, freqs: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        t = x.shape[0]
        if hasattr(self, "qkv_proj"):
            qkv = self.qkv_proj(x)
            n_qk = self._split[0] + self._split[1]
            v = qkv[:, n_qk:].view(t, self.n_kv_heads, self.head_dim)
            if not hasattr(self, "q_norm"):
                # RoPE before the K/V write: cached keys carry their absolute position. Queries and
                # keys sit side by side in the fused output: one rotation covers both.
                qk = apply_rotary_emb(qkv[:, :n_qk].view(1, t, -1, self.head_dim), freqs)[0]
                q, k = qk.split([self.n_heads, self.n_kv_heads], dim=1)
                return q, k, v
            q, k = qkv[:, : self._split[0]], qkv[:, self._split[0] : n_qk]
        else:
            q, k, v = self.q_proj(x), self.k_proj(x), self.v_proj(x).view(t, self.n_kv_heads, self.head_dim)
        q, k = q.reshape(t, self.n_heads, self.head_dim), k.reshape(t, self.n_kv_heads, self.head_dim)
        if hasattr(self, "q_norm"):
            q, k = self.q_norm(q), self.k_norm(k)
        q = apply_rotary_emb(q.unsqueeze(0), freqs)[0]
        k = apply_rotary_emb(k.unsqueeze(0), freqs)[0]
        return q, k, v

    def forward(self, x: torch.Tensor, freqs: torch.Tensor, kv_cache: KVCache) -> torch.Tensor:
        t = x.shape[0]
        q, k, v = self._qkv(x, freqs)
        o = attention(q, k, v, self.layer_id, kv_cache, self.scale, window=self.window, softcap=self.softcap)
        out = self.o_proj(o.reshape(t, self.n_heads * self.head_dim))
        return out if self.reduce is None else self.reduce(out)


class DecoderLayer(nn.Module):
    """Pre-norm: ``x + attn(norm(x))``, then ``x + mlp(norm(x))`` (Llama, Qwen, Mistral, Phi-3)."""

    def __init__(
        self, config: ModelConfig, layer_id: int, attn: Attention | None = None, mlp: nn.Module | None = None
    ) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.self_attn = attn or Attention(config, layer_id, window=config.window(layer_id))
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.mlp = mlp or GatedMLP(config.hidden_size, config.intermediate_size, config.hidden_act)

    def forward(self, x: torch.Tensor, freqs: torch.Tensor, kv_cache: KVCache) -> torch.Tensor:
        attn = self.self_attn(self.input_layernorm(x), freqs, kv_cache)
        norm = self.post_attention_layernorm
        # the residual add and the next norm, fused when a kernel is installed
        x, h = add_rms_norm(x, attn, norm.weight, norm.eps)
        return x + self.mlp(h)


class SandwichDecoderLayer(nn.Module):
    """Norms before and after each sub-block (Gemma 2 and 3):
    ``x + post_attn_norm(attn(input_norm(x)))``, then ``x + post_ffw_norm(mlp(pre_ffw_norm(x)))``."""

    def __init__(self, config: ModelConfig, layer_id: int, attn: Attention, norm: type[RMSNorm]) -> None:
        super().__init__()
        h, eps = config.hidden_size, config.rms_norm_eps
        self.input_layernorm = norm(h, eps)
        self.self_attn = attn
        self.post_attention_layernorm = norm(h, eps)
        self.pre_feedforward_layernorm = norm(h, eps)
        self.mlp = GatedMLP(h, config.intermediate_size, config.hidden_act)
        self.post_feedforward_layernorm = norm(h, eps)

    def forward(self, x: torch.Tensor, freqs: torch.Tensor, kv_cache: KVCache) -> torch.Tensor:
        x = x + self.post_attention_layernorm(self.self_attn(self.input_layernorm(x), freqs, kv_cache))
        return x + self.post_feedforward_layernorm(self.mlp(self.pre_feedforward_layernorm(x)))


@contextlib.contextmanager
def zero_init() -> Iterator[None]:
    """``nn.Linear`` and ``nn.Embedding`` start from zeros instead of torch's random init while
    this is active (one thread at a time): a loader that overwrites every parameter skips ~1 s
    of random numbers on the default model, and a model built on the meta device skips torch's
    first ``normal_`` there (1.5 s of lazy set-up). Other modules keep their own init."""

    def zero(module: nn.Module) -> None:
        with torch.no_grad():
            for p in module.parameters(recurse=False):
                p.zero_()

    with _INIT_LOCK:
        saved = nn.Linear.reset_parameters, nn.Embedding.reset_parameters
        nn.Linear.reset_parameters = nn.Embedding.reset_parameters = zero
        try:
            yield
        finally:
            nn.Linear.reset_parameters, nn.Embedding.reset_parameters = saved


@contextlib.contextmanager
def meta_parameters() -> Iterator[None]:
    """Parameters registered while this is active live on the meta device (no memory, no init), for
    a model whose every parameter a loader sets next (``DecoderLM.load_weights`` materialises each
    from the checkpoint's tensor); buffers (the RoPE tables) are built for real. A mixture of
    experts kept quantized then never holds its experts in float, not even for a moment (a random
    Qwen3-MoE of 280 MiB peaked at 2.9 GiB while loading). One thread at a time."""

    def register(module: nn.Module, name: str, param: nn.Parameter | None) -> None:
        if param is not None and not param.is_meta:
            param = nn.Parameter(param.to("meta"), requires_grad=param.requires_grad)
        saved_register(module, name, param)

    def skip(module: nn.Module) -> None:
        return None

    with _INIT_LOCK:
        saved_register = nn.Module.register_parameter
        saved_reset = nn.Linear.reset_parameters, nn.Embedding.reset_parameters
        nn.Module.register_parameter = register
        nn.Linear.reset_parameters = nn.Embedding.reset_parameters = skip
        try:
            yield
        finally:
            nn.Module.register_parameter = saved_register
            nn.Linear.reset_parameters, nn.Embedding.reset_parameters = saved_reset


_INIT_LOCK = threading.Lock()
