"""``HeldToolParser``: the streaming half shared by the formats whose calls begin at a marker
(``<tool_call>``, ``[TOOL_CALLS]``) or make up the whole answer (a leading ``{`` or ``[``).

Text goes out as it comes up to a marker (or up to a trailing prefix of one, which the next piece
may complete); from the marker on, or from the start when the answer opens with a leading
character, it is held back from the text.

Calls stream as they are written when they take the format's usual shape (the one its grammar
writes): ``open_call`` recognises a call's start up to its name, and its ``arguments`` reader
(``JsonStream`` for the JSON formats) turns the model's text into the canonical JSON of the
arguments as it comes. Once the reader gives its first piece the call is *committed*: it goes out
(``calls``) and stays a call whatever follows. A call cut off (``max_tokens``) or going wrong after
that keeps the arguments that went out, as OpenAI's own calls cut by ``max_tokens`` do; what follows
the committed calls and is no further call of the format is not part of the answer (vLLM too keeps
only the text before the calls). Text in another shape (keys in another order, an unknown tool, a
call that goes wrong before its arguments begin) commits nothing: ``finish`` then reads the whole
answer with the format's ``parse_text``, as it always has.
"""

from __future__ import annotations

import logging
from typing import Any, ClassVar, Protocol

import regex

from astrai.protocol import ToolCall, new_id
from astrai.tool_parsers.base import ToolParser
from astrai.tool_parsers.json_stream import JsonStream

__all__ = ["MORE", "ArgumentsReader", "HeldToolParser", "match_head"]

logger = logging.getLogger(__name__)

#: ``open_call``'s answer while the text so far may still become a call's start.
MORE = object()


class ArgumentsReader(Protocol):
    """Turns a call's arguments as the model writes them into their canonical JSON, as it comes."""

    done: bool  # the arguments are complete
    failed: bool  # the text is not arguments of the format: nothing more comes out

    def feed(self, text: str) -> tuple[int, str]:
        """``(characters of text taken, canonical text they add)``; the next call gets the text from
        where this one stopped taking."""
        ...


def match_head(pattern: regex.Pattern, text: str, at: int, back: int = 0) -> Any:
    """``pattern`` (a call's start: its ``name`` group, and an ``id`` group where the format gives
    one) at ``at``: ``(name, end - back, id)`` (``back``: the characters that begin the arguments),
    ``MORE`` while the text may still become one, None when it cannot."""
    m = pattern.match(text, at, partial=True)
    if m is None:
        return None
    if m.partial:
        return MORE
    return m.group("name").strip(), m.end() - back, m.groupdict().get("id")


