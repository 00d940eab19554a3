"""Building one step's ``KVCache`` from the pool's layers (``PagePool.bind_tasks``): its request table,
its storage and the layout's page size (this module sits under the pool: it never sees one)."""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import TYPE_CHECKING, NamedTuple

import torch

from astrai.kvcache.cache import KVCache

if TYPE_CHECKING:
    from astrai.kvcache.layout import KVLayout
    from astrai.kvcache.req_to_token import ReqToTokenPool
    from astrai.kvcache.storage import KVStorage


class _Layers(NamedTuple):
    table: ReqToTokenPool
    storage: KVStorage
    page_size: int
    layout: KVLayout | None


def step_kv_cache(
    table: ReqToTokenPool,
    storage: KVStorage,
    page_size: int,
    req_indices: Sequence[int],
    q_lens: Sequence[int],
    seq_lens: Sequence[int],
    layout: KVLayout | None = None,
) -> KVCache:
    """``PagePool.bind_tasks``: checks the step against the request table, then builds its ``KVCache``
    (``page_size``: the slots' layout, ``KVCache.page_size``; ``layout``: the pool's layer groups,
    None for one group of every layer)."""
    pool = _Layers(table, storage, page_size, layout)
    rows, ql, sl = [int(r) for r in req_indices], [int(q) for q in q_lens], [int(s) for s in seq_lens]
    b = len(rows)
    if b == 0 or len(ql) != b or len(sl) != b:
        raise ValueError(f"bind_tasks needs equal, non-empty lists, got {len(rows)}, {len(ql)}, {len(sl)}")
    if len(set(rows)) != b:
        raise ValueError(f"a request row appears twice in one step: {rows}")
    lens = pool.table.lens
    for row, q, s in zip(rows, ql, sl, strict=True):
        pool.table.require_live(row)
        if not 1 <= q <= s:
            raise ValueError(f"row {row}: q_len {q} outside [1, seq_len {s}]")
        if s > lens[row]:
            raise ValueError(f"row {row}: position {s - 1} has no slot (extend to {s} first)")
    if max(ql) == 1:
        return _bind_decode(pool, rows, sl)
    host = torch.tensor([rows, ql, sl], dtype=torch.int64)
    rows_t, q_t, s_t = host[0], host[1], host[2]
    t = sum(ql)
    qo_indptr = torch.zeros(b + 1, dtype=torch.int64)
    torch.cumsum(q_t, 0, out=qo_indptr[1:])
    kv_indptr = torch.zeros(b + 1, dtype=torch.int64)
    torch.cumsum(s_t, 0, out=kv_indptr[1:])
    # token -> request, then its position: start of the request's new tokens plus offset.
    batch = torch.arange(b)
    tok_req = torch.repeat_interleave(batch, q_t, output_size=t)
    tok_pos = torch.arange(t) - qo_indptr[:-1][tok_req] + (s_t - q_t)[tok_req]
    longs = torch.cat([rows_t, s_t, rows_t[tok_req], tok_pos]).to(pool.storage.device)
    ints = torch.cat([kv_indptr, qo_indptr]).to(torch.int32).to(pool.storage.device)
    req_pool_indices, seq_lens_d, tok_rows, tok_pos_d = torch.split(longs, [b, b, t, t])
    kv_indptr_d, qo_indptr_d = torch.split(ints, [b + 1, b + 1])
    kv = _kv_cache(pool, req_pool_indices, seq_lens_d, kv_indptr_d, qo_indptr_d, ql, sl)
    return _with_slots(pool, kv, tok_rows, tok_pos_d)


def _bind_decode(pool: _Layers, rows: list[int], sl: list[int]) -> KVCache:
    """``bind_tasks`` for a step of one token per request (the common case), from host lists:
    a few tensors instead of the general path's two dozen small ops."""
    b = len(rows)
    kv_indptr = [0] * (b + 1)
    for i, s in enumerate(sl):
        kv_indptr[i + 1] = kv_indptr[i] + s
    longs = torch.tensor([rows, sl, [s - 1 for s in sl]], dtype=torch.int64).to(pool.storage.device)
    ints = torch.tensor([*kv_indptr, *range(b + 1)], dtype=torch.int32).to(
        pool.storage.device
    )  # kv_indptr, qo_indptr
    kv_indptr_d, qo_indptr_d = torch.split(ints, [b + 1, b + 1])
    kv = _kv_cache(pool, longs[0], longs[1], kv_indptr_d, qo_indptr_d, [1] * b, sl)
    return _with_slots(pool, kv, longs[0], longs[2])


def _with_slots(pool: _Layers, kv: KVCache, tok_rows: torch.Tensor, tok_pos: torch.Tensor) -> KVCache:
    """``kv`` with each new token's slot; with layer groups, a ``KVCache`` per group in ``kv.groups``
    (``kv`` is group 0's), each with its group's table and slots (``KVCache.layer_slots``)."""
    kv.out_cache_loc = pool.table.req_to_token[tok_rows, tok_pos].to(torch.int64)
    if pool.layout is None or pool.layout.n_groups == 1:  # layer i at index i of the one table's pages
        return kv
    groups = [kv]
    for table in pool.table.tables[1:]:
        groups.append(
            dataclasses.replace(
                kv, req_to_token=table, out_cache_loc=table[tok_rows, tok_pos].to(torch.int64), plan={}
            )
        )
    kv.groups, kv.layer_slots = tuple(groups), pool.layout.slots
    return kv


def _kv_cache(pool: _Layers, req_pool_indices, seq_lens, kv_indptr, qo_indptr, ql, sl):
    return KVCache(
        k_buffer=pool.storage.k_buffer,
        v_buffer=pool.storage.v_buffer,
        k_scale=pool.storage.k_scale,
        v_scale=pool.storage.v_scale,
        req_to_token=pool.table.req_to_token,
        req_pool_indices=req_pool_indices,
        seq_lens=seq_lens,
        out_cache_loc=seq_lens,  # (its slots: _with_slots)
        max_len=max(sl),
        kv_indptr=kv_indptr,
        qo_indptr=qo_indptr,
        max_q_len=max(ql),
        num_tokens=sum(ql),
        q_lens_host=tuple(ql),
        seq_lens_host=tuple(sl),
        page_size=pool.page_size,
        features=pool.storage.features,
    )
