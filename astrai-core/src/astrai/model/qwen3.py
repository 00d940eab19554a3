"""Qwen3: the Llama layout without q/k/v biases, with a per-head RMSNorm on queries and keys before
RoPE (``q_norm``, ``k_norm``)."""

from __future__ import annotations

from typing import TYPE_CHECKING

from astrai.model.decoder import DecoderLM
from astrai.model.layers import Attention, DecoderLayer, RMSNorm

if TYPE_CHECKING:
    from torch import nn

    from astrai.model.config import ModelConfig


class Qwen3ForCausalLM(DecoderLM):
    """Qwen3 (dense): pre-norm layers whose attention normalises each query and key head."""

    def make_layer(self, config: ModelConfig, layer_id: int) -> nn.Module:
        attn = Attention(config, layer_id, window=config.window(layer_id), qk_norm=RMSNorm)
        return DecoderLayer(config, layer_id, attn)
