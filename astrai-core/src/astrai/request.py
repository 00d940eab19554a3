"""One generation request as the scheduler sees it, why it finished, and what plugins learn of it."""

from __future__ import annotations

import time
from collections.abc import Container, Hashable
from dataclasses import dataclass, field
from enum import Enum
from typing import TYPE_CHECKING, Any, Protocol

from astrai.errors import RequestRejected

if TYPE_CHECKING:
    from astrai.extension.backend.policy import BackendChoice
    from astrai.grammar import GrammarMatcher
    from astrai.logprobs import TokenLogprob
    from astrai.sampling import SamplingParams
    from astrai.speculative import NgramState
    from astrai.stopping import StopChecker
    from astrai.thinking import ThinkingState


class FinishReason(str, Enum):
    """Why a request ended; the value is what the HTTP layer reports."""

    STOP = "stop"  # EOS or a model stop token id
    LENGTH = "length"  # max_tokens reached
    STOP_SEQUENCE = "stop_sequence"  # a stop string matched (Request.stop_sequence says which)
    ABORT = "abort"  # the caller aborted it
    ERROR = "error"  # its step failed, or the engine stopped (Request.error says why)


class ResultSink(Protocol):
    """Where a request's output goes. Both methods are called on the scheduler thread."""

    def deliver_piece(self, piece: str) -> None:
        """A non-empty piece of valid text, in order. May raise: the request then fails.

        ``Request.logprobs`` then holds the entries of every token accepted so far."""

    def deliver_final(self, request: Request) -> None:
        """The request is over and its KV is released; called exactly once."""


@dataclass(eq=False)
class Request:
    """Scheduler-side state of one request. Mutated only on the scheduler thread.

    ``tokens`` is the prompt followed by every sampled token; the first
    ``num_computed`` of them have KV materialized in the request's pool row. A
    request with ``remaining == 1`` is decoding (its last sampled token is the
    next input); more means prefill, or recompute after a preemption, which runs
    prompt and already generated tokens through the model again without
    re-emitting any text.
    """

    request_id: str
    prompt_ids: list[int]
    params: SamplingParams
    sink: ResultSink
    stopper: StopChecker
    arrival: int = -1  # submission order; preemption takes the newest
    priority: int = 0  # under the "priority" scheduling policy: smaller is served first
    # its index among the requests submitted together (the choices of one HTTP request): admission
    # takes every caller's first request before anyone's second, so a fan-out waits behind itself
    sibling: int = 0
    # the prefix cache's namespace (a tenant, a cache_salt): pages are matched and recorded only
    # there (astrai.kvcache.radix); None: the shared namespace of requests that name none
    cache_namespace: Hashable = None
    lora: Any = None  # its LoRA adapter (``astrai.lora.Adapter``: ``slot``), None: the base model
    tokens: list[int] = field(default_factory=list)
    output_ids: list[int] = field(default_factory=list)
    req_idx: int = -1  # pool row, -1 while waiting
    num_computed: int = 0
    finish_reason: FinishReason | None = None
    stop_sequence: str | None = None
    error: BaseException | None = None
    tried_epoch: int = -1  # pool free-epoch of the last failed admission (no retry until pages free)
    preemptions: int = 0  # times it was sent back to the queue to free KV for others
    backend: BackendChoice | None = None  # attention backend chosen where it was submitted (None: not yet)
    # Timings, time.perf_counter() seconds; 0.0 until it happens. Set on the scheduler thread,
    # except submitted_at (the submitting thread, before the scheduler sees the request).
    submitted_at: float = field(default_factory=time.perf_counter)
    submitted_wall: float = field(default_factory=time.time)  # the same instant, Unix time
    admitted_at: float = 0.0  # first admission (a preempted request keeps it)
    first_token_at: float = 0.0
    finished_at: float = 0.0
    cached_tokens: int = -1  # prompt tokens the prefix cache served at first admission; -1: never admitted
    # Log-probs (when params.logprobs / prompt_logprobs is set): one per accepted token, and one per
    # prompt token from the second on, appended by the runner as the prompt is computed.
    logprobs: list[TokenLogprob] = field(default_factory=list)
    prompt_logprobs: list[TokenLogprob] = field(default_factory=list)
    matcher: GrammarMatcher | None = None  # constrained decoding: where the output is in its grammar
    spec: NgramState | None = (
        None  # speculative decoding: the proposer's lookup table (made at its first draft)
    )
    thinking: ThinkingState | None = None  # a thinking budget: where the output is in its thinking
    # a pooling model's request (an embedder's, a classifier's): its prompt's vector, once computed
    # (the engine's model gives vectors, not logits: astrai.embedding.decoder); it samples nothing
    pooled: list[float] | None = None

    def __post_init__(self) -> None:
        self.tokens = list(self.prompt_ids)

    @property
    def remaining(self) -> int:
        """Tokens still to run through the model before the next one can be sampled."""
        return len(self.tokens) - self.num_computed

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None

    def finish(
        self, reason: FinishReason, stop_sequence: str | None = None, error: BaseException | None = None
    ) -> None:
        """Mark the request over; the first reason wins."""
        if self.finish_reason is None:
            self.finish_reason, self.stop_sequence, self.error = reason, stop_sequence, error
            self.finished_at = time.perf_counter()

    def accept(self, token: int, eos_token_ids: Container[int], logprob: TokenLogprob | None = None) -> None:
        """Append one sampled token (and its log-prob), emit its text, and apply the stop conditions.

        O(1) per token (``stop_token_ids`` is a short list). A request with ``max_tokens`` 0
        wanted its prompt computed only: it ends with "length" and keeps nothing.
        """
        if self.params.max_tokens == 0:
            self.finish(FinishReason.LENGTH)
            return
        if not self.output_ids:
            self.first_token_at = time.perf_counter()
        self.tokens.append(token)
        self.output_ids.append(token)
        if logprob is not None:
            self.logprobs.append(logprob)
        forced = self.thinking.forced if self.thinking is not None else None
        if self.matcher is not None and not self.matcher.accept(token):  # the mask allowed it: a backend bug
            if forced is not None:  # unless the token was forced in: the grammar constrains the thinking
                raise RequestRejected(
                    "the grammar does not allow the end of thinking that the thinking budget forces",
                    param="thinking_budget",
                )
            raise RuntimeError(f"the grammar refused token {token}, which its own bitmask allowed")
        if self.matcher is not None and self.matcher.is_terminated():
            self._end(FinishReason.STOP)  # the grammar is complete and took its stop token
            return
        if (token in eos_token_ids and not self.params.ignore_eos) or token in self.params.stop_token_ids:
            self._end(FinishReason.STOP)
            return
        piece, matched = self.stopper.push(token)
        if self.thinking is not None:
            self.thinking.push(token, self.stopper.decoded)
        self._emit(piece)
        if matched is not None:
            self.finish(FinishReason.STOP_SEQUENCE, stop_sequence=matched)
        elif len(self.output_ids) >= self.params.max_tokens:
            self._end(FinishReason.LENGTH)

    def _end(self, reason: FinishReason) -> None:
        # the held-back text was not a stop string after all, unless the decoder's last bytes complete one
        piece, matched = self.stopper.flush()
        self._emit(piece)
        if matched is not None:
            self.finish(FinishReason.STOP_SEQUENCE, stop_sequence=matched)
        self.finish(reason)

    def _emit(self, piece: str) -> None:
        if piece:
            self.sink.deliver_piece(piece)


