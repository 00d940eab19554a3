"""``pythonic``: the answer is a Python list of calls, ``[get_weather(city="Paris"), add(a=1, b=2)]``,
as Llama 3.2/4 pythonic templates and others teach (Llama 4 may wrap it in ``<|python_start|>`` and
``<|python_end|>``, with text before).

Read with ``ast``, never evaluated: each call is a listed tool's name with keyword arguments whose
values are literals (strings, numbers, ``True``/``False``/``None`` and JSON's ``true``/``false``/
``null``, lists, tuples and dicts of them); the arguments become a JSON object. Anything else
(a positional argument, an expression, an unknown name, text after the list) leaves the answer text.

Enforced by grammar: each call writes the tool's required arguments in the schema's order, each a
JSON value valid against its schema (JSON's literals read as Python's); ``tool_choice`` auto lets
the answer be text that does not start with ``[``, or a list of valid calls.
"""

from __future__ import annotations

import ast
import json
from typing import Any

import regex

from astrai.grammar.base import GrammarSpec
from astrai.protocol import ToolCall, new_id
from astrai.tool_parsers.base import ForcedCall, json_format, parameters, structural_tag
from astrai.tool_parsers.held import HeldToolParser, match_head

START, END = "<|python_start|>", "<|python_end|>"
NOT_A_LIST = r"\s*([^\[\s][\s\S]*)?"
_NAMES = {"true": True, "false": False, "null": None}
# streaming: a call's start up to its "(", the list's first or next
_FIRST = regex.compile(r"\s*(?:<\|python_start\|>\s*)?\[\s*(?P<name>[A-Za-z_]\w*)\s*\(")
_NEXT = regex.compile(r"\s*,\s*(?P<name>[A-Za-z_]\w*)\s*\(")


def parse_pythonic_calls(text: str, names: set[str]) -> tuple[str, list[ToolCall]]:
    """``(text before the list, calls)``; ``(text, [])`` when the answer is not a list of valid calls."""
    before, body = "", text.strip()
    if (at := body.find(START)) >= 0:
        before, body = body[:at].rstrip(), body[at + len(START) :].strip()
        body = body.removesuffix(END).rstrip()
    if not body.startswith("["):
        return text, []
    try:
        tree = ast.parse(body, mode="eval").body
        if not isinstance(tree, ast.List) or not tree.elts:
            return text, []
        calls = [_call(node, names) for node in tree.elts]
    except (SyntaxError, ValueError, TypeError, RecursionError, MemoryError):
        return text, []
    return before, calls


def _call(node: ast.expr, names: set[str]) -> ToolCall:
    """A call node as a ToolCall; ValueError when it is not a call of a listed tool with literal keywords."""
    if not isinstance(node, ast.Call) or not isinstance(node.func, ast.Name) or node.func.id not in names:
        raise ValueError("not a call of a listed tool")
    return ToolCall(id=new_id("call_"), name=node.func.id, arguments=_arguments(node))


def _arguments(node: ast.Call) -> str:
    """A call node's keyword arguments as a JSON object; ValueError for anything but literal keywords."""
    if node.args or any(k.arg is None for k in node.keywords):
        raise ValueError("positional or ** arguments")
    arguments = {k.arg: _literal(k.value) for k in node.keywords}
    return json.dumps(arguments, ensure_ascii=False, allow_nan=False)


class CallArguments:
    """A call's arguments, from its ``(`` to the ``)`` that closes it (brackets and string literals
    followed), out in one piece once complete: a call's values are Python literals, whose JSON is
    known only whole (so a call cut short or not of literals never starts: it stays text)."""

    def __init__(self) -> None:
        self.body = ""
        self.depth = 0
        self.quote = ""  # the open string's quote (one character or three), or none
        self.escaped = False
        self.done = self.failed = False

    def feed(self, text: str) -> tuple[int, str]:
        for i, ch in enumerate(text):
            self.body += ch
            if self.quote:
                if self.escaped:
                    self.escaped = False
                elif ch == "\\":
                    self.escaped = True
                elif self.body.endswith(self.quote):
                    self.quote = ""
            elif ch in "\"'":
                self.quote = ch * 3 if self.body.endswith(ch * 3) and len(self.body) >= 3 else ch
            elif ch in "([{":
                self.depth += 1
            elif ch in ")]}":
                self.depth -= 1
                if self.depth < 0:
                    return i + 1, self._end()
        return len(text), ""

    def _end(self) -> str:
        try:
            node = ast.parse("f(" + self.body, mode="eval").body
            arguments = _arguments(node) if isinstance(node, ast.Call) else None
        except (SyntaxError, ValueError, TypeError, RecursionError, MemoryError):
            arguments = None
        self.done, self.failed = arguments is not None, arguments is None
        return arguments or ""


