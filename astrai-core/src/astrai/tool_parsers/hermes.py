"""``hermes``: ``<tool_call>{"name": ..., "arguments": {...}}</tool_call>``, as Hermes, Qwen2/2.5/3,
SmolLM and most open chat templates teach.

Repeated tags; a JSON list inside one tag; a missing closing tag at the very end (EOS came first).
An answer without the tag that is wholly a JSON call is read as ``llama3_json`` reads it (models
trained on this format sometimes drop the tags; astrai has always accepted both).

Enforced by grammar: ``tool_choice`` auto gets a structural tag (free text; once the model writes
``<tool_call>``, a call of a listed tool with valid arguments, closed by the tag); a required call
gets ``<tool_call>`` and a newline at the end of the prompt, a JSON schema of one call, and stops at
``</tool_call>``.
"""

from __future__ import annotations

import json
from typing import Any

import regex

from astrai.grammar.base import GrammarSpec
from astrai.protocol import ToolCall
from astrai.tool_parsers.base import (
    JSON_HEAD,
    ForcedCall,
    calls_from_json,
    decode_json,
    json_format,
    parameters,
    structural_tag,
)
from astrai.tool_parsers.held import HeldToolParser, match_head
from astrai.tool_parsers.llama3_json import parse_json_calls

OPEN, CLOSE = "<tool_call>", "</tool_call>"

_FIRST = regex.compile(r"\s*<tool_call>\s*" + JSON_HEAD)
_NEXT = regex.compile(r"\s*\}\s*</tool_call>\s*<tool_call>\s*" + JSON_HEAD)


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


def call_head(name: str) -> str:
    """How a call of tool ``name`` starts: ``<tool_call>``, a newline, ``{"name": <name>, "arguments": ``."""
    return OPEN + "\n" + '{"name": ' + json.dumps(name, ensure_ascii=False) + ', "arguments": '


def call_schema(tools: list[dict[str, Any]], arguments: str = "arguments") -> dict[str, Any]:
    """The JSON schema of one call ``{"name": ..., "arguments": {...}}`` of any of ``tools``."""
    calls = [
        {
            "type": "object",
            "properties": {"name": {"const": t["function"]["name"]}, arguments: parameters(t)},
            "required": ["name", arguments],
            "additionalProperties": False,
        }
        for t in tools
    ]
    return calls[0] if len(calls) == 1 else {"anyOf": calls}


class HermesToolParser(HeldToolParser):
    """Streams text up to a possible call and holds back the rest until the end: everything before a
    ``<tool_call>`` tag (or before a trailing prefix of it) goes out, nothing once the output is
    inside a call or starts with a JSON object."""

    name = "hermes"
    markers = (OPEN,)
    leading = ("{", "[")
    after_call = regex.compile(r"\s*\}\s*(?:</tool_call>)?")

    def open_call(self, text: str, at: int, first: bool) -> Any:
        return match_head(_FIRST if first else _NEXT, text, at, back=1)

    @classmethod
    def matches(cls, chat_template: str) -> bool:
        return OPEN in chat_template and "<function=" not in chat_template  # (that is qwen3_coder's XML)

    @classmethod
    def auto_grammar(cls, tools: list[dict[str, Any]], chat_template: str = "") -> dict[str, Any]:
        tags = [
            {
                "begin": call_head(t["function"]["name"]),
                "content": json_format(parameters(t)),
                "end": "}\n" + CLOSE,
            }
            for t in tools
        ]
        return structural_tag({"type": "triggered_tags", "triggers": [OPEN], "tags": tags})

    @classmethod
    def forced_call(cls, tools: list[dict[str, Any]], chat_template: str = "") -> ForcedCall:
        return ForcedCall(OPEN + "\n", GrammarSpec.of("json_schema", call_schema(tools)), (CLOSE,))

    def parse_text(self, text: str) -> tuple[str, list[ToolCall]]:
        return parse_hermes_calls(text, self.names)
