"""``ToolParser``: the contract of the ``astrai.tool_parsers`` entry-point group, and the JSON helpers
the JSON formats share (a call is ``{"name": ..., "arguments" | "parameters": {...}}``).

A parser works on one choice's answer (after any reasoning): ``push`` releases the text that
cannot be part of a call as it streams and holds the rest; ``finish`` returns what it held that
was no call, and the calls; ``parse`` does both on a whole text. A call of a tool not in
``names`` is not a call: the text stays text. Malformed calls stay text too, never raised.
"""

from __future__ import annotations

import json
from abc import ABC, abstractmethod
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, ClassVar

from astrai.grammar.base import GrammarSpec
from astrai.plugins import check_class
from astrai.protocol import ToolCall, new_id

__all__ = ["TOOL_PARSERS", "ForcedCall", "ToolParser", "calls_from_json", "check_tool_parser"]
__all__ += ["JSON_HEAD", "MAX_WHITESPACE", "decode_json", "json_format", "parameters", "structural_tag"]

TOOL_PARSERS = "astrai.tool_parsers"

#: Whitespace a call's grammar allows in a row (JSON mode allows 16): arguments need no more than a
#: newline and an indent, and a model that loops on spaces ends its call instead of its token budget.
MAX_WHITESPACE = 4


#: A call's JSON object up to its arguments' ``{``, the name first, as the formats' grammars write it
#: (``HeldToolParser.open_call``: such a call streams as it is written).
JSON_HEAD = r'\{\s*"name"\s*:\s*"(?P<name>[^"\\\n]+)"\s*,\s*"(?:arguments|parameters)"\s*:\s*\{'


@dataclass(frozen=True)
class ForcedCall:
    """How an answer is made a call: ``opening`` ends the prompt, ``grammar`` constrains what follows
    (the rest of one call of one of the tools, arguments valid against its schema), and generation
    stops at any of ``stop`` (a closing tag; empty when the grammar's end is the call's end)."""

    opening: str
    grammar: GrammarSpec
    stop: tuple[str, ...] = ()


class ToolParser(ABC):
    """Tool calls out of one choice's answer; one instance per choice.

    ``names``: the request's tool names. ``opening``: the start of a call that the prompt already
    ends with (a required call, enforced by grammar): the output continues it. ``tools``: the
    request's tool definitions (OpenAI's ``{"type": "function", "function": {...}}``), for formats
    whose argument values are typed by the tool's schema (``qwen3_coder``).
    ``push``/``finish`` over any split of a text give the calls of ``parse`` of the whole text,
    and the released text plus ``finish``'s held text is the whole text when there is no call.
    A parser whose calls stream as they are written keeps them in a ``calls`` list as they grow
    (``HeldToolParser``): the server sends each call's start and its arguments' new pieces after
    every ``push``; ``finish`` then returns those calls first, unchanged.
    """

    name: ClassVar[str]  # entry-point name, e.g. "hermes"

    def __init__(self, names: set[str], opening: str = "", tools: list[dict[str, Any]] | None = None) -> None:
        self.names = names
        self.opening = opening
        self.schemas = {t["function"]["name"]: parameters(t) for t in tools or ()}

    @classmethod
    def matches(cls, chat_template: str) -> bool:
        """Whether this parser is the automatic choice for a model with ``chat_template`` (default: never)."""
        return False

    @classmethod
    def auto_grammar(cls, tools: list[dict[str, Any]], chat_template: str = "") -> dict[str, Any] | None:
        """An xgrammar structural tag for ``tool_choice`` auto: free text, except that any call the model
        opens is a valid call of one of ``tools`` (None, the default: not enforced)."""
        return None

    @classmethod
    def forced_call(cls, tools: list[dict[str, Any]], chat_template: str = "") -> ForcedCall | None:
        """How to make the answer one call of one of ``tools`` (a required or named ``tool_choice``; the
        named one is then the only tool). None, the default: not enforced."""
        return None

    @abstractmethod
    def parse(self, text: str) -> tuple[str, list[ToolCall]]:
        """``(text before the first call, calls)`` of a whole answer; ``(text, [])`` when it holds no
        valid call of a tool in ``names``."""

    @abstractmethod
    def push(self, piece: str) -> str:
        """The part of the text so far that can be released as plain text now."""

    @abstractmethod
    def finish(self) -> tuple[str, list[ToolCall]]:
        """``(held text to release as plain text, calls)`` once the answer has ended."""


def check_tool_parser(name: str, plugin: object, origin: str) -> type[ToolParser]:
    """Validate an ``astrai.tool_parsers`` plugin: a ``ToolParser`` named ``name``. Raises PluginError."""
    return check_class(ToolParser, name, plugin, origin)


def calls_from_json(
    obj: Any, names: set[str], make_id: Callable[[], str] | None = None
) -> list[ToolCall] | None:
    """ToolCalls for a decoded object or list of objects; None when any item is not a valid call.
    ``make_id``: the format's ids (a non-empty string ``"id"`` of an item is kept); None: ``call_...``
    ids, any given one ignored."""
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
        given = item.get("id") if make_id is not None else None
        call_id = given if isinstance(given, str) and given else (make_id or _call_id)()
        calls.append(ToolCall(id=call_id, name=item["name"], arguments=encoded))
    return calls or None


def decode_json(text: str) -> Any:
    """``json.loads(text)``, or None when it is not JSON."""
    try:
        return json.loads(text)
    except (ValueError, RecursionError):  # a grammar can make a model write 5,000 brackets
        return None


def _call_id() -> str:
    return new_id("call_")


def parameters(tool: dict[str, Any]) -> dict[str, Any]:
    """A tool definition's JSON schema of arguments (any object when it has none)."""
    return tool["function"].get("parameters") or {"type": "object"}


def json_format(schema: dict[str, Any], style: str = "json") -> dict[str, Any]:
    """A structural tag's element: a value valid against ``schema``, written in xgrammar's ``style``
    (``json``, or ``qwen_xml``'s ``<parameter=...>`` elements), whitespace bounded."""
    return {
        "type": "json_schema",
        "json_schema": schema,
        "style": style,
        "max_whitespace_cnt": MAX_WHITESPACE,
    }


def structural_tag(fmt: dict[str, Any]) -> dict[str, Any]:
    """xgrammar's structural tag of format ``fmt``."""
    return {"type": "structural_tag", "format": fmt}
