"""Continuous batching: a daemon thread that runs one ragged model forward per step.

Each step runs the spec's four phases. ``_cleanup`` records finished requests'
materialized pages into the radix and frees them; ``_refill`` admits waiting
requests (resuming prefill after their longest cached prefix; one whose prompt is
mostly a prefix that a running request is computing right now waits for those
pages, recorded after every prefill chunk, instead of computing them twice); ``_decode`` and
``_prefill`` plan this step's rows: every decoding request brings one token at
its own position, prefilling requests bring chunks under ``max_prefill_tokens``.
All rows go through the model as ONE flattened ragged batch, and only the rows
that need a next token are sampled, once, for the whole batch.

Every piece of scheduler state is mutated on the scheduler thread only; other
threads talk to it through ``submit``/``abort``, which post to an inbox.
"""

from __future__ import annotations

import bisect
import contextlib
import logging
import queue
import threading
import time
from collections import deque
from itertools import chain, count
from typing import TYPE_CHECKING

import torch

from astrai.errors import CapacityExceeded, EngineNotReady, RequestRejected
from astrai.extension import attn_backend
from astrai.request import FinishReason, Request
from astrai.sampling import SamplingBatch, SamplingPipeline

if TYPE_CHECKING:
    from collections.abc import Callable, Iterable

    from astrai.kvcache import PagePool

logger = logging.getLogger(__name__)

_STOP = object()  # inbox message: leave the loop
Row = tuple[Request, int, bool]  # (request, q_len, sample its last row)


