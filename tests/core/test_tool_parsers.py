"""Tool-call parsers ``hermes`` and ``llama3_json``: fixed answers parse as documented, and every split
of an answer into pieces streams to the whole answer's result (released text plus held text is the
text when there is no call; the calls are the same)."""

from __future__ import annotations

import json

import pytest

from astrai.errors import PluginError
from astrai.tool_parsers import ToolParser, choose_tool_parser
from astrai.tool_parsers.hermes import HermesToolParser
from astrai.tool_parsers.llama3_json import Llama3JsonToolParser

NAMES = {"get_weather", "add"}
CALL = '{"name": "get_weather", "arguments": {"city": "Rome"}}'
CASES = {
    # (parser, answer): (text, [(name, arguments)])
    "hermes": (
        HermesToolParser,
        f"Let me check.\n<tool_call>\n{CALL}\n</tool_call>",
        ("Let me check.", [("get_weather", '{"city": "Rome"}')]),
    ),
    "hermes-two": (
        HermesToolParser,
        f'<tool_call>{CALL}</tool_call>\n<tool_call>{{"name": "add", "arguments": {{"a": 1}}}}</tool_call>',
        ("", [("get_weather", '{"city": "Rome"}'), ("add", '{"a": 1}')]),
    ),
    "hermes-unclosed": (
        HermesToolParser,
        f"<tool_call>\n{CALL}",
        ("", [("get_weather", '{"city": "Rome"}')]),
    ),
    "hermes-bare-json": (HermesToolParser, f"  {CALL}", ("", [("get_weather", '{"city": "Rome"}')])),
    "hermes-unknown-tool": (
        HermesToolParser,
        '<tool_call>{"name": "rm", "arguments": {}}</tool_call>',
        ('<tool_call>{"name": "rm", "arguments": {}}</tool_call>', []),
    ),
    "hermes-broken": (HermesToolParser, "<tool_call>{oops</tool_call>", ("<tool_call>{oops</tool_call>", [])),
    "hermes-text": (HermesToolParser, "a <tool b", ("a <tool b", [])),
    "llama3_json": (
        Llama3JsonToolParser,
        f'\n[{CALL}, {{"name": "add", "parameters": {{"a": 2}}}}]',
        ("", [("get_weather", '{"city": "Rome"}'), ("add", '{"a": 2}')]),
    ),
    "llama3_json-tagged-is-text": (
        Llama3JsonToolParser,
        f"<tool_call>{CALL}</tool_call>",
        (f"<tool_call>{CALL}</tool_call>", []),
    ),
    "llama3_json-text": (Llama3JsonToolParser, "  plain {text}", ("  plain {text}", [])),
}


def _calls(calls: list) -> list[tuple[str, str]]:
    return [(c.name, json.dumps(json.loads(c.arguments))) for c in calls]


def _streamed(parser: ToolParser, pieces: list[str]) -> tuple[str, list[tuple[str, str]]]:
    released = "".join(parser.push(p) for p in pieces)
    held, calls = parser.finish()
    return (released + held if not calls else released.rstrip()), _calls(calls)


@pytest.mark.parametrize("case", list(CASES), ids=list(CASES))
def test_whole_answer(case: str) -> None:
    cls, text, (expected_text, expected_calls) = CASES[case]
    got_text, calls = cls(NAMES).parse(text)
    assert (got_text, _calls(calls)) == (expected_text, expected_calls)


@pytest.mark.parametrize("case", list(CASES), ids=list(CASES))
def test_every_split_streams_to_the_whole_answer(case: str) -> None:
    cls, text, expected = CASES[case]
    for i in range(len(text) + 1):
        assert _streamed(cls(NAMES), [text[:i], text[i:]]) == expected, i
    assert _streamed(cls(NAMES), list(text)) == expected


def test_chosen_through_entry_points() -> None:
    assert choose_tool_parser(None) is HermesToolParser
    assert choose_tool_parser("llama3_json") is Llama3JsonToolParser
    installed = "hermes, llama3_json, mistral, pythonic, qwen3_coder"
    with pytest.raises(PluginError, match=f"'nope' not found.*Installed: {installed}"):
        choose_tool_parser("nope")
