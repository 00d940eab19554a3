"""Tool-call parsers ``mistral``, ``pythonic`` and ``qwen3_coder``: fixed answers parse as documented,
every split of an answer streams to the whole answer's result, and each parser's grammars (``auto``
and a forced call) accept a valid call in its format, which then parses, and refuse arguments
against the schema."""

from __future__ import annotations

import json

import pytest

from astrai.tool_parsers import ToolParser, choose_tool_parser
from astrai.tool_parsers.hermes import HermesToolParser
from astrai.tool_parsers.llama3_json import Llama3JsonToolParser
from astrai.tool_parsers.mistral import MistralToolParser
from astrai.tool_parsers.pythonic import PythonicToolParser
from astrai.tool_parsers.qwen3_coder import Qwen3CoderToolParser

NAMES = {"get_weather", "add"}
SCHEMA = {
    "type": "object",
    "properties": {"city": {"type": "string"}, "days": {"type": "integer"}, "hot": {"type": "boolean"}},
    "required": ["city", "days"],
}
ADD = {
    "type": "object",
    "properties": {"a": {"type": "number"}, "tags": {"type": "array"}},
    "required": ["a"],
}
TOOLS = [
    {"type": "function", "function": {"name": "get_weather", "parameters": SCHEMA}},
    {"type": "function", "function": {"name": "add", "parameters": ADD}},
]
ROME = ("get_weather", {"city": "Rome", "days": 2})
XML_ROME = "<tool_call>\n<function=get_weather>\n<parameter=city>\nRome\n</parameter>\n<parameter=days>\n2\n</parameter>\n</function>\n</tool_call>"
CASES = {
    # (parser, answer): (text, [(name, arguments)])
    "mistral-list": (
        MistralToolParser,
        'Sure.[TOOL_CALLS][{"name": "get_weather", "arguments": {"city": "Rome", "days": 2}}, {"name": "add", "arguments": {"a": 1}}]',
        ("Sure.", [ROME, ("add", {"a": 1})]),
    ),
    "mistral-args": (
        MistralToolParser,
        '[TOOL_CALLS]get_weather[ARGS]{"city": "Rome", "days": 2}[TOOL_CALLS]add[CALL_ID]abc123XYZ[ARGS]{"a": 1}',
        ("", [ROME, ("add", {"a": 1})]),
    ),
    "mistral-unknown": (MistralToolParser, '[TOOL_CALLS][{"name": "rm", "arguments": {}}]', None),
    # a call that goes wrong once its arguments began keeps what of them went out
    "mistral-broken": (MistralToolParser, "[TOOL_CALLS]get_weather[ARGS]{oops", ("", [("get_weather", "{")])),
    "mistral-text": (MistralToolParser, "a [TOOL b [x]", None),
    "pythonic": (
        PythonicToolParser,
        '[get_weather(city="Rome", days=2), add(a=-1.5, tags=["x", true, None])]',
        ("", [ROME, ("add", {"a": -1.5, "tags": ["x", True, None]})]),
    ),
    "pythonic-llama4": (
        PythonicToolParser,
        "Checking.<|python_start|>[get_weather(city='Rome', days=2)]<|python_end|>",
        ("Checking.", [ROME]),
    ),
    "pythonic-unknown": (PythonicToolParser, "[rm(path='/')]", None),
    "pythonic-code": (PythonicToolParser, "[get_weather(city=__import__('os').getcwd())]", None),
    "pythonic-positional": (PythonicToolParser, "[get_weather('Rome')]", None),
    "pythonic-broken": (PythonicToolParser, "[get_weather(city='Rome'", None),
    "pythonic-text": (PythonicToolParser, "[1] is a footnote", None),
    "qwen3_coder": (
        Qwen3CoderToolParser,
        "Let me look.\n" + XML_ROME + "\n<tool_call>\n<function=add>\n<parameter=a>\n3\n</parameter>\n"
        '<parameter=tags>\n["x"]\n</parameter>\n</function>\n</tool_call>',
        ("Let me look.", [ROME, ("add", {"a": 3, "tags": ["x"]})]),
    ),
    "qwen3_coder-unclosed": (Qwen3CoderToolParser, XML_ROME.removesuffix("</tool_call>"), ("", [ROME])),
    "qwen3_coder-cut": (
        Qwen3CoderToolParser,
        XML_ROME.removesuffix("</function>\n</tool_call>"),
        ("", [("get_weather", '{"city": "Rome", "days": 2')]),
    ),
    "qwen3_coder-string-stays": (
        Qwen3CoderToolParser,
        "<tool_call>\n<function=get_weather>\n<parameter=city>\n42\n</parameter>\n"
        "<parameter=days>\nmany\n</parameter>\n</function>\n</tool_call>",
        ("", [("get_weather", {"city": "42", "days": "many"})]),
    ),
    "qwen3_coder-unknown": (
        Qwen3CoderToolParser,
        "<tool_call>\n<function=rm>\n</function>\n</tool_call>",
        None,
    ),
    "qwen3_coder-stray": (
        Qwen3CoderToolParser,
        "<tool_call>\n<function=add>\nhi<parameter=a>\n1\n</parameter>\n</function>\n</tool_call>",
        None,
    ),
    "qwen3_coder-text": (Qwen3CoderToolParser, "a <tool_c b", None),
}


