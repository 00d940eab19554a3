"""The model runner: a ``StepPlan`` in, the sampled token ids out.

``ModelRunner.execute`` builds the step's flattened ragged batch (ids, positions, the
``KVCache`` of ``PagePool.bind_tasks``), resolves the step's attention backend once and lets
it prepare (``astrai.extension.bind_step``), runs the model and samples the rows that want a
next token, all at once. ``warm_up`` runs two tiny steps on a scratch pool before the first
request. Runs on the scheduler thread (see ``astrai.cpu_tuning`` for why the model does).
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import TYPE_CHECKING

import torch

from astrai.extension.backend.policy import BackendChoice, bind_step
from astrai.sampling import SamplingBatch, SamplingPipeline

if TYPE_CHECKING:
    from astrai.batching import StepPlan
    from astrai.kvcache import KVCache, PagePool
    from astrai.request import Request

logger = logging.getLogger(__name__)


class ModelRunner:
    """Runs ``model`` over ``pool`` one step at a time and samples with ``pipeline``.

    ``model(input_ids [T], positions [T], kv_cache, logits_indices [B]) -> [B, vocab] f32``.
    """

    def __init__(self, model: torch.nn.Module, pool: PagePool, pipeline: SamplingPipeline | None = None) -> None:
        self.model, self.pool = model, pool
        self.pipeline = pipeline or SamplingPipeline.default()
        # the query layout backends are asked about (supports/prepare read dtype, device, heads, head_dim)
        self._query = torch.empty((0, pool.n_heads, pool.head_dim), dtype=pool.dtype, device=pool.device)

    def execute(self, plan: StepPlan, sampled: Sequence[Request]) -> list[int]:
        """Run ``plan``'s rows as one forward; the next token of each of ``sampled`` (its sampled rows)."""
        device = self.pool.device
        if plan.is_decode:  # one token per row: host lists are cheaper than the general layout
            host = torch.tensor([plan.input_ids, plan.starts])
            ids, positions = host.to(device)
            logits_indices = torch.arange(len(plan.q_lens), device=device)
        else:
            q_t = torch.tensor(plan.q_lens, dtype=torch.int64)
            starts = torch.tensor(plan.starts, dtype=torch.int64)
            ends = torch.cumsum(q_t, 0)
            t = plan.num_tokens
            ids = torch.tensor(plan.input_ids, dtype=torch.int64, device=device)
            positions = (torch.arange(t) + torch.repeat_interleave(starts - (ends - q_t), q_t, output_size=t)).to(device)
            logits_indices = (ends - 1)[torch.tensor(plan.sample, dtype=torch.bool)].to(device)
        kv = self.pool.bind_tasks(plan.req_indices, plan.q_lens, plan.seq_lens)
        self.bind(kv, plan.backend)
        logits = self.model(ids, positions, kv, logits_indices)
        return self.sample(logits, sampled)

    def bind(self, kv: KVCache, choice: BackendChoice) -> None:
        """The step's attention backend for ``choice``, resolved once and prepared (``kv.backend``)."""
        bind_step(kv, self._query, choice)

    def sample(self, logits: torch.Tensor, sampled: Sequence[Request]) -> list[int]:
        """One token per row of ``logits`` (``[B, vocab]``, row i for ``sampled[i]``), vectorised."""
        if not sampled:
            return []
        if all(r.params.plain_greedy for r in sampled):  # argmax, whatever the pipeline holds
            return logits.argmax(dim=-1).tolist()
        penalised = any(r.params.frequency_penalty or r.params.presence_penalty for r in sampled)
        batch = SamplingBatch.from_params(
            [r.params for r in sampled],
            [len(r.output_ids) for r in sampled],
            logits.device,
            [r.output_ids for r in sampled] if penalised else None,
        )
        return self.pipeline.sample(logits, batch).tolist()

    def warm_up(self, choice: BackendChoice) -> None:
        """A two-token prefill and a decode step on a scratch one-row pool: weights a kernel packs
        on first use and per-model kernels are made now, not in the first request. A failure is
        logged (the requests will report it), never raised."""
        from astrai.kvcache import KVConfig, PagePool

        p = self.pool
        try:
            scratch = PagePool(p.n_layers, p.n_heads, p.n_kv_heads, p.head_dim, KVConfig(max_batch_size=1, max_seq_len=3),
                               p.dtype, p.device)  # fmt: skip
            row = scratch.task_alloc()
            scratch.extend(row, 3)
            for ids, start in (([0, 0], 0), ([0], 2)):
                kv = scratch.bind_tasks([row], [len(ids)], [start + len(ids)])
                self.bind(kv, choice)
                positions = torch.arange(start, start + len(ids), device=p.device)
                self.model(torch.tensor(ids, device=p.device), positions, kv, torch.tensor([len(ids) - 1], device=p.device))
        except Exception:
            logger.warning("warm-up forward failed (requests will report the error)", exc_info=True)

