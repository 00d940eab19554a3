"""``POST /v1/responses`` through the official ``openai`` SDK, raw SSE and the OpenAI Agents SDK, on a real
server with the default model (float32, greedy). References are the same conversation through
``/v1/chat/completions``, which shares the chat template and the tool-call handling.

Every field the SDK can send is implemented, accepted and ignored (``IGNORED``) or refused with a 400
naming it (``REFUSED``); the unit tests at the end check the builder without a model.
"""

from __future__ import annotations

import asyncio
import json
from typing import Any

import httpx
import openai
import pytest
from openai.types.responses import (
    easy_input_message_param,
    function_tool_param,
    response_create_params,
    response_function_tool_call_param,
    response_input_item_param,
    response_input_text_param,
    response_output_message_param,
    response_output_text_param,
    response_text_config_param,
)

from astrai.protocol import ChatResult, Choice, Prepared, ToolCall
from astrai.sampling import SamplingParams
from astrai_server.protocols.responses import (
    IGNORED,
    REFUSED,
    FunctionTool,
    InputItem,
    InputText,
    ResponsesBuilder,
    ResponsesRequest,
    StreamOptions,
    TextConfig,
)

slow = pytest.mark.slow  # the real default model

RESPONSES = "/v1/responses"
FRANCE = "What is the capital of France?"
PARAMETERS = {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}
WEATHER = {
    "type": "function",
    "name": "get_weather",
    "description": "Get the current weather in a city",
    "parameters": PARAMETERS,
}
CHAT_WEATHER = {"type": "function", "function": {k: v for k, v in WEATHER.items() if k != "type"}}
# One worked example teaches the 135M model the call format, and that a tool's result gets a sentence.
# The assistant turns are as the SDK echoes earlier output items (ids, status, annotations, logprobs).
ONE_SHOT = [
    {"role": "user", "content": "What is the weather in London?"},
    {
        "type": "function_call",
        "id": "fc_1",
        "call_id": "call_1",
        "name": "get_weather",
        "arguments": '{"city": "London"}',
        "status": "completed",
    },
    {"type": "function_call_output", "call_id": "call_1", "output": "12 degrees, cloudy"},
    {
        "type": "message",
        "id": "msg_1",
        "status": "completed",
        "role": "assistant",
        "content": [
            {
                "type": "output_text",
                "text": "It is 12 degrees and cloudy in London.",
                "annotations": [],
                "logprobs": [],
            }
        ],
    },
]
CHAT_ONE_SHOT = [
    {"role": "user", "content": "What is the weather in London?"},
    {
        "role": "assistant",
        "content": "",
        "tool_calls": [
            {
                "id": "call_1",
                "type": "function",
                "function": {"name": "get_weather", "arguments": '{"city": "London"}'},
            }
        ],
    },
    {"role": "tool", "tool_call_id": "call_1", "content": "12 degrees, cloudy"},
    {"role": "assistant", "content": "It is 12 degrees and cloudy in London."},
]
ROME = {"role": "user", "content": "Is Rome sunny right now?"}
TEXT_EVENTS = [
    "response.created",
    "response.in_progress",
    "response.output_item.added",
    "response.content_part.added",
]
TEXT_END = ["response.output_text.done", "response.content_part.done", "response.output_item.done"]
CALL_EVENTS = [
    "response.output_item.added",
    "response.function_call_arguments.delta",
    "response.function_call_arguments.done",
    "response.output_item.done",
]


def _chat(client: Any, messages: list[dict], **kw: Any) -> Any:
    return client.chat.completions.create(model="astrai", messages=messages, temperature=0, **kw)


