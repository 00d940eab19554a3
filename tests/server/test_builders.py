"""Unit layer: the two builders, the tool-call parser and the prompt helper, with a fake tokenizer (no
HTTP)."""

from __future__ import annotations

import json
from typing import Any

import pytest
from pydantic import ValidationError

from astrai.errors import RequestRejected
from astrai.protocol import ChatResult, Choice, Prepared, ResponseBuilder, ToolCall, chat_prompt_ids, sse
from astrai_server.protocols.anthropic import AnthropicResponseBuilder, MessagesRequest
from astrai_server.protocols.openai import ChatCompletionRequest, OpenAIResponseBuilder
from astrai_server.tools import ToolCallStreamFilter, call_opening, parse_tool_calls

WEATHER = {"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object"}}}


def _openai(fake_engine: Any, **body: Any) -> Prepared:
    body.setdefault("messages", [{"role": "user", "content": "hi there"}])
    return OpenAIResponseBuilder().prepare(ChatCompletionRequest.model_validate(body), fake_engine)


def _anthropic(fake_engine: Any, **body: Any) -> Prepared:
    body.setdefault("messages", [{"role": "user", "content": "hi there"}])
    return AnthropicResponseBuilder().prepare(MessagesRequest.model_validate(body), fake_engine)


def _frames(frames: list[str]) -> list[Any]:
    """Decode ``data:`` payloads (``[DONE]`` stays a string) and check the SSE framing of each frame."""
    out = []
    for f in frames:
        assert f.endswith("\n\n") and f.count("data: ") == 1
        data = f.split("data: ", 1)[1][:-2]
        out.append(data if data == "[DONE]" else json.loads(data))
    return out


def test_openai_prepare_maps_the_documented_defaults_and_parameters(fake_engine: Any) -> None:
    p = _openai(fake_engine)
    sp = p.params
    assert (sp.max_tokens, sp.temperature, sp.top_p, sp.top_k, sp.stop, sp.seed) == (
        2048,
        1.0,
        1.0,
        50,
        [],
        None,
    )
    assert (p.n, p.stream, p.max_tokens_explicit, p.model, p.state["include_usage"]) == (
        1,
        False,
        False,
        "astrai",
        True,
    )
    assert p.prompt_ids == [5, 2, 5, 10]  # "user: hi there\nassistant:" one id per word (its length)
    p = _openai(
        fake_engine,
        max_completion_tokens=7,
        max_tokens=99,
        temperature=0,
        top_p=0.5,
        top_k=None,
        stop="END",
        seed=3,
        presence_penalty=1.5,
        frequency_penalty=-1,
        logit_bias={"12": -100},
        n=3,
        ignore_eos=True,
        stream=True,
        stream_options={"include_usage": False},
        model="m",
    )
    sp = p.params
    assert (sp.max_tokens, sp.temperature, sp.top_p, sp.top_k, sp.stop, sp.seed) == (
        7,
        0.0,
        0.5,
        0,
        ["END"],
        3,
    )
    assert (sp.presence_penalty, sp.frequency_penalty, sp.logit_bias, sp.ignore_eos) == (
        1.5,
        -1.0,
        {12: -100.0},
        True,
    )
    assert (p.n, p.stream, p.max_tokens_explicit, p.model, p.state["include_usage"]) == (
        3,
        True,
        True,
        "m",
        False,
    )


NULLS = (
    "temperature",
    "top_p",
    "top_k",
    "max_tokens",
    "n",
    "presence_penalty",
    "frequency_penalty",
    "logit_bias",
    "stop",
)


def test_null_is_the_documented_default(fake_engine: Any) -> None:
    """JSON null means the field's default (top_k: off); a null max_tokens is a default, so it may be
    shortened."""
    nulls = dict.fromkeys(NULLS, None)
    request = ChatCompletionRequest.model_validate({"messages": [{"role": "user", "content": "x"}], **nulls})
    assert (
        request.sampling_params()
        == ChatCompletionRequest.model_validate(
            {"messages": [{"role": "user", "content": "x"}], "top_k": 0}
        ).sampling_params()
    )
    p = _openai(fake_engine, **nulls)
    assert (p.params.max_tokens, p.params.temperature, p.params.top_k, p.n, p.max_tokens_explicit) == (
        2048,
        1.0,
        0,
        1,
        False,
    )
    p = _anthropic(fake_engine, temperature=None, top_p=None, top_k=None, stop_sequences=None)
    assert (p.params.temperature, p.params.top_p, p.params.top_k, p.params.stop) == (1.0, 1.0, 0, [])
    assert (
        p.params
        == MessagesRequest.model_validate(
            {"messages": [{"role": "user", "content": "x"}], "top_k": 0}
        ).sampling_params()
    )