def _calls(calls: list) -> list[tuple[str, dict | str]]:
    """(name, arguments decoded, or as they are where they are not JSON: a call cut short)."""
    out = []
    for c in calls:
        try:
            out.append((c.name, json.loads(c.arguments)))
        except ValueError:
            out.append((c.name, c.arguments))
    return out


def _streamed(parser: ToolParser, pieces: list[str]) -> tuple[str, list]:
    released = "".join(parser.push(p) for p in pieces)
    held, calls = parser.finish()
    return (released + held if not calls else released.rstrip()), _calls(calls)


def _case(case: str) -> tuple[type[ToolParser], str, tuple[str, list]]:
    cls, text, expected = CASES[case]
    return cls, text, expected or (text, [])  # None: the answer stays text


@pytest.mark.parametrize("case", list(CASES), ids=list(CASES))
def test_whole_answer(case: str) -> None:
    cls, text, (expected_text, expected_calls) = _case(case)
    got_text, calls = cls(NAMES, tools=TOOLS).parse(text)
    assert (got_text, _calls(calls)) == (expected_text, expected_calls)


@pytest.mark.parametrize("case", list(CASES), ids=list(CASES))
def test_every_split_streams_to_the_whole_answer(case: str) -> None:
    cls, text, expected = _case(case)
    for i in range(len(text) + 1):
        assert _streamed(cls(NAMES, tools=TOOLS), [text[:i], text[i:]]) == expected, i
    assert _streamed(cls(NAMES, tools=TOOLS), list(text)) == expected


def test_mistral_ids_are_kept_or_made_in_mistrals_form() -> None:
    # an id given before the arguments is kept; one after them comes when the call has gone out
    # (streamed) with an id of its own, in Mistral's form
    text = '[TOOL_CALLS][{"id": "given1234", "name": "add", "arguments": {"a": 1}}, {"name": "add", "arguments": {"a": 2}}]'
    given, made = MistralToolParser(NAMES).parse(text)[1]
    assert given.id == "given1234" and len(made.id) == 9 and made.id.isalnum()
    text = '[TOOL_CALLS][{"name": "add", "arguments": {"a": 1}, "id": "given1234"}, {"name": "add", "arguments": {"a": 2}}]'
    calls = MistralToolParser(NAMES).parse(text)[1]
    assert [json.loads(c.arguments) for c in calls] == [{"a": 1}, {"a": 2}]
    assert all(len(c.id) == 9 and c.id.isalnum() and c.id != "given1234" for c in calls)
    assert MistralToolParser(NAMES).parse(CASES["mistral-args"][1])[1][1].id == "abc123XYZ"


@pytest.mark.parametrize(
    ("template", "name"),
    [
        ("", "hermes"),
        ("{% if tools %}<tool_call>{% endif %}", "hermes"),
        ("{{ '[TOOL_CALLS]' }}", "mistral"),
        ("[func_name1(params_name1=params_value1)]", "pythonic"),
        ("<tool_call>\n<function=...>\n<parameter=...>", "qwen3_coder"),
        ('{"name": function name, "parameters": dictionary of argument name and its value}', "llama3_json"),
    ],
)
def test_chosen_from_the_chat_template(template: str, name: str) -> None:
    assert choose_tool_parser(None, template).name == name


xgr = pytest.importorskip("xgrammar")
accepts = pytest.importorskip("xgrammar.testing")._is_grammar_accept_string