# ---------------------------------------------------------------- the openai SDK, real server
@slow
def test_string_input_is_one_user_turn(openai_client: Any) -> None:
    r = openai_client.responses.create(model="astrai", input=FRANCE, temperature=0, max_output_tokens=32)
    chat = _chat(openai_client, [{"role": "user", "content": FRANCE}], max_tokens=32)
    assert r.output_text == chat.choices[0].message.content == "The capital of France is Paris."
    assert (r.object, r.status, r.incomplete_details, r.error, r.model) == (
        "response",
        "completed",
        None,
        None,
        "astrai",
    )
    assert r.id.startswith("resp_") and r.completed_at >= r.created_at
    (message,) = r.output
    assert (message.type, message.role, message.status) == ("message", "assistant", "completed")
    assert message.id.startswith("msg_") and message.content[0].annotations == []
    usage = (r.usage.input_tokens, r.usage.output_tokens, r.usage.total_tokens)
    assert usage == (chat.usage.prompt_tokens, chat.usage.completion_tokens, chat.usage.total_tokens)
    assert (r.temperature, r.top_p, r.max_output_tokens, r.tool_choice, r.tools) == (0.0, 1.0, 32, "auto", [])


@slow
def test_instructions_are_the_system_message(openai_client: Any) -> None:
    system = "Answer in French."
    r = openai_client.responses.create(
        model="astrai", instructions=system, input=FRANCE, temperature=0, max_output_tokens=16
    )
    chat = _chat(
        openai_client,
        [{"role": "system", "content": system}, {"role": "user", "content": FRANCE}],
        max_tokens=16,
    )
    assert (r.output_text, r.usage.input_tokens) == (
        chat.choices[0].message.content,
        chat.usage.prompt_tokens,
    )
    assert r.instructions == system


@slow
def test_input_items_replay_a_tool_call_as_chat_messages(openai_client: Any) -> None:
    kw = {"temperature": 0, "max_output_tokens": 40}
    r = openai_client.responses.create(model="astrai", input=[*ONE_SHOT, ROME], tools=[WEATHER], **kw)
    chat = _chat(openai_client, [*CHAT_ONE_SHOT, ROME], tools=[CHAT_WEATHER], max_tokens=40)
    assert r.output_text == chat.choices[0].message.content and "Rome" in r.output_text
    assert [o.type for o in r.output] == ["message"] and r.usage.input_tokens == chat.usage.prompt_tokens


@slow
@pytest.mark.parametrize(
    "choice", ["required", {"type": "function", "name": "get_weather"}], ids=["required", "named"]
)
def test_required_tool_choice_answers_with_a_function_call(openai_client: Any, choice: Any) -> None:
    kw = {
        "input": [*ONE_SHOT, ROME],
        "tools": [WEATHER],
        "tool_choice": choice,
        "temperature": 0,
        "max_output_tokens": 40,
    }
    r = openai_client.responses.create(model="astrai", **kw)
    (call,) = r.output
    assert (call.type, call.name, json.loads(call.arguments), call.status) == (
        "function_call",
        "get_weather",
        {"city": "Rome"},
        "completed",
    )
    assert call.call_id.startswith("call_") and call.id == "fc_" + call.call_id.removeprefix("call_")
    assert r.output_text == "" and r.status == "completed" and r.to_dict()["tool_choice"] == choice
    chat_choice = (
        choice if isinstance(choice, str) else {"type": "function", "function": {"name": "get_weather"}}
    )
    chat = _chat(
        openai_client, [*CHAT_ONE_SHOT, ROME], tools=[CHAT_WEATHER], tool_choice=chat_choice, max_tokens=40
    )
    assert chat.choices[0].message.tool_calls[0].function.arguments == call.arguments
    assert r.usage.input_tokens == chat.usage.prompt_tokens  # the call's opening counted the same way


@slow
def test_stream_text_events_in_order_and_deltas_make_the_text(openai_client: Any) -> None:
    kw = {"model": "astrai", "input": FRANCE, "temperature": 0, "max_output_tokens": 32}
    with openai_client.responses.stream(**kw) as stream:
        events = list(stream)
        final = stream.get_final_response()
    types = [e.type for e in events]
    deltas = [e.delta for e in events if e.type == "response.output_text.delta"]
    assert types == [
        *TEXT_EVENTS,
        *["response.output_text.delta"] * len(deltas),
        *TEXT_END,
        "response.completed",
    ]
    assert [e.sequence_number for e in events] == list(range(len(events)))
    expected = openai_client.responses.create(**kw)
    assert "".join(deltas) == final.output_text == expected.output_text == "The capital of France is Paris."
    assert len({e.response.id for e in events if hasattr(e, "response")}) == 1
    assert (
        final.usage.input_tokens == expected.usage.input_tokens
        and final.usage.output_tokens == expected.usage.output_tokens
    )