@pytest.mark.parametrize(
    "body",
    [
        {"messages": []},
        {"messages": [{"role": "bot", "content": "x"}]},
        {"messages": [{"role": "user", "content": None}]},
        {"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]},
        {"messages": [{"role": "user", "content": "x"}], "temperature": 2.5},
        {"messages": [{"role": "user", "content": "x"}], "top_p": 1.5},
        {"messages": [{"role": "user", "content": "x"}], "max_tokens": 0},
        {"messages": [{"role": "user", "content": "x"}], "n": 0},
        {"messages": [{"role": "user", "content": "x"}], "logit_bias": {"5": 101}},
        {"messages": [{"role": "user", "content": "x"}], "frequency_penalty": -3},
    ],
    ids=[
        "no-messages",
        "role",
        "no-content",
        "image",
        "temperature",
        "top_p",
        "max_tokens",
        "n",
        "bias",
        "penalty",
    ],
)
def test_openai_request_model_rejects_out_of_range(body: dict) -> None:
    with pytest.raises(ValidationError):
        ChatCompletionRequest.model_validate(body)


def test_openai_messages_reach_the_template_in_hf_form(fake_engine: Any) -> None:
    fake_engine.tokenizer.chat_template = "{{ tools }} {{ tool_calls }}"  # a tool-aware template
    messages = [
        {
            "role": "developer",
            "content": [{"type": "text", "text": "Be "}, {"type": "text", "text": "brief."}],
        },
        {"role": "user", "content": "weather?"},
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [
                {
                    "id": "c1",
                    "type": "function",
                    "function": {"name": "get_weather", "arguments": '{"city": "Oslo"}'},
                }
            ],
        },
        {"role": "tool", "content": "cold", "tool_call_id": "c1"},
    ]
    _openai(fake_engine, messages=messages, tools=[WEATHER])
    sent, tools = fake_engine.tokenizer.calls[-1]
    assert sent == [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "weather?"},
        {
            "role": "assistant",
            "content": "",
            "tool_calls": [
                {
                    "id": "c1",
                    "type": "function",
                    "function": {"name": "get_weather", "arguments": {"city": "Oslo"}},
                }
            ],
        },
        {"role": "tool", "content": "cold", "tool_call_id": "c1"},
    ]
    assert tools == [WEATHER]


def test_tools_are_described_in_the_system_prompt_when_the_template_ignores_them(fake_engine: Any) -> None:
    messages = [
        {"role": "system", "content": "Sys."},
        {
            "role": "assistant",
            "content": "",
            "tool_calls": [{"type": "function", "function": {"name": "f", "arguments": {"a": 1}}}],
        },
    ]
    chat_prompt_ids(fake_engine.tokenizer, messages, [WEATHER])
    sent, tools = fake_engine.tokenizer.calls[-1]
    assert tools is None
    assert sent[0]["content"].startswith("Sys.\n\n# Tools\n") and json.dumps(WEATHER) in sent[0]["content"]
    assert sent[1] == {
        "role": "assistant",
        "content": '<tool_call>\n{"name": "f", "arguments": {"a": 1}}\n</tool_call>',
    }


def test_tool_choice_selects_tools(fake_engine: Any) -> None:
    other = {"type": "function", "function": {"name": "other"}}
    assert _openai(fake_engine, tools=[WEATHER, other], tool_choice="none").tools == []
    chosen = _openai(
        fake_engine, tools=[WEATHER, other], tool_choice={"type": "function", "function": {"name": "other"}}
    )
    assert chosen.tools == [other]
    with pytest.raises(RequestRejected, match="'nope'"):
        _openai(fake_engine, tools=[WEATHER], tool_choice={"type": "function", "function": {"name": "nope"}})


def test_tool_choice_that_requires_a_call(fake_engine: Any) -> None:
    other = {"type": "function", "function": {"name": "other"}}
    named = {"type": "function", "function": {"name": "other"}}
    assert [
        _openai(fake_engine, tools=[WEATHER, other], tool_choice=c).tool_call_required
        for c in ("auto", "none", "required", named)
    ] == [False, False, True, True]
    assert _openai(fake_engine).tool_call_required is False
    tools = [{"name": "get_weather", "input_schema": {"type": "object"}}]
    choices = [
        None,
        {"type": "auto"},
        {"type": "none"},
        {"type": "any"},
        {"type": "tool", "name": "get_weather"},
    ]
    assert [_anthropic(fake_engine, tools=tools, tool_choice=c).tool_call_required for c in choices] == [
        False,
        False,
        False,
        True,
        True,
    ]
    prefilled = [{"role": "user", "content": "weather?"}, {"role": "assistant", "content": "Let me see"}]
    with pytest.raises(RequestRejected, match="'any' cannot continue a prefilled assistant turn"):
        _anthropic(fake_engine, messages=prefilled, tools=tools, tool_choice={"type": "any"})


