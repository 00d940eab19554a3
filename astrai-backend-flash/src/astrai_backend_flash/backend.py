"""``FlashAttnBackend``: flash-attn's paged kernels over astrai's KV pool, without copying it.

A step is one of three shapes (see ``plan.FlashPlan``):

- decode (every ``q_len`` 1): one ``flash_attn_with_kvcache`` call per layer that appends
  the new K/V at ``cache_seqlens`` through the block table (the pool's slot for that
  position, i.e. ``out_cache_loc``) and attends over the request's ``seq_len`` positions;
- fresh prefill (no request has cached positions): K/V written to the pool, then
  ``flash_attn_varlen_func`` over this step's K/V (``cu_seqlens_k = qo_indptr``);
- anything else (prefix hits, chunked prefill, prompts mixed with decodes): K/V written,
  then ``flash_attn_varlen_func`` over the pool through the block table
  (``cu_seqlens_k = kv_indptr``); causal masks align to the bottom right, so a new token
  at position ``p`` sees positions ``0..p``.

A sliding-window layer passes ``window_size=(window - 1, 0)`` (flash-attn's query at position
``p`` then sees keys ``p - (window - 1) .. p``, HF's ``sliding_window``) and a soft-capped one
``softcap`` (flash-attn caps the scaled scores, ``softcap * tanh(s / softcap)``), in every mode;
layers without them call flash-attn exactly as before.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

import astrai_backend_flash.kernels as flash_kernels
from astrai.extension.api import AttentionBackend
from astrai_backend_flash.plan import BLOCK, build_plan, paged_view

if TYPE_CHECKING:
    from astrai.extension.api import KVCache

_DTYPES = (torch.float16, torch.bfloat16)
_MAX_HEAD_DIM = 256


def layout_page_size(kv_cache: KVCache) -> int:
    """``KVCache.page_size``: each request's positions sit in aligned runs of this many consecutive
    slots (the pool's page size; ``max_seq_len`` in contiguous mode). 1 when the core does not say."""
    return getattr(kv_cache, "page_size", 1)


def layer_options(window: int, softcap: float) -> dict:
    """flash-attn's keywords for a layer's sliding window and soft-cap (none when it has neither).

    ``window_size=(left, right)``: with ``causal`` a query at position ``p`` sees keys ``p - left ..
    p``, so a window of ``window`` positions (itself included) is ``left = window - 1``.
    """
    options: dict = {}
    if window:
        options["window_size"] = (window - 1, 0)
    if softcap:
        options["softcap"] = float(softcap)
    return options


class FlashAttnBackend(AttentionBackend):
    """Attention through flash-attn 2's paged kernels; see ``AttentionBackend.forward``.

    Runs fp16/bf16 on CUDA devices of compute capability 8.0+, head dims that are
    multiples of 8 up to 256 (others make flash-attn pad, i.e. copy, the whole cache),
    and KV layouts whose page size is a multiple of 256 (flash-attn's paged block).
    """

    name = "flash"
    priority = 20
    #: flash-attn's ``window_size`` and ``softcap`` (``AttentionBackend.features``).
    features = frozenset({"window", "softcap"})

    def __init__(self) -> None:
        self._kernels = flash_kernels.resolve()
        self._device_reasons: dict[torch.device, str | None] = {}

    @classmethod
    def is_available(cls) -> tuple[bool, str]:
        """flash_attn (>= 2.6) imports and a CUDA device of compute capability 8.0+ is present."""
        return flash_kernels.availability()

    def supports(self, q: torch.Tensor, kv_cache: KVCache) -> str | None:
        """None, or why not: device, dtype, pool dtype, head dim, missing host facts, page size."""
        if q.device not in self._device_reasons:
            self._device_reasons[q.device] = flash_kernels.device_reason(self._kernels, q.device)
        reason = self._device_reasons[q.device]
        if reason is not None:
            return reason
        if q.dtype not in _DTYPES:
            return f"dtype {q.dtype} not supported (flash-attn takes float16 or bfloat16)"
        if kv_cache.k_buffer.dtype != q.dtype:
            return f"KV pool dtype {kv_cache.k_buffer.dtype} differs from q dtype {q.dtype}"
        head_dim = q.shape[-1]
        if head_dim % 8 or head_dim > _MAX_HEAD_DIM:
            return f"head_dim {head_dim} not supported (flash-attn: a multiple of 8, at most {_MAX_HEAD_DIM})"
        if kv_cache.max_q_len < 1:
            return "KVCache has no host facts (max_q_len)"
        page = layout_page_size(kv_cache)
        if page % BLOCK:
            return (
                f"KV page size {page} is not a multiple of flash-attn's paged block size {BLOCK} "
                f"(run the engine with page_size={BLOCK})"
            )
        return None

    def prepare(self, q: torch.Tensor, kv_cache: KVCache) -> None:
        """The step's plan (mode, block table, ``cache_seqlens``), kept in ``kv_cache.plan["flash"]``."""
        kv_cache.plan[self.name] = build_plan(kv_cache)

    def forward(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        layer_id: int,
        kv_cache: KVCache,
        scale: float,
        *,
        window: int = 0,
        softcap: float = 0.0,
    ) -> torch.Tensor:
        """Write ``k``/``v`` at ``out_cache_loc`` and attend: ``q [T, Hq, D]`` -> ``[T, Hq, D]``.

        Reads the plan ``prepare`` made (a direct call without it plans here).
        """
        options = layer_options(window, softcap)
        plan = kv_cache.plan.get(self.name)
        if plan is None:
            plan = kv_cache.plan[self.name] = build_plan(kv_cache)
        k_buf, v_buf = kv_cache.k_buffer[layer_id], kv_cache.v_buffer[layer_id]
        n_tok, n_heads, head_dim = q.shape
        if plan.mode == "decode":
            out = self._kernels.with_kvcache(
                q.reshape(n_tok, 1, n_heads, head_dim),
                paged_view(k_buf),
                paged_view(v_buf),
                k=k.reshape(n_tok, 1, -1, head_dim),
                v=v.reshape(n_tok, 1, -1, head_dim),
                cache_seqlens=plan.cache_seqlens,
                block_table=plan.block_table,
                softmax_scale=scale,
                causal=True,
                **options,
            )
            return out.view(n_tok, n_heads, head_dim)
        k_buf.index_copy_(0, kv_cache.out_cache_loc, k)
        v_buf.index_copy_(0, kv_cache.out_cache_loc, v)
        if plan.mode == "fresh":
            qo, max_q = kv_cache.qo_indptr, kv_cache.max_q_len
            return self._kernels.varlen_func(
                q, k, v, qo, qo, max_q, max_q, softmax_scale=scale, causal=True, **options
            )
        return self._kernels.varlen_func(
            q,
            paged_view(k_buf),
            paged_view(v_buf),
            kv_cache.qo_indptr,
            kv_cache.kv_indptr,
            kv_cache.max_q_len,
            kv_cache.max_len,
            softmax_scale=scale,
            causal=True,
            block_table=plan.block_table,
            **options,
        )
