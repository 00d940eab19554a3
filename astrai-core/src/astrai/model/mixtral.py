"""Mixtral: the Llama/Mistral layer (a sliding window where the config sets one) with top-2 of 8
routed experts in place of the MLP, every layer (``astrai.model.moe``). Its checkpoints call the MLP
``block_sparse_moe`` and an expert's projections ``w1`` (gate), ``w3`` (up), ``w2`` (down): the
loaders rename them (``astrai.model.architecture.MIXTRAL``)."""

from __future__ import annotations

from typing import TYPE_CHECKING

from astrai.model.architecture import GGUF_BLOCK, GGUF_TOP, Architecture
from astrai.model.decoder import DecoderLM
from astrai.model.layers import DecoderLayer
from astrai.model.moe import GGUF_EXPERTS, moe_mlp

if TYPE_CHECKING:
    from torch import nn

    from astrai.model.config import ModelConfig


class MixtralForCausalLM(DecoderLM):
    """Mixtral: pre-norm layers of grouped-query attention and routed SwiGLU experts."""

    def make_layer(self, config: ModelConfig, layer_id: int) -> nn.Module:
        return DecoderLayer(config, layer_id, mlp=moe_mlp(config, layer_id))


MIXTRAL = Architecture(
    "mixtral",
    MixtralForCausalLM,
    GGUF_TOP,
    GGUF_BLOCK | GGUF_EXPERTS,
    gguf_rope_interleaved=True,
    hf_renames=(
        (r"\.block_sparse_moe\.", ".mlp."),
        (r"(\.experts\.\d+)\.w1\.", r"\1.gate_proj."),
        (r"(\.experts\.\d+)\.w3\.", r"\1.up_proj."),
        (r"(\.experts\.\d+)\.w2\.", r"\1.down_proj."),
    ),
)
"""Mixtral's ``astrai.models`` entry point."""