# (parser, template, a valid auto answer with a call, a valid forced continuation of get_weather alone)
GRAMMARS = {
    "hermes": (
        HermesToolParser,
        "",
        'Hi <tool_call>\n{"name": "get_weather", "arguments": {"city": "Rome", "days": 2}}\n</tool_call>',
        '{"name": "get_weather", "arguments": {"city": "Rome", "days": 2}}',
    ),
    "llama3_json": (
        Llama3JsonToolParser,
        "",
        '{"name": "get_weather", "parameters": {"city": "Rome", "days": 2}}',
        '{"name": "get_weather", "parameters": {"city": "Rome", "days": 2}}',
    ),
    "mistral": (
        MistralToolParser,
        "",
        'Hi [TOOL_CALLS][{"name": "get_weather", "arguments": {"city": "Rome", "days": 2}}]',
        '[{"name": "get_weather", "arguments": {"city": "Rome", "days": 2}}]',
    ),
    "mistral-args": (
        MistralToolParser,
        "[ARGS]",
        'Hi [TOOL_CALLS]get_weather[ARGS]{"city": "Rome", "days": 2}',
        'get_weather[ARGS]{"city": "Rome", "days": 2}',
    ),
    "pythonic": (
        PythonicToolParser,
        "",
        '[get_weather(city="Rome", days=2), add(a=1.5)]',
        'get_weather(city="Rome", days=2)]',
    ),
    "qwen3_coder": (Qwen3CoderToolParser, "", "Hi " + XML_ROME, XML_ROME.removeprefix("<tool_call>\n")),
}


def _grammar(spec_or_tag) -> object:
    kind, value = (
        ("structural_tag", spec_or_tag)
        if isinstance(spec_or_tag, dict)
        else (spec_or_tag.kind, spec_or_tag.value)
    )
    if kind == "json_schema":
        return xgr.Grammar.from_json_schema(value)
    return xgr.Grammar.from_structural_tag(value if isinstance(value, str) else json.dumps(value))


@pytest.mark.parametrize("case", list(GRAMMARS), ids=list(GRAMMARS))
def test_grammars_enforce_the_format(case: str) -> None:
    cls, template, auto, forced_rest = GRAMMARS[case]
    tag = cls.auto_grammar(TOOLS, template)
    assert accepts(_grammar(tag), auto) and accepts(_grammar(tag), "Just text.")
    assert cls(NAMES, tools=TOOLS).parse(auto)[1][0].name == "get_weather"
    bad = auto.replace("2", '"two"').replace('<parameter=days>\n"two"', "<parameter=days>\ntwo")
    assert not accepts(_grammar(tag), bad)
    forced = cls.forced_call(TOOLS[:1], template)
    assert accepts(_grammar(forced.grammar), forced_rest)
    assert not accepts(
        _grammar(forced.grammar), forced_rest.replace("2", '"two"').replace('>\n"two"', ">\ntwo")
    )
    assert _calls(cls(NAMES, forced.opening, TOOLS).parse(forced.opening + forced_rest)[1]) == [ROME]


@pytest.mark.parametrize("case", list(CASES), ids=list(CASES))
def test_calls_stream_as_prefixes_of_the_final_calls(case: str) -> None:
    """Pushed a character at a time, a committed call keeps its id and name and its arguments only
    grow, each a prefix of what the answer's calls end with; the calls in the usual shape start
    before the answer ends (they stream), with their names."""
    cls, text, _ = _case(case)
    parser = cls(NAMES, tools=TOOLS)
    seen: list[tuple[str, str, str]] = []
    first_seen_at: list[int] = []
    for i, ch in enumerate(text):
        parser.push(ch)
        now = [(c.id, c.name, c.arguments) for c in parser.calls]
        assert len(now) >= len(seen)
        for (id0, name0, args0), (id1, name1, args1) in zip(seen, now, strict=False):
            assert (id1, name1) == (id0, name0) and args1.startswith(args0)
        first_seen_at += [i] * (len(now) - len(seen))
        seen = now
    _, final = parser.finish()
    assert [(c.id, c.name) for c in final[: len(seen)]] == [s[:2] for s in seen]
    assert all(c.arguments == s[2] for c, s in zip(final, seen, strict=False))
    if seen:
        assert first_seen_at[0] < len(text) - 1  # the first call went out before the answer's end


def test_a_parser_written_with_parse_still_reads_whole_answers() -> None:
    """A ``HeldToolParser`` subclass from before streamed calls (it overrides ``parse``, no
    ``open_call``) keeps working: its calls come from its ``parse`` at the end."""
    from astrai.protocol import ToolCall
    from astrai.tool_parsers.held import HeldToolParser

    class Old(HeldToolParser):
        name = "old"
        markers = ("<call>",)

        def parse(self, text: str) -> tuple[str, list]:
            at = text.find("<call>")
            return (text[:at], [ToolCall("call_1", text[at + 6 :].strip(), "{}")]) if at >= 0 else (text, [])

    parser = Old({"add"})
    released = parser.push("Sure. <call> add")
    assert (released, [c.name for c in parser.finish()[1]]) == ("Sure. ", ["add"])
