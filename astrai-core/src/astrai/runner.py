"""The model runner: a ``StepPlan`` in, a ``StepResult`` out (``astrai.step``); it reads the plan's
``RowInput`` of each row and never holds or writes a request.

``ModelRunner.run`` builds the step's flattened ragged batch (ids, positions, the ``KVCache`` of
``PagePool.bind_tasks``), resolves the step's attention backend once and lets it prepare
(``astrai.extension.bind_step``), runs the model and samples the rows that want a next token,
all at once; the log-probs of the rows that asked (and the prompt log-probs of the rows that
score their prompt) come from the same logits (``astrai.logprobs``). A failure is isolated:
when the batched forward or the batched sampling raises, the rows are retried in halves until
each failure is one row's own (``run_apart``), so only that row fails. A row with speculative drafts
(``StepPlan.drafts``) is sampled at each of its positions and verified (``_verify``): its
drafts are confirmed while each equals the model's greedy token at the position before it, and
the model's token at the first mismatch (or after the last draft) follows them. ``warm_up`` runs
two tiny steps on a scratch pool before the first request. Runs on the scheduler thread (see
``astrai.cpu_tuning`` for why the model does).

Over 300 lines because verification belongs with the forward that lays out the draft
positions and the failure isolation that must keep each row's positions together.
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Callable, Collection, Sequence
from itertools import accumulate, chain
from typing import TYPE_CHECKING, TypeVar

import torch

from astrai.errors import EngineNotReady
from astrai.extension.backend.policy import BackendChoice, bind_step
from astrai.extension.fused import greedy_tokens
from astrai.logprobs import TokenLogprob, token_logprobs
from astrai.sampling import SamplingBatch, SamplingPipeline
from astrai.step import RowInput, StepPlan, StepResult

if TYPE_CHECKING:
    from astrai.kvcache import KVCache, PagePool

logger = logging.getLogger(__name__)

T = TypeVar("T")


class ModelRunner:
    """Runs ``model`` over ``pool`` one step at a time and samples with ``pipeline``.

    ``model(input_ids [T], positions [T], kv_cache, logits_indices [B]) -> [B, vocab] f32``.
    ``eos_token_ids`` are banned (with ``stop_token_ids``) until a request reaches ``min_tokens``.
    """

    def __init__(
        self,
        model: torch.nn.Module,
        pool: PagePool,
        pipeline: SamplingPipeline | None = None,
        eos_token_ids: Collection[int] = (),
    ) -> None:
        self.model, self.pool = model, pool
        self.pipeline = pipeline or SamplingPipeline.default()
        self.eos_token_ids = tuple(eos_token_ids)
        # the query layout backends are asked about (supports/prepare read dtype, device, heads, head_dim)
        self._query = torch.empty((0, pool.n_heads, pool.head_dim), dtype=pool.dtype, device=pool.device)
        # what the model's layers ask of attention (sliding windows, soft-caps): only a backend that
        # implements it is picked (``AttentionBackend.features``), as for a quantized pool ("kv_int8")
        self._features = frozenset(getattr(model, "attention_features", ())) | pool.storage.features
        # a pooling model (astrai.embedding.decoder) gives each sampled row's vector, not its logits
        self.pooling = getattr(model, "pooling", None) is not None
        # LoRA adapters (astrai.lora): each step tells the model's projections whose rows are whose
        self.lora = getattr(model, "lora", None)

    def run(self, plan: StepPlan) -> StepResult:
        """Every row of ``plan`` as one forward, with failures isolated (see ``StepResult``).

        When the batched forward raises, the rows run again in halves (``run_apart``; a retried
        row rewrites the same KV positions with the same values, so a partial write of the failed
        forward is harmless), each half then in halves while it fails, down to single rows; a
        row fails only if it fails alone. When the batched sampling raises, the same happens on
        the computed logits, without running the model again. A failure that does not come back
        in the halves (a transient one) fails nobody. ``EngineNotReady`` from the model (a lost
        tensor-parallel rank) is raised as it is: no step can run. A row with drafts gives its
        tokens as a list: the confirmed drafts, then the model's own (``_verify``).
        """
        sampled = [i for i, s in enumerate(plan.sample) if s]
        try:
            logits, scored = self._forward(plan)
            failed: dict[int, Exception] = {}
        except EngineNotReady:  # the model cannot run any step (a lost tensor-parallel rank): no retry
            raise
        except Exception as exc:
            logits, scored, failed = self._forward_apart(plan, exc)
            sampled = [i for i in sampled if i not in failed]
        if self.pooling:  # vectors: nothing to sample
            vectors = logits.cpu().tolist() if logits is not None else []
            return StepResult(pooled=dict(zip(sampled, vectors, strict=True)), failed=failed)
        rows = [plan.rows[i] for i in sampled]
        main, extra = (logits[: len(rows)], logits[len(rows) :]) if logits is not None else (None, None)
        try:
            ids, logprobs = self.sample(main, rows)
            ids = self._verify(plan, sampled, ids, extra)
            return StepResult(ids, logprobs or [None] * len(ids), scored, failed)
        except Exception as exc:
            drawn, lost = self._sample_apart(main, rows, exc)
        failed.update((sampled[j], err) for j, err in lost.items())
        kept = [j for j in range(len(rows)) if j not in lost]
        if plan.drafts and lost:  # the verified positions of the rows that failed in sampling are left out
            parts = [e for j, e in enumerate(_split_drafts(plan, sampled, extra)) if j not in lost]
            extra = torch.cat(parts) if parts else None
        ids = self._verify(plan, [sampled[j] for j in kept], [drawn[j][0] for j in kept], extra)
        scored = {i: entries for i, entries in scored.items() if i not in failed}
        return StepResult(ids, [drawn[j][1] for j in kept], scored, failed)

    def _forward_apart(
        self, plan: StepPlan, error: Exception
    ) -> tuple[torch.Tensor | None, dict[int, list[TokenLogprob]], dict[int, Exception]]:
        """The forward of ``plan`` raised ``error``: run its rows apart. The logits of the sampled rows
        that succeeded (``None``: there are none), their prompt log-probs, and the error of each
        row that failed alone."""
        if len(plan.request_ids) > 1:
            logger.warning(
                "a step of %d rows raised %r: running its rows apart to find the cause",
                len(plan.request_ids),
                error,
            )
        scored: dict[int, list[TokenLogprob]] = {}

        def compute(part: list[int]) -> dict[int, torch.Tensor | None]:
            sub = plan_rows(plan, part)
            out, sub_scored = self._forward(sub)
            scored.update((part[j], entries) for j, entries in sub_scored.items())
            got: dict[int, torch.Tensor | None] = dict.fromkeys(part)
            picked = [i for i in part if plan.sample[i]]
            if not sub.drafts:
                got.update(zip(picked, out.unsqueeze(1), strict=True))
                return got
            extra = _split_drafts(sub, [j for j, s in enumerate(sub.sample) if s], out[len(picked) :])
            got.update(
                (i, torch.cat([out[j : j + 1], e]))
                for j, (i, e) in enumerate(zip(picked, extra, strict=True))
            )
            return got

        by_row, failed = run_apart(list(range(len(plan.request_ids))), compute, error)
        kept = [
            by_row[i] for i, s in enumerate(plan.sample) if s and i not in failed
        ]  # [1 + drafts, vocab] each
        logits = torch.cat([k[:1] for k in kept] + [k[1:] for k in kept]) if kept else None
        return logits, {i: e for i, e in scored.items() if i not in failed}, failed

    def _sample_apart(
        self, logits: torch.Tensor, sampled: Sequence[RowInput], error: Exception
    ) -> tuple[dict[int, tuple[int, TokenLogprob | None]], dict[int, Exception]]:
        """Sampling ``logits`` (row i for ``sampled[i]``) raised ``error``: sample the rows apart, from the
        same logits (the model does not run again). ``(token, log-probs)`` per row that succeeded
        and the error of each row that failed alone, by row."""
        if len(sampled) > 1:
            logger.warning(
                "sampling %d rows raised %r: sampling them apart to find the cause", len(sampled), error
            )

        def draw(part: list[int]) -> dict[int, tuple[int, TokenLogprob | None]]:
            picked = logits.index_select(0, torch.tensor(part, device=logits.device))
            ids, logprobs = self.sample(picked, [sampled[j] for j in part])
            return dict(zip(part, zip(ids, logprobs or [None] * len(ids), strict=True), strict=True))

        return run_apart(list(range(len(sampled))), draw, error)

    def forward(self, plan: StepPlan) -> torch.Tensor:
        """Run ``plan``'s rows as one forward: the logits ``[number of sampled rows, vocab]`` of the
        rows that sample, in row order (a row with drafts: at its decode token), then those of each
        draft position, in row order."""
        return self._forward(plan)[0]

    def _forward(self, plan: StepPlan) -> tuple[torch.Tensor, dict[int, list[TokenLogprob]]]:
        """``forward``'s logits, and by row index the prompt log-probs a scored row's chunk computed."""
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
            offsets = torch.repeat_interleave(starts - (ends - q_t), q_t, output_size=t)
            positions = (torch.arange(t) + offsets).to(device)
            sample = torch.tensor(plan.sample, dtype=torch.bool)
            if plan.drafts:  # each sampled row's decode token first, then every draft position, in row order
                d_t = torch.tensor(plan.drafts, dtype=torch.int64)
                logits_indices = torch.cat([(ends - 1 - d_t)[sample], _draft_positions(ends, d_t)]).to(device)
            else:
                logits_indices = (ends - 1)[sample].to(device)
        scoring = _scoring(plan) if any(plan.scored) else None
        if scoring is not None:
            logits_indices = torch.cat([scoring[0].to(device), logits_indices])
        kv = self.pool.bind_tasks(plan.req_indices, plan.q_lens, plan.seq_lens)
        kv.drafts_host = plan.drafts
        self.bind(kv, plan.backend)
        if self.lora is None:
            logits = self.model(ids, positions, kv, logits_indices)
        else:
            self.lora.bind([r.lora for r in plan.rows] or [-1] * len(plan.q_lens), plan.q_lens)
            try:
                logits = self.model(ids, positions, kv, logits_indices)
            finally:
                self.lora.clear()
        scored: dict[int, list[TokenLogprob]] = {}
        if scoring is not None:
            _, targets, owners = scoring
            ks = [plan.rows[i].params.prompt_logprobs for i, n in owners for _ in range(n)]
            entries = token_logprobs(logits[: len(targets)], targets.to(device), ks)
            logits, at = logits[len(targets) :], 0
            for i, n in owners:
                scored[i] = entries[at : at + n]
                at += n
        return logits, scored

    @staticmethod
    def _verify(
        plan: StepPlan, sampled: Sequence[int], ids: list[int], extra: torch.Tensor | None
    ) -> list[int | list[int]]:
        """``ids`` (the tokens sampled for rows ``sampled`` of ``plan``) with each row that has drafts
        given its tokens instead: the drafts the model confirms, then the model's own next token.

        ``extra`` holds the logits of those rows' draft positions, in row order. Only greedy rows
        draft (``astrai.batching``): the model's token at each position is the argmax, and draft
        ``m`` is confirmed while it equals the token the model gives at the position before it
        (drafts ``0 .. m - 1`` confirmed), the rule of vLLM's and SGLang's greedy verification.
        """
        if not plan.drafts or extra is None or not extra.shape[0]:
            return ids
        d = torch.tensor([plan.drafts[i] for i in sampled], dtype=torch.int64)
        has = d > 0
        rows, lens = has.nonzero()[:, 0], d[has]
        ends = torch.cumsum(torch.tensor(plan.q_lens, dtype=torch.int64), 0)[
            torch.tensor(sampled, dtype=torch.int64)
        ]
        drafted = torch.tensor(plan.input_ids, dtype=torch.int64)[_draft_positions(ends[has], lens)]
        width = int(lens.max())
        inside = torch.arange(width) < lens.unsqueeze(1)
        proposed = torch.full((len(lens), width), -1, dtype=torch.int64)
        proposed[inside] = drafted
        model = torch.full(
            (len(lens), width + 1), -2, dtype=torch.int64
        )  # the model's token at each position
        model[:, 0] = torch.tensor(ids, dtype=torch.int64)[rows]
        model[:, 1:][inside] = greedy_tokens(extra).cpu()
        confirmed = (model[:, :width] == proposed).cumprod(dim=1).sum(dim=1)
        out: list[int | list[int]] = list(ids)
        for row, n, tokens in zip(rows.tolist(), confirmed.tolist(), model.tolist(), strict=True):
            out[row] = tokens[: n + 1]
        return out

    def bind(self, kv: KVCache, choice: BackendChoice) -> None:
        """The step's attention backend for ``choice``, resolved once and prepared (``kv.backend``)."""
        kv.features = self._features
        bind_step(kv, self._query, choice)

    def sample(
        self, logits: torch.Tensor | None, sampled: Sequence[RowInput]
    ) -> tuple[list[int], list[TokenLogprob | None]]:
        """One token per row of ``logits`` (``[B, vocab]``, row i for ``sampled[i]``; ``None`` only when
        ``sampled`` is empty), vectorised, and the log-probs of the rows that asked (of the raw
        ``logits``: the pipeline does not modify them). A row with ``forced`` set gets that token
        (one indexed write for all of them), its log-probs those of that token."""
        if not sampled:
            return [], []
        params = [r.params for r in sampled]
        raw, logits = logits, self._constrain(logits, sampled, any(p.logprobs is not None for p in params))
        if all(p.plain_greedy for p in params):  # argmax, whatever the pipeline holds
            ids = greedy_tokens(logits)
        else:
            penalised = any(p.penalised for p in params)
            batch = SamplingBatch.from_params(
                params,
                [len(r.output_ids) for r in sampled],
                logits.device,
                [r.output_ids for r in sampled] if penalised else None,
                [r.prompt_ids for r in sampled] if any(p.repetition_penalty != 1.0 for p in params) else None,
                [self._banned(r) for r in sampled] if any(p.min_tokens for p in params) else None,
            )
            ids = self.pipeline.sample(logits, batch)
        forced = [(i, r.forced) for i, r in enumerate(sampled) if r.forced is not None]
        if forced:  # a thinking's forced end takes the sampled token's place (astrai.thinking)
            rows, tokens = zip(*forced, strict=True)
            ids[torch.tensor(rows, device=ids.device)] = torch.tensor(
                tokens, device=ids.device, dtype=ids.dtype
            )
        asked = [i for i, p in enumerate(params) if p.logprobs is not None]
        if not asked:
            return ids.tolist(), []
        rows = torch.tensor(asked, device=logits.device)
        entries = token_logprobs(
            raw.index_select(0, rows), ids.index_select(0, rows), [params[i].logprobs for i in asked]
        )
        out: list[TokenLogprob | None] = [None] * len(sampled)
        for i, entry in zip(asked, entries, strict=True):
            out[i] = entry
        return ids.tolist(), out

    @staticmethod
    def _constrain(logits: torch.Tensor, sampled: Sequence[RowInput], keep: bool) -> torch.Tensor:
        """``logits`` with each constrained row's disallowed tokens at -inf: every matcher fills its row of
        one bitmask, applied at once (in place, on a copy when ``keep``: log-probs read the raw logits)."""
        rows = [i for i, r in enumerate(sampled) if r.matcher is not None]
        if not rows:
            return logits
        backend = sampled[rows[0]].matcher.backend
        bitmask = backend.allocate_bitmask(len(sampled))
        for i in rows:
            sampled[i].matcher.fill_bitmask(bitmask, i)
        out = logits.clone() if keep else logits
        backend.apply_bitmask(out, bitmask, rows)
        return out

    def _banned(self, row: RowInput) -> tuple[int, ...]:
        """Tokens ``row`` may not sample yet: EOS (unless ignored) and its stop ids, before ``min_tokens``."""
        if len(row.output_ids) >= row.params.min_tokens:
            return ()
        return (*(() if row.params.ignore_eos else self.eos_token_ids), *row.params.stop_token_ids)

    def warm_up(self, choice: BackendChoice) -> None:
        """A two-token prefill and a decode step on a scratch one-row pool: weights a kernel packs
        on first use and per-model kernels are made now, not in the first request. A failure is
        logged (the requests will report it), never raised."""
        from astrai.kvcache import KVConfig, PagePool

        p = self.pool
        try:
            one_row = KVConfig(max_batch_size=1, max_seq_len=3)
            scratch = PagePool(p.n_layers, p.n_heads, p.n_kv_heads, p.head_dim, one_row, p.dtype, p.device)
            row = scratch.task_alloc()
            scratch.extend(row, 3)
            for ids, start in (([0, 0], 0), ([0], 2)):
                kv = scratch.bind_tasks([row], [len(ids)], [start + len(ids)])
                self.bind(kv, choice)
                positions = torch.arange(start, start + len(ids), device=p.device)
                self.model(
                    torch.tensor(ids, device=p.device),
                    positions,
                    kv,
                    torch.tensor([len(ids) - 1], device=p.device),
                )
        except Exception:
            logger.warning("warm-up forward failed (requests will report the error)", exc_info=True)


