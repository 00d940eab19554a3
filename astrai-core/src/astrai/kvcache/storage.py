"""KVStorage: the flat K/V slot buffers every layer writes into and gathers from."""

from __future__ import annotations

import torch


class KVStorage:
    """Two preallocated buffers of token slots, one K and one V, shared by every request.

    ``k_buffer`` and ``v_buffer`` are ``[n_layers, size, n_kv_heads, head_dim]`` in the
    model dtype on ``device``. A slot index (what ``req_to_token`` and
    ``out_cache_loc`` hold) addresses dim 1; attention backends index the buffers
    directly (``k_buffer[layer_id, out_cache_loc] = k``). The storage never decides
    which slot belongs to whom: that is the allocator's and ``req_to_token``'s job.
    """

    def __init__(
        self,
        n_layers: int,
        size: int,
        n_kv_heads: int,
        head_dim: int,
        dtype: torch.dtype,
        device: torch.device | str,
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
        self.device = torch.device(device)
        shape = (n_layers, size, n_kv_heads, head_dim)
        # zeros, not empty: a slot read before it is written must be finite, never NaN garbage.
        self.k_buffer = torch.zeros(shape, dtype=dtype, device=self.device)
        self.v_buffer = torch.zeros(shape, dtype=dtype, device=self.device)

    @staticmethod
    def bytes_per_token(n_layers: int, n_kv_heads: int, head_dim: int, dtype: torch.dtype) -> int:
        """Bytes one token slot costs across K and V of all layers."""
        return 2 * n_layers * n_kv_heads * head_dim * dtype.itemsize

    def nbytes(self) -> int:
        """Total bytes held by both buffers."""
        return self.k_buffer.nbytes + self.v_buffer.nbytes