def _literal(node: ast.expr) -> Any:
    """The value of a literal node; ValueError for anything else."""
    if isinstance(node, ast.Constant) and (node.value is None or isinstance(node.value, (str, int, float))):
        return node.value
    if isinstance(node, ast.Name) and node.id in _NAMES:
        return _NAMES[node.id]
    if isinstance(node, ast.UnaryOp) and isinstance(node.op, (ast.USub, ast.UAdd)):
        value = _literal(node.operand)
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise ValueError("a sign before no number")
        return -value if isinstance(node.op, ast.USub) else value
    if isinstance(node, (ast.List, ast.Tuple)):
        return [_literal(e) for e in node.elts]
    if isinstance(node, ast.Dict):
        keys = [_literal(k) if k is not None else None for k in node.keys]
        if not all(isinstance(k, str) for k in keys):
            raise ValueError("a dict key that is not a string")
        return dict(zip(keys, (_literal(v) for v in node.values), strict=True))
    raise ValueError(f"not a literal: {type(node).__name__}")


def _call_tag(t: dict[str, Any]) -> dict[str, Any]:
    """A call of tool ``t``: ``name(`` then its required arguments ``key=<JSON>``, comma-separated, then ``)``."""
    schema = parameters(t)
    props = schema.get("properties") or {}
    required = [k for k in props if k in set(schema.get("required") or ())]
    elements: list[dict[str, Any]] = []
    for i, key in enumerate(required):
        elements.append({"type": "const_string", "value": (", " if i else "") + key + "="})
        elements.append(json_format(props[key] or {}))
    content = (
        {"type": "sequence", "elements": elements} if elements else {"type": "const_string", "value": ""}
    )
    return {"type": "tag", "begin": t["function"]["name"] + "(", "content": content, "end": ")"}


def _calls(tools: list[dict[str, Any]], at_most_one: bool) -> dict[str, Any]:
    tags = [_call_tag(t) for t in tools]
    return {
        "type": "tags_with_separator",
        "tags": tags,
        "separator": ", ",
        "at_least_one": True,
        "stop_after_first": at_most_one,
    }


class PythonicToolParser(HeldToolParser):
    """Streams text at once unless the answer starts with ``[`` (or reaches ``<|python_start|>``): then
    it holds everything until the end."""

    name = "pythonic"
    markers = (START,)
    leading = ("[",)
    after_call = regex.compile(r"\s*\]\s*(?:<\|python_end\|>)?")

    def open_call(self, text: str, at: int, first: bool) -> Any:
        return match_head(_FIRST if first else _NEXT, text, at)

    def arguments(self, name: str) -> CallArguments:
        return CallArguments()

    @classmethod
    def matches(cls, chat_template: str) -> bool:
        return "[func_name1(" in chat_template or START in chat_template

    @classmethod
    def auto_grammar(cls, tools: list[dict[str, Any]], chat_template: str = "") -> dict[str, Any]:
        listed = {
            "type": "sequence",
            "elements": [
                {"type": "const_string", "value": "["},
                _calls(tools, False),
                {"type": "const_string", "value": "]"},
            ],
        }
        return structural_tag({"type": "or", "elements": [{"type": "regex", "pattern": NOT_A_LIST}, listed]})

    @classmethod
    def forced_call(cls, tools: list[dict[str, Any]], chat_template: str = "") -> ForcedCall:
        fmt = {"type": "sequence", "elements": [_calls(tools, True), {"type": "const_string", "value": "]"}]}
        return ForcedCall("[", GrammarSpec.of("structural_tag", structural_tag(fmt)))

    def parse_text(self, text: str) -> tuple[str, list[ToolCall]]:
        return parse_pythonic_calls(text, self.names)
