"""Tool calls out of generated text, in the formats chat templates teach models.

Recognised (what Hermes, Qwen2/2.5, SmolLM and most open chat templates use):

* ``<tool_call>{"name": ..., "arguments": {...}}</tool_call>``, repeated; a JSON
  list inside one tag; a missing closing tag at the very end (EOS came first);
* the whole output being one JSON object ``{"name": ..., "arguments" | "parameters": ...}``
  or a list of them (Llama 3.x style).

A call whose name is not one of the request's tools is not a tool call: the
text stays text. Protocol-neutral: builders receive ``astrai.protocol.ToolCall``.

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
from astrai.protocol import Prepared, ToolCall, new_id

OPEN, CLOSE = "<tool_call>", "</tool_call>"


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


def _calls_from_json(obj: Any, names: set[str]) -> list[ToolCall] | None:
    """ToolCalls for a decoded object or list of objects; None when any item is not a valid call."""
    items = obj if isinstance(obj, list) else [obj]
    calls = []
    for item in items:
        if not isinstance(item, dict) or item.get("name") not in names:
            return None
        args = item.get("arguments", item.get("parameters", {}))
        try:
            if isinstance(args, str):  # some templates emit the arguments already encoded
                args = json.loads(args)
            encoded = json.dumps(args, ensure_ascii=False) if isinstance(args, dict) else None
        except (ValueError, RecursionError):  # not JSON, or nested too deep to re-encode
            return None
        if encoded is None:
            return None
        calls.append(ToolCall(id=new_id("call_"), name=item["name"], arguments=encoded))
    return calls or None


def _decode(text: str) -> Any:
    try:
        return json.loads(text)
    except (ValueError, RecursionError):  # a grammar can make a model write 5,000 brackets
        return None


def parse_tool_calls(text: str, names: set[str]) -> tuple[str, list[ToolCall]]:
    """Split ``text`` into (plain text before the first call, tool calls).

    Returns ``(text, [])`` unchanged when ``text`` holds no valid call for a tool in
    ``names``; malformed JSON inside the tags is left as text, never raised.
    """
    start = text.find(OPEN)
    if start < 0:
        stripped = text.strip()
        if stripped[:1] in ("{", "["):
            calls = _calls_from_json(_decode(stripped), names)
            if calls:
                return "", calls
        return text, []
    calls: list[ToolCall] = []
    rest = text[start:]
    while rest.startswith(OPEN):
        end = rest.find(CLOSE)
        body, rest = (rest[len(OPEN) :], "") if end < 0 else (rest[len(OPEN) : end], rest[end + len(CLOSE) :])
        found = _calls_from_json(_decode(body.strip()), names)
        if found is None:
            return text, []
        calls.extend(found)
        rest = rest.lstrip()
    if rest:  # text after the calls that is not another call: not a clean tool-call turn
        return text, []
    return text[:start].rstrip(), calls


class ToolCallStreamFilter:
    """Streams text up to a possible tool call and holds back the rest until the end.

    ``push(piece)`` returns the text that can be sent now: everything before a
    ``<tool_call>`` tag (or before a trailing prefix of it), nothing once the
    output is inside a call or starts with a JSON object. ``finish()`` returns
    ``(held text to send as plain text, tool calls)``. ``opening``: the part of a
    call that the prompt already holds (see ``call_opening``); the output continues it.
    """

    def __init__(self, names: set[str], opening: str = "") -> None:
        self.names = names
        self.sent = ""  # text already released
        self.held = opening  # text not released yet
        self.capturing = bool(opening)  # a call (tag or leading JSON) has begun

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
        text, calls = parse_tool_calls(self.sent + self.held, self.names)
        if not calls:
            held, self.held = self.held, ""
            return held, []
        self.held = ""
        return "", calls
