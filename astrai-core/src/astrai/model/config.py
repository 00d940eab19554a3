"""Architecture hyper-parameters of a Llama-family decoder."""

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