@slow
def test_stream_required_call_is_a_function_call_item(openai_client: Any) -> None:
    kw = {
        "input": [*ONE_SHOT, ROME],
        "tools": [WEATHER],
        "tool_choice": "required",
        "temperature": 0,
        "max_output_tokens": 40,
    }
    with openai_client.responses.stream(model="astrai", **kw) as stream:
        events = list(stream)
        final = stream.get_final_response()
    deltas = [e for e in events if e.type == "response.function_call_arguments.delta"]
    assert len(deltas) > 1  # the arguments stream as the model writes them
    assert [e.type for e in events] == [
        "response.created",
        "response.in_progress",
        CALL_EVENTS[0],
        *[CALL_EVENTS[1]] * len(deltas),
        *CALL_EVENTS[2:],
        "response.completed",
    ]
    (call,) = final.output
    assert (call.type, call.name, json.loads(call.arguments)) == (
        "function_call",
        "get_weather",
        {"city": "Rome"},
    )
    done = events[-3]
    assert (
        events[2].item.arguments == ""
        and done.arguments == "".join(e.delta for e in deltas) == call.arguments
    )
    assert all(e.output_index == 0 and e.item_id == call.id for e in [*deltas, done])


@slow
def test_raw_sse_transcript_of_an_incomplete_answer(base_url: str) -> None:
    body = {"input": FRANCE, "temperature": 0, "max_output_tokens": 3, "stream": True}
    r = httpx.post(base_url + RESPONSES, json=body, timeout=120)
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
    frames = r.text.split("\n\n")
    assert frames[-1] == "" and "[DONE]" not in r.text
    events = []
    for frame in frames[:-1]:
        event, data = frame.split("\n")
        assert event.startswith("event: ") and data.startswith("data: ")
        events.append((event[7:], json.loads(data[6:])))
    assert [name for name, _ in events] == [
        *TEXT_EVENTS,
        *["response.output_text.delta"] * 3,
        *TEXT_END,
        "response.incomplete",
    ]
    assert all(name == data["type"] for name, data in events)
    assert [data["sequence_number"] for _, data in events] == list(range(len(events)))
    assert [data["delta"] for name, data in events if name.endswith(".delta")] == ["The", " capital", " of"]
    end = events[-1][1]["response"]
    assert (end["status"], end["incomplete_details"], end["output"][0]["status"]) == (
        "incomplete",
        {"reason": "max_output_tokens"},
        "incomplete",
    )
    assert end["output"][0]["content"][0]["text"] == "The capital of" and end["usage"]["output_tokens"] == 3
    message_id = events[2][1]["item"]["id"]
    assert all(data["item_id"] == message_id for _, data in events[3:-2])


@slow
def test_top_logprobs_and_include_return_log_probs(openai_client: Any) -> None:
    kw = {
        "model": "astrai",
        "input": FRANCE,
        "temperature": 0,
        "max_output_tokens": 3,
        "top_logprobs": 2,
        "include": ["message.output_text.logprobs"],
    }
    r = openai_client.responses.create(**kw)
    entries = r.output[0].content[0].logprobs
    assert "".join(e.token for e in entries) == r.output_text == "The capital of"
    assert all(len(e.top_logprobs) == 2 and e.top_logprobs[0].token == e.token for e in entries)  # greedy
    assert all(bytes(e.bytes).decode() == e.token and e.logprob <= 0 for e in entries)
    with openai_client.responses.stream(**kw) as stream:
        streamed = [lp for e in stream if e.type == "response.output_text.delta" for lp in e.logprobs]
    assert [(e.token, e.logprob) for e in streamed] == [(e.token, e.logprob) for e in entries]


