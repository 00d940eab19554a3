"""Tensor parallelism over ``torch.distributed``: one rank's shard, the step broadcast, rank 0's model.

Rank 0 runs the whole engine (scheduler, radix cache, sampling, plugins) over ``TensorParallelModel``,
which is called like any model: ``model(input_ids, positions, kv_cache, logits_indices)``. Each
call sends the step to the other ranks (``send_step``: a small header over the gloo control group,
then one int64 payload over the device group: the ids, positions, the logits rows, the step's
``KVCache`` indices and, per request, the pool slots of its positions), runs rank 0's shard, and
gathers the vocabulary-sharded logits on rank 0. The other ranks (``worker_loop``) hold their
own K/V buffers of the same geometry (their share of the KV heads) and a mirror of rank 0's
``req_to_token`` rows, rebuild the same ``KVCache`` and run their shard; they never allocate.

Inside a shard, the outputs of ``o_proj`` and ``down_proj`` are summed over the ranks
(``Attention.reduce``/``MLP.reduce``: ``all_reduce_sum``), so every rank holds the same hidden
states; bfloat16 and float16 are summed in float32 over gloo (whose half-precision all-reduce is
not reliable) and rounded once. A model with reductions never offers a whole-stack kernel
(``DecoderLM.decoder_stack`` is None), so no fused path skips them.

While idle, rank 0 sends a heartbeat every ``timeout / 4`` seconds (the scheduler calls
``idle()``), so the workers' waits never reach the collective time-out. A failed collective or a
worker that exited makes the model unhealthy (``healthy``) and raises ``WorkerLost``, which ends
the scheduler loop: requests in flight fail, ``/health`` is 503, nothing waits forever.
"""

from __future__ import annotations

import datetime
import logging
import math
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from astrai.errors import EngineNotReady
from astrai.kvcache import KVCache
from astrai.model.config import ModelConfig

__all__ = ["STEP", "NOOP", "STOP", "Groups", "TPShard", "WorkerLost", "all_reduce_sum", "worker_loop"]

logger = logging.getLogger(__name__)

STEP, NOOP, STOP = 1, 2, 3
# ints: kind, T, B, n_logits, S, slots, rows, max_ctx, page_size, max_len, max_q_len, name length, 2 spare
HEADER = 14
NAME = 32  # bytes of the attention backend's name


class WorkerLost(EngineNotReady):
    """A tensor-parallel rank failed or exited: the engine cannot run another step."""


@dataclass
class Groups:
    """The process groups of one tensor-parallel engine: ``device`` for tensors (NCCL on CUDA, else
    gloo; the default group), ``control`` (gloo) for step headers and heartbeats."""

    rank: int
    size: int
    device: Any
    control: Any


def all_reduce_sum(x: torch.Tensor, group: Any) -> torch.Tensor:
    """``x`` summed over ``group``'s ranks (the same bits on every rank); half precision over gloo
    is summed in float32 and rounded once."""
    if x.dtype in (torch.bfloat16, torch.float16) and x.device.type == "cpu":
        wide = x.float()
        dist.all_reduce(wide, group=group)
        return wide.to(x.dtype)
    dist.all_reduce(x, group=group)
    return x


class TPShard(nn.Module):
    """One rank's shard: a model built from ``shard_config`` whose LM head holds ``vocab rows / size``
    rows and whose row-parallel outputs are all-reduced; ``forward`` returns this rank's logits
    ``[B, rows]`` (float32)."""

    def __init__(self, model: nn.Module, groups: Groups) -> None:
        super().__init__()
        self.model, self.groups = model, groups
        self.attention_features = getattr(model, "attention_features", frozenset())
        reduce = _Reduce(groups.device)
        for layer in model.model.layers:
            layer.self_attn.reduce = reduce
            layer.mlp.reduce = reduce

    def forward(
        self, ids: torch.Tensor, positions: torch.Tensor, kv: KVCache, logits_indices: torch.Tensor
    ) -> torch.Tensor:
        return self.model(ids, positions, kv, logits_indices)


