"""InferenceEngine: the user-facing API over the scheduler, and GenerateResult, a request's handle."""

from __future__ import annotations

import asyncio
import logging
import queue
import threading
import uuid
from collections.abc import AsyncGenerator, Callable, Generator, Iterator, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch

from astrai.extension.backend.policy import context_backend
from astrai.kvcache import KVConfig, PagePool
from astrai.kvcache.storage import KVStorage
from astrai.model import IncrementalDecoder
from astrai.request import FinishReason, Request
from astrai.sampling import SamplingParams
from astrai.scheduler import InferenceScheduler
from astrai.stopping import StopChecker

if TYPE_CHECKING:
    from astrai.model import ModelConfig, Tokenizer

logger = logging.getLogger(__name__)

#: KV budget of a paged pool when neither n_tokens nor kv_memory_bytes is given.
DEFAULT_KV_MEMORY_BYTES = 512 * 2**20


@dataclass
class EngineConfig:
    """How the engine batches and sizes its KV pool (maps onto ``KVConfig``).

    Paged by default: ``page_size`` 16 with radix prefix caching, the pool sized by
    ``n_tokens`` or ``kv_memory_bytes`` (default: ``DEFAULT_KV_MEMORY_BYTES``, capped
    at ``max_batch_size * max_seq_len`` tokens). ``paged=False`` gives the spec's
    contiguous pool (``max_batch_size * max_seq_len`` slots, no prefix caching).
    """

    max_batch_size: int = 64
    max_seq_len: int | None = None  # None: the model's context length
    paged: bool = True
    page_size: int = 16
    n_tokens: int | None = None
    kv_memory_bytes: int | None = None
    prefix_caching: bool = True
    max_prefill_tokens: int = 2048
    attention_backend: str | None = None  # strict selection for every step (as ASTR_BACKEND); None: policy

    def kv_config(self, model_config: ModelConfig, dtype: torch.dtype) -> KVConfig:
        """The pool configuration for a model; raises ValueError on an impossible size."""
        ctx = model_config.max_position_embeddings
        seq = min(self.max_seq_len or ctx, ctx)
        if not self.paged:
            return KVConfig(self.max_batch_size, seq, page_size=1, prefix_caching=False)
        n_tokens, budget = self.n_tokens, self.kv_memory_bytes
        if n_tokens is None and budget is None:
            per_token = KVStorage.bytes_per_token(
                model_config.num_hidden_layers, model_config.num_key_value_heads, model_config.head_dim, dtype
            )
            n_tokens = max(seq, min(self.max_batch_size * seq, DEFAULT_KV_MEMORY_BYTES // per_token))
        return KVConfig(self.max_batch_size, seq, self.page_size, n_tokens, budget, self.prefix_caching)


class GenerateResult:
    """The caller's handle on one request; written only by the scheduler thread.

    Non-streaming callers block in ``wait_completion()`` (a Condition); streaming
    callers wait on ``wait()`` (an Event set by every new piece and at the end) and
    read ``pieces()``. ``on_piece(piece)`` (the spec's ``cb(token)``) and
    ``on_done(result)`` run on the scheduler thread and must not block; an
    exception from ``on_piece`` fails this request only. After completion:
    ``text``, ``output_ids`` (EOS included when generated), ``prompt_tokens``,
    ``completion_tokens``, ``finish_reason``, ``stop_sequence``, ``error``.
    """

    def __init__(
        self,
        request_id: str,
        prompt_tokens: int,
        on_piece: Callable[[str], None] | None = None,
        on_done: Callable[[GenerateResult], None] | None = None,
    ) -> None:
        self.request_id, self.prompt_tokens = request_id, prompt_tokens
        self.output_ids: list[int] = []
        self.finish_reason: FinishReason | None = None
        self.stop_sequence: str | None = None
        self.error: BaseException | None = None
        self._on_piece, self._on_done = on_piece, on_done
        self._pieces: list[str] = []
        self._done = False
        self._cond = threading.Condition()
        self._event = threading.Event()

    @property
    def done(self) -> bool:
        return self._done

    @property
    def text(self) -> str:
        with self._cond:
            return "".join(self._pieces)

    @property
    def completion_tokens(self) -> int:
        return len(self.output_ids)

    def deliver_piece(self, piece: str) -> None:
        with self._cond:
            self._pieces.append(piece)
            self._event.set()
        if self._on_piece is not None:
            self._on_piece(piece)

    def deliver_final(self, request: Request) -> None:
        with self._cond:
            self.output_ids = list(request.output_ids)
            self.finish_reason, self.stop_sequence = request.finish_reason, request.stop_sequence
            self.error = request.error
            self._done = True
            self._cond.notify_all()
            self._event.set()
        if self._on_done is not None:
            self._on_done(self)

    def wait_completion(self, timeout: float | None = None) -> bool:
        """Block until the request is over (no timeout by default); False if ``timeout`` passed."""
        with self._cond:
            return self._cond.wait_for(lambda: self._done, timeout)

    def wait(self, timeout: float | None = None) -> bool:
        """Block until a new piece arrives or the request ends; False if ``timeout`` passed."""
        return self._event.wait(timeout)

    def pieces(self) -> Iterator[str]:
        """Yield the text pieces as they arrive, until the request ends (one consumer)."""
        seen = 0
        while True:
            self._event.wait()
            with self._cond:
                self._event.clear()
                new, done = self._pieces[seen:], self._done
            seen += len(new)
            yield from new
            if done:
                return

    def raise_for_error(self) -> None:
        if self.error is not None:
            raise self.error


class InferenceEngine:
    """Continuous-batching generation over ``model`` and ``tokenizer`` (the spec's Engine API).

    Starts the scheduler thread on construction; ``shutdown()`` (or leaving a
    ``with`` block) stops it. Sampling keywords are those of ``SamplingParams``
    (``stop`` may be a single string). Raises RequestRejected for a request that
    can never fit, EngineNotReady once shut down or if the scheduler died.
    """

    def __init__(self, model: torch.nn.Module, tokenizer: Tokenizer, config: EngineConfig | None = None) -> None:
        self.model, self.tokenizer = model, tokenizer
        self.config = config or EngineConfig()
        mc = model.config
        param = next(model.parameters())
        self.pool = PagePool(
            mc.num_hidden_layers, mc.num_attention_heads, mc.num_key_value_heads, mc.head_dim,
            self.config.kv_config(mc, param.dtype), dtype=param.dtype, device=param.device,
        )
        eos = set(mc.eos_token_ids) | set(tokenizer.eos_token_ids)
        self.scheduler = InferenceScheduler(
            model, self.pool, self.config.max_prefill_tokens, eos, backend=self.config.attention_backend
        )
        self.scheduler.start()

    @classmethod
    def from_model(
        cls,
        name_or_path: str | None = None,
        dtype: torch.dtype | None = None,
        device: str | torch.device = "cpu",
        config: EngineConfig | None = None,
    ) -> InferenceEngine:
        """Load a model with ``astrai.model.load_model`` and start an engine on it."""
        from astrai.model import load_model

        model, tokenizer = load_model(name_or_path, dtype=dtype, device=device)
        return cls(model, tokenizer, config)

    # ------------------------------------------------------------ low level
    def submit(
        self,
        prompt_ids: Sequence[int],
        params: SamplingParams,
        on_piece: Callable[[str], None] | None = None,
        on_done: Callable[[GenerateResult], None] | None = None,
    ) -> GenerateResult:
        """Queue one request of token ids; returns its handle at once (see GenerateResult)."""
        rid = uuid.uuid4().hex
        result = GenerateResult(rid, len(prompt_ids), on_piece, on_done)
        stopper = StopChecker(IncrementalDecoder(self.tokenizer), params.stop)
        req = Request(rid, list(prompt_ids), params, result, stopper, backend=context_backend())
        self.scheduler.submit(req)
        return result

    def abort(self, request_id: str) -> None:
        """End a request within one step (finish reason "abort"); its KV is freed."""
        self.scheduler.abort(request_id)

    # ------------------------------------------------------------ the spec's API
    def generate(
        self, prompt: str | Sequence[str], stream: bool = False, **sampling: Any
    ) -> str | list[str] | Generator[str, None, None] | Generator[tuple[int, str], None, None]:
        """Text for a prompt (or a list of them); ``stream=True`` yields pieces as they come.

        A list streams ``(index of the prompt, piece)`` tuples. Requests are submitted
        before this returns, so a rejection raises here, not at the first ``next()``.
        """
        params = self._params(sampling)
        if isinstance(prompt, str):
            return self._run_one(self._encode(prompt), params, stream)
        ids = [self._encode(p) for p in prompt]
        if stream:
            return self._stream_many(ids, params)
        results = self._submit_all(ids, params)
        return [self._text(r) for r in results]

    async def generate_async(self, prompt: str | Sequence[int], **sampling: Any) -> AsyncGenerator[str, None]:
        """Yield pieces in the running event loop; the scheduler posts them with call_soon_threadsafe."""
        loop = asyncio.get_running_loop()
        pieces: asyncio.Queue[str | None] = asyncio.Queue()

        def post(item: str | None) -> None:  # on the scheduler thread
            try:
                loop.call_soon_threadsafe(pieces.put_nowait, item)
            except RuntimeError:  # the loop is closed: nobody is listening any more
                if item is not None:
                    raise

        ids = self._encode(prompt) if isinstance(prompt, str) else list(prompt)
        result = self.submit(ids, self._params(sampling), on_piece=post, on_done=lambda _: post(None))
        try:
            while (piece := await pieces.get()) is not None:
                yield piece
            result.raise_for_error()
        finally:
            if not result.done:  # consumer left early (break, cancel): free the request
                self.abort(result.request_id)

    def chat(
        self, messages: list[dict], stream: bool = False, tools: list[dict] | None = None, **sampling: Any
    ) -> str | Generator[str, None, None]:
        """Generate the assistant's reply through the model's chat template."""
        ids = self.tokenizer.apply_chat_template(messages, tools=tools, add_generation_prompt=True)
        return self._run_one(ids, self._params(sampling), stream)

    def get_stats(self) -> dict:
        """total_tasks, total_tokens (generated), active_tasks, waiting_queue, kv_tokens_total,
        kv_tokens_in_use, kv_tokens_cached, prefix_hit_tokens, preemptions (as of the last step)."""
        return self.scheduler.stats()

    def is_healthy(self) -> bool:
        """False once shut down or if the scheduler loop died (``scheduler.reason`` says why)."""
        return self.scheduler.healthy

    def shutdown(self) -> None:
        """Stop the scheduler; pending requests fail with EngineNotReady. Idempotent."""
        self.scheduler.stop()

    def __enter__(self) -> InferenceEngine:
        return self

    def __exit__(self, *exc: object) -> None:
        self.shutdown()

    # ------------------------------------------------------------ helpers
    def _params(self, sampling: dict[str, Any]) -> SamplingParams:
        if isinstance(sampling.get("stop"), str):
            sampling = {**sampling, "stop": [sampling["stop"]]}
        return SamplingParams(**sampling)

    def _encode(self, prompt: str) -> list[int]:
        return self.tokenizer.encode(prompt, add_special_tokens=True)

    def _run_one(self, ids: list[int], params: SamplingParams, stream: bool) -> Any:
        result = self.submit(ids, params)
        return self._stream_one(result) if stream else self._text(result)

    def _text(self, result: GenerateResult) -> str:
        result.wait_completion()
        result.raise_for_error()
        return result.text

    def _stream_one(self, result: GenerateResult) -> Generator[str, None, None]:
        try:
            yield from result.pieces()
            result.raise_for_error()
        finally:
            if not result.done:
                self.abort(result.request_id)

    def _submit_all(self, ids: list[list[int]], params: SamplingParams, **callbacks: Any) -> list[GenerateResult]:
        results: list[GenerateResult] = []
        try:
            for i, prompt_ids in enumerate(ids):
                cbs = {k: (lambda *a, f=f, i=i: f(i, *a)) for k, f in callbacks.items()}
                results.append(self.submit(prompt_ids, params, **cbs))
        except BaseException:  # one rejected: withdraw the ones already queued
            for r in results:
                self.abort(r.request_id)
            raise
        return results

    def _stream_many(self, ids: list[list[int]], params: SamplingParams) -> Generator[tuple[int, str], None, None]:
        events: queue.SimpleQueue[tuple[int, str | None]] = queue.SimpleQueue()
        results = self._submit_all(
            ids, params, on_piece=lambda i, p: events.put((i, p)), on_done=lambda i, _: events.put((i, None))
        )
        return self._iter_many(results, events)

    def _iter_many(
        self, results: list[GenerateResult], events: queue.SimpleQueue
    ) -> Generator[tuple[int, str], None, None]:
        left = len(results)
        try:
            while left:
                i, piece = events.get()
                if piece is None:
                    left -= 1
                    results[i].raise_for_error()
                else:
                    yield i, piece
        finally:
            for r in results:
                if not r.done:
                    self.abort(r.request_id)
