"""The batching policy: which requests run in the next step, and how many tokens each brings.

``BatchPolicy.schedule()`` decides a step and returns it as a ``StepPlan`` (``astrai.step``, with
what the runner may read of each row's request); the caller runs it (``astrai.runner.ModelRunner``)
and hands the ``StepResult`` to ``update()``, which alone changes the requests. A step is, in order:

1. cleanup: finished requests' materialized pages go into the radix, their KV is freed;
2. refill: waiting requests are admitted in order (arrival; or priority, then arrival), each
   resuming prefill after its longest cached prefix, when the pool has room for it and for the
   running requests to grow (the watermark below); one that does not fit now does not block the ones
   behind it, and one whose prompt is mostly a prefix that a running request is computing right now
   waits for those pages (recorded after every prefill chunk) instead of computing them twice;
3. decode rows: every decoding request brings its one token at its own position; when one
   cannot grow by a token the newest running request (of the lowest priority, when scheduling by
   priority, and of those preempted the fewest times) is preempted: its computed prefix is recorded,
   it requeues at the front and recomputes later without re-emitting text;
4. prefill rows: chunks of prefilling requests, in order, under ``max_prefill_tokens`` (less beside
   decode rows with ``prefill_step_ratio``: ``astrai.pacing``);
5. drafts (with a ``proposer``, ``astrai.speculative``): a greedy decode row may bring the
   tokens its n-gram proposer drafts after its own, on slots the pool has free (never evicting,
   never preempting, after the prefill rows took theirs), when the step is worth verifying;
   ``update`` keeps the drafts the model confirmed and gives back the slots of the others.

All rows run as one ragged batch; only rows that need a next token are sampled, and rows whose
request asked for prompt log-probs are scored at every position. Page arithmetic is the pool's
(``round_up``, ``grow``). Runs on the scheduler thread; no tensors.

The watermark (vLLM's admission watermark, SGLang's new-token ratio): a request is admitted
only if its whole (re)prefill, plus room for ``GROWTH_RESERVE`` of its remaining output, fits
in what the pool can give once every running request has the same room for its own growth
(its unprefilled prompt included: admissions of one step do not each count the same free
pages). Short of that, a pool of a few requests' size admitted every request whose prompt
fitted, then preempted them in turn as they grew (hundreds of preemptions for 32 requests on
a 2,000-token pool, one request preempted 29 times). The reserve is a share, not the whole
``max_tokens``: most answers end early, and a pool kept free for outputs that never come
runs fewer requests at once. A preempted request reserves all of its remaining output, so
it is readmitted only once it can run to its end alongside the running ones, and no request
that never ran is admitted before it.

Over 300 lines because the watermark's accounting (``_reserve``, ``_reserved``) belongs with
the admission and preemption it governs.
"""

from __future__ import annotations

import bisect
import logging
import math
import time
from collections import deque
from collections.abc import Callable, Container, Sequence
from itertools import chain
from typing import TYPE_CHECKING, Any

from astrai.errors import CapacityExceeded
from astrai.extension.backend.selection import AUTOMATIC
from astrai.pacing import StepPacer
from astrai.request import FinishReason, Request
from astrai.speculative import NgramState
from astrai.step import RowInput, StepPlan, StepResult

if TYPE_CHECKING:
    from astrai.config import EngineConfig
    from astrai.kvcache import PagePool
    from astrai.speculative import NgramProposer

logger = logging.getLogger(__name__)

#: Share of a running or admitted request's remaining output that admission keeps room for.
GROWTH_RESERVE = 0.3


