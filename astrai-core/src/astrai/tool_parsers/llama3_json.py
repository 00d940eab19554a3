"""``llama3_json``: the whole answer is one JSON call ``{"name": ..., "arguments" | "parameters": ...}``
or a list of them, as Llama 3.x templates teach (chosen for a template that asks for
``{"name": function name, "parameters": dictionary of argument name and its value}``).

Enforced by grammar: ``tool_choice`` auto lets the answer be text that does not start with ``{`` or
``[``, or one valid call; a required call is one ``{"name": ..., "parameters": {...}}`` object.
"""

from __future__ import annotations

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

#: An answer that is text, not calls: it does not start (after whitespace) with ``{`` or ``[``.
NOT_JSON = r"\s*([^\[{\s][\s\S]*)?"

_FIRST = regex.compile(r"\s*(?:\[\s*)?" + JSON_HEAD)
_NEXT = regex.compile(r"\s*\}\s*,\s*" + JSON_HEAD)


def parse_json_calls(text: str, names: set[str]) -> tuple[str, list[ToolCall]]:
    """``("", calls)`` when the whole of ``text`` is a JSON call or list of calls, else ``(text, [])``."""
    stripped = text.strip()
    if stripped[:1] in ("{", "["):
        calls = calls_from_json(decode_json(stripped), names)
        if calls:
            return "", calls
    return text, []


def _call(tools: list[dict[str, Any]]) -> dict[str, Any]:
    calls = [
        {
            "type": "object",
            "properties": {"name": {"const": t["function"]["name"]}, "parameters": parameters(t)},
            "required": ["name", "parameters"],
            "additionalProperties": False,
        }
        for t in tools
    ]
    return calls[0] if len(calls) == 1 else {"anyOf": calls}


class Llama3JsonToolParser(HeldToolParser):
    """Streams text at once unless the answer starts (after whitespace) with ``{`` or ``[``: then
    it holds everything until the end."""

    name = "llama3_json"
    leading = ("{", "[")
    after_call = regex.compile(r"\s*\}\s*\]?")

    def open_call(self, text: str, at: int, first: bool) -> Any:
        return match_head(_FIRST if first else _NEXT, text, at, back=1)

    @classmethod
    def matches(cls, chat_template: str) -> bool:
        return '"parameters": dictionary of argument name' in chat_template

    @classmethod
    def auto_grammar(cls, tools: list[dict[str, Any]], chat_template: str = "") -> dict[str, Any]:
        call = json_format(_call(tools))
        return structural_tag({"type": "or", "elements": [{"type": "regex", "pattern": NOT_JSON}, call]})

    @classmethod
    def forced_call(cls, tools: list[dict[str, Any]], chat_template: str = "") -> ForcedCall:
        return ForcedCall("", GrammarSpec.of("structural_tag", structural_tag(json_format(_call(tools)))))

    def parse_text(self, text: str) -> tuple[str, list[ToolCall]]:
        return parse_json_calls(text, self.names)