def _draft_positions(ends: torch.Tensor, drafts: torch.Tensor) -> torch.Tensor:
    """Flat token indices of the draft tokens of rows ending at ``ends`` (exclusive) with ``drafts``
    drafts each (the last ones of each row), in row order."""
    n = int(drafts.sum())
    first = torch.repeat_interleave(ends - drafts, drafts, output_size=n)
    return (
        first
        + torch.arange(n)
        - torch.repeat_interleave(torch.cumsum(drafts, 0) - drafts, drafts, output_size=n)
    )


def _scoring(plan: StepPlan) -> tuple[torch.Tensor, torch.Tensor, list[tuple[int, int]]] | None:
    """Flat token indices whose logits score a prompt token, those tokens, and ``(row, count)`` per
    scored row: the positions its chunk computes that no earlier step scored."""
    indices, targets, owners, offset = [], [], [], 0
    for i, (row, start, q, scored) in enumerate(
        zip(plan.rows, plan.starts, plan.q_lens, plan.scored, strict=True)
    ):
        lo, hi = max(start, row.scored), min(start + q, len(row.prompt_ids) - 1)
        if scored and hi > lo:  # position p's logits give the log-prob of prompt token p + 1
            indices.extend(range(offset + lo - start, offset + hi - start))
            targets.extend(row.prompt_ids[lo + 1 : hi + 1])
            owners.append((i, hi - lo))
        offset += q
    if not owners:
        return None
    return torch.tensor(indices, dtype=torch.int64), torch.tensor(targets, dtype=torch.int64), owners