REFUSED_EXAMPLES: dict[str, tuple[dict, str]] = {
    "access_programs": ({"access_programs": {"cyber": "standard"}}, "access_programs"),
    "background": ({"background": True}, "background"),
    "background_options": ({"background_options": {}}, "background_options"),
    "context_management": ({"context_management": [{"type": "compaction"}]}, "context_management"),
    "conversation": ({"conversation": "conv_1"}, "conversation"),
    "image": ({"image": {"context_compression": "enabled"}}, "image"),
    "include": ({"include": ["file_search_call.results"]}, "include"),
    "moderation": ({"moderation": {"model": "omni-moderation-latest"}}, "moderation"),
    "previous_response_id": ({"previous_response_id": "resp_1"}, "previous_response_id"),
    "prompt": ({"prompt": {"id": "pmpt_1"}}, "prompt"),
    "reasoning": ({"reasoning": {"summary": "auto"}}, "reasoning"),
    "store": ({"store": True}, "store"),
    "truncation": ({"truncation": "auto"}, "truncation"),
    "text.verbosity": ({"text": {"verbosity": "low"}}, "text.verbosity"),
    "tools[].type": ({"tools": [WEATHER, {"type": "web_search"}]}, "tools.1.type"),
    "tool_choice": ({"tools": [WEATHER], "tool_choice": {"type": "file_search"}}, "tool_choice"),
    "input[].encrypted_content": (
        {
            "input": [
                {"type": "reasoning", "id": "rs_1", "summary": [], "encrypted_content": "e"},
                {"role": "user", "content": FRANCE},
            ]
        },
        "input.0.encrypted_content",
    ),
}


def test_examples_cover_the_refused_table() -> None:
    assert list(REFUSED_EXAMPLES) == list(REFUSED)


@slow
@pytest.mark.parametrize("field", list(REFUSED))
def test_refused_field_is_a_400_naming_it(base_url: str, field: str) -> None:
    patch, param = REFUSED_EXAMPLES[field]
    r = httpx.post(base_url + RESPONSES, json={"input": FRANCE, "max_output_tokens": 1, **patch}, timeout=120)
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert (error["param"], error["type"]) == (param, "invalid_request_error")


@slow
@pytest.mark.parametrize(
    "kw",
    [
        {"store": True},
        {"previous_response_id": "resp_1"},
        {"background": True},
        {"text": {"format": {"type": "json_schema", "name": "x"}}},
        {"tools": [{"type": "web_search"}]},
    ],
    ids=["store", "previous_response_id", "background", "json_schema-without-schema", "web_search"],
)
def test_refused_fields_raise_bad_request_in_the_sdk(openai_client: Any, kw: dict) -> None:
    with pytest.raises(openai.BadRequestError) as info:
        openai_client.responses.create(model="astrai", input=FRANCE, max_output_tokens=1, **kw)
    assert info.value.body["param"].split(".")[0] in kw


IGNORED_EXAMPLES: dict[str, dict] = {  # a field that leaves the greedy answer as it is without it
    "max_tool_calls": {"max_tool_calls": 1},
    "metadata": {"metadata": {"team": "a"}},
    "prompt_cache_key": {"prompt_cache_key": "k-1"},
    "prompt_cache_options": {"prompt_cache_options": {"mode": "implicit", "ttl": "30m"}},
    "prompt_cache_retention": {"prompt_cache_retention": "24h"},
    "safety_identifier": {"safety_identifier": "user-1"},
    "service_tier": {"service_tier": "flex"},
    "store": {"store": False},
    "user": {"user": "user-1"},
    "input[].phase": {"input": [{"role": "user", "content": FRANCE, "phase": "final_answer"}]},
    "input[].content[].annotations": {
        "input": [{"role": "user", "content": [{"type": "input_text", "text": FRANCE, "annotations": []}]}]
    },
    "input[].content[].logprobs": {
        "input": [{"role": "user", "content": [{"type": "input_text", "text": FRANCE, "logprobs": []}]}]
    },
    "input[].content[].prompt_cache_breakpoint": {
        "input": [
            {
                "role": "user",
                "content": [
                    {"type": "input_text", "text": FRANCE, "prompt_cache_breakpoint": {"mode": "explicit"}}
                ],
            }
        ]
    },
    "stream_options.include_obfuscation": {"stream": True, "stream_options": {"include_obfuscation": True}},
}


def test_examples_cover_the_ignored_table() -> None:
    assert list(IGNORED_EXAMPLES) == list(IGNORED)


