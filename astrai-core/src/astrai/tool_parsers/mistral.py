"""``mistral``: ``[TOOL_CALLS]`` then the calls, in either of Mistral's two forms:

- a JSON list ``[{"name": ..., "arguments": {...}, "id": "a1b2c3d4e"}]`` (tokenizers v3 to v7;
  ``id`` optional, kept when given, else a new one in Mistral's form: nine letters and digits,
  which Mistral's templates check when the call comes back);
- ``[TOOL_CALLS]name[ARGS]{...}``, repeated for parallel calls, optionally
  ``[TOOL_CALLS]name[CALL_ID]a1b2c3d4e[ARGS]{...}`` (v11 and later: Mistral Small 3.2, Devstral).

The text before the first ``[TOOL_CALLS]`` is the answer's text; text after the calls, a call of an
unknown tool or one that does not decode leaves the whole answer text. Enforced by grammar in the
form the template teaches (``[ARGS]`` in it: the newer one).
"""

from __future__ import annotations

import secrets
import string
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

TOOL_CALLS, ARGS, CALL_ID = "[TOOL_CALLS]", "[ARGS]", "[CALL_ID]"
_ALNUM = string.ascii_letters + string.digits

# a call's start, as the grammar writes it: the JSON list's first or next item, or name[ARGS]{
_ARGS_HEAD = (
    r"\[TOOL_CALLS\]\s*(?P<name>[^\[\]\s]+)\s*(?:\[CALL_ID\]\s*(?P<id>[A-Za-z0-9]+)\s*)?\[ARGS\]\s*\{"
)
_FIRST = regex.compile(r"\s*(?:\[TOOL_CALLS\]\s*\[\s*" + JSON_HEAD + "|" + _ARGS_HEAD + ")")
# (an "id" the model writes after a streamed call's arguments comes too late: the call has its own)
_NEXT = regex.compile(r'\s*(?:(?:,\s*"id"\s*:\s*"[^"]*"\s*)?\}\s*,\s*' + JSON_HEAD + "|" + _ARGS_HEAD + ")")


def mistral_id() -> str:
    """A call id as Mistral's templates want them: nine letters and digits."""
    return "".join(secrets.choice(_ALNUM) for _ in range(9))


def parse_mistral_calls(text: str, names: set[str]) -> tuple[str, list[ToolCall]]:
    """``(text before [TOOL_CALLS], calls)``; ``(text, [])`` when any part after it is not a valid call."""
    start = text.find(TOOL_CALLS)
    if start < 0:
        return text, []
    calls: list[ToolCall] = []
    for part in text[start + len(TOOL_CALLS) :].split(TOOL_CALLS):
        part = part.strip()
        if part[:1] in ("[", "{"):
            found = calls_from_json(decode_json(part), names, mistral_id)
        else:
            found = _args_call(part, names)
        if not found:
            return text, []
        calls.extend(found)
    return text[:start].rstrip(), calls


def _args_call(part: str, names: set[str]) -> list[ToolCall] | None:
    """``name[ARGS]{...}`` or ``name[CALL_ID]id[ARGS]{...}`` as a call; None when it is not one."""
    head, sep, body = part.partition(ARGS)
    name, _, given = head.partition(CALL_ID)
    arguments = decode_json(body.strip())
    if not sep or name.strip() not in names or not isinstance(arguments, dict):
        return None
    found = calls_from_json(
        {"name": name.strip(), "arguments": arguments, "id": given.strip()}, names, mistral_id
    )
    return found


def _json_call(t: dict[str, Any]) -> dict[str, Any]:
    return {
        "type": "object",
        "properties": {"name": {"const": t["function"]["name"]}, "arguments": parameters(t)},
        "required": ["name", "arguments"],
        "additionalProperties": False,
    }


def _json_list(tools: list[dict[str, Any]], at_most: int | None = None) -> dict[str, Any]:
    calls = [_json_call(t) for t in tools]
    schema = {"type": "array", "items": calls[0] if len(calls) == 1 else {"anyOf": calls}, "minItems": 1}
    return schema if at_most is None else {**schema, "maxItems": at_most}


def _args_tags(tools: list[dict[str, Any]], prefix: str) -> list[dict[str, Any]]:
    return [
        {
            "begin": prefix + t["function"]["name"] + ARGS,
            "content": json_format(parameters(t)),
            "end": "",
        }
        for t in tools
    ]


class MistralToolParser(HeldToolParser):
    """Streams the text before ``[TOOL_CALLS]`` and holds everything from it to the end."""

    name = "mistral"
    markers = (TOOL_CALLS,)
    after_call = regex.compile(r'\s*(?:,\s*"id"\s*:\s*"[^"]*"\s*)?(?:\}\s*\]?)?')

    def open_call(self, text: str, at: int, first: bool) -> Any:
        return match_head(_FIRST if first else _NEXT, text, at, back=1)

    def new_id(self) -> str:
        return mistral_id()

    @classmethod
    def matches(cls, chat_template: str) -> bool:
        return TOOL_CALLS in chat_template

    @classmethod
    def auto_grammar(cls, tools: list[dict[str, Any]], chat_template: str = "") -> dict[str, Any]:
        if ARGS in chat_template:
            tags = _args_tags(tools, TOOL_CALLS)
            return structural_tag({"type": "triggered_tags", "triggers": [TOOL_CALLS], "tags": tags})
        content = json_format(_json_list(tools))
        tag = {"begin": TOOL_CALLS, "content": content, "end": ""}
        fmt = {"type": "triggered_tags", "triggers": [TOOL_CALLS], "tags": [tag], "stop_after_first": True}
        return structural_tag(fmt)

    @classmethod
    def forced_call(cls, tools: list[dict[str, Any]], chat_template: str = "") -> ForcedCall:
        if ARGS in chat_template:
            tags = [{"type": "tag", **t} for t in _args_tags(tools, "")]
            fmt = tags[0] if len(tags) == 1 else {"type": "or", "elements": tags}
            return ForcedCall(TOOL_CALLS, GrammarSpec.of("structural_tag", structural_tag(fmt)))
        listed = structural_tag(json_format(_json_list(tools, 1)))
        return ForcedCall(TOOL_CALLS, GrammarSpec.of("structural_tag", listed))

    def parse_text(self, text: str) -> tuple[str, list[ToolCall]]:
        return parse_mistral_calls(text, self.names)