class BatchPolicy:
    """The waiting queue, the running batch and every choice between them, over ``pool``.

    ``running`` and ``waiting`` are sorted by ``order``: arrival (``config.scheduling_policy``
    "fcfs"), or priority (a smaller ``Request.priority`` first), then arrival; in both, ahead of
    arrival, the request's index among those submitted together (``Request.sibling``: the choices
    of one HTTP request), so that a request of many choices is served round-robin with the others,
    not before them; under fcfs a request that was preempted orders before every one that never
    was. The last running request is preemption's first victim (under priority: the newest of the
    lowest priority). The pool's ``max_batch_size`` bounds the batch; ``config.max_prefill_tokens``
    the prefill tokens of one step. ``eos_token_ids`` end a request in ``update`` (unless it
    ignores EOS). ``proposer``: speculative drafts for greedy decode rows (None: none).
    """

    def __init__(
        self,
        pool: PagePool,
        config: EngineConfig | None = None,
        eos_token_ids: Container[int] = (),
        proposer: NgramProposer | None = None,
    ) -> None:
        from astrai.config import EngineConfig

        config = config or EngineConfig()
        if config.max_prefill_tokens < 1:
            raise ValueError(f"max_prefill_tokens must be >= 1, got {config.max_prefill_tokens}")
        self.pool = pool
        self.max_batch_size = pool.config.max_batch_size
        self.max_prefill_tokens = config.max_prefill_tokens
        self.pacer = StepPacer(config.max_prefill_tokens, config.prefill_step_ratio)
        self.eos_token_ids = eos_token_ids
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        # admitted: requests admitted for the first time (a preempted one is not counted again)
        self.counters = {
            "total_tokens": 0,
            "prefix_hit_tokens": 0,
            "preemptions": 0,
            "max_preemptions": 0,
            "admitted": 0,
        }
        # speculative decoding: rows verified with drafts, draft tokens, drafts the model confirmed
        self.counters.update(spec_drafts=0, spec_draft_tokens=0, spec_accepted_tokens=0)
        self.proposer = proposer
        self._free_epoch = 0  # bumped whenever pages are freed: a refused admission may now fit
        self._planned: list[Request] = []  # the requests of the last plan's rows, in order (update's)
        self.priority = config.scheduling_policy == "priority"
        self.order: Callable[[Request], Any] = _by_priority if self.priority else _by_arrival

    # ------------------------------------------------------------ the step
    def add(self, req: Request) -> None:
        """Queue ``req`` by ``order``: behind the waiting ones of its sibling index (under
        ``priority``: of its priority, then sibling index) or a smaller one, before those of a
        larger one."""
        self.waiting.insert(bisect.bisect_right(self.waiting, self.order(req), key=self.order), req)

    def schedule(self) -> StepPlan:
        """Cleanup, refill, decode rows, prefill rows: the next step (see the module doc).

        When no row can run, makes room instead: preempts the newest of several running
        requests, or fails a lone one that this pool can never grow (``CapacityExceeded``).
        """
        finished = self._cleanup()
        self._refill()
        # decode rows are planned first: running requests grow by their one token (preempting if
        # they must) before prefill chunks take pages; both then run in the same forward.
        decode = self._decode()
        prefill = self._prefill(self.pacer.budget(decoding=bool(decode)))
        decode_drafts = self._draft(decode, len(prefill))
        rows = [(req, q + len(d), s) for (req, q, s), d in zip(decode, decode_drafts, strict=True)] + prefill
        drafts = decode_drafts + [()] * len(prefill)
        if not rows:
            self._make_room()
        self._planned = reqs = [req for req, _, _ in rows]
        return StepPlan(
            request_ids=tuple(r.request_id for r in reqs),
            req_indices=tuple(r.req_idx for r in reqs),
            starts=tuple(r.num_computed for r in reqs),
            q_lens=tuple(q for _, q, _ in rows),
            sample=tuple(s for _, _, s in rows),
            input_ids=tuple(
                chain.from_iterable(
                    chain(r.tokens[r.num_computed : r.num_computed + q - len(d)], d)
                    for (r, q, _), d in zip(rows, drafts, strict=True)
                )
            ),
            scored=tuple(_scores(r) for r in reqs)
            if any(r.params.prompt_logprobs is not None for r in reqs)
            else (),
            backend=(reqs[0].backend or AUTOMATIC) if reqs else AUTOMATIC,
            finished=tuple(r.request_id for r in finished),
            drafts=tuple(map(len, drafts)) if any(drafts) else (),
            rows=tuple(
                RowInput(
                    r.params,
                    r.prompt_ids,
                    r.output_ids,
                    len(r.prompt_logprobs),
                    r.matcher,
                    r.thinking.forced if r.thinking is not None else None,
                    r.lora.slot if r.lora is not None else -1,
                )
                for r in reqs
            ),
        )

    def observe(self, plan: StepPlan, seconds: float) -> None:
        """How long ``plan`` took to run (the pacer's costs, ``astrai.pacing``)."""
        decode_rows = sum(1 for q, s in zip(plan.q_lens, plan.sample, strict=True) if q == 1 and s)
        self.pacer.observe(decode_rows, plan.num_tokens - decode_rows, seconds)

    def update(self, plan: StepPlan, result: StepResult) -> None:
        """Apply what the runner computed for ``plan`` (the last one scheduled) to its requests.

        A row that failed alone (``result.failed``) ends with its error (its KV is freed at the next
        cleanup, never recorded); the others advance as if it had not been there. Each row's
        computed positions count, its prompt log-probs join its request's, and a prefill chunk's
        complete pages enter the radix at once (a sharer may be waiting for them). A sampled row
        accepts its token; a row with drafts gives its tokens as a sequence (the confirmed drafts,
        then the model's own token): they are accepted in order until one ends the request, and
        the slots past the last accepted one go back to the pool (``_accept_run``). A request whose
        decoder or stream callback raises fails alone. A pooling model's row takes its vector
        instead of a token and ends (``StepResult.pooled``).
        """
        reqs = self._planned
        if len(reqs) != len(plan.request_ids):
            raise RuntimeError(f"update of a plan of {len(plan.request_ids)} rows; {len(reqs)} were planned")
        for n, (i, exc) in enumerate(sorted(result.failed.items())):
            logger.error(
                "request %s failed in a step of %d rows: %r",
                reqs[i].request_id,
                len(reqs),
                exc,
                exc_info=exc if n == 0 else None,
            )
            reqs[i].finish(FinishReason.ERROR, error=exc)
        drafts = plan.drafts or (0,) * len(reqs)
        sampled: list[tuple[Request, int]] = []
        for i, (req, q, d) in enumerate(zip(reqs, plan.q_lens, drafts, strict=True)):
            if i in result.failed:
                continue
            req.prompt_logprobs.extend(result.prompt_logprobs.get(i, ()))
            req.num_computed += q - d  # a row's drafts count once confirmed (_accept_run)
            if (
                q - d > 1
            ):  # a prefill chunk: its complete pages are reusable from now on (see _sharer_computing)
                self.pool.record(req.req_idx, req.tokens[: req.num_computed])
            if plan.sample[i] and i in result.pooled:  # a pooling model's row: its vector ends it
                req.pooled = result.pooled[i]
                req.finish(FinishReason.STOP)
            elif plan.sample[i]:
                sampled.append((req, d))
        self.counters["total_tokens"] += len(sampled)
        logprobs = result.logprobs or [None] * len(sampled)
        for (req, d), token, lp in zip(sampled, result.next_ids, logprobs, strict=True):
            try:
                if d:
                    self._accept_run(req, (token,) if isinstance(token, int) else token, d)
                else:
                    req.accept(token, self.eos_token_ids, lp)
            except Exception as exc:
                logger.exception("request %s failed", req.request_id)
                req.finish(FinishReason.ERROR, error=exc)

    def _accept_run(self, req: Request, tokens: Sequence[int], drafted: int) -> None:
        """Accept the tokens of a row that verified ``drafted`` drafts: ``tokens[:-1]`` are the drafts
        the model confirmed (their KV is right), ``tokens[-1]`` the model's own next token. Stops
        at the token that ends the request; the slots past its computed positions go back."""
        counters = self.counters
        counters["spec_drafts"] += 1
        counters["spec_draft_tokens"] += drafted
        counters["spec_accepted_tokens"] += len(tokens) - 1
        self.proposer.observe(req.spec, drafted, len(tokens) - 1)
        try:
            for n, token in enumerate(tokens):
                if n:  # the token before this one was a confirmed draft: its KV is computed
                    req.num_computed += 1
                    counters["total_tokens"] += 1
                req.accept(token, self.eos_token_ids)
                if req.finished:
                    break
        finally:  # the rejected drafts' positions (and pages only they used) go back;
            # the radix never saw them
            self.pool.truncate(req.req_idx, req.num_computed)

    def drain(self) -> list[Request]:
        """Every request in flight, running then waiting, with its KV released (not recorded)."""
        pending, self.running, self.waiting = [*self.running, *self.waiting], [], deque()
        for req in pending:
            try:
                self.release(req, record=False)
            except Exception:
                logger.exception("could not free request %s", req.request_id)
        return pending

    def release(self, req: Request, record: bool) -> None:
        """Free ``req``'s pool row; with ``record``, its materialized tokens enter the radix first."""
        if req.req_idx < 0:
            return
        idx, req.req_idx = req.req_idx, -1
        self._free_epoch += 1
        try:
            if record:  # excludes the last sampled token: it has not passed through the model
                self.pool.record(idx, req.tokens[: req.num_computed])
        finally:
            self.pool.task_free(idx)

    # ------------------------------------------------------------ phases
    def _cleanup(self) -> list[Request]:
        """Release the finished running requests (their materialized tokens recorded first)."""
        if not any(r.finished for r in self.running):
            return []
        done = [r for r in self.running if r.finished]
        self.running = [r for r in self.running if not r.finished]
        for req in done:
            self.release(req, record=req.finish_reason is not FinishReason.ERROR)
        return done

    def _refill(self) -> None:
        """Admit waiting requests in order; one that does not fit now does not block the rest, unless it
        was preempted: requests that never ran then wait behind it (a steady load would starve it)."""
        skipped: list[Request] = []
        reserved = -1  # slots the running requests will still take (the watermark), once needed
        held_back = False  # a preempted request waits for room: no request that never ran overtakes it
        while self.waiting and len(self.running) < self.max_batch_size:
            req = self.waiting.popleft()
            if held_back and not req.preemptions:  # preempted ones come first in the queue: the rest wait
                self.waiting.appendleft(req)
                break
            if self._sharer_computing(req):  # admitted next step, onto the sharer's recorded pages
                skipped.append(req)
                continue
            # one forward runs on one attention backend: a request that chose another waits
            mismatch = bool(self.running) and _backend_name(req) != _backend_name(self.running[0])
            if not mismatch and req.tried_epoch != self._free_epoch:
                reserved = self._reserved() if reserved < 0 else reserved
                need = self._admit(req, reserved)
                if need >= 0:
                    reserved += need
                    continue
            # the watermark only loosens when pages are freed: no retry before then
            req.tried_epoch = self._free_epoch
            skipped.append(req)
            held_back = held_back or (req.preemptions > 0 and not mismatch)
        self.waiting.extendleft(reversed(skipped))

    def _decode(self) -> list[tuple[Request, int, bool]]:
        """One row per decoding request; preempt the newest (``_victim``) when one cannot grow by a token."""
        rows = []
        for req in list(self.running):
            if req.req_idx < 0 or req.remaining != 1:
                continue
            while not self.pool.extend(req.req_idx, req.num_computed + 1):
                victim = self._victim(
                    self.running.index(req)
                )  # never a row already planned (those are older)
                self._preempt(victim)
                if victim is req:
                    break
            else:
                rows.append((req, 1, True))
        return rows

    def _draft(self, rows: list[tuple[Request, int, bool]], prefills: int) -> list[Sequence[int]]:
        """Per decode row, the drafts it brings (empty: none), their slots taken: greedy rows only
        (``_speculates``), no more than the request may still generate, on free slots, and only
        when the step is worth verifying (``NgramProposer.worth``; with ``prefills`` prefill rows
        the step leaves the pure-decode layout anyway)."""
        out: list[Sequence[int]] = [()] * len(rows)
        if self.proposer is None or not rows:
            return out
        proposer, pool, picked = self.proposer, self.pool, []
        for i, (req, _, _) in enumerate(rows):
            if not _speculates(req):
                continue
            limit = min(req.params.max_tokens - len(req.output_ids) - 1, pool.spare(req.req_idx))
            room = req.thinking.draft_room() if req.thinking is not None else None
            limit = limit if room is None else min(limit, room)  # drafts never cross a thinking budget
            if limit < 1:
                continue
            if req.spec is None:
                req.spec = NgramState()
            draft = proposer.propose(req.spec, req.tokens, limit)
            if draft:
                picked.append((i, draft))
        if not picked or not proposer.worth(
            len(rows), [(rows[i][0].spec, len(d)) for i, d in picked], prefills > 0
        ):
            return out
        for i, draft in picked:
            req = rows[i][0]
            draft = draft[: pool.spare(req.req_idx)]  # the free pages the rows before took
            if draft and pool.extend(req.req_idx, req.num_computed + 1 + len(draft)):
                out[i] = draft
        return out

    def _prefill(self, budget: int) -> list[tuple[Request, int, bool]]:
        """Chunks of prefilling requests, oldest first, under ``budget`` tokens (``max_prefill_tokens``,
        or less beside decoding requests: ``StepPacer``)."""
        rows = []
        for req in self.running:
            if budget <= 0:
                break
            if req.remaining <= 1:
                continue
            end = self.pool.grow(req.req_idx, req.num_computed + min(req.remaining, budget))
            if end > req.num_computed:
                rows.append((req, end - req.num_computed, end == len(req.tokens)))
                budget -= end - req.num_computed
        return rows

    def _make_room(self) -> None:
        """Nothing could progress: preempt the newest (``_victim``), or fail a lone request this
        pool cannot grow."""
        if len(self.running) > 1:
            self._preempt(self._victim())
        elif self.running:
            req = self.running[0]
            req.finish(FinishReason.ERROR, error=CapacityExceeded(f"request {req.request_id} cannot grow"))

    # ------------------------------------------------------------ decisions
    def _admit(self, req: Request, reserved: int) -> int:
        """Give ``req`` a row and its cached prefix if its reserve fits the pool beside ``reserved``
        (the running requests' reserves); returns the slots it reserves, or -1 when it waits.

        A lone request is always admitted: nothing else can make room for it.
        """
        idx = self.pool.task_alloc()
        # prompt log-probs need the logits of every position not scored yet: those are not taken
        # from the cache
        scored = (
            req.tokens if req.params.prompt_logprobs is None else req.tokens[: len(req.prompt_logprobs) + 1]
        )
        hit = self.pool.match_prefix(idx, scored, req.cache_namespace)
        # the whole (re)prefill, its first decode and a share of its output, less the cached pages
        # (a hit's slots: its pages, as few as a windowed layer keeps of them)
        need = max(self._reserve(req) - self.pool.round_up(hit), 0)
        if self.running and need + reserved > self.pool.available_tokens():
            self.pool.task_free(idx)  # only drops the references match_prefix took
            return -1
        req.req_idx, req.num_computed = idx, hit
        self.counters["prefix_hit_tokens"] += hit
        if req.cached_tokens < 0:  # first admission: what the client waited for and what the cache saved
            req.admitted_at, req.cached_tokens = time.perf_counter(), min(hit, len(req.prompt_ids))
            self.counters["admitted"] += 1
        bisect.insort(self.running, req, key=self.order)
        return need

    def _reserve(self, req: Request) -> int:
        """Slots ``req`` is planned to hold: its tokens, its next decode and a share of the rest of
        its output (``GROWTH_RESERVE``, or all of it once preempted), in whole pages."""
        # the last token sampled never passes through the model: at most max_tokens - 1 more positions
        rest = max(req.params.max_tokens - len(req.output_ids) - 1, 0)
        share = 1.0 if req.preemptions else GROWTH_RESERVE
        return self.pool.round_up(len(req.tokens) + max(1, math.ceil(share * rest)))

    def _reserved(self) -> int:
        """Slots the running requests are still planned to take beyond those they hold (the watermark)."""
        held = (self.pool.round_up(self.pool.req_len(r.req_idx)) for r in self.running if r.req_idx >= 0)
        planned = (self._reserve(r) for r in self.running if r.req_idx >= 0)
        return sum(max(p - h, 0) for p, h in zip(planned, held, strict=True))

    def _sharer_computing(self, req: Request) -> bool:
        """Whether a running request is still computing complete pages of at least half of ``req``'s prompt.

        Admitting ``req`` once they are recorded makes them a cache hit; admitting it now would
        compute them twice (SGLang's in-batch prefix caching does the same). A shorter shared
        head (a chat template's default system prompt) is not worth a step of waiting.
        """
        if self.pool.radix is None:
            return False
        for other in self.running:
            if other.remaining <= 1 or other.cache_namespace != req.cache_namespace:
                continue  # decoding (its prompt's pages are recorded already), or pages req may not reuse
            shared = self.pool.common_pages(req.tokens, other.tokens) * self.pool.page_size
            if 2 * shared >= len(req.tokens) and other.num_computed < shared:
                return True
        return False

    def _victim(self, first: int = 0) -> Request:
        """The newest of the running requests from ``first`` on, among those preempted the fewest times.

        The newest has the least work to lose. A preempted request comes back while older ones may
        still outgrow their reserves: as the newest it would be their victim again and again.
        """
        candidates = self.running[first:]
        if self.priority:  # the lowest priority (the largest value) goes first
            worst = max(r.priority for r in candidates)
            candidates = [r for r in candidates if r.priority == worst]
        fewest = min(r.preemptions for r in candidates)
        return next(r for r in reversed(candidates) if r.preemptions == fewest)

    def _preempt(self, req: Request) -> None:
        """Free ``req``'s pages (materialized prefix recorded first) and requeue it at the front."""
        logger.info("preempting request %s at %d tokens", req.request_id, req.num_computed)
        self.release(req, record=True)
        req.num_computed = 0
        req.preemptions += 1
        self.running.remove(req)
        # fcfs: at the front (a preempted request orders before those that never ran); priority: first
        # among those of its priority and sibling index (it arrived before those waiting)
        self.waiting.insert(bisect.bisect_left(self.waiting, self.order(req), key=self.order), req)
        self.counters["preemptions"] += 1
        self.counters["max_preemptions"] = max(self.counters["max_preemptions"], req.preemptions)


def _speculates(req: Request) -> bool:
    """Drafts are verified for ``req``: its next token is the argmax of the model's raw logits and
    it asks for no log-probs, so the tokens a verification confirms are exactly decoding's."""
    return req.params.plain_greedy and req.params.logprobs is None and req.matcher is None


def _scores(req: Request) -> bool:
    return req.params.prompt_logprobs is not None and len(req.prompt_logprobs) < len(req.prompt_ids) - 1


def _backend_name(req: Request) -> str | None:
    return req.backend.name if req.backend is not None else None


def _by_arrival(req: Request) -> tuple[bool, int, int]:
    return req.preemptions == 0, req.sibling, req.arrival


def _by_priority(req: Request) -> tuple[int, int, int]:
    return req.priority, req.sibling, req.arrival
