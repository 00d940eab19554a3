"""Gemma 2 and Gemma 3 (text): sandwich-normed layers, GeGLU, embeddings scaled by sqrt(hidden).

Every norm is Gemma's ``x * (1 + weight)`` (``OffsetRMSNorm``). Local (sliding-window) and global
layers interleave (``ModelConfig.layer_types``); Gemma 3's local layers turn with their own RoPE
base (``local_rope_theta``), and normalise each query and key head before RoPE. The softmax scale is
``query_pre_attn_scalar ** -0.5``. Gemma 2 soft-caps the attention scores and the final logits.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from astrai.model.decoder import DecoderLM
from astrai.model.layers import Attention, OffsetRMSNorm, SandwichDecoderLayer

if TYPE_CHECKING:
    from torch import nn

    from astrai.model.config import ModelConfig


class GemmaForCausalLM(DecoderLM):
    """Gemma 2 / 3 text decoder; ``qk_norm`` says whether queries and keys are normalised (Gemma 3)."""

    norm = OffsetRMSNorm
    scales_embeddings = True
    qk_norm = False

    def make_layer(self, config: ModelConfig, layer_id: int) -> nn.Module:
        scalar = config.query_pre_attn_scalar or config.head_dim
        attn = Attention(
            config,
            layer_id,
            window=config.window(layer_id),
            softcap=config.attn_logit_softcapping or 0.0,
            qk_norm=OffsetRMSNorm if self.qk_norm else None,
            scale=scalar**-0.5,
        )
        return SandwichDecoderLayer(config, layer_id, attn, OffsetRMSNorm)


class Gemma2ForCausalLM(GemmaForCausalLM):
    """Gemma 2: no q/k norms; soft-capped scores and logits."""


class Gemma3ForCausalLM(GemmaForCausalLM):
    """Gemma 3 (text): q/k norms, local layers with their own RoPE base."""

    qk_norm = True