class _Template:
    def __init__(self, chat_template: str | None) -> None:
        self.chat_template = chat_template


def test_call_opening_only_in_the_tool_call_format() -> None:
    ignores_tools, hermes = _Template("{{ messages }}"), _Template("{% if tools %}<tool_call>{% endif %}")
    for tok in (ignores_tools, hermes, _Template(None)):
        assert call_opening(tok, None) == "<tool_call>\n"
        assert call_opening(tok, "get_weather") == '<tool_call>\n{"name": "get_weather", "arguments": '
    assert (
        call_opening(_Template('{% if tools %}{"name": ...}{% endif %}'), "get_weather") == ""
    )  # Llama 3 style


def test_stream_filter_continues_an_opening_from_the_prompt() -> None:
    opening = call_opening(_Template(None), "get_weather")
    f = ToolCallStreamFilter(NAMES, opening)
    assert [f.push(p) for p in ['{"city"', ': "Rome"}}']] == ["", ""]
    held, calls = f.finish()
    assert held == "" and [(c.name, json.loads(c.arguments)) for c in calls] == [
        ("get_weather", {"city": "Rome"})
    ]
    g = ToolCallStreamFilter(NAMES, opening)
    assert g.push("nonsense") == ""
    assert g.finish() == (opening + "nonsense", [])  # not a call: the whole answer, opening included, as text


def _prepared(builder: ResponseBuilder, n: int = 1, **state: Any) -> Prepared:
    return Prepared(
        request=None,
        prompt_ids=[1, 2, 3],
        params=None,
        n=n,
        response_id="id-1",
        created=7,
        model="m",
        state=state,
    )  # type: ignore[arg-type]


def test_openai_stream_frames_are_the_spec_sequence_with_a_standard_usage_chunk() -> None:
    b = OpenAIResponseBuilder()
    p = _prepared(b, n=1, include_usage=True)
    result = ChatResult([Choice(0, "Hi", "stop_sequence", 2, stop_sequence="!")], prompt_tokens=3)
    frames = b.format_stream_start(p) + b.format_chunk(p, 0, "Hi") + b.format_stream_end(p, result)
    head = '{"id":"id-1","object":"chat.completion.chunk","created":7,"model":"m","choices":'
    assert "".join(frames) == (
        f'data: {head}[{{"index":0,"delta":{{"role":"assistant"}},"finish_reason":null}}]}}\n\n'
        f'data: {head}[{{"index":0,"delta":{{"content":"Hi"}},"finish_reason":null}}]}}\n\n'
        f'data: {head}[{{"index":0,"delta":{{}},"finish_reason":"stop"}}]}}\n\n'
        f'data: {head}[],"usage":{{"prompt_tokens":3,"completion_tokens":2,"total_tokens":5,'
        '"prompt_tokens_details":{"cached_tokens":0}}}\n\n'
        "data: [DONE]\n\n"
    )
    no_usage = _frames(b.format_stream_end(_prepared(b, include_usage=False), result))
    assert [f if f == "[DONE]" else "usage" in f for f in no_usage] == [False, "[DONE]"]


def test_openai_tool_calls_in_response_and_stream() -> None:
    b = OpenAIResponseBuilder()
    call = ToolCall("call_9", "get_weather", '{"city": "Paris"}')
    result = ChatResult(
        [Choice(0, "", "tool_calls", 5, tool_calls=[call]), Choice(1, "x", "length", 1)], prompt_tokens=3
    )
    body = b.format_response(_prepared(b, n=2), result)
    fn = {"name": "get_weather", "arguments": '{"city": "Paris"}'}
    assert body["choices"][0] == {
        "index": 0,
        "logprobs": None,
        "finish_reason": "tool_calls",
        "message": {
            "role": "assistant",
            "content": None,
            "tool_calls": [{"id": "call_9", "type": "function", "function": fn}],
        },
    }
    assert body["choices"][1]["message"] == {"role": "assistant", "content": "x"}
    assert body["usage"] == {
        "prompt_tokens": 3,
        "completion_tokens": 6,
        "total_tokens": 9,
        "prompt_tokens_details": {"cached_tokens": 0},
    }
    frames = _frames(b.format_stream_end(_prepared(b, n=2, include_usage=True), result))
    assert [f["choices"] if isinstance(f, dict) else f for f in frames] == [
        [
            {
                "index": 0,
                "delta": {"tool_calls": [{"index": 0, "id": "call_9", "type": "function", "function": fn}]},
                "finish_reason": None,
            }
        ],
        [{"index": 0, "delta": {}, "finish_reason": "tool_calls"}],
        [{"index": 1, "delta": {}, "finish_reason": "length"}],
        [],
        "[DONE]",
    ]


