"""``llama3_json``: the whole answer is one JSON call ``{"name": ..., "arguments" | "parameters": ...}``
or a list of them, as Llama 3.x templates teach."""

from __future__ import annotations

from astrai.protocol import ToolCall
from astrai.tool_parsers.base import ToolParser, calls_from_json, decode_json


def parse_json_calls(text: str, names: set[str]) -> tuple[str, list[ToolCall]]:
    """``("", calls)`` when the whole of ``text`` is a JSON call or list of calls, else ``(text, [])``."""
    stripped = text.strip()
    if stripped[:1] in ("{", "["):
        calls = calls_from_json(decode_json(stripped), names)
        if calls:
            return "", calls
    return text, []


class Llama3JsonToolParser(ToolParser):
    """Streams text at once unless the answer starts (after whitespace) with ``{`` or ``[``: then
    it holds everything until the end."""

    name = "llama3_json"

    def __init__(self, names: set[str], opening: str = "") -> None:
        super().__init__(names, opening)
        self.sent = ""
        self.held = opening
        self.capturing = bool(opening)

    def parse(self, text: str) -> tuple[str, list[ToolCall]]:
        return parse_json_calls(text, self.names)

    def push(self, piece: str) -> str:
        self.held += piece
        if self.capturing:
            return ""
        if not self.sent:
            head = self.held.lstrip()
            if head[:1] in ("{", "["):
                self.capturing = True
                return ""
            if not head:
                return ""  # leading whitespace: the JSON form may still follow
        out, self.held = self.held, ""
        self.sent += out
        return out

    def finish(self) -> tuple[str, list[ToolCall]]:
        held, self.held = self.held, ""
        _, calls = self.parse(self.sent + held)
        return ("", calls) if calls else (held, [])
