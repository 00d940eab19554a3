"""``qwen3_coder``: Qwen3-Coder's XML calls,

    <tool_call>
    <function=get_weather>
    <parameter=city>
    Paris
    </parameter>
    </function>
    </tool_call>

repeated for parallel calls. A value is converted by the type its tool's schema gives the
parameter: a string stays raw (one newline on either side is the format's, not the value's);
numbers, booleans, null, objects and arrays are read as JSON (a value that does not read as its
type stays a string, as vLLM does; an enum's value with spaces around it is the value). Calls
stream a parameter at a time (``XmlArguments``); a call cut inside keeps the parameters that went
out (``HeldToolParser``). Read as a whole text (a call not in this shape), a missing
``</tool_call>`` at the very end is accepted, not a missing ``</function>``; an unknown tool, stray
text inside a call or text after the calls leaves the answer text.

Enforced by grammar with xgrammar's ``qwen_xml`` JSON-schema style (each parameter's value valid
against its schema).
"""

from __future__ import annotations

import json
import re
from typing import Any

import regex

from astrai.grammar.base import GrammarSpec
from astrai.protocol import ToolCall, new_id
from astrai.tool_parsers.base import ForcedCall, json_format, parameters, structural_tag
from astrai.tool_parsers.held import HeldToolParser, match_head

OPEN, CLOSE = "<tool_call>", "</tool_call>"
_FUNCTION = re.compile(r"\s*<function=([^>\n]+)>(.*?)</function>\s*$", re.DOTALL)
_PARAMETER = re.compile(r"<parameter=([^>\n]+)>(.*?)</parameter>", re.DOTALL)
# streaming: a call's start up to its name, and its next parameter or its end
_HEAD = r"\s*<tool_call>\s*<function=(?P<name>[^>\n]+)>"
_FIRST = regex.compile(_HEAD)
_NEXT = regex.compile(r"\s*</tool_call>" + _HEAD)
_NEXT_PARAMETER = regex.compile(r"\s*(?:<parameter=([^>\n]+)>(.*?)</parameter>|(</function>))", regex.DOTALL)


def parse_qwen3_coder_calls(
    text: str, names: set[str], schemas: dict[str, dict[str, Any]]
) -> tuple[str, list[ToolCall]]:
    """``(text before the first call, calls)``; ``(text, [])`` when any call is not a valid one."""
    start = text.find(OPEN)
    if start < 0:
        return text, []
    calls: list[ToolCall] = []
    rest = text[start:]
    while rest.startswith(OPEN):
        end = rest.find(CLOSE)
        body, rest = (rest[len(OPEN) :], "") if end < 0 else (rest[len(OPEN) : end], rest[end + len(CLOSE) :])
        call = _call(body, names, schemas)
        if call is None:
            return text, []
        calls.append(call)
        rest = rest.lstrip()
    if rest:
        return text, []
    return text[:start].rstrip(), calls


def _call(body: str, names: set[str], schemas: dict[str, dict[str, Any]]) -> ToolCall | None:
    match = _FUNCTION.match(body)
    if match is None or match.group(1).strip() not in names:
        return None
    name, inner = match.group(1).strip(), match.group(2)
    if _PARAMETER.sub("", inner).strip():  # text between the parameters, or one left open
        return None
    props = schemas.get(name, {}).get("properties") or {}
    arguments = {
        key.strip(): convert(_unwrap(raw), props.get(key.strip())) for key, raw in _PARAMETER.findall(inner)
    }
    try:
        encoded = json.dumps(arguments, ensure_ascii=False, allow_nan=False)
    except ValueError:
        return None
    return ToolCall(id=new_id("call_"), name=name, arguments=encoded)


def _unwrap(raw: str) -> str:
    """A parameter's value without the newline on either side that the format puts there."""
    value = raw[1:] if raw.startswith("\n") else raw
    return value[:-1] if value.endswith("\n") else value


