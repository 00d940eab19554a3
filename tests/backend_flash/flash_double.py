"""A plain-PyTorch test double of flash-attn 2's ``flash_attn_with_kvcache`` and
``flash_attn_varlen_func``, written from their documented contracts (flash_attn_interface.py
docstrings, flash_api.cpp checks), not from astrai's attention.

It enforces what the real kernels check (fp16/bf16, int32 index tensors, paged block
size a multiple of 256, head dim <= 256, heads divisible by KV heads, contiguous last
dims) and implements what the backend relies on: paged K/V through ``block_table``, the
in-place append of ``k``/``v`` at ``cache_seqlens``, ragged batches through
``cu_seqlens``, grouped-query heads (query head ``h`` reads KV head ``h // group``),
and the causal mask aligned to the bottom-right corner (query ``i`` of ``n_q`` sees key
``j`` of ``n_k`` iff ``j <= i + n_k - n_q``; a row that sees nothing outputs zeros). Sliding
windows: with ``window_size=(left, right)`` query ``i`` sees keys ``i + n_k - n_q - left .. i +
n_k - n_q + right`` inclusive (a negative side: no limit; ``causal`` sets ``right`` to 0, as
flash_api.cpp does). ``softcap > 0``: the scaled scores become ``softcap * tanh(s / softcap)``
(flash_api.cpp folds softmax_scale / softcap into the tanh and scales by softcap after).
Options the backend does not use raise NotImplementedError. Slow (a loop over requests)
and float32 inside: a reference, not a kernel.
"""

from __future__ import annotations

import torch

from astrai_backend_flash.kernels import FlashKernels

PAGED_BLOCK_MULTIPLE = 256


def _check(cond: bool, message: str) -> None:
    if not cond:
        raise RuntimeError(message)  # flash-attn's TORCH_CHECK raises RuntimeError


def _check_common(q, k, v, block_table) -> None:
    _check(q.dtype in (torch.float16, torch.bfloat16), "FlashAttention only support fp16 and bf16 data type")
    _check(k.dtype == q.dtype and v.dtype == q.dtype, "query and key/value must have the same dtype")
    _check(
        q.stride(-1) == 1 and k.stride(-1) == 1 and v.stride(-1) == 1, "must have contiguous last dimension"
    )
    _check(q.shape[-1] <= 256, "FlashAttention forward only supports head dimension at most 256")
    _check(
        q.shape[-2] % k.shape[-2] == 0, "Number of heads in key/value must divide number of heads in query"
    )
    if block_table is not None:
        _check(block_table.dtype == torch.int32, "block_table must have dtype torch.int32")
        _check(block_table.stride(-1) == 1, "block_table must have contiguous last dimension")
        _check(
            k.dim() == 4 and k.shape[1] % PAGED_BLOCK_MULTIPLE == 0,
            "Paged KV cache block size must be divisible by 256",
        )


