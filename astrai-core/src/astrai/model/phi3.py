"""Phi-3 and Phi-4-mini: the Llama layout, stored fused (``qkv_proj``, ``gate_up_proj``), with partial
rotary (``ModelConfig.rotary_dim``) and LongRoPE scaling where the config has it.

The checkpoint's fused projections are cut into the model's q/k/v and gate/up at load
(``PHI3_PARTS``, through ``Architecture.fused_parts``), so the rest of astrai (tensor-parallel
sharding, quantized concatenation, fusing back) sees the Llama layout.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from astrai.model.llama import LlamaForCausalLM

if TYPE_CHECKING:
    from astrai.model.config import ModelConfig


class Phi3ForCausalLM(LlamaForCausalLM):
    """Phi-3 / Phi-4-mini: Llama's layers; RoPE over ``rotary_dim`` of each head."""


def phi3_parts(config: ModelConfig) -> dict[str, list[tuple[str, int]]]:
    """A Phi-3 layer's fused projections -> the projections they hold, top rows first, and their rows."""
    q, kv = config.num_attention_heads * config.head_dim, config.num_key_value_heads * config.head_dim
    ffn = config.intermediate_size
    return {
        "self_attn.qkv_proj": [("self_attn.q_proj", q), ("self_attn.k_proj", kv), ("self_attn.v_proj", kv)],
        "mlp.gate_up_proj": [("mlp.gate_proj", ffn), ("mlp.up_proj", ffn)],
    }
