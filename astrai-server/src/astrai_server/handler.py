"""``ProtocolHandler``: runs one request of any protocol through the engine (no HTTP here).

The handler owns everything protocol-neutral: fitting a defaulted ``max_tokens``
to ``engine.context_limit`` (the engine checks the rest at submit: ``logit_bias``
ids against the vocabulary, an explicit ``max_tokens`` against the context), the
``n`` choices, bridging the engine's scheduler-thread callbacks into the event loop
(no thread per token), tool-call extraction, aborting on client disconnect, and
turning the engine's results into ``astrai.protocol.ChatResult``. The builder formats.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

from pydantic import BaseModel

from astrai.errors import EngineNotReady, RequestRejected
from astrai.protocol import ChatResult, Choice, Prepared, ResponseBuilder
from astrai_server.errors import public_message, status_for
from astrai_server.tools import CLOSE, ToolCallStreamFilter, call_opening, parse_tool_calls

logger = logging.getLogger(__name__)

#: Awaitable that returns once the client has gone away.
Disconnect = Callable[[], Awaitable[None]]


class ProtocolHandler:
    """Drive ``builder`` over ``engine``: ``start(request)`` (in the event loop), then ``respond`` or ``stream``.

    ``start`` raises before anything is sent, so its errors still get a status
    line; ``stream`` reports later failures in-stream. Both ``respond`` and
    ``stream`` abort the engine requests when ``disconnected()`` returns first,
    and on cancellation.
    """

    def __init__(self, builder: ResponseBuilder, engine: Any) -> None:
        if engine is None:
            raise EngineNotReady()
        self.builder, self.engine = builder, engine

    def start(self, request: BaseModel) -> _Run:
        """Prepare and submit every choice. Raises RequestRejected (400: the builder's, or the
        engine's at submit) or EngineNotReady (503)."""
        prepared = self.builder.prepare(request, self.engine)
        opening = self._open_tool_call(prepared)
        self._check_limits(prepared)
        run = _Run(self.engine, prepared, asyncio.get_running_loop(), opening)
        run.submit()
        return run

    def _open_tool_call(self, p: Prepared) -> str:
        """A request that must call a tool: end its prompt with the opening of a call, stop at the
        closing tag; returns the opening ("" when not required, or the template's format is another)."""
        if not (p.tool_call_required and p.tools):
            return ""
        tokenizer = self.engine.tokenizer
        opening = call_opening(tokenizer, p.tools[0]["function"]["name"] if len(p.tools) == 1 else None)
        if opening:
            p.prompt_ids = [*p.prompt_ids, *tokenizer.encode(opening, add_special_tokens=False)]
            p.params = dataclasses.replace(p.params, stop=[*p.params.stop, CLOSE])
        return opening

    def _check_limits(self, p: Prepared) -> None:
        """Refuse a prompt that leaves no room to generate; shorten a defaulted ``max_tokens`` to fit."""
        limit, n_prompt = self.engine.context_limit, len(p.prompt_ids)
        if n_prompt >= limit:
            raise RequestRejected(
                f"the prompt is {n_prompt} tokens after templating, but the context limit is {limit} tokens "
                "(prompt plus at least one generated token)"
            )
        if not p.max_tokens_explicit and n_prompt + p.params.max_tokens > limit:
            p.params = dataclasses.replace(p.params, max_tokens=limit - n_prompt)  # a default never rejects

    async def respond(self, run: _Run, disconnected: Disconnect) -> dict[str, Any]:
        """The non-streaming body; the requests are aborted if the client leaves first."""
        watcher = asyncio.ensure_future(_abort_on(disconnected, run))
        try:
            async for _ in run.events():
                pass
            return self.builder.format_response(run.prepared, run.result())
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
            async for index, text in run.events():
                for frame in b.format_chunk(p, index, text):
                    yield frame
            result = run.result()
            for index, text in run.held_text():
                for frame in b.format_chunk(p, index, text):
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


async def _abort_on(disconnected: Disconnect, run: _Run) -> None:
    await disconnected()
    logger.info("client of %s disconnected: aborting", run.prepared.response_id)
    run.abort()


class _Run:
    """The ``n`` engine requests of one HTTP request, and their events on the event loop."""

    def __init__(self, engine: Any, prepared: Prepared, loop: asyncio.AbstractEventLoop, opening: str = "") -> None:
        self.engine, self.prepared, self.loop = engine, prepared, loop
        self.queue: asyncio.Queue[tuple[int, str | None]] = asyncio.Queue()
        self.results: list[Any] = []
        names = {t["function"]["name"] for t in prepared.tools}
        self.filters = [ToolCallStreamFilter(names, opening) for _ in range(prepared.n)] if names else None
        self.names, self.opening = names, opening  # opening: the start of a call that the prompt ends with
        self._held: list[str] = [""] * prepared.n  # set by result(): text a filter held that was no call

    def _post(self, item: tuple[int, str | None]) -> None:
        # Runs on the scheduler thread: never raise there (a closed loop means nobody listens).
        try:
            self.loop.call_soon_threadsafe(self.queue.put_nowait, item)
        except RuntimeError:
            pass

    def submit(self) -> None:
        p = self.prepared
        try:
            for i in range(p.n):
                params = p.params if p.params.seed is None else dataclasses.replace(p.params, seed=p.params.seed + i)
                self.results.append(
                    self.engine.submit(
                        p.prompt_ids, params,
                        on_piece=lambda piece, i=i: self._post((i, piece)),
                        on_done=lambda _r, i=i: self._post((i, None)),
                    )
                )  # fmt: skip
        except BaseException:
            self.abort()  # one choice rejected: withdraw the others
            raise

    async def events(self) -> AsyncIterator[tuple[int, str]]:
        """``(choice index, text)`` as it may be sent (tool-call text held back), until all are done."""
        left = len(self.results)
        while left:
            index, piece = await self.queue.get()
            if piece is None:
                left -= 1
                continue
            text = self.filters[index].push(piece) if self.filters else piece
            if text:
                yield index, text

    def held_text(self) -> list[tuple[int, str]]:
        """Text a tool-call filter held back that turned out not to be a call (after ``result``)."""
        return [(i, t) for i, t in enumerate(self._held) if t]

    def result(self) -> ChatResult:
        """The finished choices; raises the first engine error (status from ``errors.status_for``)."""
        choices, self._held = [], [""] * len(self.results)
        for i, r in enumerate(self.results):
            if r.error is not None:
                raise r.error
            reason = getattr(r.finish_reason, "value", r.finish_reason)
            text, calls, stop_sequence = self.opening + r.text, [], r.stop_sequence
            if self.filters:
                self._held[i], calls = self.filters[i].finish()
                text = parse_tool_calls(text, self.names)[0] if calls else text
            if self.opening and stop_sequence == CLOSE:  # the forced call's end, not the client's stop
                reason, stop_sequence = "stop", None
            choices.append(
                Choice(
                    index=i, text=text, finish_reason="tool_calls" if calls else reason,
                    completion_tokens=r.completion_tokens, stop_sequence=stop_sequence, tool_calls=calls,
                )
            )  # fmt: skip
        return ChatResult(choices=choices, prompt_tokens=len(self.prepared.prompt_ids))

    def abort(self) -> None:
        """Abort every choice still running (idempotent; finished ones are left alone)."""
        for r in self.results:
            if not r.done:
                self.engine.abort(r.request_id)