def _split_drafts(plan: StepPlan, sampled: Sequence[int], extra: torch.Tensor) -> list[torch.Tensor]:
    """``extra`` (the draft positions' logits of rows ``sampled``, in row order) cut per row."""
    return list(extra.split([plan.drafts[i] if plan.drafts else 0 for i in sampled]))


def plan_rows(plan: StepPlan, keep: Sequence[int]) -> StepPlan:
    """The plan of the rows ``keep`` (ascending indices) of ``plan``: the same tokens at the same
    positions, nothing ``finished``."""
    ends = [0, *accumulate(plan.q_lens)]

    def pick(values: tuple) -> tuple:
        return tuple(values[i] for i in keep)

    return dataclasses.replace(
        plan,
        request_ids=pick(plan.request_ids),
        req_indices=pick(plan.req_indices),
        starts=pick(plan.starts),
        q_lens=pick(plan.q_lens),
        sample=pick(plan.sample),
        scored=pick(plan.scored) if plan.scored else (),
        input_ids=tuple(chain.from_iterable(plan.input_ids[ends[i] : ends[i + 1]] for i in keep)),
        finished=(),
        drafts=pick(plan.drafts) if plan.drafts and any(plan.drafts[i] for i in keep) else (),
        rows=pick(plan.rows) if plan.rows else (),
    )


def run_apart(
    items: list[int], attempt: Callable[[list[int]], dict[int, T]], error: Exception
) -> tuple[dict[int, T], dict[int, Exception]]:
    """Retry ``items``, which failed together with ``error``, in halves until every failure is one item's.

    ``attempt(part)`` returns a result per item of ``part`` or raises. Returns the results of the
    items that succeeded and the error of each item that failed alone (a lone item's failure is
    its own: it is not tried again). One culprit among n items costs about ``2 log2 n`` attempts.
    """
    if len(items) == 1:
        return {}, {items[0]: error}
    done: dict[int, T] = {}
    failed: dict[int, Exception] = {}
    mid = len(items) // 2
    for part in (items[:mid], items[mid:]):
        try:
            done.update(attempt(part))
        except Exception as exc:
            more, lost = run_apart(part, attempt, exc)
            done.update(more)
            failed.update(lost)
    return done, failed
