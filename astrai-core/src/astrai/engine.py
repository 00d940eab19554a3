"""InferenceEngine: the user-facing API over the scheduler (``generate``, ``chat``, ``submit``, stats).

``EngineConfig`` (``astrai.config``) and ``GenerateResult`` (a request's handle, ``astrai.result``)
are re-exported here.

Over 300 lines because the Engine API is one class: the low-level calls (``submit``, ``abort``,
``abort_all``), the text API over them and the lifecycle (a tensor-parallel model's ranks
included) read best together.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import queue
import threading
import uuid
from collections.abc import AsyncGenerator, Callable, Generator, Sequence
from typing import TYPE_CHECKING, Any

import torch

from astrai.config import DEFAULT_KV_MEMORY_BYTES, EngineConfig
from astrai.cpu_tuning import run_off_thread
from astrai.errors import RequestRejected
from astrai.extension.backend.policy import check_features, load_backends
from astrai.grammar import GrammarCache
from astrai.hooks import HookThread, PluginManager
from astrai.kvcache import PagePool
from astrai.kvcache.sizing import kv_config
from astrai.malloc import tune_malloc
from astrai.model import IncrementalDecoder
from astrai.request import FinishedRequest, Request
from astrai.result import GenerateResult
from astrai.sampling import SamplingParams, SamplingPipeline
from astrai.scheduler import InferenceScheduler
from astrai.speculative import NgramProposer
from astrai.stopping import StopChecker
from astrai.thinking import ThinkingFormat, ThinkingState

if TYPE_CHECKING:
    from astrai.kvcache.tier import KVTier
    from astrai.lora import LoraManager
    from astrai.model import Tokenizer

__all__ = ["DEFAULT_KV_MEMORY_BYTES", "EngineConfig", "GenerateResult", "InferenceEngine"]

logger = logging.getLogger(__name__)

_FIELDS = frozenset(f.name for f in dataclasses.fields(SamplingParams))


class InferenceEngine:
    """Continuous-batching generation over ``model`` and ``tokenizer``: the Engine API of
    docs/architecture.md.

    Starts the scheduler thread on construction; ``shutdown()`` (or leaving a
    ``with`` block) stops it. Sampling keywords are those of ``SamplingParams``
    (``stop`` may be a single string) plus the parameters of installed sampling
    plugins (``min_p=0.1`` goes to ``SamplingParams.extra``). Raises RequestRejected
    for a request that can never fit, EngineNotReady once shut down or if the
    scheduler died.

    Plugins: the sampling strategies of the ``astrai.sampling`` entry points, and the
    hook plugins of ``plugins`` (default: ``PluginManager.discover()``, every
    ``astrai.plugins`` entry point). ``config.chat_template`` replaces ``tokenizer``'s template (the
    tokenizer is changed); ``config.generation_defaults`` fill the sampling keywords a call leaves
    out. Hooks: ``astrai_engine_started`` before the
    constructor returns, ``astrai_request_finished`` on a hook thread of the engine's
    own, ``astrai_engine_stopped`` in ``shutdown()``. Raises PluginError when
    ``config.sampling`` names a missing or broken sampling plugin.
    """

    def __init__(
        self,
        model: torch.nn.Module,
        tokenizer: Tokenizer,
        config: EngineConfig | None = None,
        plugins: PluginManager | None = None,
    ) -> None:
        self.model, self.tokenizer = model, tokenizer
        self.config = config or EngineConfig()
        self.plugins = PluginManager.discover() if plugins is None else plugins
        self.pipeline = SamplingPipeline.discover(self.config.sampling)
        if self.config.chat_template is not None:  # before the end-of-turn token joins the EOS ids
            from astrai.model.chat_template import load_chat_template

            tokenizer.use_chat_template(load_chat_template(self.config.chat_template))
        self._stopped = False
        self._stop_lock = threading.Lock()
        mc = model.config
        param = next(model.parameters())
        _check_kv_cache_dtype(self.config, getattr(model, "tensor_parallel_size", 1))
        kv = kv_config(self.config, mc, param.dtype)
        pool_args = (mc.num_hidden_layers, mc.num_attention_heads, mc.num_key_value_heads, mc.head_dim, kv)
        # sliding-window layers keep only their window (astrai.kvcache.layout); the ranks of a
        # tensor-parallel model mirror one table per step, so there every layer keeps every page
        windows = mc.windows if getattr(model, "tensor_parallel_size", 1) == 1 else ()
        pool_args += (param.dtype, param.device, windows)
        if param.device.type == "cpu":  # see astrai.cpu_tuning for both
            tune_malloc()  # keep freed step temporaries mapped
            self.pool = run_off_thread(PagePool, *pool_args)  # zero-filling the pool uses OpenMP
        else:
            self.pool = PagePool(*pool_args)
        # Load every attention backend that can run, now: a plugin that builds kernels on first
        # use (astrai-backend-cpu, once per machine) does so before the first request, and its
        # fused kernels (astrai.extension.fused) are installed for the first step.
        self.kv_tier = (
            self._kv_tier(model)
            if self.config.kv_cache_host_memory_bytes or self.config.kv_cache_dir
            else None
        )
        load_backends()
        if self.config.activations != "dtype":  # before the first forward (the warm-up's)
            from astrai.model.activations import int8_by_default, use_int8_activations

            if self.config.activations == "int8" or int8_by_default(model):
                n = use_int8_activations(model)
                logger.info(
                    "int8 activations (--activations %s) on %d quantized linears", self.config.activations, n
                )
        # a quantized pool needs a backend that reads it: the one chosen, or (automatic) any
        check_features(self.pool.storage.features, _KV_INT8, self.config.attention_backend)
        self.loras = self._loras() if self.config.enable_lora else None
        eos = set(mc.eos_token_ids) | set(tokenizer.eos_token_ids)
        # compiled grammars of constrained requests, compiled on the submitting thread (never the scheduler's)
        self.grammars = GrammarCache(
            tokenizer, mc.vocab_size, sorted(eos), self.config.grammar_backend, self.config.grammar
        )
        # Built only when someone listens: the scheduler then just queues a small record per request.
        self._hooks = HookThread(self.plugins) if self.plugins.has_impls("astrai_request_finished") else None
        self.scheduler = InferenceScheduler(
            model,
            self.pool,
            self.config,
            eos,
            pipeline=self.pipeline,
            on_finished=self._request_finished if self._hooks else None,
            proposer=self._proposer(),
        )
        self.scheduler.start(
            warm_up=True
        )  # returns once a first forward has packed weights and built kernels
        if (
            self.kv_tier is not None and self.kv_tier.disk is not None
        ):  # its weights hashed, its pages indexed
            self.kv_tier.disk.wait_ready()
        self.plugins.notify("astrai_engine_started", engine=self)

    @classmethod
    def from_model(
        cls,
        name_or_path: str | None = None,
        dtype: torch.dtype | None = None,
        device: str | torch.device = "cpu",
        config: EngineConfig | None = None,
        plugins: PluginManager | None = None,
        weights: str = "dense",
    ) -> InferenceEngine:
        """Load a model with ``astrai.model.load_model`` and start an engine on it; with
        ``config.tensor_parallel_size`` > 1, split over that many ranks (``astrai.distributed``:
        TPConfigError names the valid sizes). ``weights``: ``load_model``'s (tensor parallel
        shards dense weights: "gguf" is refused there).

        The checkpoint's header is read first: the KV pool ``config`` gives it is sized from it,
        the model is built for the context that pool serves (its rotary table no longer), and the
        pool's bytes count in ``load_model``'s memory check, so that a malformed checkpoint
        (``ModelFormatError``) or one that cannot fit (``InsufficientMemory``) is refused before
        anything is allocated."""
        from astrai.model import default_dtype, load_model, open_checkpoint

        size = config.tensor_parallel_size if config is not None else 1
        if size > 1:
            _check_kv_cache_dtype(config, size)
            if weights == "gguf":
                raise ValueError(
                    "--weights gguf: tensor parallelism shards dense weights (use --weights dense or auto)"
                )
            from astrai.distributed.launch import load_tensor_parallel

            model, tokenizer = load_tensor_parallel(
                name_or_path,
                dtype or default_dtype(device),
                device,
                size,
                config.tp_timeout,
                max_seq_len=config.max_seq_len,
            )
            try:
                return cls(model, tokenizer, config, plugins)
            except BaseException:
                model.close()
                raise
        dtype = dtype or default_dtype(device)
        checkpoint = open_checkpoint(name_or_path)
        mc = checkpoint.config
        engine_config = config or EngineConfig()
        kv = kv_config(engine_config, mc, dtype)
        shape = (mc.num_hidden_layers, mc.num_key_value_heads, mc.head_dim, dtype, mc.windows)
        what = f"KV pool ({kv.slots(*shape)} slots, a context of {kv.max_seq_len}"
        if engine_config.max_seq_len is None:  # the model's context: say how to serve less
            what += f": the model's context length {mc.max_position_embeddings}; a max_seq_len serves less"
        what += ")"
        model, tokenizer = load_model(
            checkpoint,
            dtype=dtype,
            device=device,
            weights=weights,
            max_seq_len=kv.max_seq_len,
            reserve={what: kv.nbytes(*shape)},
        )
        return cls(model, tokenizer, config, plugins)

    def _kv_tier(self, model: torch.nn.Module) -> KVTier | None:
        """The pool's KV tiers (``astrai.kvcache.tier``): host RAM and, with ``kv_cache_dir``, a folder
        whose pages belong to this model, checkpoint and cache layout. ValueError where the pool has
        no prefix cache or the model is split over ranks; None (logged) for a pool of layer groups."""
        from astrai.kvcache.disk import DiskTier, fingerprint
        from astrai.kvcache.tier import KVTier

        config, pool = self.config, self.pool
        if getattr(model, "tensor_parallel_size", 1) > 1 or pool.radix is None:
            raise ValueError(
                "KV cache tiers (kv_cache_host_memory_bytes, kv_cache_dir) keep the prefix cache's pages: "
                "they need a paged pool with prefix caching, and no tensor parallelism"
            )
        if not pool.layout.trivial:
            logger.warning(
                "KV cache tiers are off: the model's sliding-window layers keep pages per layer group"
            )
            return None
        disk = None
        if config.kv_cache_dir:
            storage = pool.storage
            layout = {
                "page_size": pool.page_size,
                "dtypes": [str(t.dtype) for t in (storage.k_buffer, storage.v_buffer)],
                "shape": [storage.n_layers, storage.n_kv_heads, storage.head_dim, str(storage.dtype)],
                "scales": [t is not None for t in (storage.k_scale, storage.v_scale)],
            }
            tensors = sorted(model.state_dict().items())  # now, before a step swaps any module
            disk = DiskTier(
                config.kv_cache_dir,
                config.kv_cache_dir_bytes,
                lambda: fingerprint(model.config, tensors, layout),
            )
        tier = KVTier(config.kv_cache_host_memory_bytes, disk)
        pool.attach_tier(tier)
        return tier

    def _loras(self) -> LoraManager:
        """The model's projections wrapped for LoRA adapters (``astrai.lora``) and their manager."""
        from astrai.lora import LoraManager, install_lora, lora_dtype

        if getattr(self.model, "tensor_parallel_size", 1) > 1:
            raise ValueError(
                "LoRA adapters are not supported under tensor parallelism (--tensor-parallel-size 1 "
                "serves them): the adapters' updates would have to be sharded with every rank's layers"
            )
        if getattr(self.model, "pooling", None) is not None:
            raise ValueError("LoRA adapters apply to generation, not to a pooling model")
        lora = install_lora(self.model, self.config.max_loras, lora_dtype(self.config.lora_dtype, self.model))
        manager = LoraManager(lora, self.model.config, self.config.max_loras, self.config.max_lora_rank)
        manager.on_gone = self._drop_adapter_pages
        return manager

    def _drop_adapter_pages(self, adapter: Any) -> None:
        """An adapter is gone: its pages in the prefix cache go too (on the scheduler thread)."""
        radix, tag = self.pool.radix, ("lora", adapter.uid)
        if radix is not None:
            self.scheduler.call_soon(lambda: radix.drop(lambda ns: isinstance(ns, tuple) and ns[:2] == tag))

    def _proposer(self) -> NgramProposer | None:
        """The speculative drafter ``config.speculative`` names (None: speculation is off)."""
        c = self.config
        return (
            NgramProposer(c.num_speculative_tokens, c.ngram_min, c.ngram_max)
            if c.speculative == "ngram"
            else None
        )

    @property
    def context_limit(self) -> int:
        """Tokens one request may hold, prompt plus generated: the context length, capped by the KV pool."""
        return self.pool.context_limit

    # ------------------------------------------------------------ low level
    def submit(
        self,
        prompt_ids: Sequence[int],
        params: SamplingParams,
        on_piece: Callable[[str], None] | None = None,
        on_done: Callable[[GenerateResult], None] | None = None,
        request_id: str | None = None,
        priority: int = 0,
        cache_namespace: str | None = None,
        sibling: int = 0,
        grammar: Any = None,
        lora: str | None = None,
    ) -> GenerateResult:
        """Queue one request of token ids; returns its handle at once (see GenerateResult).

        ``request_id`` (default: a new uuid) names it in logs and hooks; RequestRejected if a request of
        that id is in flight. ``priority`` (smaller first) needs ``scheduling_policy="priority"``.
        ``cache_namespace``: the prefix cache's namespace this request reuses and leaves pages in
        (a tenant, a ``cache_salt``); None: the shared one. ``sibling``: this request's index among
        those submitted together (an HTTP request's choices): admission serves every caller's first
        request before anyone's second. ``grammar``: ``params.grammar`` compiled already
        (``self.grammars.compile``; None: compiled here unless cached). ``params.thinking_budget`` (or
        ``params.thinking``): the request's thinking is followed and ended at the budget
        (``astrai.thinking``; the ``<think>`` format when ``params.thinking`` is None). ``lora``: the
        name of a loaded LoRA adapter the request runs on (``self.loras``; ModelNotFound for none
        such). Raises Overloaded when ``max_queued_requests`` requests wait already."""
        self.config.limits.check(params)
        rid = uuid.uuid4().hex if request_id is None else request_id
        adapter = None
        if lora is not None:
            if self.loras is None:
                raise RequestRejected(
                    "LoRA adapters are not enabled (EngineConfig.enable_lora)", param="model"
                )
            adapter = self.loras.acquire(lora)
            on_done = self._releasing(adapter, on_done)
            cache_namespace = adapter.namespace(cache_namespace)
        try:
            return self._submit(
                rid,
                prompt_ids,
                params,
                on_piece,
                on_done,
                priority,
                cache_namespace,
                sibling,
                grammar,
                adapter,
            )
        except BaseException:
            if adapter is not None:
                self.loras.release(adapter)
            raise

    def _releasing(
        self, adapter: Any, on_done: Callable[[GenerateResult], None] | None
    ) -> Callable[[GenerateResult], None]:
        def done(result: GenerateResult) -> None:
            self.loras.release(adapter, result.prompt_tokens, len(result.output_ids))
            if on_done is not None:
                on_done(result)

        return done

    def _submit(
        self,
        rid: str,
        prompt_ids: Sequence[int],
        params: SamplingParams,
        on_piece: Callable[[str], None] | None,
        on_done: Callable[[GenerateResult], None] | None,
        priority: int,
        cache_namespace: Any,
        sibling: int,
        grammar: Any,
        adapter: Any,
    ) -> GenerateResult:
        result = GenerateResult(rid, len(prompt_ids), on_piece, on_done)
        stopper = StopChecker(IncrementalDecoder(self.tokenizer), params.stop)
        # submitted on this thread: the scheduler keeps the attn_backend() choice in force here
        req = Request(
            rid,
            list(prompt_ids),
            params,
            result,
            stopper,
            priority=priority,
            cache_namespace=cache_namespace,
            sibling=sibling,
            lora=adapter,
        )
        if params.grammar is not None:  # compiled here unless given or cached (RequestRejected for a bad one)
            req.matcher = self.grammars.matcher(params.grammar, grammar)
        if params.thinking_budget is not None or params.thinking is not None:
            fmt = params.thinking or ThinkingFormat()
            req.thinking = ThinkingState(params.thinking_budget, fmt, self._end_ids(fmt.end))
        result.bind(req)
        self.scheduler.submit(req)
        return result

    def check_room(self, count: int) -> None:
        """Overloaded when ``count`` more requests would pass ``max_queued_requests``: a request of many
        choices is refused whole, before any of it is submitted."""
        self.scheduler.check_room(count)

    def abort(self, request_id: str) -> None:
        """End a request within one step (finish reason "abort"); its KV is freed."""
        self.scheduler.abort(request_id)

    def abort_all(self) -> int:
        """End every request in flight within one step (finish reason "abort"); returns how many."""
        return self.scheduler.abort_all()

    # ------------------------------------------------------------ the Engine API
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
        kv_tokens_in_use, kv_tokens_cached, prefix_hit_tokens, preemptions, max_preemptions, and
        speculative decoding's spec_drafts (rows verified with drafts), spec_draft_tokens,
        spec_accepted_tokens, spec_acceptance_rate (accepted / drafted) and spec_accepted_per_step
        (accepted per row verified), as of the last step."""
        return self.scheduler.stats()

    def is_healthy(self) -> bool:
        """False once shut down, if the scheduler loop died (``scheduler.reason`` says why), or if a
        tensor-parallel rank was lost."""
        return self.scheduler.healthy and getattr(self.model, "healthy", True)

    def shutdown(self) -> None:
        """Stop the scheduler (pending requests fail with EngineNotReady), let the hook thread
        finish its queued ``astrai_request_finished`` calls, then call ``astrai_engine_stopped``.
        Idempotent."""
        self.scheduler.stop()
        with self._stop_lock:
            if self._stopped:
                return
            self._stopped = True
        if self._hooks is not None:
            self._hooks.close()
        if self.kv_tier is not None:  # the pages still cached, and those queued, are written first
            saved = self.pool.spill.save_all()
            if saved:
                logger.info(
                    "KV cache disk tier: writing the %d page(s) still cached for the next start", saved
                )
            self.kv_tier.close()
        self.grammars.close()  # its compile workers
        close = getattr(self.model, "close", None)  # a tensor-parallel model stops its ranks
        if close is not None:
            close()
        self.plugins.notify("astrai_engine_stopped", engine=self)

    def __enter__(self) -> InferenceEngine:
        return self

    def __exit__(self, *exc: object) -> None:
        self.shutdown()

    # ------------------------------------------------------------ helpers
    def _request_finished(self, req: Request) -> None:  # on the scheduler thread: a snapshot and a put
        self._hooks.post("astrai_request_finished", engine=self, request=FinishedRequest.of(req))

    def _params(self, sampling: dict[str, Any]) -> SamplingParams:
        sampling = {**self.config.generation_defaults, **sampling}
        if isinstance(sampling.get("stop"), str):
            sampling = {**sampling, "stop": [sampling["stop"]]}
        plugin = {k: sampling[k] for k in sampling.keys() & self.pipeline.extra_keys if k not in _FIELDS}
        if plugin:
            sampling = {k: v for k, v in sampling.items() if k not in plugin}
            sampling["extra"] = {**(sampling.get("extra") or {}), **plugin}
        return SamplingParams(**sampling)

    def _end_ids(self, text: str) -> tuple[int, ...]:
        """The ids of a thinking's end text (``ThinkingFormat.end``), encoded once per engine."""
        cache = self.__dict__.setdefault("_end_cache", {})
        if text not in cache:
            cache[text] = tuple(self.tokenizer.encode(text, add_special_tokens=False))
        return cache[text]

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

    def _submit_all(
        self, ids: list[list[int]], params: SamplingParams, **callbacks: Any
    ) -> list[GenerateResult]:
        results: list[GenerateResult] = []
        try:
            for i, prompt_ids in enumerate(ids):
                cbs = {k: (lambda *a, f=f, i=i: f(i, *a)) for k, f in callbacks.items()}
                results.append(self.submit(prompt_ids, params, sibling=i, **cbs))
        except BaseException:  # one rejected: withdraw the ones already queued
            for r in results:
                self.abort(r.request_id)
            raise
        return results

    def _stream_many(
        self, ids: list[list[int]], params: SamplingParams
    ) -> Generator[tuple[int, str], None, None]:
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


_KV_INT8 = "an int8 KV cache (kv_cache_dtype int8)"


def _check_kv_cache_dtype(config: EngineConfig, tensor_parallel_size: int) -> None:
    """ValueError for a quantized KV cache under tensor parallelism: the ranks mirror rank 0's
    pool in the model dtype (``astrai.distributed.tp``)."""
    if tensor_parallel_size > 1 and config.kv_kinds != ("auto", "auto"):
        raise ValueError(
            "an int8 KV cache is not supported under tensor parallelism (--tensor-parallel-size 1 "
            "serves it): the ranks' mirrored pools keep the model dtype"
        )