class InferenceScheduler:
    """Owns the waiting queue, the running batch and the pool; drives ``model`` on its thread.

    ``model(input_ids [T], positions [T], kv_cache, logits_indices [B]) -> [B, vocab] f32``.
    A failing step fails only the requests in it; a failing loop fails everyone
    and leaves ``healthy`` False with ``reason`` set. ``pipeline.prepare`` admits each
    request's sampling parameters in ``submit``. ``on_finished(request)`` runs on the
    scheduler thread after each request's result is delivered: it must be cheap (hand
    the request over to another thread) and must not raise (it is logged if it does).
    """

    def __init__(
        self,
        model: torch.nn.Module,
        pool: PagePool,
        max_prefill_tokens: int = 2048,
        eos_token_ids: Iterable[int] = (),
        pipeline: SamplingPipeline | None = None,
        backend: str | None = None,
        on_finished: Callable[[Request], None] | None = None,
    ) -> None:
        if max_prefill_tokens < 1:
            raise ValueError(f"max_prefill_tokens must be >= 1, got {max_prefill_tokens}")
        self.model, self.pool = model, pool
        self.max_batch_size = pool.config.max_batch_size
        self.max_prefill_tokens = max_prefill_tokens
        self.eos_token_ids = frozenset(eos_token_ids)
        self.pipeline = pipeline or SamplingPipeline.default()
        self.backend = backend  # attention backend for requests that did not choose one
        self.on_finished = on_finished  # after a request's result is delivered; cheap, on this thread
        self.vocab_size: int | None = getattr(getattr(model, "config", None), "vocab_size", None)
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []  # sorted by arrival: the last one is the newest
        self.counters = {"total_tasks": 0, "total_tokens": 0, "prefix_hit_tokens": 0, "preemptions": 0}
        self.reason: str | None = None  # why the scheduler is not healthy
        self.iterations = 0  # loop iterations run (an idle loop adds none)
        self._by_id: dict[str, Request] = {}
        self._inbox: queue.SimpleQueue = queue.SimpleQueue()
        self._lock = threading.Lock()  # orders submit() against the loop's shutdown
        self._accepting = True
        self._arrivals = count()
        self._free_epoch = 0  # bumped whenever pages are freed: a refused admission may now fit
        self._stats: dict = {}
        self._thread = threading.Thread(target=self._run, name="astrai-scheduler", daemon=True)
        self._warm: threading.Event | None = None  # set once the warm-up forward ran (start(warm_up=True))

    # ------------------------------------------------------------ other threads
    def start(self, warm_up: bool = False) -> None:
        """Start the loop thread; with ``warm_up``, return once a warm-up forward ran on it."""
        self._publish_stats()
        self._warm = threading.Event() if warm_up else None
        self._thread.start()
        if self._warm is not None:
            self._warm.wait()

    @property
    def healthy(self) -> bool:
        return self.reason is None and self._thread.is_alive()

    def submit(self, req: Request) -> None:
        """Queue ``req``; raises RequestRejected if it can never fit, EngineNotReady if stopped."""
        n, limit = len(req.prompt_ids) + req.params.max_tokens, min(self.pool.max_ctx_len, self.pool.size)
        if not req.prompt_ids:
            raise RequestRejected("empty prompt: at least one token is needed")
        req.params = self.pipeline.prepare(req.params, self.vocab_size)
        if not self.pool.can_ever_fit(n):
            raise RequestRejected(
                f"prompt of {len(req.prompt_ids)} tokens + max_tokens {req.params.max_tokens} = {n} tokens "
                f"exceeds the limit of {limit} tokens (max_seq_len {self.pool.max_ctx_len}, "
                f"KV pool {self.pool.size} slots)"
            )
        with self._lock:
            if not self._accepting:
                raise EngineNotReady(f"scheduler is not running: {self.reason}")
            req.arrival = next(self._arrivals)
            self.counters["total_tasks"] += 1
            self._inbox.put(req)

    def abort(self, request_id: str) -> None:
        """Ask the loop to end ``request_id`` (finish reason "abort"); unknown ids are ignored."""
        self._inbox.put(request_id)

    def stop(self) -> None:
        """Fail pending requests with EngineNotReady and join the thread; idempotent."""
        with self._lock:
            if self._accepting:
                self._accepting = False
                self._inbox.put(_STOP)
        if self._thread.ident is None:  # never started: nobody else will fail the pending requests
            self.reason = "shut down"
            self._fail_all(EngineNotReady("engine shut down"))
        elif threading.current_thread() is not self._thread:
            self._thread.join()

    def stats(self) -> dict:
        """A snapshot taken by the loop after its last step (never reads live state)."""
        return {**self._stats, "total_tasks": self.counters["total_tasks"]}

    # ------------------------------------------------------------ the loop
    def step(self, block: bool = False) -> bool:
        """One loop iteration; False once stopped. Runs on the scheduler thread, or in a
        test's thread on a scheduler that was never started. ``block``: wait on the
        inbox while there is nothing to do (the thread never busy-spins)."""
        if not self._receive(block and not self.running and not self.waiting):
            return False
        self._cleanup()
        self._refill()
        # decode rows are planned first: running requests grow by their one token (preempting if
        # they must) before prefill chunks take pages; both then run in the same single forward.
        self._execute(self._decode() + self._prefill())
        self.iterations += 1
        self._publish_stats()
        return True

    def _run(self) -> None:
        try:
            with torch.inference_mode():
                if self._warm is not None:
                    self._warm_up()
                while self.step(block=True):
                    pass
            self.reason = "shut down"
            self._fail_all(EngineNotReady("engine shut down"))
        except BaseException as exc:  # the loop itself broke: nobody may wait forever
            logger.exception("scheduler loop died")
            self.reason = f"scheduler loop died: {type(exc).__name__}: {exc}"
            self._fail_all(EngineNotReady(self.reason))
        self._publish_stats()

    def _warm_up(self) -> None:
        """A two-token prefill and a decode step on a scratch one-row pool, on this thread (where
        the model runs: see astrai.cpu_tuning): weights a kernel packs on first use and per-model
        kernels are made now, not in the first request. A failure is logged; requests report it."""
        from astrai.kvcache import KVConfig, PagePool

        p = self.pool
        try:
            scratch = PagePool(p.n_layers, p.n_heads, p.n_kv_heads, p.head_dim, KVConfig(max_batch_size=1, max_seq_len=3),
                               p.dtype, p.device)  # fmt: skip
            row = scratch.task_alloc()
            scratch.extend(row, 3)
            with attn_backend(self.backend) if self.backend else contextlib.nullcontext():
                for ids, start in (([0, 0], 0), ([0], 2)):
                    kv = scratch.bind_tasks([row], [len(ids)], [start + len(ids)])
                    positions = torch.arange(start, start + len(ids), device=p.device)
                    self.model(torch.tensor(ids, device=p.device), positions, kv, torch.tensor([len(ids) - 1], device=p.device))
        except Exception:
            logger.warning("warm-up forward failed (requests will report the error)", exc_info=True)
        finally:
            self._warm.set()

    def _receive(self, block: bool) -> bool:
        """Drain the inbox (waiting for a first message if ``block``); False on stop."""
        while True:
            try:
                msg = self._inbox.get(block=block)
            except queue.Empty:
                return True
            block = False
            if msg is _STOP:
                return False
            if isinstance(msg, Request):
                self._by_id[msg.request_id] = msg
                self.waiting.append(msg)
            else:
                self._abort(msg)

    def _cleanup(self) -> None:
        """Record finished requests' materialized tokens, free their KV, then tell their callers."""
        if not any(r.finished for r in self.running):
            return
        done = [r for r in self.running if r.finished]
        self.running = [r for r in self.running if not r.finished]
        for req in done:
            self._release(req, record=req.finish_reason is not FinishReason.ERROR)
            self._complete(req)

    def _refill(self) -> None:
        """Admit waiting requests in order; one that does not fit now does not block the rest."""
        skipped: list[Request] = []
        while self.waiting and len(self.running) < self.max_batch_size:
            req = self.waiting.popleft()
            if self._sharer_computing(req):  # admitted next step, onto the sharer's recorded pages
                skipped.append(req)
                continue
            # one forward runs under one attention backend: a request that chose another waits
            mismatch = bool(self.running) and req.backend != self.running[0].backend
            if mismatch or req.tried_epoch == self._free_epoch or not self._admit(req):
                req.tried_epoch = self._free_epoch
                skipped.append(req)
        self.waiting.extendleft(reversed(skipped))

    def _decode(self) -> list[Row]:
        """One row per decoding request; preempt the newest when one cannot grow by a token."""
        rows: list[Row] = []
        for req in list(self.running):
            if req.req_idx < 0 or req.remaining != 1:
                continue
            while not self.pool.extend(req.req_idx, req.num_computed + 1):
                victim = self.running[-1]  # newest; never a row already planned (those are older)
                self._preempt(victim)
                if victim is req:
                    break
            else:
                rows.append((req, 1, True))
        return rows

    def _prefill(self) -> list[Row]:
        """Chunks of prefilling requests, oldest first, under the ``max_prefill_tokens`` budget."""
        rows: list[Row] = []
        budget = self.max_prefill_tokens
        for req in self.running:
            if budget <= 0:
                break
            if req.remaining <= 1:
                continue
            end = self._grow(req, req.num_computed + min(req.remaining, budget))
            if end > req.num_computed:
                rows.append((req, end - req.num_computed, end == len(req.tokens)))
                budget -= end - req.num_computed
        return rows

    def _execute(self, rows: list[Row]) -> None:
        """Run the planned rows as one forward, sample, and advance each request."""
        if not rows:
            if len(self.running) > 1:  # nothing could progress: make room
                self._preempt(self.running[-1])
            elif self.running:  # alone and still unable to grow: this pool cannot serve it
                req = self.running[0]
                req.finish(FinishReason.ERROR, error=CapacityExceeded(f"request {req.request_id} cannot grow"))
            return
        reqs = [r for r, _, _ in rows]
        q_lens = [q for _, q, _ in rows]
        sampled = [r for r, _, s in rows if s]
        try:
            next_ids = self._forward(rows, sampled)
        except Exception as exc:
            logger.exception("step of %d requests failed", len(reqs))
            for req in reqs:
                req.finish(FinishReason.ERROR, error=exc)
            return
        for req, q in zip(reqs, q_lens, strict=True):
            req.num_computed += q
            if q > 1:  # a prefill chunk: its complete pages are reusable from now on (see _sharer_computing)
                self.pool.record(req.req_idx, req.tokens[: req.num_computed])
        self.counters["total_tokens"] += len(sampled)
        for req, token in zip(sampled, next_ids, strict=True):
            try:
                req.accept(token, self.eos_token_ids)
            except Exception as exc:  # a decoder or stream callback failed: only this request ends
                logger.exception("request %s failed", req.request_id)
                req.finish(FinishReason.ERROR, error=exc)

    # ------------------------------------------------------------ helpers
    def _forward(self, rows: list[Row], sampled: list[Request]) -> list[int]:
        """Build the flattened batch with tensor ops, run the model, sample the wanted rows."""
        device = self.pool.device
        if len(sampled) == len(rows) and all(q == 1 for _, q, _ in rows):  # decode: host lists are cheaper
            reqs = [r for r, _, _ in rows]
            host = torch.tensor([[r.tokens[r.num_computed] for r in reqs], [r.num_computed for r in reqs]])
            ids, positions = host.to(device)
            logits_indices = torch.arange(len(reqs), device=device)
            kv = self.pool.bind_tasks([r.req_idx for r in reqs], [1] * len(reqs), [r.num_computed + 1 for r in reqs])
        else:
            q_t = torch.tensor([q for _, q, _ in rows], dtype=torch.int64)
            starts = torch.tensor([r.num_computed for r, _, _ in rows], dtype=torch.int64)
            ends = torch.cumsum(q_t, 0)
            t = int(ends[-1])
            ids = list(chain.from_iterable(r.tokens[r.num_computed : r.num_computed + q] for r, q, _ in rows))
            ids = torch.tensor(ids, dtype=torch.int64, device=device)
            positions = (torch.arange(t) + torch.repeat_interleave(starts - (ends - q_t), q_t, output_size=t)).to(device)
            logits_indices = (ends - 1)[torch.tensor([s for _, _, s in rows], dtype=torch.bool)].to(device)
            kv = self.pool.bind_tasks([r.req_idx for r, _, _ in rows], q_t.tolist(), (starts + q_t).tolist())
        backend = rows[0][0].backend or self.backend
        with attn_backend(backend) if backend else contextlib.nullcontext():
            logits = self.model(ids, positions, kv, logits_indices)
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

    def _admit(self, req: Request) -> bool:
        """Give ``req`` a row and its cached prefix, if its uncached tokens fit the pool now."""
        idx = self.pool.task_alloc()
        hit = self.pool.match_prefix(idx, req.tokens)
        need = self._round_up(len(req.tokens) + 1) - hit  # the whole (re)prefill plus its first decode
        # keep a page of headroom per running request, so admitting does not force a preemption next step
        headroom = len(self.running) * self._round_up(1)
        if self.running and need + headroom > self.pool.available_tokens():
            self.pool.task_free(idx)  # only drops the references match_prefix took
            return False
        req.req_idx, req.num_computed = idx, hit
        self.counters["prefix_hit_tokens"] += hit
        if req.cached_tokens < 0:  # first admission: what the client waited for and what the cache saved
            req.admitted_at, req.cached_tokens = time.perf_counter(), min(hit, len(req.prompt_ids))
        bisect.insort(self.running, req, key=lambda r: r.arrival)
        return True

    def _sharer_computing(self, req: Request) -> bool:
        """Whether a running request is still computing complete pages of at least half of ``req``'s prompt.

        Admitting ``req`` once they are recorded makes them a cache hit; admitting it now would
        compute them twice (SGLang's in-batch prefix caching does the same). A shorter shared
        head (a chat template's default system prompt) is not worth a step of waiting.
        """
        if self.pool.radix is None:
            return False
        page = self.pool.page_size
        for other in self.running:
            if other.remaining <= 1:  # decoding: its prompt's pages are recorded already
                continue
            shared = _common_pages(req.tokens, other.tokens, page) * page
            if 2 * shared >= len(req.tokens) and other.num_computed < shared:
                return True
        return False

    def _grow(self, req: Request, want: int) -> int:
        """Extend ``req`` towards ``want`` positions; returns the end it could get (all-or-part)."""
        if self.pool.extend(req.req_idx, want):
            return want
        have = self._round_up(self.pool.req_len(req.req_idx))
        cap = min(want, have + self.pool.available_tokens())
        return cap if cap > req.num_computed and self.pool.extend(req.req_idx, cap) else req.num_computed

    def _round_up(self, n: int) -> int:
        ps = self.pool.page_size if self.pool.paged else 1
        return -(-n // ps) * ps

    def _preempt(self, req: Request) -> None:
        """Free ``req``'s pages (materialized prefix recorded first) and requeue it at the front."""
        logger.info("preempting request %s at %d tokens", req.request_id, req.num_computed)
        self._release(req, record=True)
        req.num_computed = 0
        self.running.remove(req)
        self.waiting.appendleft(req)
        self.counters["preemptions"] += 1

    def _release(self, req: Request, record: bool) -> None:
        if req.req_idx < 0:
            return
        idx, req.req_idx = req.req_idx, -1
        self._free_epoch += 1
        try:
            if record:  # excludes the last sampled token: it has not passed through the model
                self.pool.record(idx, req.tokens[: req.num_computed])
        finally:
            self.pool.task_free(idx)

    def _complete(self, req: Request) -> None:
        self._by_id.pop(req.request_id, None)
        try:
            req.sink.deliver_final(req)
            if self.on_finished is not None:
                self.on_finished(req)
        except Exception:
            logger.exception("completion callback of %s failed", req.request_id)

    def _abort(self, request_id: str) -> None:
        req = self._by_id.get(request_id)
        if req is None or req.finished:
            return
        req.finish(FinishReason.ABORT)
        if req.req_idx < 0:  # waiting: holds no KV, answer now; running ones go through _cleanup
            self.waiting.remove(req)
            self._complete(req)

    def _fail_all(self, error: Exception) -> None:
        """Stop accepting, then end every request in flight with ``error`` and free its KV."""
        with self._lock:
            self._accepting = False
        self._receive(block=False)  # queued submissions join the waiting list; a stop message ends it
        pending, self.running, self.waiting = [*self.running, *self.waiting], [], deque()
        for req in pending:
            req.finish(FinishReason.ERROR, error=error)
            try:
                self._release(req, record=False)
            except Exception:
                logger.exception("could not free request %s", req.request_id)
            self._complete(req)

    def _publish_stats(self) -> None:
        self._stats = {
            "total_tokens": self.counters["total_tokens"],
            "active_tasks": len(self.running),
            "waiting_queue": len(self.waiting),
            **self.pool.stats(),
            "prefix_hit_tokens": self.counters["prefix_hit_tokens"],
            "preemptions": self.counters["preemptions"],
        }


def _common_pages(a: list[int], b: list[int], page: int) -> int:
    """Complete pages that ``a[:-1]`` (what a prefix match may cover) and ``b`` share from the start."""
    lo, hi = 0, min(len(a) - 1, len(b)) // page
    while lo < hi:  # binary search on slice equality: C-speed comparisons, log(pages) of them
        mid = (lo + hi + 1) // 2
        if a[: mid * page] == b[: mid * page]:
            lo = mid
        else:
            hi = mid - 1
    return lo