class XmlArguments:
    """A call's ``<parameter=...>`` elements as the canonical JSON of its arguments, one parameter at a
    time (each as ``convert`` reads it), ``}`` at ``</function>``."""

    def __init__(self, schema: dict[str, Any]) -> None:
        self.props = schema.get("properties") or {}
        self.keys: set[str] = set()
        self.done = self.failed = False

    def feed(self, text: str) -> tuple[int, str]:
        at, out = 0, []
        while not (self.done or self.failed):
            m = _NEXT_PARAMETER.match(text, at, partial=True)
            if m is None:
                self.failed = True
            elif m.partial:
                break
            elif m.group(3):  # </function>
                out.append("}" if self.keys else "{}")
                self.done, at = True, m.end()
            else:
                key = m.group(1).strip()
                try:
                    value = json.dumps(
                        convert(_unwrap(m.group(2)), self.props.get(key)), ensure_ascii=False, allow_nan=False
                    )
                except ValueError:
                    value = None
                if value is None or key in self.keys:  # not JSON, or a key given twice: not a prefix
                    self.failed = True
                    break
                out.append(
                    ("{" if not self.keys else ", ") + json.dumps(key, ensure_ascii=False) + ": " + value
                )
                self.keys.add(key)
                at = m.end()
        return at, "".join(out)


def convert(value: str, schema: Any) -> Any:
    """``value`` as the type ``schema`` gives it; the string itself for a string, an unknown
    parameter, a schema without a type, or a value that does not read as its type."""
    if not isinstance(schema, dict):
        return value
    choices = schema.get("enum") or ([schema["const"]] if "const" in schema else [])
    if value not in choices and value.strip() in choices:  # spaces around an enum's value (the
        return value.strip()  # grammar allows a few): the value meant
    kinds = schema.get("type")
    kinds = [kinds] if isinstance(kinds, str) else list(kinds or [])
    if not kinds:
        return value
    if "string" in kinds:
        return None if value.strip() == "null" and "null" in kinds else value
    text = value.strip()
    if text in ("True", "False"):
        text = text.lower()
    try:
        decoded = json.loads(text)
    except (ValueError, RecursionError):
        return value
    wanted = {
        "integer": lambda v: isinstance(v, int) and not isinstance(v, bool),
        "number": lambda v: isinstance(v, (int, float)) and not isinstance(v, bool),
        "boolean": lambda v: isinstance(v, bool),
        "null": lambda v: v is None,
        "object": lambda v: isinstance(v, dict),
        "array": lambda v: isinstance(v, list),
    }
    ok = any(wanted.get(k, lambda v: False)(decoded) for k in kinds)
    return decoded if ok else value


def _tag(t: dict[str, Any], begin: str) -> dict[str, Any]:
    return {
        "type": "tag",
        "begin": begin + "<function=" + t["function"]["name"] + ">\n",
        "content": json_format(parameters(t), "qwen_xml"),
        "end": "</function>\n" + CLOSE,
    }


class Qwen3CoderToolParser(HeldToolParser):
    """Streams text up to ``<tool_call>`` and holds everything from it to the end."""

    name = "qwen3_coder"
    markers = (OPEN,)
    after_call = regex.compile(r"\s*(?:</tool_call>)?")

    def open_call(self, text: str, at: int, first: bool) -> Any:
        return match_head(_FIRST if first else _NEXT, text, at)

    def arguments(self, name: str) -> XmlArguments:
        return XmlArguments(self.schemas.get(name, {}))

    @classmethod
    def matches(cls, chat_template: str) -> bool:
        return "<function=" in chat_template and "<parameter=" in chat_template

    @classmethod
    def auto_grammar(cls, tools: list[dict[str, Any]], chat_template: str = "") -> dict[str, Any]:
        tags = [{k: v for k, v in _tag(t, OPEN + "\n").items() if k != "type"} for t in tools]
        return structural_tag({"type": "triggered_tags", "triggers": [OPEN], "tags": tags})

    @classmethod
    def forced_call(cls, tools: list[dict[str, Any]], chat_template: str = "") -> ForcedCall:
        tags = [_tag(t, "") for t in tools]
        fmt = tags[0] if len(tags) == 1 else {"type": "or", "elements": tags}
        return ForcedCall(OPEN + "\n", GrammarSpec.of("structural_tag", structural_tag(fmt)))

    def parse_text(self, text: str) -> tuple[str, list[ToolCall]]:
        return parse_qwen3_coder_calls(text, self.names, self.schemas)
