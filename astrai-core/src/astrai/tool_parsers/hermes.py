"""``hermes``: ``<tool_call>{"name": ..., "arguments": {...}}</tool_call>``, as Hermes, Qwen2/2.5/3,
SmolLM and most open chat templates teach.

Repeated tags; a JSON list inside one tag; a missing closing tag at the very end (EOS came first).
An answer without the tag that is wholly a JSON call is read as ``llama3_json`` reads it (models
trained on this format sometimes drop the tags; astrai has always accepted both).
"""

from __future__ import annotations

from astrai.protocol import ToolCall
from astrai.tool_parsers.base import ToolParser, calls_from_json, decode_json
from astrai.tool_parsers.llama3_json import parse_json_calls

OPEN, CLOSE = "<tool_call>", "</tool_call>"


def parse_hermes_calls(text: str, names: set[str]) -> tuple[str, list[ToolCall]]:
    """Split ``text`` into (plain text before the first call, tool calls); ``(text, [])`` unchanged when
    it holds no valid call for a tool in ``names``, or when text that is no call follows the calls."""
    start = text.find(OPEN)
    if start < 0:
        return parse_json_calls(text, names)
    calls: list[ToolCall] = []
    rest = text[start:]
    while rest.startswith(OPEN):
        end = rest.find(CLOSE)
        body, rest = (rest[len(OPEN) :], "") if end < 0 else (rest[len(OPEN) : end], rest[end + len(CLOSE) :])
        found = calls_from_json(decode_json(body.strip()), names)
        if found is None:
            return text, []
        calls.extend(found)
        rest = rest.lstrip()
    if rest:  # text after the calls that is not another call: not a clean tool-call turn
        return text, []
    return text[:start].rstrip(), calls


class HermesToolParser(ToolParser):
    """Streams text up to a possible call and holds back the rest until the end: everything before a
    ``<tool_call>`` tag (or before a trailing prefix of it) goes out, nothing once the output is
    inside a call or starts with a JSON object."""

    name = "hermes"

    def __init__(self, names: set[str], opening: str = "") -> None:
        super().__init__(names, opening)
        self.sent = ""  # text already released
        self.held = opening  # text not released yet
        self.capturing = bool(opening)  # a call (tag or leading JSON) has begun

    def parse(self, text: str) -> tuple[str, list[ToolCall]]:
        return parse_hermes_calls(text, self.names)

    def push(self, piece: str) -> str:
        self.held += piece
        if self.capturing:
            return ""
        if not self.sent and self.held.lstrip()[:1] in ("{", "["):
            self.capturing = True
            return ""
        tag = self.held.find(OPEN)
        if tag >= 0:
            self.capturing = True
            out, self.held = self.held[:tag], self.held[tag:]
        else:
            longest = min(len(OPEN) - 1, len(self.held))  # the held text's end may begin a tag
            keep = next((k for k in range(longest, 0, -1) if OPEN.startswith(self.held[-k:])), 0)
            if not self.sent and not self.held.strip():
                keep = len(self.held)  # leading whitespace: the JSON form may still follow
            out, self.held = self.held[: len(self.held) - keep], self.held[len(self.held) - keep :]
        self.sent += out
        return out

    def finish(self) -> tuple[str, list[ToolCall]]:
        _, calls = self.parse(self.sent + self.held)
        if not calls:
            held, self.held = self.held, ""
            return held, []
        self.held = ""
        return "", calls