def _answer(base_url: str, body: dict) -> str:
    r = httpx.post(
        base_url + RESPONSES,
        json={"input": FRANCE, "temperature": 0, "max_output_tokens": 8, **body},
        timeout=120,
    )
    assert r.status_code == 200, r.text
    if not body.get("stream"):
        return r.json()["output"][0]["content"][0]["text"]
    events = [json.loads(line[6:]) for line in r.text.splitlines() if line.startswith("data: ")]
    return "".join(e["delta"] for e in events if e["type"] == "response.output_text.delta")


@slow
def test_ignored_fields_change_nothing_and_null_is_not_sent(base_url: str) -> None:
    expected = _answer(base_url, {})
    assert expected == "The capital of France is Paris."
    for field, with_it in IGNORED_EXAMPLES.items():
        assert _answer(base_url, with_it) == expected, field
    assert _answer(base_url, dict.fromkeys(k for k in REFUSED if "." not in k)) == expected
    served = {
        "text": {"format": {"type": "text"}},
        "reasoning": {"effort": None},
        "include": [],
        "truncation": "disabled",
        "background": False,
        "tools": [WEATHER],
        "tool_choice": "none",
        "parallel_tool_calls": False,
    }
    assert (
        _answer(base_url, served) == expected
    )  # the values astrai serves of the fields it refuses others of


@slow
def test_unknown_keys_are_refused_with_their_path(base_url: str) -> None:
    cases = [
        ({"foo": 1}, "foo"),
        ({"input": [{"role": "user", "content": FRANCE, "foo": 1}]}, "input.0.foo"),
        (
            {"input": [{"role": "user", "content": [{"type": "input_text", "text": FRANCE, "foo": 1}]}]},
            "input.0.content.0.foo",
        ),
        ({"tools": [{**WEATHER, "defer_loading": True}]}, "tools.0.defer_loading"),
    ]
    for patch, param in cases:
        r = httpx.post(
            base_url + RESPONSES, json={"input": FRANCE, "max_output_tokens": 1, **patch}, timeout=120
        )
        assert (r.status_code, r.json()["error"]["param"]) == (400, param), r.text


# ---------------------------------------------------------------- the OpenAI Agents SDK
@slow
def test_agents_sdk_runs_a_tool_and_answers(base_url: str) -> None:
    agents = pytest.importorskip("agents")
    agents.set_tracing_disabled(True)
    called: list[str] = []

    @agents.function_tool
    def get_weather(city: str) -> str:
        """Get the current weather in a city."""
        called.append(city)
        return "25 degrees, sunny"

    async def run() -> Any:
        async with openai.AsyncOpenAI(
            base_url=base_url + "/v1", api_key="x", max_retries=0, timeout=120
        ) as client:
            agent = agents.Agent(
                name="weather",
                instructions="You are a weather assistant.",
                tools=[get_weather],
                model=agents.OpenAIResponsesModel(model="astrai", openai_client=client),
                # required on the first turn; the SDK resets tool_choice after the call (reset_tool_choice)
                model_settings=agents.ModelSettings(tool_choice="required", temperature=0, max_tokens=60),
            )
            question = {"role": "user", "content": "What is the weather in Paris?"}
            return await agents.Runner.run(agent, [*ONE_SHOT, question], max_turns=3)

    result = asyncio.run(run())
    assert called == ["Paris"]
    kinds = [item.type for item in result.new_items]
    assert kinds == ["tool_call_item", "tool_call_output_item", "message_output_item"]
    assert (
        isinstance(result.final_output, str) and result.final_output == "It is 25 degrees and sunny in Paris."
    )
    assert len(result.raw_responses) == 2 and all(r.usage.input_tokens > 0 for r in result.raw_responses)


# ---------------------------------------------------------------- the builder, without a model
def _keys(typed_dict: Any) -> set[str]:
    return set(typed_dict.__required_keys__ | typed_dict.__optional_keys__)


# Keys the SDK can send that are neither declared nor metadata: refused as unknown keys (400 naming the path).
UNKNOWN_NESTED = {"async", "caller", "namespace", "allowed_callers", "defer_loading", "output_schema"}


