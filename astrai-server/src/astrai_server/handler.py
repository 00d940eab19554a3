"""``ProtocolHandler``: runs one request of any protocol through the engine (no HTTP here).

The handler owns everything protocol-neutral: bounding a request's fan-out (``--max-choices``) and
refusing request fields nobody implements (``refuse_unknown``), preparing a request on a worker
thread (templating and tokenizing never run on the event loop), the cheap checks before a grammar
compiles in the engine's compile workers (``RequestLimits``, the context, the grammar's size),
the prefix cache's namespace of the caller (``cache_namespace``), fitting a defaulted ``max_tokens`` to
``engine.context_limit`` (the engine checks the rest at submit: ``logit_bias`` ids
against the vocabulary, an explicit ``max_tokens`` against the context), the ``n``
choices of each prompt, bridging the engine's scheduler-thread callbacks into the event
loop (no thread per token), log-probs alongside the text they belong to, tool-call
extraction, aborting on client disconnect, and turning the engine's results into
``astrai.protocol.ChatResult``. The builder formats.

Over 300 lines because ``ProtocolHandler`` and ``_Run`` are one request's life, from its checks to
its last event; ``_Run`` is the first candidate for a module of its own.
"""

from __future__ import annotations

import asyncio
import dataclasses
import hashlib
import logging
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

from pydantic import BaseModel

from astrai.errors import EngineNotReady, RequestRejected
from astrai.protocol import ChatResult, Choice, Prepared, ResponseBuilder, ToolCall
from astrai.sampling import SamplingParams
from astrai.tool_parsers import ForcedCall
from astrai_server.errors import public_message, status_for
from astrai_server.parsers import Chosen, Parsers
from astrai_server.thinking import apply_thinking
from astrai_server.tools import open_tool_call

logger = logging.getLogger(__name__)

#: Awaitable that returns once the client has gone away.
Disconnect = Callable[[], Awaitable[None]]


def count_choices(factors: list[tuple[str, int]], max_choices: int | None) -> int:
    """The product of a builder's ``fan_out`` ``factors``; RequestRejected naming the fields when it
    passes ``max_choices``."""
    count = 1
    for _, value in factors:
        count *= max(int(value), 1)
    if max_choices is not None and count > max_choices:
        named = " and ".join(f"{name} {value}" for name, value in factors)
        raise RequestRejected(
            f"{named} make {count} choices; at most {max_choices} are served per request "
            "(--max-choices): send them in several requests",
            param=max(factors, key=lambda f: f[1])[0],
        )
    return count