class _Reduce:
    """The all-reduce after a row-parallel linear (a plain object: not a module, not a parameter)."""

    def __init__(self, group: Any) -> None:
        self.group = group

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        return all_reduce_sum(x, self.group)


# ---------------------------------------------------------------- the step message


def send_step(
    groups: Groups, ids: torch.Tensor, positions: torch.Tensor, kv: KVCache, logits_indices: torch.Tensor
) -> None:
    """Rank 0: the header (control group), then the payload (device group) of one step."""
    b, t, s = len(kv.seq_lens_host), kv.num_tokens, sum(kv.seq_lens_host)
    name = (kv.backend.name if kv.backend is not None else "").encode()[:NAME]
    header = torch.zeros(HEADER + NAME, dtype=torch.int64)
    header[:12] = torch.tensor(
        [
            STEP,
            t,
            b,
            logits_indices.numel(),
            s,
            kv.k_buffer.shape[1],
            kv.req_to_token.shape[0],
            kv.req_to_token.shape[1],
            kv.page_size,
            kv.max_len,
            kv.max_q_len,
            len(name),
        ]
    )
    header[HEADER : HEADER + len(name)] = torch.tensor(list(name), dtype=torch.int64)
    dist.broadcast(header, 0, group=groups.control)
    seq = kv.seq_lens
    rows = torch.repeat_interleave(kv.req_pool_indices, seq, output_size=s)
    pos = torch.arange(s, device=seq.device) - torch.repeat_interleave(
        kv.kv_indptr[:-1].to(torch.int64), seq, output_size=s
    )
    slots = kv.req_to_token[rows, pos].to(torch.int64)
    payload = torch.cat(
        [
            ids.to(torch.int64),
            positions.to(torch.int64),
            logits_indices.to(torch.int64),
            kv.req_pool_indices,
            seq,
            kv.out_cache_loc,
            kv.kv_indptr.to(torch.int64),
            kv.qo_indptr.to(torch.int64),
            slots,
        ]
    )
    dist.broadcast(payload, 0, group=groups.device)


def send_signal(groups: Groups, kind: int) -> None:
    """Rank 0: a header without a step (``NOOP``: heartbeat, ``STOP``: leave the loop)."""
    header = torch.zeros(HEADER + NAME, dtype=torch.int64)
    header[0] = kind
    dist.broadcast(header, 0, group=groups.control)


class _Mirror:
    """A worker's K/V buffers and ``req_to_token`` mirror for one pool geometry of rank 0's."""

    def __init__(
        self,
        config: ModelConfig,
        slots: int,
        rows: int,
        max_ctx: int,
        dtype: torch.dtype,
        device: torch.device,
    ) -> None:
        shape = (config.num_hidden_layers, slots, config.num_key_value_heads, config.head_dim)
        self.k = torch.zeros(shape, dtype=dtype, device=device)
        self.v = torch.zeros(shape, dtype=dtype, device=device)
        self.req_to_token = torch.zeros((rows, max_ctx), dtype=torch.int32, device=device)