def test_anthropic_prepare_converts_system_blocks_tools_and_prefill(fake_engine: Any) -> None:
    messages = [
        {"role": "user", "content": [{"type": "text", "text": "weather?"}]},
        {
            "role": "assistant",
            "content": [{"type": "tool_use", "id": "t1", "name": "get_weather", "input": {"city": "Oslo"}}],
        },
        {
            "role": "user",
            "content": [
                {"type": "tool_result", "tool_use_id": "t1", "content": [{"type": "text", "text": "cold"}]}
            ],
        },
        {"role": "assistant", "content": "It is  "},
    ]
    p = _anthropic(
        fake_engine,
        messages=messages,
        system=[{"type": "text", "text": "A"}, {"type": "text", "text": "B"}],
        tools=[{"name": "get_weather", "input_schema": {"type": "object"}}],
        max_tokens=5,
        stop_sequences=["x", ""],
    )
    sent, _ = fake_engine.tokenizer.calls[-1]
    assert (
        sent[0] == {"role": "system", "content": "AB" + sent[0]["content"][2:]}
        and "get_weather" in sent[0]["content"]
    )
    assert sent[1:] == [
        {"role": "user", "content": "weather?"},
        {
            "role": "assistant",
            "content": '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo"}}\n</tool_call>',
        },
        {"role": "tool", "content": "cold", "tool_call_id": "t1"},
    ]
    rendered = fake_engine.tokenizer.render(sent) + "\nassistant:"
    assert p.prompt_ids == fake_engine.tokenizer.encode(rendered) + [2, 2]  # the prefill "It is" continues
    assert (p.params.max_tokens, p.params.stop, p.params.top_k, p.max_tokens_explicit) == (5, ["x"], 50, True)
    assert (
        _anthropic(fake_engine).params.max_tokens == 1024 and not _anthropic(fake_engine).max_tokens_explicit
    )


@pytest.mark.parametrize(
    "body",
    [
        {"messages": [{"role": "system", "content": "x"}]},
        {"messages": [{"role": "user", "content": [{"type": "image", "source": {}}]}]},
        {"messages": [{"role": "user", "content": "x"}], "temperature": -0.1},
        {"messages": [{"role": "user", "content": "x"}], "max_tokens": -1},
        {"messages": [{"role": "user", "content": "x"}], "tool_choice": {"type": "maybe"}},
    ],
    ids=["system-role", "image", "temperature", "max_tokens", "tool_choice"],
)
def test_anthropic_request_model_rejects(body: dict) -> None:
    with pytest.raises(ValidationError):
        MessagesRequest.model_validate(body)


def test_anthropic_stream_frames_follow_the_spec_sequence() -> None:
    b = AnthropicResponseBuilder()
    p = _prepared(b)
    call = ToolCall("call_ab", "f", '{"a": 1}')
    result = ChatResult([Choice(0, "Hi", "tool_calls", 4, tool_calls=[call])], prompt_tokens=3)
    frames = b.format_stream_start(p) + b.format_chunk(p, 0, "Hi") + b.format_stream_end(p, result)
    events = [
        f.split("\n", 1)[0].removeprefix("event: ") if f.startswith("event: ") else None for f in frames
    ]
    assert events == [
        "message_start",
        "content_block_start",
        "content_block_delta",
        "content_block_stop",
        "content_block_start",
        "content_block_delta",
        "content_block_stop",
        "message_delta",
        "message_stop",
        None,
    ]
    data = [json.loads(f.split("data: ", 1)[1]) if "[DONE]" not in f else "[DONE]" for f in frames]
    assert data[0]["message"]["usage"] == {"input_tokens": 3, "output_tokens": 0}
    assert data[4]["content_block"] == {"type": "tool_use", "id": "toolu_ab", "name": "f", "input": {}}
    assert data[5]["delta"] == {"type": "input_json_delta", "partial_json": '{"a": 1}'}
    assert data[7] == {
        "type": "message_delta",
        "delta": {"stop_reason": "tool_use", "stop_sequence": None},
        "usage": {"input_tokens": 3, "output_tokens": 4},
    }
    assert frames[-1] == "data: [DONE]\n\n"


