"""A step's attention for one layer: the layer's view of the step's KV cache, the model options
(windows, soft-caps) a backend must implement, and the call that passes them (``policy.attention``).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch

    from astrai.extension.backend.base import AttentionBackend
    from astrai.kvcache.cache import KVCache


def layer_view(backend: AttentionBackend, q: torch.Tensor, layer_id: int, kv_cache: KVCache):
    """``(index in k_buffer, KVCache)`` of layer ``layer_id``: its layer group's view of the step
    (``KVCache.layer_slots``), prepared for ``backend`` on its first use; the step itself and
    ``layer_id`` for a pool of one group."""
    if not getattr(kv_cache, "layer_slots", None):  # (a test's stand-in may have none)
        return layer_id, kv_cache
    group, index = kv_cache.layer_slots[layer_id]
    view = kv_cache.groups[group]
    if view.backend is not backend:
        view.features = kv_cache.features
        backend.prepare(q, view)
        view.backend = backend
    return index, view


def lacks(backend: AttentionBackend, kv_cache: KVCache) -> str | None:
    """Why ``backend`` cannot run the step's model: a layer option (``KVCache.features``) it does not
    implement (``AttentionBackend.features``); None when it implements them all."""
    missing = sorted(getattr(kv_cache, "features", frozenset()) - backend.features)
    return f"no {' or '.join(missing)} attention (the model's layers need it)" if missing else None


def call_forward(backend, q, k, v, layer_id, kv_cache, scale, window, softcap) -> torch.Tensor:
    """``backend.forward``, with the layer's options only when it has some (a backend without
    ``features`` takes the spec's six arguments)."""
    if not window and not softcap:
        return backend.forward(q, k, v, layer_id, kv_cache, scale)
    return backend.forward(q, k, v, layer_id, kv_cache, scale, window=window, softcap=softcap)