class ProtocolHandler:
    """Drive ``builder`` over ``engine``: ``start(request)`` (awaited in the event loop; the work runs
    on a worker thread), then ``respond`` or ``stream``.

    ``start`` raises before anything is sent, so its errors still get a status
    line; ``stream`` reports later failures in-stream. Both ``respond`` and
    ``stream`` abort the engine requests when ``disconnected()`` returns first,
    and on cancellation.
    """

    def __init__(
        self,
        builder: ResponseBuilder,
        engine: Any,
        state: Any = None,
        max_choices: int | None = None,
        parsers: Parsers | None = None,
    ) -> None:
        if engine is None:
            raise EngineNotReady()
        self.builder, self.engine = builder, engine
        self.parsers = parsers or Parsers()
        # the HTTP request's state (Starlette's request.state): its request_id names the engine requests,
        # its cache_tenant (edge.py) namespaces their prefix cache; usage (prompt and completion tokens)
        # is left there for the access log
        self.state = state
        self.max_choices = max_choices  # engine requests one request may fan out to (None: no bound)

    async def start(self, request: BaseModel) -> _Run:
        """Prepare and submit every choice. Raises RequestRejected (400: too many choices, an unknown
        field, the builder's, a bound of ``RequestLimits``, a prompt too long, an invalid or oversized
        grammar, one whose compile outlasted its time-out, or the engine's at submit), Overloaded (429:
        the queue, or the grammar compiles, are full) or EngineNotReady (503).

        Every cheap check comes first, counts before anything is templated; then preparing (the
        chat template, tokenizing) runs on a worker thread and a grammar compiles in the engine's
        compile workers (``GrammarCache.compile_async``: cancelling this coroutine, as a client that
        leaves does, stops it), so neither the event loop nor the scheduler waits for either; a
        request of several choices is submitted off the event loop too."""
        loop = asyncio.get_running_loop()
        count = self._check_fan_out(request)
        check_room = getattr(self.engine, "check_room", None)
        if check_room is not None:
            check_room(count)  # a fan-out that the queue cannot take is refused whole, now
        chosen = self.parsers.for_engine(self.engine)
        prepared, forced = await loop.run_in_executor(None, self._prepare, request, chosen)
        compiled = None
        if prepared.params.grammar is not None:
            compiled = await self.engine.grammars.compile_async(prepared.params.grammar)
        if not self.builder.splits_reasoning:
            chosen = dataclasses.replace(chosen, reasoning=None)
        run = _Run(self.engine, prepared, loop, forced, compiled, chosen)
        args = (
            getattr(self.state, "request_id", None),
            getattr(request, "priority", None) or 0,
            cache_namespace(getattr(self.state, "cache_tenant", None), prepared.cache_salt),
        )
        args += (self._adapter(prepared.model),)
        if count == 1:
            run.submit(*args)
            return run
        submitted = loop.run_in_executor(None, run.submit, *args)  # many choices: not on the event loop
        try:
            await asyncio.shield(submitted)
        except (
            asyncio.CancelledError
        ):  # the client left while they were submitted: withdraw them once they are
            submitted.add_done_callback(lambda _: run.abort())
            raise
        return run

    def _adapter(self, model: str | None) -> str | None:
        """The LoRA adapter ``model`` names (None: the base model). With adapters enabled, a name that
        is neither the served model's nor an adapter's is refused at submit (404, model_not_found)."""
        if getattr(self.engine, "loras", None) is None or not model or model == self.builder.model_name:
            return None
        return model

    def _check_fan_out(self, request: BaseModel) -> int:
        """The engine requests ``request`` makes (the product of the builder's ``fan_out``); RequestRejected
        naming the fields when it passes ``max_choices``."""
        return count_choices(self.builder.fan_out(request), self.max_choices)

    async def admitted(self, run: _Run, disconnected: Disconnect) -> bool:
        """Wait for ``run``'s first output (a piece, or an end); raise its error when a choice ended in
        error before any output (a queue timeout: ``Overloaded``), after aborting the rest. False
        (the requests aborted) when the client leaves first."""
        gone = asyncio.ensure_future(disconnected())
        first = asyncio.ensure_future(run.peek())
        try:
            await asyncio.wait((gone, first), return_when=asyncio.FIRST_COMPLETED)
        finally:
            gone.cancel()
        if not first.done():
            first.cancel()
            logger.info(
                "client of %s disconnected before its first token: aborting", run.prepared.response_id
            )
            run.abort()
            return False
        early = next(
            (r.error for r in run.results if r.done and r.error is not None and not r.output_ids), None
        )
        if early is not None:
            run.abort()
            raise early
        return True

    def _prepare(self, request: BaseModel, chosen: Chosen) -> tuple[Prepared, ForcedCall | None]:
        """Template and tokenize, then every check that costs nothing: the sampling bounds, the context,
        the grammar's size. The thinking's budget and a grammar's place after it follow the
        reasoning parser of ``chosen`` (``astrai_server.thinking``). Runs on a worker thread."""
        refuse_unknown(request, self.engine)
        prepared = self.builder.prepare(request, self.engine)
        prepared.params = with_generation_defaults(prepared, self.engine)
        forced = open_tool_call(
            prepared, self.engine.tokenizer, chosen.tool
        )  # a required call is a grammar too
        apply_thinking(prepared, chosen.reasoning, self.engine.tokenizer, forced.opening if forced else "")
        limits = getattr(getattr(self.engine, "config", None), "limits", None)
        if limits is not None:
            limits.check(prepared.params)
        self._check_limits(prepared)
        if prepared.params.grammar is not None:
            self.engine.grammars.check(prepared.params.grammar)
        return prepared, forced

    def _check_limits(self, p: Prepared) -> None:
        """Refuse a prompt that leaves no room to generate; shorten a defaulted ``max_tokens`` to fit."""
        limit, n_prompt = self.engine.context_limit, max(map(len, p.prompts or [p.prompt_ids]))
        if n_prompt >= limit:
            raise RequestRejected(
                f"the prompt is {n_prompt} tokens after templating, but the context limit is {limit} tokens "
                "(prompt plus at least one generated token)"
            )
        if not p.max_tokens_explicit and n_prompt + p.params.max_tokens > limit:
            budget = p.params.thinking_budget  # a default never rejects: nor does the budget it bounds
            budget = None if budget is None else min(budget, limit - n_prompt)
            p.params = dataclasses.replace(p.params, max_tokens=limit - n_prompt, thinking_budget=budget)

    async def respond(self, run: _Run, disconnected: Disconnect) -> dict[str, Any]:
        """The non-streaming body; the requests are aborted if the client leaves first."""
        watcher = asyncio.ensure_future(_abort_on(disconnected, run))
        try:
            async for _ in run.events():
                pass
            result = run.result()
            self._usage(result)
            return self.builder.format_response(run.prepared, result)
        finally:
            watcher.cancel()
            run.abort()

    async def stream(self, run: _Run, disconnected: Disconnect) -> AsyncIterator[str]:
        """Frames of a streaming response; an engine failure becomes the builder's in-stream error."""
        b, p = self.builder, run.prepared
        watcher = asyncio.ensure_future(_abort_on(disconnected, run))
        try:
            for frame in b.format_stream_start(p):
                yield frame
            async for index, reasoning, text, logprobs in run.events():
                if reasoning:
                    for frame in b.format_reasoning_chunk(p, index, reasoning):
                        yield frame
                if text:
                    for frame in b.format_chunk(p, index, text, **logprobs):
                        yield frame
                if b.streams_calls:
                    for k, call, piece, first in run.call_deltas(index):
                        for frame in b.format_call_delta(p, index, k, call, piece, first):
                            yield frame
            result = run.result()
            self._usage(result)
            for index, reasoning in run.held_reasoning():
                for frame in b.format_reasoning_chunk(p, index, reasoning):
                    yield frame
            for index, text, logprobs in run.held_text(result):
                for frame in b.format_chunk(p, index, text, **logprobs):
                    yield frame
            for frame in b.format_stream_end(p, result):
                yield frame
        except Exception as exc:  # the status line is sent already: report in-stream
            if status_for(exc) >= 500:
                logger.error("request %s failed mid-stream", p.response_id, exc_info=exc)
            for frame in b.format_stream_error(p, status_for(exc), public_message(exc)):
                yield frame
        finally:
            watcher.cancel()
            run.abort()

    def _usage(self, result: ChatResult) -> None:
        if self.state is not None:
            self.state.usage = {
                "prompt_tokens": result.prompt_tokens,
                "completion_tokens": result.completion_tokens,
            }


