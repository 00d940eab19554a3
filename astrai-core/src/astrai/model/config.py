"""Architecture hyper-parameters of a decoder-only transformer (every family astrai serves)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any


@dataclass
class ModelConfig:
    """What the model class needs to build itself, whatever the weights' source.

    Loaders (GGUF metadata, HF ``config.json``) fill it; names follow HF's
    ``LlamaConfig`` so a reader can map them at a glance.
    """

    architecture: str  # "llama", "qwen2", ...: the key in the ``astrai.models`` group
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    max_position_embeddings: int
    rms_norm_eps: float = 1e-5
    rope_theta: float = 10000.0
    # HF-style ``rope_scaling`` dict, e.g. {"rope_type": "llama3", "factor": 8.0,
    # "low_freq_factor": 1.0, "high_freq_factor": 4.0,
    # "original_max_position_embeddings": 8192}; None for plain RoPE.
    rope_scaling: dict[str, Any] | None = None
    tie_word_embeddings: bool = False
    attention_bias: bool = False  # q/k/v projections carry a bias (Qwen2)
    bos_token_id: int | None = None
    eos_token_ids: list[int] = field(default_factory=list)  # every id that ends generation
    name: str = ""  # the served model name
    hidden_act: str = "silu"  # the gated MLP's activation (HF hidden_act / hidden_activation)
    rotary_dim: int | None = None  # the rotated dims of a head (partial rotary, Phi-4-mini); None: all
    # Sliding windows: the positions a query of a local layer sees, itself included (HF's
    # sliding_window); layer_types[i] is "sliding_attention" or "full_attention" (None: every layer
    # is local when a window is set, as Mistral's).
    sliding_window: int | None = None
    layer_types: list[str] | None = None
    # RoPE of the local layers when it differs from the global one (Gemma 3: base 10,000 locally)
    local_rope_theta: float | None = None
    local_rope_scaling: dict[str, Any] | None = None
    query_pre_attn_scalar: float | None = None  # softmax scale = this ** -0.5 (Gemma); None: head_dim
    attn_logit_softcapping: float | None = None  # Gemma 2: scores -> cap * tanh(scores / cap)
    final_logit_softcapping: float | None = None  # Gemma 2: the same on the logits
    # Mixture of experts (Qwen2-MoE, Qwen3-MoE, Mixtral): ``num_experts`` routed experts of
    # ``moe_intermediate_size`` each, ``num_experts_per_tok`` chosen per token, their weights
    # renormalised over the chosen (``norm_topk_prob``), and a gated shared expert of
    # ``shared_expert_intermediate_size`` rows where that is not 0 (Qwen2-MoE); a layer is sparse
    # when it is not in ``mlp_only_layers`` and its number plus one is a multiple of
    # ``decoder_sparse_step``
    num_experts: int = 0
    num_experts_per_tok: int = 0
    moe_intermediate_size: int | None = None
    norm_topk_prob: bool = True
    shared_expert_intermediate_size: int = 0
    decoder_sparse_step: int = 1
    mlp_only_layers: list[int] = field(default_factory=list)

    def window(self, layer_id: int) -> int:
        """Layer ``layer_id``'s sliding window (0: it attends to every position)."""
        if not self.sliding_window:
            return 0
        if self.layer_types is not None and self.layer_types[layer_id] != "sliding_attention":
            return 0
        return int(self.sliding_window)

    def sparse(self, layer_id: int) -> bool:
        """Whether layer ``layer_id``'s MLP is a mixture of experts."""
        return (
            self.num_experts > 0
            and layer_id not in self.mlp_only_layers
            and (layer_id + 1) % max(self.decoder_sparse_step, 1) == 0
        )

    @property
    def windows(self) -> tuple[int, ...]:
        """Every layer's window, in order (0: full attention)."""
        return tuple(self.window(i) for i in range(self.num_hidden_layers))
