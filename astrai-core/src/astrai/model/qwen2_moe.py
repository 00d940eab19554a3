"""Qwen2-MoE (Qwen1.5-MoE, Qwen2-57B-A14B): Qwen2's attention (q/k/v biases) with routed experts and a
shared expert in place of the MLP (``astrai.model.moe``): each token's ``top_k`` routed experts,
weighted by their softmax probabilities (not renormalised unless ``norm_topk_prob``), plus the shared
expert that every token runs, scaled by its own sigmoid gate. Layers the config keeps dense
(``decoder_sparse_step``, ``mlp_only_layers``) have an MLP of ``intermediate_size``.

llama.cpp writes it as ``qwen2moe``: the routed experts stacked (``ffn_*_exps``), the shared one as
``ffn_*_shexp`` with its gate ``ffn_gate_inp_shexp``, its width ``expert_shared_feed_forward_length``;
llama.cpp never renormalises this architecture's routing weights, so neither does a GGUF file here.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from astrai.model.architecture import GGUF_BLOCK, GGUF_TOP, Architecture
from astrai.model.decoder import DecoderLM
from astrai.model.layers import DecoderLayer
from astrai.model.moe import GGUF_EXPERTS, GGUF_SHARED_EXPERT, moe_mlp

if TYPE_CHECKING:
    from collections.abc import Callable

    from torch import nn

    from astrai.model.config import ModelConfig


class Qwen2MoeForCausalLM(DecoderLM):
    """Qwen2-MoE: pre-norm layers of biased grouped-query attention, routed and shared experts."""

    def make_layer(self, config: ModelConfig, layer_id: int) -> nn.Module:
        return DecoderLayer(config, layer_id, mlp=moe_mlp(config, layer_id))


def _gguf(key: Callable[[str, Any], Any], config: ModelConfig) -> None:
    """The shared expert's width, and llama.cpp's routing (weights as the softmax gave them)."""
    config.shared_expert_intermediate_size = int(key("expert_shared_feed_forward_length", 0) or 0)
    config.norm_topk_prob = False


QWEN2_MOE = Architecture(
    "qwen2_moe",
    Qwen2MoeForCausalLM,
    GGUF_TOP,
    GGUF_BLOCK | GGUF_EXPERTS | GGUF_SHARED_EXPERT,
    gguf_rope_interleaved=False,
    attention_bias=True,
    aliases=("qwen2moe",),  # llama.cpp's name
    gguf_config=_gguf,
)
"""Qwen2-MoE's ``astrai.models`` entry point."""