def refuse_unknown(request: BaseModel, engine: Any) -> None:
    """RequestRejected (400, ``param`` set) for a top-level field that neither the request model
    declares nor an installed sampling plugin claims (``SamplingPipeline.extra_keys``): a field
    the server does not implement is refused, never silently ignored. JSON null is not setting it."""
    pipeline = getattr(engine, "pipeline", None)
    claimed = pipeline.extra_keys if pipeline is not None else frozenset()
    for key, value in (request.model_extra or {}).items():
        if value is not None and key not in claimed:
            raise RequestRejected(
                f"unsupported parameter {key!r}: astrai does not implement it (see docs/http-api.md)",
                param=key,
            )


def with_generation_defaults(prepared: Prepared, engine: Any) -> SamplingParams:
    """``prepared.params`` with the model's generation defaults (``EngineConfig.generation_defaults``)
    for the values the client left out (``Prepared.sampling_sent``; None: none are applied)."""
    defaults = getattr(getattr(engine, "config", None), "generation_defaults", None) or {}
    if prepared.sampling_sent is None:
        return prepared.params
    left_out = {k: v for k, v in defaults.items() if k not in prepared.sampling_sent}
    return dataclasses.replace(prepared.params, **left_out) if left_out else prepared.params


def cache_namespace(tenant: str | None, salt: str | None) -> str | None:
    """The prefix cache's namespace of a request: its tenant (a digest of its API key, None when keys are
    shared or absent) and its ``cache_salt``; None (the shared namespace) when it has neither."""
    if tenant is None and salt is None:
        return None
    return hashlib.sha256(f"{tenant or ''}\0{salt or ''}".encode()).hexdigest()[:32]