@dataclass(frozen=True)
class FinishedRequest:
    """What the ``astrai_request_finished`` hook learns of one request (see ``astrai.hookspecs``).

    Durations are seconds from submission (``time.perf_counter`` differences); a
    duration is None when its event never happened (no token, never admitted).
    """

    request_id: str
    prompt_tokens: int
    completion_tokens: int  # generated tokens, EOS included when generated
    cached_tokens: int  # prompt tokens served by the prefix cache (0 when never admitted)
    finish_reason: str  # a FinishReason value: stop, length, stop_sequence, abort, error
    error: str | None  # "ExceptionClass: message" when finish_reason is "error"
    submitted_at: float  # Unix time of submission
    queue_time: float | None  # until first admitted to the running batch
    time_to_first_token: float | None
    total_time: float  # until finished

    @classmethod
    def of(cls, req: Request) -> FinishedRequest:
        """Snapshot a finished ``req``; cheap (no tensors, no copies of token lists)."""
        since = lambda t: t - req.submitted_at if t else None  # noqa: E731
        reason = req.finish_reason.value if req.finish_reason is not None else FinishReason.ERROR.value
        return cls(
            request_id=req.request_id,
            prompt_tokens=len(req.prompt_ids),
            completion_tokens=len(req.output_ids),
            cached_tokens=max(req.cached_tokens, 0),
            finish_reason=reason,
            error=None if req.error is None else f"{type(req.error).__name__}: {req.error}",
            submitted_at=req.submitted_wall,
            queue_time=since(req.admitted_at),
            time_to_first_token=since(req.first_token_at),
            total_time=(req.finished_at or req.submitted_at) - req.submitted_at,
        )
