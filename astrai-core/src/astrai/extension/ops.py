"""Direct wrappers around the compiled kernels under ``torch.ops.astrai``.

The ops are registered by the astrai-backend-cuda distribution when it loads its
extension library (``astrai_backend_cuda.load_kernels()``, which
``CudaBackend.is_available()`` calls). These wrappers never fall back: a missing
op raises ``KernelUnavailable``. Use them for kernel tests or where failing on a
missing kernel is intended; inference code calls ``astrai.extension.attention``.

All tensors are on one CUDA device; bfloat16 or float16 storage (the KV pool's K and V
each that, or int8 with float32 scales), head_dim 64 or 128. ``k_buffer``/``v_buffer`` are the whole pool, ``[n_layers, size, n_kv_heads,
head_dim]`` (contiguous); ``layer_id`` picks the layer. The index tensors are the
``KVCache`` fields of the same name (see its docstring). The ops mutate only the
tensors documented as written, never synchronise the device and allocate nothing
(CUDA-graph safe); the wrappers allocate an output only when none is passed.
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
            "distribution must be installed and its kernels loaded (astrai_backend_cuda.load_kernels(), "
            "which selecting the cuda backend does) on a machine with a CUDA device"
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
    num_splits: int,
    o_part: torch.Tensor,
    ml_part: torch.Tensor,
    out: torch.Tensor,
    scale: float,
    window: int = 0,
    softcap: float = 0.0,
    k_scale: torch.Tensor | None = None,
    v_scale: torch.Tensor | None = None,
) -> torch.Tensor:
    """Decode attention (one new token per request) straight from the paged pool, split-K.

    ``q [B, Hq, D]``, ``new_k``/``new_v [B, Hkv, D]`` (model dtype, RoPE applied);
    the kernel writes ``new_k``/``new_v`` to ``k_buffer[layer_id, out_cache_loc]``
    (``out_cache_loc [B]`` int64, the slot of position ``seq_lens[b] - 1``) and
    attends request ``b`` over positions ``0 .. seq_lens[b]-1``, whose slots are
    ``req_to_token[req_pool_indices[b]]`` (``req_to_token [num_reqs, max_ctx_len]``
    int32 is the page table, one slot per page; no ``page_size`` argument).

    Split-K: positions are cut into ``num_splits`` ranges of ``chunk =
    ceil(ceil(max_len / num_splits) / 32) * 32`` positions (the last range runs to
    the request's end; ``max_len`` (host int) is ``max(seq_lens)`` for the best
    balance). For split ``s`` the kernel writes ``o_part[b, h, s]`` (float32, the
    softmax-normalised output over that range) and ``ml_part[b, h, s]`` (float32,
    the natural-log log-sum-exp of the range's scaled scores; ``-inf`` with a zero
    ``o_part`` for an empty range). ``o_part [B, Hq, S, D]`` and ``ml_part [B, Hq, S]``
    are contiguous with ``1 <= num_splits <= S``; entries of splits ``>= num_splits``
    are left alone. The combine writes ``out [B, Hq, D]`` (model dtype, contiguous):
    the ``exp(ml_part)``-weighted mean of the partials, returned.

    ``window > 0`` (a sliding-window layer): request ``b`` attends only positions
    ``seq_lens[b] - window .. seq_lens[b] - 1`` (those from 0 when shorter); the splits then cut
    that range, so ``max_len`` is best ``min(max(seq_lens), window)``. ``softcap > 0``: each scaled
    score ``s`` becomes ``softcap * tanh(s / softcap)`` (``ml_part`` is over the capped scores).
    ``k_scale`` (``v_scale``) given: ``k_buffer`` (``v_buffer``) is an int8 pool with these float32
    scales ``[n_layers, size, n_kv_heads]`` (``astrai.kvcache.quant``); the new K (V) is written
    quantized, its scale beside it, and the pool is read as ``q * scale``.
    Raises ``KernelUnavailable`` when the op is not registered.
    """
    op = _op("attn_paged_decode")
    op(
        q,
        new_k,
        new_v,
        k_buffer,
        v_buffer,
        layer_id,
        req_to_token,
        req_pool_indices,
        seq_lens,
        out_cache_loc,
        max_len,
        num_splits,
        o_part,
        ml_part,
        out,
        scale,
        window,
        softcap,
        k_scale,
        v_scale,
    )
    return out


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
    scale: float,
    out: torch.Tensor | None = None,
    window: int = 0,
    softcap: float = 0.0,
    k_scale: torch.Tensor | None = None,
    v_scale: torch.Tensor | None = None,
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
    request and to its tile index within that request; only rows of listed tiles
    are written. ``qo_indptr``/``kv_indptr`` are ``[B + 1]`` int32. Writes and
    returns ``out [T, Hq, D]`` (q's dtype; allocated when None). ``window > 0`` (a
    sliding-window layer): the row at position ``p`` sees positions ``p - window + 1 .. p``
    only; ``softcap > 0``: each scaled score ``s`` becomes ``softcap * tanh(s / softcap)``.
    ``k_scale``/``v_scale``: an int8 K/V pool's scales, as in ``attn_paged_decode``.
    Raises ``KernelUnavailable`` when the op is not registered.
    """
    op = _op("attn_paged_prefill")
    out = torch.empty_like(q) if out is None else out
    op(
        q,
        k_buffer,
        v_buffer,
        layer_id,
        req_to_token,
        req_pool_indices,
        qo_indptr,
        kv_indptr,
        q_tile_to_batch,
        q_tile_to_index,
        scale,
        out,
        window,
        softcap,
        k_scale,
        v_scale,
    )
    return out


def rotary_emb(x: torch.Tensor, freqs: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
    """Fused interleaved-pair RoPE: ``apply_rotary_emb``'s contract, bf16/fp16 on CUDA.

    ``x [..., heads, head_dim]``, ``freqs [..., head_dim/2, 2]`` float32 ``[cos, sin]``
    with x's leading shape (a ``RotaryEmbedding`` output), contiguous. Writes the
    rotated ``x`` (rounded once from float32) into ``out`` (x's shape and dtype;
    allocated when None, or ``x`` itself to rotate in place) and returns it.
    Raises ``KernelUnavailable`` when the op is not registered.
    """
    op = _op("rotary_emb")
    out = torch.empty_like(x) if out is None else out
    op(x, freqs, out)
    return out