def test_every_top_level_sdk_field_is_declared_or_refused() -> None:
    sdk = _keys(response_create_params.ResponseCreateParamsStreaming)
    declared = set(ResponsesRequest.model_fields)
    assert not sdk - declared - set(REFUSED), "decide: implement, accept as metadata, or refuse"
    top = {k for k in IGNORED if "." not in k}
    assert top <= declared and top <= sdk
    assert not {k.split(".")[0].removesuffix("[]") for k in REFUSED} - sdk


@pytest.mark.parametrize(
    ("typed_dict", "model"),
    [
        (easy_input_message_param.EasyInputMessageParam, InputItem),
        (response_input_item_param.Message, InputItem),
        (response_output_message_param.ResponseOutputMessageParam, InputItem),
        (response_input_text_param.ResponseInputTextParam, InputText),
        (response_output_text_param.ResponseOutputTextParam, InputText),
        (response_function_tool_call_param.ResponseFunctionToolCallParam, InputItem),
        (response_input_item_param.FunctionCallOutput, InputItem),
        (function_tool_param.FunctionToolParam, FunctionTool),
        (response_text_config_param.ResponseTextConfigParam, TextConfig),
        (response_create_params.StreamOptions, StreamOptions),
    ],
    ids=lambda x: getattr(x, "__name__", ""),
)
def test_every_nested_sdk_key_is_declared_or_refused(typed_dict: Any, model: Any) -> None:
    assert _keys(typed_dict) - set(model.model_fields) <= UNKNOWN_NESTED
    assert model.model_config.get("extra") == "forbid"


def _prepared(**request: Any) -> Prepared:
    req = ResponsesRequest.model_validate({"input": FRANCE, **request})
    state = {"seq": 0, "message_id": "msg_1", "opened": False}
    return Prepared(request=req, prompt_ids=[1], params=SamplingParams(), response_id="resp_1", state=state)


def _events(frames: list[str]) -> list[dict]:
    return [json.loads(f.split("data: ", 1)[1]) for f in frames]


CALLS = [ToolCall("call_1", "a", '{"x": 1}'), ToolCall("call_2", "b", "{}")]


@pytest.mark.parametrize("parallel", [True, False])
def test_parallel_tool_calls_false_keeps_the_first_call(parallel: bool) -> None:
    b, result = (
        ResponsesBuilder(),
        ChatResult([Choice(0, "", "tool_calls", 9, tool_calls=CALLS)], prompt_tokens=3),
    )
    names = ["a", "b"] if parallel else ["a"]
    body = b.format_response(_prepared(parallel_tool_calls=parallel), result)
    assert [o["name"] for o in body["output"]] == names and body["parallel_tool_calls"] is parallel
    events = _events(b.format_stream_end(_prepared(parallel_tool_calls=parallel), result))
    assert [e["item"]["name"] for e in events if e["type"] == "response.output_item.done"] == names
    assert [e["output_index"] for e in events if e["type"] == "response.output_item.added"] == list(
        range(len(names))
    )


def test_text_before_a_call_is_a_message_at_output_index_0() -> None:
    b, p = ResponsesBuilder(), _prepared()
    result = ChatResult([Choice(0, "Let me check.", "tool_calls", 9, tool_calls=CALLS[:1])], prompt_tokens=3)
    frames = b.format_stream_start(p) + b.format_chunk(p, 0, "Let me check.") + b.format_stream_end(p, result)
    events = _events(frames)
    added = [
        (e["output_index"], e["item"]["type"]) for e in events if e["type"] == "response.output_item.added"
    ]
    assert added == [(0, "message"), (1, "function_call")]
    assert [e["sequence_number"] for e in events] == list(range(len(events)))
    assert [o["type"] for o in events[-1]["response"]["output"]] == ["message", "function_call"]
    assert b.format_response(_prepared(), result)["output"] == events[-1]["response"]["output"]


def test_an_error_mid_stream_is_an_error_event() -> None:
    b, p = ResponsesBuilder(), _prepared()
    b.format_stream_start(p)
    (frame,) = b.format_stream_error(p, 500, "internal server error (see the server log)")
    assert frame.startswith("event: error\n")
    event = json.loads(frame.split("data: ", 1)[1])
    assert event == {
        "type": "error",
        "sequence_number": 2,
        "code": "server_error",
        "message": "internal server error (see the server log)",
        "param": None,
    }
