"""KVStorage: the flat K/V slot buffers every layer writes into and gathers from."""

from __future__ import annotations

import torch

from astrai.kvcache.quant import check_kv_dtype, slot_bytes


class KVStorage:
    """Two preallocated buffers of token slots, one K and one V, shared by every request.

    ``k_buffer`` and ``v_buffer`` are ``[n_layers, size, n_kv_heads, head_dim]`` on ``device``, in
    the model dtype, or int8 where ``kinds`` (K's, V's: ``astrai.kvcache.quant``) quantizes them;
    then ``k_scale`` (``v_scale``) holds each slot's float32 scale per head, ``[n_layers, size,
    n_kv_heads]`` (None otherwise). A slot index (what ``req_to_token`` and ``out_cache_loc`` hold)
    addresses dim 1; attention backends index the buffers directly (``k_buffer[layer_id,
    out_cache_loc] = k``). The storage never decides which slot belongs to whom: that is the
    allocator's and ``req_to_token``'s job.
    """

    def __init__(
        self,
        n_layers: int,
        size: int,
        n_kv_heads: int,
        head_dim: int,
        dtype: torch.dtype,
        device: torch.device | str,
        kinds: tuple[str, str] = ("auto", "auto"),
    ) -> None:
        if min(n_layers, size, n_kv_heads, head_dim) < 1:
            raise ValueError(
                f"KVStorage dimensions must be positive, got n_layers={n_layers}, size={size}, "
                f"n_kv_heads={n_kv_heads}, head_dim={head_dim}"
            )
        self.n_layers = n_layers
        self.size = size
        self.n_kv_heads = n_kv_heads
        self.head_dim = head_dim
        self.dtype = dtype
        self.kinds = tuple(check_kv_dtype(k) for k in kinds)
        self.device = torch.device(device)
        shape = (n_layers, size, n_kv_heads, head_dim)
        # zeros, not empty: a slot read before it is written must be finite, never NaN garbage.
        k8, v8 = (kind == "int8" for kind in self.kinds)
        self.k_buffer = torch.zeros(shape, dtype=torch.int8 if k8 else dtype, device=self.device)
        self.v_buffer = torch.zeros(shape, dtype=torch.int8 if v8 else dtype, device=self.device)
        scales = shape[:-1]
        self.k_scale = torch.zeros(scales, dtype=torch.float32, device=self.device) if k8 else None
        self.v_scale = torch.zeros(scales, dtype=torch.float32, device=self.device) if v8 else None

    @property
    def features(self) -> frozenset[str]:
        """What a backend must implement to read this storage (``AttentionBackend.features``):
        ``kv_int8`` where K or V is quantized."""
        return frozenset({"kv_int8"}) if "int8" in self.kinds else frozenset()

    @staticmethod
    def bytes_per_token(
        n_layers: int,
        n_kv_heads: int,
        head_dim: int,
        dtype: torch.dtype,
        kinds: tuple[str, str] = ("auto", "auto"),
    ) -> int:
        """Bytes one token slot costs across K and V of all layers (with their scales)."""
        return n_layers * sum(slot_bytes(kind, n_kv_heads, head_dim, dtype) for kind in kinds)

    def nbytes(self) -> int:
        """Total bytes held by the buffers and their scales."""
        extra = [t.nbytes for t in (self.k_scale, self.v_scale) if t is not None]
        return self.k_buffer.nbytes + self.v_buffer.nbytes + sum(extra)