class HeldToolParser(ToolParser):
    """Subclasses set ``markers`` (strings that open a call anywhere) and ``leading`` (first
    characters, after whitespace, of an answer that is wholly calls), and implement ``parse_text``
    (the format read on a whole text, for answers that commit no call as they stream); to
    stream calls, ``open_call`` (and ``arguments`` for a reader other than ``JsonStream``), and
    ``after_call``, a pattern of what may close a call before the next one or the end."""

    markers: ClassVar[tuple[str, ...]] = ()
    leading: ClassVar[tuple[str, ...]] = ()
    after_call: ClassVar[regex.Pattern | None] = None

    def __init__(self, names: set[str], opening: str = "", tools: list[dict[str, Any]] | None = None) -> None:
        super().__init__(names, opening, tools)
        self.tools = tools
        self.sent = ""  # text already released
        self.held = opening  # text not released yet
        self.capturing = bool(opening)  # a call (marker or leading character) has begun
        self.calls: list[ToolCall] = []  # calls committed while streaming, their arguments so far
        self._at = 0  # where in ``held`` reading goes on
        self._reader: ArgumentsReader | None = None
        self._pending: ToolCall | None = None  # a call whose arguments have not started to come
        self._start = 0  # where in ``held`` the last call began
        self._streaming = True
        if self.capturing:
            self._advance()

    # -- the formats' streaming hooks ---------------------------------------------------------------

    def open_call(self, text: str, at: int, first: bool) -> Any:
        """The start of the next call in ``text`` from ``at`` (``first``: none went out yet), up to
        where its arguments begin: ``(name, end, id or None)`` for a call of a tool in ``names``,
        ``MORE`` while undecided, None when this is no call in the usual shape (the default: no
        call streams)."""
        return None

    def arguments(self, name: str) -> ArgumentsReader:
        """The reader of a call's arguments (default: a JSON object)."""
        return JsonStream()

    def new_id(self) -> str:
        """A call's id where the model gave none."""
        return new_id("call_")

    def parse_text(self, text: str) -> tuple[str, list[ToolCall]]:
        """``parse`` of a whole answer whose calls are not in the usual shape (nothing committed).
        A parser written before streamed calls overrides ``parse`` instead: that is used then."""
        if type(self).parse is not HeldToolParser.parse:
            return self.parse(text)
        raise NotImplementedError(f"{type(self).__name__} implements neither parse_text nor parse")

    def parse(self, text: str) -> tuple[str, list[ToolCall]]:
        """What the stream of ``text`` gives: its calls, and the text before them."""
        twin = type(self)(self.names, "", self.tools)
        out = twin.push(text)
        if not twin.calls:
            return self.parse_text(text)
        return out.rstrip(), twin.finish()[1]

    # -- the stream --------------------------------------------------------------------------------

    def push(self, piece: str) -> str:
        self.held += piece
        if self.capturing:
            self._advance()
            return ""
        if self.leading and not self.sent and self.held.lstrip()[:1] in self.leading:
            self.capturing = True
            self._advance()
            return ""
        found = [i for i in (self.held.find(m) for m in self.markers) if i >= 0]
        if found:
            self.capturing = True
            out, self.held = self.held[: min(found)], self.held[min(found) :]
            self._advance()
        else:
            keep = max((_partial(self.held, m) for m in self.markers), default=0)
            if self.leading and not self.sent and not self.held.strip():
                keep = len(self.held)  # leading whitespace: an answer of calls may still follow
            out, self.held = self.held[: len(self.held) - keep], self.held[len(self.held) - keep :]
        self.sent += out
        return out

    def _advance(self) -> None:
        """Read on in ``held``: start the calls that begin, extend the arguments of the open one."""
        text = self.held
        while self._streaming:
            if self._reader is None or self._reader.done:
                found = self.open_call(text, self._at, not self.calls)
                if found is MORE:
                    return
                if found is None or found[0] not in self.names:
                    self._streaming = False
                    return
                self._start = self._at
                name, self._at, given = found
                self._pending = ToolCall(id=given or self.new_id(), name=name, arguments="")
                self._reader = self.arguments(name)
            took, out = self._reader.feed(text[self._at :])
            self._at += took
            if self._pending is not None and (out or self._reader.done):
                self.calls.append(self._pending)  # committed: its first arguments came
                self._pending = None
            if out and self._pending is None:
                self.calls[-1].arguments += out
            if self._reader.failed:
                self._streaming = False
                if self._pending is not None:  # it never started: not a call, read from its start
                    self._pending, self._at = None, self._start
            if not self._reader.done:
                return

    def finish(self) -> tuple[str, list[ToolCall]]:
        if not self.calls:  # nothing committed: the whole answer as the format reads it
            _, calls = self.parse_text(self.sent + self.held)
            held, self.held = self.held, ""
            return ("", calls) if calls else (held, [])
        calls = list(self.calls)
        if self._pending is not None:  # a call that had not started: read from its start
            self._pending, self._at = None, self._start
        rest = self.held[self._at :]
        if self._closed():
            if self.after_call is not None and (m := self.after_call.match(rest)) is not None:
                rest = rest[m.end() :]
            # further calls in another shape (streaming stopped at them): read as the format reads them
            before, more = self.parse_text(rest) if rest.strip() else ("", [])
            if more and not before.strip():
                calls += more
                rest = ""
        if rest.strip():
            logger.debug("text after the tool calls left out of the answer: %r", rest[:200])
        self.held = ""
        return "", calls

    def _closed(self) -> bool:
        """Whether the last committed call's arguments are complete (``_at`` is then past them)."""
        return self._at == self._start or (self._reader is not None and self._reader.done)


def _partial(text: str, marker: str) -> int:
    """The length of the longest end of ``text`` that begins ``marker`` (0: none)."""
    longest = min(len(marker) - 1, len(text))
    return next((k for k in range(longest, 0, -1) if marker.startswith(text[-k:])), 0)
