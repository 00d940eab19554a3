"""The KV pool an engine's configuration gives a model: ``kv_config(config, model_config, dtype)``."""

from __future__ import annotations

from typing import TYPE_CHECKING

from astrai.config import DEFAULT_KV_MEMORY_BYTES
from astrai.kvcache.pool import KVConfig
from astrai.kvcache.storage import KVStorage

if TYPE_CHECKING:
    import torch

    from astrai.config import EngineConfig
    from astrai.model import ModelConfig

__all__ = ["kv_config"]


def kv_config(config: EngineConfig, model_config: ModelConfig, dtype: torch.dtype) -> KVConfig:
    """The pool configuration of ``config`` for a model; raises ValueError on an impossible size.

    Its ``max_seq_len`` is the context served: ``max_seq_len`` capped by the model's context
    length and, paged, by the pool's slots (a request never holds more positions than the
    pool has, so a longer req_to_token row or rotary table would never be read). The default
    pool holds at least one request of that context, so a model whose context length is
    absurd and no ``max_seq_len`` gives an absurd pool, which the memory check refuses.
    """
    ctx = model_config.max_position_embeddings
    seq = min(config.max_seq_len or ctx, ctx)
    if not config.paged:
        return KVConfig(config.max_batch_size, seq, page_size=1, prefix_caching=False, kinds=config.kv_kinds)
    n_tokens, budget = config.n_tokens, config.kv_memory_bytes
    per_token = KVStorage.bytes_per_token(
        model_config.num_hidden_layers,
        model_config.num_key_value_heads,
        model_config.head_dim,
        dtype,
        config.kv_kinds,
    )
    if n_tokens is None and budget is None:
        n_tokens = max(seq, min(config.max_batch_size * seq, DEFAULT_KV_MEMORY_BYTES // per_token))
    chunk = max(1, config.max_prefill_tokens)
    kv = KVConfig(
        config.max_batch_size,
        seq,
        config.page_size,
        n_tokens,
        budget,
        config.prefix_caching,
        chunk,
        config.kv_kinds,
    )
    # a request never holds more positions than the pool has for one (a longer req_to_token row or
    # rotary table would never be read); sliding-window layers hold only their window of them
    shape = (model_config.num_hidden_layers, model_config.num_key_value_heads, model_config.head_dim, dtype)
    n_pages = kv.slots(*shape, model_config.windows) // config.page_size
    fits = kv.layout(model_config.num_hidden_layers, model_config.windows).positions(
        n_pages, config.page_size, chunk
    )
    kv.max_seq_len = max(1, min(seq, fits))  # no slot at all: PagePool says so
    return kv
