"""The Llama family (Llama 2/3.x, SmolLM2, Qwen2, Mistral and Ministral): pre-norm layers of
grouped-query attention and a SwiGLU MLP, from ``astrai.model.layers``.

Qwen2 adds q/k/v biases (``ModelConfig.attention_bias``), Mistral and Ministral sliding windows
(``ModelConfig.window``); Llama 3.x's RoPE scaling, tied embeddings and end-of-turn ids come with
the config. The stock layer may run on a backend's whole-stack kernel (``decoder_layers``,
``astrai.model.stack``).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from astrai.model.decoder import DecoderLM
from astrai.model.layers import Attention, DecoderLayer, GatedMLP, RMSNorm
from astrai.model.stack import DecoderStack

if TYPE_CHECKING:
    from torch import nn

    from astrai.model.config import ModelConfig

__all__ = ["Attention", "DecoderLayer", "DecoderStack", "LlamaForCausalLM", "MLP", "RMSNorm"]

MLP = GatedMLP  # the SwiGLU MLP under its older name


class LlamaForCausalLM(DecoderLM):
    """Llama-family causal LM whose parameter names match HF checkpoints."""

    def make_layer(self, config: ModelConfig, layer_id: int) -> nn.Module:
        return DecoderLayer(config, layer_id)