def test_anthropic_response_and_errors() -> None:
    b = AnthropicResponseBuilder()
    stop = ChatResult([Choice(0, "Hi", "stop_sequence", 2, stop_sequence="!")], prompt_tokens=3)
    body = b.format_response(_prepared(b), stop)
    assert body == {
        "id": "id-1",
        "type": "message",
        "role": "assistant",
        "model": "m",
        "content": [{"type": "text", "text": "Hi"}],
        "stop_reason": "stop_sequence",
        "stop_sequence": "!",
        "usage": {"input_tokens": 3, "output_tokens": 2},
    }
    assert b.format_error(401, "no") == {
        "type": "error",
        "error": {"type": "authentication_error", "message": "no"},
    }
    assert b.format_error(422, "bad")["error"]["type"] == "invalid_request_error"
    assert b.format_error(503, "busy")["error"]["type"] == "overloaded_error"
    assert b.format_stream_error(_prepared(b), 500, "boom") == [
        'event: error\ndata: {"type":"error","error":{"type":"api_error","message":"boom"}}\n\n'
    ]
    assert OpenAIResponseBuilder().format_error(400, "long", "messages") == {
        "error": {"message": "long", "type": "invalid_request_error", "param": "messages", "code": None}
    }


def test_sse_frame_format() -> None:
    assert sse({"a": "é"}, "x") == 'event: x\ndata: {"a":"é"}\n\n'
    assert sse("[DONE]") == "data: [DONE]\n\n"


NAMES = {"get_weather"}


@pytest.mark.parametrize(
    ("text", "before", "calls"),
    [
        (
            'Sure.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>',
            "Sure.",
            [("get_weather", {"city": "Paris"})],
        ),
        (
            '<tool_call>{"name": "get_weather", "arguments": "{\\"city\\": \\"A\\"}"}</tool_call>\n'
            '<tool_call>{"name": "get_weather", "arguments": {}}</tool_call>',
            "",
            [("get_weather", {"city": "A"}), ("get_weather", {})],
        ),
        ('<tool_call>[{"name": "get_weather", "arguments": {"x": 1}}]', "", [("get_weather", {"x": 1})]),
        (' {"name": "get_weather", "parameters": {"city": "B"}}', "", [("get_weather", {"city": "B"})]),
        ('<tool_call>{"name": "unknown", "arguments": {}}</tool_call>', None, []),
        ('<tool_call>{"name": "get_weather", "arguments": {</tool_call>', None, []),
        ('<tool_call>{"name": "get_weather", "arguments": {}}</tool_call> and more', None, []),
        ("plain text {not json}", None, []),
    ],
    ids=[
        "hermes",
        "two-calls",
        "list-unclosed",
        "llama-json",
        "unknown-name",
        "bad-json",
        "trailing-text",
        "plain",
    ],
)
def test_parse_tool_calls(text: str, before: str | None, calls: list) -> None:
    got_text, got = parse_tool_calls(text, NAMES)
    assert got_text == (text if before is None else before)
    assert [(c.name, json.loads(c.arguments)) for c in got] == calls
    assert all(c.id.startswith("call_") for c in got)


def test_stream_filter_holds_back_a_tag_split_across_pieces() -> None:
    f = ToolCallStreamFilter(NAMES)
    pieces = [
        "Let me",
        " check.",
        " <to",
        "ol_c",
        'all>{"name": "get_weather", "arguments": {}}',
        "</tool_call>",
    ]
    assert [f.push(p) for p in pieces] == ["Let me", " check.", " ", "", "", ""]
    held, calls = f.finish()
    assert held == "" and [(c.name, c.arguments) for c in calls] == [("get_weather", "{}")]
    g = ToolCallStreamFilter(NAMES)
    assert [g.push(p) for p in ["a <", "b", "<tool_call>oops"]] == ["a ", "<b", ""]
    assert g.finish() == ("<tool_call>oops", [])  # not a call: released as text at the end
    h = ToolCallStreamFilter(NAMES)
    assert [h.push(p) for p in ["  ", '{"name": "get_weather"', ', "arguments": {}}']] == ["", "", ""]
    held, calls = h.finish()
    assert held == "" and [c.name for c in calls] == ["get_weather"]