async def _abort_on(disconnected: Disconnect, run: _Run) -> None:
    await disconnected()
    logger.info("client of %s disconnected: aborting", run.prepared.response_id)
    run.abort()


class _Run:
    """The engine requests of one HTTP request (``n`` per prompt), and their events on the event loop."""

    def __init__(
        self,
        engine: Any,
        prepared: Prepared,
        loop: asyncio.AbstractEventLoop,
        forced: ForcedCall | None = None,
        grammar: Any = None,
        parsers: Chosen | None = None,
    ) -> None:
        self.engine, self.prepared, self.loop = engine, prepared, loop
        self.grammar = grammar  # prepared.params.grammar compiled (None: none)
        self.queue: asyncio.Queue[tuple[int, str | None]] = asyncio.Queue()
        self._peeked: list[tuple[int, str | None]] = []  # taken off the queue by peek(), not yet by events()
        self.results: list[Any] = []
        self.prompts = prepared.prompts or [prepared.prompt_ids]
        count = prepared.n * len(self.prompts)
        names = {t["function"]["name"] for t in prepared.tools}
        tool, reasoning = (parsers.tool, parsers.reasoning) if parsers else (None, None)
        if tool is None:
            from astrai.tool_parsers.hermes import HermesToolParser as tool
        # the start of a call that the prompt ends with, and the stops that end it (a required call)
        opening, self.call_stops = (forced.opening, forced.stop) if forced else ("", ())
        self.filters = [tool(names, opening, prepared.tools) for _ in range(count)] if names else None
        self.names, self.opening = names, opening
        self._held: list[str] = [""] * count  # set by result(): text a filter held that was no call
        self._released = [""] * count  # text a filter let through, per choice
        self._calls_sent: list[list[int]] = [[] for _ in range(count)]  # per call: argument characters sent
        # the answer's reasoning, split off before tool calls are looked for (none after a forced call's opening)
        self.reasoners = None
        if reasoning is not None and reasoning.name != "none" and not opening:
            tails = [self._prompt_tail(ids) for ids in self.prompts]
            self.reasoners = [reasoning(tails[i // prepared.n]) for i in range(count)]
        self._reasoning = [""] * count  # reasoning released per choice
        self._content = [""] * count  # content (before tool-call parsing) per choice
        self._held_reasoning = [""] * count  # set by result(): reasoning held to the end
        self._reasoning_pieces = [0] * count  # pieces received while thinking (the reasoning's tokens)
        params = prepared.params
        self.with_logprobs = params.logprobs is not None or params.prompt_logprobs is not None
        self._pieces = [0] * count  # pieces received per choice
        self._sent = [0] * count  # log-prob entries sent per choice
        self._opened = [False] * count  # whether a choice's first chunk went out

    def _prompt_tail(self, ids: list[int]) -> str:
        """The last tokens of a prompt, decoded with their special tokens (``<think>`` may be one):
        whether its template opened a thinking block."""
        try:
            return str(self.engine.tokenizer.decode(ids[-16:], skip_special_tokens=False))
        except Exception:  # a duck-typed tokenizer without decode: no hint
            return ""

    def _post(self, item: tuple[int, str | None]) -> None:
        # Runs on the scheduler thread: never raise there (a closed loop means nobody listens).
        try:
            self.loop.call_soon_threadsafe(self.queue.put_nowait, item)
        except RuntimeError:
            pass

    def submit(
        self,
        request_id: str | None = None,
        priority: int = 0,
        namespace: str | None = None,
        lora: str | None = None,
    ) -> None:
        """Submit every choice: named ``request_id`` (one choice) or ``request_id-i`` (None: the engine names
        them), in the prefix cache's ``namespace``, choice ``i`` as the ``i``-th sibling (admission serves
        other requests' first choices before this one's second), on LoRA adapter ``lora`` (None: none)."""
        p, count = self.prepared, len(self._pieces)
        adapter = {} if lora is None else {"lora": lora}
        try:
            for i in range(count):
                k = i % p.n  # choice k of prompt i // n
                params = (
                    p.params
                    if p.params.seed is None
                    else dataclasses.replace(p.params, seed=p.params.seed + k)
                )
                rid = None if request_id is None else request_id if count == 1 else f"{request_id}-{i}"
                self.results.append(
                    self.engine.submit(
                        self.prompts[i // p.n],
                        params,
                        on_piece=lambda piece, i=i: self._post((i, piece)),
                        on_done=lambda _r, i=i: self._post((i, None)),
                        request_id=rid,
                        priority=priority,
                        cache_namespace=namespace,
                        sibling=i,
                        grammar=self.grammar,
                        **adapter,
                    )
                )
        except BaseException:
            self.abort()  # one choice rejected: withdraw the others
            raise

    async def events(self) -> AsyncIterator[tuple[int, str, str, dict[str, Any]]]:
        """``(choice index, reasoning, text, log-probs)`` as they may be sent (tool-call text held back),
        until all are done; the log-probs are ``format_chunk``'s keywords ({} when the request asked
        none), those of reasoning tokens going with the next text."""
        left = len(self.results)
        while left:
            index, piece = self._peeked.pop(0) if self._peeked else await self.queue.get()
            if piece is None:
                left -= 1
                continue
            self._pieces[index] += 1
            reasoning = ""
            if self.reasoners:
                parser = self.reasoners[index]
                was = parser.thinking
                reasoning, piece = parser.push(piece)
                if was or parser.thinking:
                    self._reasoning_pieces[index] += 1
                self._reasoning[index] += reasoning
                self._content[index] += piece
            text = self.filters[index].push(piece) if self.filters and piece else piece
            if self.filters:
                self._released[index] += text
            if reasoning or text or (self.filters and self.filters[index].calls):
                yield index, reasoning, text, self._logprobs(index, self._pieces[index] - 1) if text else {}

    def call_deltas(self, index: int) -> list[tuple[int, ToolCall, str, bool]]:
        """Choice ``index``'s tool calls as they grew since the last time: ``(k, call, new arguments,
        whether it starts)`` (``ResponseBuilder.format_call_delta``)."""
        calls = getattr(self.filters[index], "calls", None) if self.filters else None
        sent, out = self._calls_sent[index], []
        for k, call in enumerate(calls or ()):
            first = k == len(sent)
            if first:
                sent.append(0)
            if first or len(call.arguments) > sent[k]:
                out.append((k, call, call.arguments[sent[k] :], first))
                sent[k] = len(call.arguments)
        return out

    async def peek(self) -> None:
        """Wait for the first event of any choice, leaving it for ``events()``."""
        if not self._peeked:
            self._peeked.append(await self.queue.get())

    def _logprobs(self, index: int, piece: int | None) -> dict[str, Any]:
        """The log-prob keywords of choice ``index``'s next chunk: its entries not sent yet, up to those
        of its ``piece``-th piece (None: all)."""
        if not self.with_logprobs:
            return {}
        r = self.results[index]
        upto = len(r.logprobs) if piece is None else r.piece_ends[piece]
        out: dict[str, Any] = {"logprobs": r.logprobs[self._sent[index] : upto]}
        self._sent[index] = max(self._sent[index], upto)
        if not self._opened[index] and self.prepared.params.prompt_logprobs is not None:
            out["prompt_logprobs"] = r.prompt_logprobs
        self._opened[index] = True
        return out

    def held_reasoning(self) -> list[tuple[int, str]]:
        """Reasoning a parser held to the end (an output cut inside its thinking), after ``result``."""
        return [(i, r) for i, r in enumerate(self._held_reasoning) if r]

    def held_text(self, result: ChatResult) -> list[tuple[int, str, dict[str, Any]]]:
        """Text a tool-call filter held back that turned out not to be a call (after ``result``, whose
        choices then count the log-probs these chunks carry as streamed)."""
        held = [(i, t, self._logprobs(i, None)) for i, t in enumerate(self._held) if t]
        for c in result.choices:
            c.logprobs_streamed = self._sent[c.index]
        return held

    def result(self) -> ChatResult:
        """The finished choices; raises the first engine error (status from ``errors.status_for``)."""
        choices, self._held = [], [""] * len(self.results)
        for i, r in enumerate(self.results):
            if r.error is not None:
                raise r.error
            reason = getattr(r.finish_reason, "value", r.finish_reason)
            text, calls, stop_sequence = self.opening + r.text, [], r.stop_sequence
            reasoning, reasoning_tokens = None, 0
            if self.reasoners:
                self._held_reasoning[i], tail = self.reasoners[i].finish()
                if tail and self.filters:
                    self._held[i] = self.filters[i].push(tail)
                    self._released[i] += self._held[i]
                elif tail:
                    self._held[i] = tail
                reasoning = (self._reasoning[i] + self._held_reasoning[i]) or None
                text = self._content[i] + tail
                reasoning_tokens = min(self._reasoning_pieces[i], r.completion_tokens)
            if self.filters:
                held, calls = self.filters[i].finish()
                self._held[i] += held
                text = self._released[i].rstrip() if calls else text  # the text before the calls
            if stop_sequence is not None and stop_sequence in self.call_stops:  # the forced call's end
                reason, stop_sequence = "stop", None
            params = self.prepared.params
            choices.append(
                Choice(
                    index=i,
                    text=text,
                    # (a call cut by max_tokens: "length", as OpenAI's own)
                    finish_reason="tool_calls" if calls and reason != "length" else reason,
                    completion_tokens=r.completion_tokens,
                    stop_sequence=stop_sequence,
                    tool_calls=calls,
                    reasoning=reasoning,
                    reasoning_tokens=reasoning_tokens,
                    prompt_index=i // self.prepared.n,
                    logprobs=list(r.logprobs) if params.logprobs is not None else None,
                    prompt_logprobs=r.prompt_logprobs if params.prompt_logprobs is not None else None,
                    logprobs_streamed=self._sent[i],
                    calls_streamed=list(self._calls_sent[i]),
                )
            )
        n = (
            self.prepared.n
        )  # a prompt's cached tokens: its first choice's (the others may hit what it computed)
        cached = sum(getattr(self.results[k * n], "cached_tokens", 0) for k in range(len(self.prompts)))
        return ChatResult(choices=choices, prompt_tokens=sum(map(len, self.prompts)), cached_tokens=cached)

    def abort(self) -> None:
        """Abort every choice still running (idempotent; finished ones are left alone)."""
        for r in self.results:
            if not r.done:
                self.engine.abort(r.request_id)
