"""Direct wrappers around the compiled kernels under ``torch.ops.astrai``.

The ops are registered by the astrai-backend-cuda distribution when its
extension library is imported (``import astrai_backend_cuda``, which selecting
the ``cuda`` backend does). These wrappers never fall back: a missing op raises
``KernelUnavailable``. Use them for kernel tests or where failing on a missing
kernel is intended; inference code calls ``astrai.extension.attention``.

All tensors are on one CUDA device. ``k_buffer``/``v_buffer`` are the whole pool,
``[n_layers, size, n_kv_heads, head_dim]``; ``layer_id`` picks the layer. The
index tensors are the ``KVCache`` fields of the same name (see its docstring).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch

from astrai.errors import KernelUnavailable

if TYPE_CHECKING:
    from collections.abc import Callable


def _op(name: str) -> Callable[..., Any]:
    """``torch.ops.astrai.<name>``, or ``KernelUnavailable`` naming it."""
    try:
        return getattr(torch.ops.astrai, name)
    except (AttributeError, RuntimeError) as err:
        raise KernelUnavailable(
            f"compiled kernel torch.ops.astrai.{name} is not available: the astrai-backend-cuda "
            "distribution must be installed, built with its CUDA extension, and imported "
            "(import astrai_backend_cuda) on a machine with a CUDA device"
        ) from err


def attn_paged_decode(
    q: torch.Tensor,
    new_k: torch.Tensor,
    new_v: torch.Tensor,
    k_buffer: torch.Tensor,
    v_buffer: torch.Tensor,
    layer_id: int,
    req_to_token: torch.Tensor,
    req_pool_indices: torch.Tensor,
    seq_lens: torch.Tensor,
    out_cache_loc: torch.Tensor,
    max_len: int,
    o_part: torch.Tensor,
    ml_part: torch.Tensor,
    out: torch.Tensor,
    scale: float,
) -> torch.Tensor:
    """Decode attention (one new token per request) straight from the paged pool.

    ``q [B, Hq, D]``, ``new_k``/``new_v [B, Hkv, D]`` (model dtype, RoPE applied);
    the kernel writes ``new_k``/``new_v`` to ``k_buffer[layer_id, out_cache_loc]``
    (``out_cache_loc [B]`` int64) and attends request ``b`` over positions
    ``0 .. seq_lens[b]-1``, whose slots are ``req_to_token[req_pool_indices[b]]``
    (``req_to_token [num_reqs, max_ctx_len]`` int32 is the page table, one slot per
    page; no ``page_size`` argument). ``max_len`` (host int) = ``max(seq_lens)``
    sizes the split-K grid without a device sync. ``o_part [B, Hq, D]`` and
    ``ml_part [B, Hq]`` (float32) are split-K scratch; the result goes into
    ``out [B, Hq, D]`` (model dtype), which is returned.
    Raises ``KernelUnavailable`` when the op is not registered.
    """
    return _op("attn_paged_decode")(
        q, new_k, new_v, k_buffer, v_buffer, layer_id, req_to_token, req_pool_indices,
        seq_lens, out_cache_loc, max_len, o_part, ml_part, out, scale,
    )  # fmt: skip


def attn_paged_prefill(
    q: torch.Tensor,
    k_buffer: torch.Tensor,
    v_buffer: torch.Tensor,
    layer_id: int,
    req_to_token: torch.Tensor,
    req_pool_indices: torch.Tensor,
    qo_indptr: torch.Tensor,
    kv_indptr: torch.Tensor,
    q_tile_to_batch: torch.Tensor,
    q_tile_to_index: torch.Tensor,
    max_q_len: int,
    scale: float,
) -> torch.Tensor:
    """Ragged-batch causal attention over the paged pool (prefill, or mixed steps).

    The caller has already written this step's K/V into ``k_buffer[layer_id,
    out_cache_loc]``. ``q [T, Hq, D]`` is flattened request after request;
    request ``b`` owns rows ``qo_indptr[b] .. qo_indptr[b+1]-1`` and has
    ``kv_len = kv_indptr[b+1] - kv_indptr[b]`` tokens of KV at slots
    ``req_to_token[req_pool_indices[b], :kv_len]``; its row ``j`` sits at position
    ``kv_len - q_len + j`` and sees positions up to it. The launch grid is one
    program per (Q tile, head): ``q_tile_to_batch``/``q_tile_to_index``
    ([num_q_tiles] int32, tiles of ``PREFILL_Q_TILE`` rows) map a tile to its
    request and to its tile index within that request. ``qo_indptr``/``kv_indptr``
    are ``[B + 1]`` int32; ``max_q_len`` is a host int. Returns ``o [T, Hq, D]``.
    Raises ``KernelUnavailable`` when the op is not registered.
    """
    return _op("attn_paged_prefill")(
        q, k_buffer, v_buffer, layer_id, req_to_token, req_pool_indices, qo_indptr,
        kv_indptr, q_tile_to_batch, q_tile_to_index, max_q_len, scale,
    )  # fmt: skip


def rotary_emb(x: torch.Tensor, freqs: torch.Tensor) -> torch.Tensor:
    """Fused interleaved-pair RoPE: ``apply_rotary_emb``'s contract, bf16 on CUDA.

    ``x [batch, seq, heads, head_dim]`` bf16, ``freqs [batch, seq, head_dim/2, 2]``
    float32 ``[cos, sin]`` (a ``RotaryEmbedding`` output) -> rotated ``x``
    (the kernel may work in place and return ``x``). Raises ``KernelUnavailable``
    when the op is not registered.
    """
    return _op("rotary_emb")(x, freqs)