def receive_step(
    groups: Groups,
    header: torch.Tensor,
    mirrors: dict,
    config: ModelConfig,
    dtype: torch.dtype,
    device: torch.device,
) -> tuple[torch.Tensor, torch.Tensor, KVCache, torch.Tensor, str]:
    """A worker: the payload of the step ``header`` announced, as the shard's inputs and its
    backend's name."""
    t, b, n, s, slots, rows, max_ctx, page, max_len, max_q, name_len = (int(x) for x in header[1:12])
    name = bytes(int(c) for c in header[HEADER : HEADER + name_len]).decode()
    payload = torch.empty(3 * t + n + 4 * b + 2 + s, dtype=torch.int64, device=device)
    dist.broadcast(payload, 0, group=groups.device)
    ids, positions, logits_indices, req_idx, seq, out_loc, kv_indptr, qo_indptr, row_slots = torch.split(
        payload, [t, t, n, b, b, t, b + 1, b + 1, s]
    )
    key = (slots, rows, max_ctx)
    mirror = mirrors.get(key)
    if mirror is None:
        mirror = mirrors[key] = _Mirror(config, slots, rows, max_ctx, dtype, device)
    flat_rows = torch.repeat_interleave(req_idx, seq, output_size=s)
    flat_pos = torch.arange(s, device=device) - torch.repeat_interleave(kv_indptr[:-1], seq, output_size=s)
    mirror.req_to_token[flat_rows, flat_pos] = row_slots.to(torch.int32)
    q_lens = (qo_indptr[1:] - qo_indptr[:-1]).tolist()
    kv = KVCache(
        k_buffer=mirror.k,
        v_buffer=mirror.v,
        req_to_token=mirror.req_to_token,
        req_pool_indices=req_idx,
        seq_lens=seq,
        out_cache_loc=out_loc,
        max_len=max_len,
        kv_indptr=kv_indptr.to(torch.int32),
        qo_indptr=qo_indptr.to(torch.int32),
        max_q_len=max_q,
        num_tokens=t,
        q_lens_host=tuple(q_lens),
        seq_lens_host=tuple(seq.tolist()),
        page_size=page,
    )
    return ids, positions, kv, logits_indices, name


def gather_logits(groups: Groups, local: torch.Tensor, vocab_size: int) -> torch.Tensor | None:
    """Rank 0: every rank's vocabulary slice ``[B, rows]`` joined into ``[B, vocab_size]``; other
    ranks: None."""
    if groups.rank == 0:
        parts = [torch.empty_like(local) for _ in range(groups.size)]
        dist.gather(local.contiguous(), parts, dst=0, group=groups.device)
        return torch.cat(parts, dim=1)[:, :vocab_size]
    dist.gather(local.contiguous(), None, dst=0, group=groups.device)
    return None


def worker_loop(shard: TPShard, config: ModelConfig, dtype: torch.dtype, device: torch.device) -> None:
    """Ranks > 0: run every step rank 0 sends until ``STOP`` (or until rank 0 is gone: a
    collective raises)."""
    from astrai.extension.backend.policy import bind_step
    from astrai.extension.backend.selection import BackendChoice

    groups = shard.groups
    mirrors: dict = {}
    query = torch.empty((0, config.num_attention_heads, config.head_dim), dtype=dtype, device=device)
    header = torch.zeros(HEADER + NAME, dtype=torch.int64)
    with torch.inference_mode():
        while True:
            dist.broadcast(header, 0, group=groups.control)
            kind = int(header[0])
            if kind == STOP:
                return
            if kind == NOOP:
                continue
            ids, positions, kv, logits_indices, name = receive_step(
                groups, header, mirrors, config, dtype, device
            )
            bind_step(kv, query, BackendChoice(name or None, "tensor-parallel rank 0"))
            gather_logits(groups, shard(ids, positions, kv, logits_indices), config.vocab_size)


def init_groups(
    rank: int, size: int, init_method: str, device: torch.device, timeout: float, store: Any = None
) -> Groups:
    """Join the process group (``store``, else ``init_method``) and make the control group."""
    backend = "nccl" if device.type == "cuda" else "gloo"
    span = datetime.timedelta(seconds=timeout)
    if store is not None:
        dist.init_process_group(backend, store=store, rank=rank, world_size=size, timeout=span)
    else:
        dist.init_process_group(backend, init_method=init_method, rank=rank, world_size=size, timeout=span)
    control = dist.new_group(backend="gloo", timeout=span) if backend != "gloo" else dist.group.WORLD
    return Groups(rank, size, dist.group.WORLD, control)


def lm_rows(vocab_size: int, size: int) -> int:
    """Rows of each rank's LM-head shard (the vocabulary padded to a multiple of ``size``)."""
    return math.ceil(vocab_size / size)