def _positions(cache: torch.Tensor, table_row: torch.Tensor, n: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(block, offset) of positions 0..n-1 of one sequence of a paged cache."""
    page = cache.shape[1]
    pos = torch.arange(n)
    _check(-(-n // page) <= table_row.shape[0], "block_table too short for the sequence")
    blocks = table_row.long()[pos // page]
    _check(bool(((blocks >= 0) & (blocks < cache.shape[0])).all()), "block id out of range")
    return blocks, pos % page


def _check_window(window_size) -> tuple[int, int]:
    left, right = window_size  # flash-attn unpacks a pair of ints
    _check(isinstance(left, int) and isinstance(right, int), "window_size must be a pair of ints")
    return left, right


def _attend(q, keys, values, scale: float, causal: bool, window_size=(-1, -1), softcap=0.0) -> torch.Tensor:
    """q [n_q, H, D] over keys/values [n_k, Hkv, D] -> [n_q, H, D] float32."""
    n_q, n_k, group = q.shape[0], keys.shape[0], q.shape[1] // keys.shape[1]
    keys = keys.float().repeat_interleave(group, dim=1)
    values = values.float().repeat_interleave(group, dim=1)
    scores = torch.einsum("qhd,khd->hqk", q.float(), keys) * scale
    if softcap > 0:
        scores = torch.tanh(scores / softcap) * softcap
    left, right = window_size
    if causal:
        right = 0
    diagonal = torch.arange(n_q)[:, None] + (n_k - n_q)  # the key aligned with each query
    cols = torch.arange(n_k)[None, :]
    allowed = torch.ones(n_q, n_k, dtype=torch.bool)
    if right >= 0:
        allowed &= cols <= diagonal + right
    if left >= 0:
        allowed &= cols >= diagonal - left
    if not bool(allowed.all()):
        scores = scores.masked_fill(~allowed, float("-inf"))
    probs = torch.softmax(scores, dim=-1).nan_to_num(0.0)  # a fully masked row outputs zeros
    return torch.einsum("hqk,khd->qhd", probs, values)


def _unsupported(**options) -> None:
    used = [name for name, (value, default) in options.items() if value != default]
    if used:
        raise NotImplementedError(f"flash double: options not implemented: {used}")


def flash_attn_with_kvcache(
    q,
    k_cache,
    v_cache,
    k=None,
    v=None,
    rotary_cos=None,
    rotary_sin=None,
    cache_seqlens=None,
    cache_batch_idx=None,
    cache_leftpad=None,
    block_table=None,
    softmax_scale=None,
    causal=False,
    window_size=(-1, -1),
    softcap=0.0,
    rotary_interleaved=True,
    alibi_slopes=None,
    num_splits=0,
    return_softmax_lse=False,
):
    """q (B, Sq, H, D); paged k_cache/v_cache (num_blocks, P, Hkv, D) with block_table (B, max_blocks)
    int32; k/v (B, Snew, Hkv, D) written in place at positions cache_seqlens[b] + i; attention over
    cache_seqlens[b] + Snew keys. Returns (B, Sq, H, D)."""
    _unsupported(
        rotary_cos=(rotary_cos, None),
        cache_batch_idx=(cache_batch_idx, None),
        cache_leftpad=(cache_leftpad, None),
        alibi_slopes=(alibi_slopes, None),
        return_softmax_lse=(return_softmax_lse, False),
    )
    window_size = _check_window(window_size)
    if block_table is None:
        raise NotImplementedError("flash double: only the paged cache (block_table) is implemented")
    _check_common(q, k_cache, v_cache, block_table)
    batch, n_q, _, head_dim = q.shape
    _check(block_table.shape[0] == batch, "block_table must have shape [batch_size, max_num_blocks_per_seq]")
    if isinstance(cache_seqlens, int):
        cache_seqlens = torch.full((batch,), cache_seqlens, dtype=torch.int32)
    _check(
        cache_seqlens is not None and cache_seqlens.dtype == torch.int32 and cache_seqlens.shape == (batch,),
        "seqlens_k must have dtype int32 and shape (batch_size,)",
    )
    _check((k is None) == (v is None), "If key is supplied, value must also be passed in")
    n_new = 0 if k is None else k.shape[1]
    if k is not None:
        _check(k.dtype == q.dtype and v.dtype == q.dtype, "Key/Value must have the same dtype as query")
        _check(k.shape == (batch, n_new, k_cache.shape[2], head_dim), "k must have shape (B, Snew, Hkv, D)")
    scale = head_dim**-0.5 if softmax_scale is None else softmax_scale
    out = torch.empty(q.shape, dtype=q.dtype)
    for b in range(batch):
        start = int(cache_seqlens[b])
        blocks, offsets = _positions(k_cache, block_table[b], start + n_new)
        if k is not None:
            k_cache[blocks[start:], offsets[start:]] = k[b]
            v_cache[blocks[start:], offsets[start:]] = v[b]
        keys, values = k_cache[blocks, offsets], v_cache[blocks, offsets]
        out[b] = _attend(q[b], keys, values, scale, causal, window_size, softcap).to(q.dtype)
    return out


def flash_attn_varlen_func(
    q,
    k,
    v,
    cu_seqlens_q,
    cu_seqlens_k,
    max_seqlen_q,
    max_seqlen_k,
    dropout_p=0.0,
    softmax_scale=None,
    causal=False,
    window_size=(-1, -1),
    softcap=0.0,
    alibi_slopes=None,
    deterministic=False,
    return_attn_probs=False,
    block_table=None,
):
    """q (total_q, H, D); k/v (total_k, Hkv, D), or paged (num_blocks, P, Hkv, D) with block_table
    (B, max_blocks) int32, sequence b then reading positions 0..n_k-1 through block_table[b];
    cu_seqlens_q/k (B + 1,) int32. Returns (total_q, H, D)."""
    _unsupported(
        dropout_p=(dropout_p, 0.0),
        alibi_slopes=(alibi_slopes, None),
        return_attn_probs=(return_attn_probs, False),
    )
    window_size = _check_window(window_size)
    _check_common(q, k, v, block_table)
    for name, cu in (("cu_seqlens_q", cu_seqlens_q), ("cu_seqlens_k", cu_seqlens_k)):
        _check(cu.dtype == torch.int32 and cu.is_contiguous(), f"{name} must be contiguous int32")
    batch = cu_seqlens_q.shape[0] - 1
    _check(cu_seqlens_k.shape == (batch + 1,), "cu_seqlens_k must have shape (batch_size + 1)")
    q_lens, k_lens = cu_seqlens_q.diff().tolist(), cu_seqlens_k.diff().tolist()
    _check(q.shape[0] == cu_seqlens_q[-1], "total_q must equal cu_seqlens_q[-1]")
    # The kernel sizes its grid by max_seqlen_*: rows beyond them would silently go missing.
    _check(
        max(q_lens) <= max_seqlen_q and max(k_lens) <= max_seqlen_k, "max_seqlen_q/k below the real maxima"
    )
    if block_table is None:
        _check(k.dim() == 3 and k.shape[0] == cu_seqlens_k[-1], "total_k must equal cu_seqlens_k[-1]")
    else:
        _check(
            block_table.shape[0] == batch, "block_table must have shape [batch_size, max_num_blocks_per_seq]"
        )
    scale = q.shape[-1] ** -0.5 if softmax_scale is None else softmax_scale
    out = torch.empty(q.shape, dtype=q.dtype)
    for b in range(batch):
        q0, q1 = int(cu_seqlens_q[b]), int(cu_seqlens_q[b + 1])
        if block_table is None:
            k0, k1 = int(cu_seqlens_k[b]), int(cu_seqlens_k[b + 1])
            keys, values = k[k0:k1], v[k0:k1]
        else:
            blocks, offsets = _positions(k, block_table[b], k_lens[b])
            keys, values = k[blocks, offsets], v[blocks, offsets]
        out[q0:q1] = _attend(q[q0:q1], keys, values, scale, causal, window_size, softcap).to(q.dtype)
    return out


DOUBLE = FlashKernels(flash_attn_with_kvcache, flash_attn_varlen_func, device_type="cpu")
