"""Tool calls enforced by grammar, in the ``<tool_call>`` format (parsing them out of the answer is
the job of the ``astrai.tool_parsers`` plugins: ``astrai.tool_parsers.hermes`` and ``llama3_json``).

A request that must call a tool gets the opening of a ``<tool_call>`` appended to
its prompt (``call_opening``), a grammar that makes the rest a valid call of one of its
tools (``open_tool_call``), and stops at the closing tag: the answer always parses.
"""

from __future__ import annotations

import dataclasses
import json
from typing import Any

from astrai.errors import RequestRejected
from astrai.grammar import GrammarSpec
from astrai.protocol import Prepared
from astrai.tool_parsers.hermes import CLOSE, OPEN, HermesToolParser, parse_hermes_calls

#: Today's names of the ``hermes`` parser's pieces, kept for the code and tests that use them.
ToolCallStreamFilter = HermesToolParser
parse_tool_calls = parse_hermes_calls

__all__ = ["CLOSE", "OPEN", "ToolCallStreamFilter", "call_opening", "call_schema", "calls_tag"]
__all__ += ["open_tool_call", "parse_tool_calls"]


def call_opening(tokenizer: Any, name: str | None) -> str:
    """The start of a tool call to append to a prompt whose answer must be one ("" if not enforceable).

    ``<tool_call>`` and a newline, then ``{"name": <name>, "arguments": `` when the tool is known.
    Only in the ``<tool_call>`` format: the one ``chat_prompt_ids`` describes to a template that
    ignores tools, or that the template uses itself. A template that teaches another format
    (Llama 3's bare JSON, Mistral's ``[TOOL_CALLS]``) gets "": the choice is then not enforced.
    """
    template = getattr(tokenizer, "chat_template", None) or ""
    if "tools" in template and OPEN not in template:
        return ""
    return _call_head(name) if name else OPEN + "\n"


def _call_head(name: str) -> str:
    """How a call of tool ``name`` starts: ``<tool_call>``, a newline, ``{"name": <name>, "arguments": ``."""
    return OPEN + "\n" + '{"name": ' + json.dumps(name, ensure_ascii=False) + ', "arguments": '


def open_tool_call(p: Prepared, tokenizer: Any) -> str:
    """A request that must call a tool: end its prompt with the opening of a call, constrain what
    follows to a call of one of ``p.tools`` with arguments valid against its ``parameters``
    (a JSON-schema grammar, so the answer always parses), and stop at the closing tag. A request
    that may call one (``auto``, no other constraint) gets a structural tag instead: free text,
    and any call it opens is a valid one (``calls_tag``). Returns the opening ("" when not
    required, for several prompts, or when the template teaches another format, where nothing is
    enforced). Modifies ``p.prompt_ids`` and ``p.params``."""
    if not p.tools or p.prompts is not None:
        return ""
    opening = call_opening(tokenizer, None)
    if not opening:
        return ""
    if not p.tool_call_required:
        if p.params.grammar is None:  # free text, but a call the model opens is a valid call
            p.params = dataclasses.replace(
                p.params, grammar=GrammarSpec.of("structural_tag", calls_tag(p.tools))
            )
        return ""
    if p.params.grammar is not None:
        raise RequestRejected(
            "a required tool call and a response format cannot both constrain the answer", param="tool_choice"
        )
    p.prompt_ids = [*p.prompt_ids, *tokenizer.encode(opening, add_special_tokens=False)]
    grammar = GrammarSpec.of("json_schema", call_schema(p.tools))
    p.params = dataclasses.replace(p.params, stop=[*p.params.stop, CLOSE], grammar=grammar)
    return opening


def calls_tag(tools: list[dict[str, Any]]) -> dict[str, Any]:
    """An xgrammar structural tag: free text, except that once the model writes ``<tool_call>`` what
    follows is a call ``{"name": ..., "arguments": {...}}`` of one of ``tools``, closed by the tag."""
    tags = [
        {
            "begin": _call_head(t["function"]["name"]),
            "content": {
                "type": "json_schema",
                "json_schema": t["function"].get("parameters") or {"type": "object"},
            },
            "end": "}\n" + CLOSE,
        }
        for t in tools
    ]
    return {"type": "structural_tag", "format": {"type": "triggered_tags", "triggers": [OPEN], "tags": tags}}


def call_schema(tools: list[dict[str, Any]]) -> dict[str, Any]:
    """The JSON schema of one call ``{"name": ..., "arguments": {...}}`` of any of ``tools``."""
    calls = [
        {
            "type": "object",
            "properties": {
                "name": {"const": t["function"]["name"]},
                "arguments": t["function"].get("parameters") or {"type": "object"},
            },
            "required": ["name", "arguments"],
            "additionalProperties": False,
        }
        for t in tools
    ]
    return calls[0] if len(calls) == 1 else {"anyOf": calls}
