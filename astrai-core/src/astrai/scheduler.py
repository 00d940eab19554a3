"""Continuous batching: a daemon thread that runs one ragged model forward per step.

``InferenceScheduler`` owns the thread, the inbox, the lifecycle and the stats. Each step is
three calls on the data of ``astrai.step``: the batching policy decides it
(``BatchPolicy.schedule`` -> a ``StepPlan``), the model runner runs it (``ModelRunner.run`` ->
a ``StepResult``; a row that fails alone is reported in it, the others are unaffected), and the
policy applies it to the requests (``BatchPolicy.update``). A failing loop fails everyone.

Every piece of scheduler state is mutated on the scheduler thread only; other threads talk
to it through ``submit``/``abort``, which post to an inbox. ``submit`` is also where load is
shed (a bounded queue) and ``_expire`` where waiting too long ends a request.

Over 300 lines because load shedding (the queue bound and timeout) belongs with the inbox and
the lifecycle that count what is queued.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from itertools import count
from typing import TYPE_CHECKING

import torch

from astrai.batching import BatchPolicy
from astrai.cpu_tuning import release_openmp_team
from astrai.errors import EngineNotReady, Overloaded, RequestRejected
from astrai.extension.backend.policy import requested_backend
from astrai.request import FinishReason, Request
from astrai.runner import ModelRunner
from astrai.sampling import SamplingPipeline
from astrai.speculative import NgramProposer

if TYPE_CHECKING:
    from collections.abc import Callable, Iterable

    from astrai.config import EngineConfig
    from astrai.kvcache import PagePool

logger = logging.getLogger(__name__)

_STOP = object()  # inbox message: leave the loop


class InferenceScheduler:
    """Drives ``model`` over ``pool`` on its thread: ``policy`` decides each step, ``runner`` runs it.

    ``model(input_ids [T], positions [T], kv_cache, logits_indices [B]) -> [B, vocab] f32``.
    A failing step fails only the requests that fail in it alone (its rows are retried apart);
    a failing loop fails everyone and leaves ``healthy`` False with ``reason`` set. ``submit``
    checks each request once against the model (vocabulary: the prompt's ids and, through
    ``pipeline.prepare``, the sampling ids and ``top_k``) and the pool (context), and records its
    attention-backend choice (``config.attention_backend``: the default for requests that made none).
    ``on_finished(request)`` runs on the scheduler thread after each request's result is
    delivered: it must be cheap (hand the request over to another thread) and must not
    raise (it is logged if it does).

    Load shedding: ``submit`` raises ``Overloaded`` while ``config.max_queued_requests`` requests wait
    for their first admission; a request that waited ``config.queue_timeout`` seconds without one
    ends with ``Overloaded``. Under ``config.scheduling_policy`` "priority" the policy orders by
    ``Request.priority``; otherwise a request that sets one is refused (as vLLM does under fcfs).

    ``proposer``: n-gram speculative decoding for greedy requests (``astrai.speculative``; None: off).
    """

    def __init__(
        self,
        model: torch.nn.Module,
        pool: PagePool,
        config: EngineConfig | None = None,
        eos_token_ids: Iterable[int] = (),
        pipeline: SamplingPipeline | None = None,
        on_finished: Callable[[Request], None] | None = None,
        proposer: NgramProposer | None = None,
    ) -> None:
        from astrai.config import EngineConfig

        config = config or EngineConfig()
        self.pool = pool
        self.policy = BatchPolicy(pool, config, frozenset(eos_token_ids), proposer=proposer)
        self.max_queued, self.queue_timeout = config.max_queued_requests, config.queue_timeout
        self.runner = ModelRunner(model, pool, pipeline, self.policy.eos_token_ids)
        self.backend = config.attention_backend  # attention backend for requests that did not choose one
        self.on_finished = on_finished  # after a request's result is delivered; cheap, on this thread
        self.vocab_size: int | None = getattr(getattr(model, "config", None), "vocab_size", None)
        self.reason: str | None = None  # why the scheduler is not healthy
        self.iterations = 0  # loop iterations run (an idle loop adds none)
        self._total_tasks = 0
        self._dropped = 0  # requests that ended before their first admission (scheduler thread)
        self._live: set[str] = set()  # ids submitted and not yet completed (under _lock)
        self._next_expiry = 0.0  # perf_counter time of the next queue-timeout scan
        self._by_id: dict[str, Request] = {}
        self._inbox: queue.SimpleQueue = queue.SimpleQueue()
        self._lock = threading.Lock()  # orders submit() against the loop's shutdown
        self._accepting = True
        self._arrivals = count()
        self._stats: dict = {}
        self._thread = threading.Thread(target=self._run, name="astrai-scheduler", daemon=True)
        self._warm: threading.Event | None = None  # set once the warm-up forward ran (start(warm_up=True))

    @property
    def running(self) -> list[Request]:
        return self.policy.running

    @property
    def waiting(self) -> list[Request]:
        return list(self.policy.waiting)

    @property
    def counters(self) -> dict[str, int]:
        return {"total_tasks": self._total_tasks, **self.policy.counters}

    # ------------------------------------------------------------ other threads
    def start(self, warm_up: bool = False) -> None:
        """Start the loop thread; with ``warm_up``, return once a warm-up forward ran on it."""
        release_openmp_team()  # this thread's team would throttle the loop's (astrai.cpu_tuning)
        self._publish_stats()
        self._warm = threading.Event() if warm_up else None
        self._thread.start()
        if self._warm is not None:
            self._warm.wait()

    @property
    def healthy(self) -> bool:
        return self.reason is None and self._thread.is_alive()

    def submit(self, req: Request) -> None:
        """Queue ``req``; raises RequestRejected if it can never fit, EngineNotReady if stopped.

        The checks that depend on the model and the pool run here, once per request. The
        attention-backend choice in force on the calling thread is kept with the request. The
        calling thread hands back any OpenMP team it formed since (``astrai.cpu_tuning``).
        """
        release_openmp_team()
        if not req.prompt_ids:
            raise RequestRejected("empty prompt: at least one token is needed", param="prompt")
        if (
            self.vocab_size is not None
            and not 0 <= min(req.prompt_ids) <= max(req.prompt_ids) < self.vocab_size
        ):
            raise RequestRejected(f"prompt token ids must be in [0, {self.vocab_size})", param="prompt")
        req.params = self.runner.pipeline.prepare(req.params, self.vocab_size)
        n = len(req.prompt_ids) + req.params.max_tokens
        if not self.pool.can_ever_fit(n):
            raise RequestRejected(
                f"prompt of {len(req.prompt_ids)} tokens + max_tokens {req.params.max_tokens} = {n} tokens "
                f"exceeds the limit of {self.pool.context_limit} tokens "
                f"(max_seq_len {self.pool.max_ctx_len}, "
                f"KV pool {self.pool.size} slots)"
            )
        if req.priority and not self.policy.priority:
            raise RequestRejected(
                "priority is only honoured with the 'priority' scheduling policy "
                "(astrai serve --scheduling-policy priority)",
                param="priority",
            )
        if req.backend is None:
            req.backend = requested_backend(self.backend)
        with self._lock:
            if not self._accepting:
                raise EngineNotReady(f"scheduler is not running: {self.reason}")
            if req.request_id in self._live:
                raise RequestRejected(
                    f"request id {req.request_id!r} is in flight already", param="request_id"
                )
            if self.max_queued is not None and self.queued >= self.max_queued:
                raise Overloaded(
                    f"the server is overloaded: {self.queued} requests are waiting already; retry later"
                )
            self._live.add(req.request_id)
            req.arrival = next(self._arrivals)
            self._total_tasks += 1
            self._inbox.put(req)

    def check_room(self, count: int) -> None:
        """Overloaded when ``count`` more requests would pass ``max_queued`` (a fan-out is refused whole,
        before any of it is submitted); each ``submit`` still checks its own."""
        if self.max_queued is not None and self.queued + count > self.max_queued:
            raise Overloaded(
                f"the server is overloaded: {self.queued} requests are waiting "
                f"and this one brings {count} more "
                f"(at most {self.max_queued} may wait); retry later"
            )

    def abort(self, request_id: str) -> None:
        """Ask the loop to end ``request_id`` (finish reason "abort"); unknown ids are ignored."""
        self._inbox.put(request_id)

    def call_soon(self, fn: Callable[[], object]) -> None:
        """Run ``fn`` on the scheduler thread between two steps (state only the loop may touch)."""
        self._inbox.put(fn)

    def abort_all(self) -> int:
        """Ask the loop to end every request in flight (finish reason "abort"); returns how many."""
        with self._lock:
            ids = list(self._live)
        for rid in ids:
            self._inbox.put(rid)
        return len(ids)

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

    @property
    def queued(self) -> int:
        """Requests submitted and not yet admitted a first time (nor ended): what ``max_queued`` bounds.

        Read from any thread: the scheduler's counters only grow, so a stale read overcounts."""
        return self._total_tasks - self.policy.counters["admitted"] - self._dropped

    def stats(self) -> dict:
        """A snapshot taken by the loop after its last step (never reads live state)."""
        return {**self._stats, "total_tasks": self._total_tasks}

    # ------------------------------------------------------------ the loop
    def step(self, block: bool = False) -> bool:
        """One loop iteration; False once stopped. Runs on the scheduler thread, or in a
        test's thread on a scheduler that was never started. ``block``: wait on the
        inbox while there is nothing to do (the thread never busy-spins)."""
        if not self._receive(block and not self.policy.running and not self.policy.waiting):
            return False
        if self.queue_timeout is not None and self.policy.waiting:
            self._expire()
        plan = self.policy.schedule()
        self._complete_all(plan.finished)
        if plan.request_ids:
            started = time.perf_counter()
            result = self.runner.run(plan)
            self.policy.observe(plan, time.perf_counter() - started)
            self.policy.update(plan, result)
        self.iterations += 1
        self._publish_stats()
        return True

    def _run(self) -> None:
        try:
            with torch.inference_mode():
                if self._warm is not None:
                    try:
                        self.runner.warm_up(requested_backend(self.backend))
                    finally:
                        self._warm.set()
                while self.step(block=True):
                    pass
            self.reason = "shut down"
            self._fail_all(EngineNotReady("engine shut down"))
        except BaseException as exc:  # the loop itself broke: nobody may wait forever
            logger.exception("scheduler loop died")
            self.reason = f"scheduler loop died: {type(exc).__name__}: {exc}"
            self._fail_all(EngineNotReady(self.reason))
        self._publish_stats()

    def _receive(self, block: bool) -> bool:
        """Drain the inbox (waiting for a first message if ``block``); False on stop. A model with
        ``idle()`` (tensor parallel: a heartbeat to its ranks) gets a call every ``idle_interval``
        seconds of the wait."""
        idle = getattr(self.runner.model, "idle", None)
        interval = getattr(self.runner.model, "idle_interval", None) if idle is not None else None
        while True:
            try:
                msg = self._inbox.get(block=block, timeout=interval if block else None)
            except queue.Empty:
                if block:  # the wait outlasted the interval: the heartbeat, then wait again
                    idle()
                    continue
                return True
            block = False
            if msg is _STOP:
                return False
            if isinstance(msg, Request):
                self._by_id[msg.request_id] = msg
                self.policy.add(msg)
            elif callable(msg):  # call_soon's
                try:
                    msg()
                except Exception:
                    logger.exception("a call on the scheduler thread failed")
            else:
                self._abort(msg)

    # ------------------------------------------------------------ helpers
    def _complete_all(self, request_ids: tuple[str, ...]) -> None:
        for rid in request_ids:
            self._complete(self._by_id[rid])

    def _complete(self, req: Request) -> None:
        """Retire ``req`` (no longer running nor waiting), then deliver its end: the stats are published
        first, so that a caller whose request has returned never reads it as active or waiting."""
        self._by_id.pop(req.request_id, None)
        if req.cached_tokens < 0:
            self._dropped += 1
        with self._lock:
            self._live.discard(req.request_id)
        self._publish_stats()
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
        if req.req_idx < 0:  # waiting: holds no KV, answer now; running ones go through the next cleanup
            self.policy.waiting.remove(req)
            self._complete(req)

    def _expire(self) -> None:
        """End the requests that waited ``queue_timeout`` seconds without a first admission (scanned
        at most every 50 ms: the waiting queue is not walked every step)."""
        now = time.perf_counter()
        if now < self._next_expiry:
            return
        self._next_expiry = now + min(0.05, self.queue_timeout / 4)
        late = [
            r
            for r in self.policy.waiting
            if r.cached_tokens < 0 and now - r.submitted_at >= self.queue_timeout
        ]
        for req in late:
            self.policy.waiting.remove(req)
            logger.info(
                "request %s waited %.1f s without admission: refused", req.request_id, now - req.submitted_at
            )
            req.finish(
                FinishReason.ERROR,
                error=Overloaded(
                    f"the server is overloaded: the request waited {self.queue_timeout:g} s in the queue; "
                    "retry later"
                ),
            )
            self._complete(req)

    def _fail_all(self, error: Exception) -> None:
        """Stop accepting, then end every request in flight with ``error`` and free its KV."""
        with self._lock:
            self._accepting = False
        self._receive(block=False)  # queued submissions join the waiting list; a stop message ends it
        for req in self.policy.drain():
            req.finish(FinishReason.ERROR, error=error)
            self._complete(req)

    def _publish_stats(self) -> None:
        counters = self.policy.counters
        drafted, accepted = counters["spec_draft_tokens"], counters["spec_accepted_tokens"]
        self._stats = {
            "total_tokens": counters["total_tokens"],
            "active_tasks": len(self.policy.running),
            "waiting_queue": len(self.policy.waiting),
            **self.pool.stats(),
            "prefix_hit_tokens": counters["prefix_hit_tokens"],
            "preemptions": counters["preemptions"],
            "max_preemptions": counters["max_preemptions"],
            "spec_drafts": counters["spec_drafts"],
            "spec_draft_tokens": drafted,
            "spec_accepted_tokens": accepted,
            "spec_acceptance_rate": accepted / drafted if drafted else 0.0,
            "spec_accepted_per_step": accepted / counters["spec_drafts"] if counters["spec_drafts"] else 0.0,
        }
