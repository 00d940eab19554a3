"""Qwen3-MoE: Qwen3's attention (per-head q/k norms, no biases) with a mixture of experts in place of
the MLP (``astrai.model.moe``) in the layers the config makes sparse (``decoder_sparse_step``,
``mlp_only_layers``; the others keep a dense MLP of ``intermediate_size``)."""

from __future__ import annotations

from typing import TYPE_CHECKING

from astrai.model.architecture import GGUF_BLOCK, GGUF_QK_NORM, GGUF_TOP, Architecture
from astrai.model.decoder import DecoderLM
from astrai.model.layers import Attention, DecoderLayer, RMSNorm
from astrai.model.moe import GGUF_EXPERTS, moe_mlp

if TYPE_CHECKING:
    from torch import nn

    from astrai.model.config import ModelConfig


class Qwen3MoeForCausalLM(DecoderLM):
    """Qwen3-MoE: pre-norm layers, q/k-normed attention, routed experts."""

    def make_layer(self, config: ModelConfig, layer_id: int) -> nn.Module:
        attn = Attention(config, layer_id, window=config.window(layer_id), qk_norm=RMSNorm)
        return DecoderLayer(config, layer_id, attn, moe_mlp(config, layer_id))


QWEN3_MOE = Architecture(
    "qwen3_moe",
    Qwen3MoeForCausalLM,
    GGUF_TOP,
    GGUF_BLOCK | GGUF_QK_NORM | GGUF_EXPERTS,
    gguf_rope_interleaved=False,
    aliases=("qwen3moe",),  # llama.cpp's name
)
"""Qwen3-MoE's ``astrai.models`` entry point."""
