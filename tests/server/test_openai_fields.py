"""Parameters that never lie: every field the installed ``openai`` SDK can send to chat completions is
implemented, accepted and ignored (``IGNORED``: the greedy answer is the same without it) or refused with
a 400 naming it (``REFUSED``, the table docs/http-api.md shows); and the vLLM sampling extensions."""

from __future__ import annotations

import json
from typing import Any

import httpx
import openai
import pytest
from openai.types.chat import (
    ChatCompletionAssistantMessageParam,
    ChatCompletionContentPartTextParam,
    ChatCompletionDeveloperMessageParam,
    ChatCompletionMessageFunctionToolCallParam,
    ChatCompletionStreamOptionsParam,
    ChatCompletionSystemMessageParam,
    ChatCompletionToolMessageParam,
    ChatCompletionUserMessageParam,
    completion_create_params,
)
from openai.types.shared_params import FunctionDefinition

from astrai.protocol import ChatResult, Choice, Prepared, ToolCall
from astrai_server.protocols.openai import (
    IGNORED,
    REFUSED,
    ChatCompletionRequest,
    FunctionDef,
    Message,
    OpenAIResponseBuilder,
    StreamOptions,
    TextPart,
    ToolCallIn,
)

CHAT = "/v1/chat/completions"
FRANCE = [{"role": "user", "content": "What is the capital of France?"}]
BASE = {"messages": FRANCE, "max_tokens": 8, "temperature": 0}
REPLAYED = [*FRANCE, {"role": "assistant", "content": "Paris."}, {"role": "user", "content": "And of Italy?"}]


def _keys(typed_dict: Any) -> set[str]:
    return set(typed_dict.__required_keys__ | typed_dict.__optional_keys__)


def _replayed(**assistant: Any) -> list[dict]:
    return [REPLAYED[0], {**REPLAYED[1], **assistant}, REPLAYED[2]]


# ---------------------------------------------------------------- what the SDK can send
def test_every_top_level_sdk_field_is_declared_or_refused() -> None:
    sdk = _keys(completion_create_params.CompletionCreateParamsStreaming)
    declared = set(ChatCompletionRequest.model_fields)
    assert not sdk - declared - set(REFUSED), "decide: implement, accept as metadata, or refuse"
    top = {k for k in IGNORED if "." not in k}
    assert top <= declared and top - {"store"} <= sdk  # ignored fields are accepted, and are OpenAI's
    assert not {k for k in REFUSED if "." not in k} - sdk


@pytest.mark.parametrize(
    ("typed_dict", "model"),
    [
        (ChatCompletionSystemMessageParam, Message),
        (ChatCompletionDeveloperMessageParam, Message),
        (ChatCompletionUserMessageParam, Message),
        (ChatCompletionAssistantMessageParam, Message),
        (ChatCompletionToolMessageParam, Message),
        (ChatCompletionContentPartTextParam, TextPart),
        (ChatCompletionMessageFunctionToolCallParam, ToolCallIn),
        (ChatCompletionStreamOptionsParam, StreamOptions),
        (FunctionDefinition, FunctionDef),
    ],
    ids=lambda x: getattr(x, "__name__", ""),
)
def test_every_nested_sdk_key_is_declared(typed_dict: Any, model: Any) -> None:
    assert _keys(typed_dict) <= set(model.model_fields)
    assert model.model_config.get("extra") == "forbid"  # and nothing else is taken silently


def test_parallel_tool_calls_false_keeps_the_first_call() -> None:
    b = OpenAIResponseBuilder()
    calls = [ToolCall("call_1", "a", "{}"), ToolCall("call_2", "b", "{}")]
    result = ChatResult([Choice(0, "", "tool_calls", 9, tool_calls=calls)], prompt_tokens=3)
    for one, names in ((True, ["a"]), (False, ["a", "b"])):
        kw = {"request": None, "prompt_ids": [1], "params": None, "response_id": "id"}
        p = Prepared(**kw, state={"one_call": one})
        message = b.format_response(p, result)["choices"][0]["message"]
        assert [c["function"]["name"] for c in message["tool_calls"]] == names
        frames = [
            json.loads(f[6:]) for f in b.format_stream_end(p, result) if "tool_calls" in f and "delta" in f
        ]
        assert [
            c["function"]["name"] for f in frames for c in f["choices"][0]["delta"].get("tool_calls", [])
        ] == names


# ---------------------------------------------------------------- the real server
def _answer(base_url: str, body: dict) -> str:
    r = httpx.post(base_url + CHAT, json=body, timeout=120)
    assert r.status_code == 200, r.text
    if not body.get("stream"):
        return r.json()["choices"][0]["message"]["content"]
    chunks = [json.loads(line[6:]) for line in r.text.splitlines() if line.startswith("data: {")]
    return "".join(c["choices"][0]["delta"].get("content") or "" for c in chunks if c["choices"])


REFUSED_EXAMPLES: dict[str, tuple[dict, str]] = {
    "audio": ({"audio": {"voice": "alloy", "format": "wav"}}, "audio"),
    "function_call": ({"function_call": "auto"}, "function_call"),
    "functions": ({"functions": [{"name": "f", "parameters": {"type": "object"}}]}, "functions"),
    "modalities": ({"modalities": ["text", "audio"]}, "modalities"),
    "moderation": ({"moderation": {"model": "omni-moderation-latest"}}, "moderation"),
    "prediction": ({"prediction": {"type": "content", "content": "Paris"}}, "prediction"),
    "store": ({"store": True}, "store"),
    "verbosity": ({"verbosity": "low"}, "verbosity"),
    "web_search_options": ({"web_search_options": {}}, "web_search_options"),
    "messages[].audio": ({"messages": _replayed(audio={"id": "audio_1"})}, "messages.1.audio"),
    "messages[].function_call": (
        {"messages": _replayed(function_call={"name": "f", "arguments": "{}"})},
        "messages.1.function_call",
    ),
}


def test_examples_cover_the_refused_table() -> None:
    assert list(REFUSED_EXAMPLES) == list(REFUSED)


@pytest.mark.slow
@pytest.mark.parametrize("field", list(REFUSED))
def test_refused_field_is_a_400_naming_it(base_url: str, field: str) -> None:
    patch, param = REFUSED_EXAMPLES[field]
    r = httpx.post(base_url + CHAT, json={**BASE, **patch}, timeout=120)
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert (error["param"], error["type"]) == (param, "invalid_request_error")


@pytest.mark.slow
@pytest.mark.parametrize(
    "kw",
    [
        {"store": True},
        {"response_format": {"type": "yaml"}},
        {"verbosity": "low"},
        {"modalities": ["text", "audio"], "audio": {"voice": "alloy", "format": "wav"}},
    ],
    ids=["store", "response_format-type", "verbosity", "audio"],
)
def test_refused_fields_raise_bad_request_in_the_sdk(openai_client: Any, kw: dict) -> None:
    with pytest.raises(openai.BadRequestError) as info:
        openai_client.chat.completions.create(model="astrai", messages=FRANCE, max_tokens=1, **kw)
    assert info.value.body["param"].split(".")[0] in kw


IGNORED_EXAMPLES: dict[str, tuple[dict, dict]] = {  # (request with the field, the same without it)
    "metadata": ({"metadata": {"team": "a"}}, {}),
    "prompt_cache_key": ({"prompt_cache_key": "k-1"}, {}),
    "prompt_cache_options": ({"prompt_cache_options": {"mode": "implicit", "ttl": "30m"}}, {}),
    "prompt_cache_retention": ({"prompt_cache_retention": "24h"}, {}),
    "safety_identifier": ({"safety_identifier": "user-1"}, {}),
    "service_tier": ({"service_tier": "flex"}, {}),
    "store": ({"store": False}, {}),
    "user": ({"user": "user-1"}, {}),
    "messages[].annotations": ({"messages": _replayed(annotations=[], refusal=None)}, {"messages": REPLAYED}),
    "messages[].content[].prompt_cache_breakpoint": (
        {
            "messages": [
                {
                    "role": "user",
                    "content": [
                        {
                            "type": "text",
                            "text": FRANCE[0]["content"],
                            "prompt_cache_breakpoint": {"mode": "explicit"},
                        }
                    ],
                }
            ]
        },
        {"messages": [{"role": "user", "content": [{"type": "text", "text": FRANCE[0]["content"]}]}]},
    ),
    "stream_options.include_obfuscation": (
        {"stream": True, "stream_options": {"include_obfuscation": True}},
        {"stream": True},
    ),
}


def test_examples_cover_the_ignored_table() -> None:
    assert list(IGNORED_EXAMPLES) == list(IGNORED)


@pytest.mark.slow
@pytest.mark.parametrize("field", list(IGNORED))
def test_ignored_field_changes_nothing(base_url: str, field: str) -> None:
    with_it, without = IGNORED_EXAMPLES[field]
    assert _answer(base_url, {**BASE, **with_it}) == _answer(base_url, {**BASE, **without})


@pytest.mark.slow
def test_null_is_not_sent_and_ignored_fields_pass_through_the_sdk(openai_client: Any, base_url: str) -> None:
    kw = {"model": "astrai", "messages": FRANCE, "max_tokens": 8, "temperature": 0}
    expected = openai_client.chat.completions.create(**kw).choices[0].message.content
    nulls = dict.fromkeys(k for k in REFUSED if "." not in k)
    assert _answer(base_url, {**BASE, **nulls}) == expected
    ignored = {
        "user": "u",
        "metadata": {"a": "b"},
        "store": False,
        "service_tier": "auto",
        "safety_identifier": "s",
        "prompt_cache_key": "k",
        "prompt_cache_retention": "in_memory",
        "parallel_tool_calls": True,
    }
    assert openai_client.chat.completions.create(**kw, **ignored).choices[0].message.content == expected


@pytest.mark.slow
def test_messages_refuse_unknown_keys_and_take_refusals_and_names(base_url: str) -> None:
    r = httpx.post(base_url + CHAT, json={**BASE, "messages": [{**FRANCE[0], "foo": 1}]}, timeout=120)
    assert r.status_code == 400 and r.json()["error"]["param"] == "messages.0.foo"
    refused = _replayed(content=None, refusal="I cannot answer that.")
    stated = _replayed(content="I cannot answer that.")
    assert _answer(base_url, {**BASE, "messages": refused}) == _answer(base_url, {**BASE, "messages": stated})
    named = [{**FRANCE[0], "name": "alice"}]  # the default model's template does not show names
    assert _answer(base_url, {**BASE, "messages": named}) == _answer(base_url, BASE)


# ---------------------------------------------------------------- vLLM's sampling extensions
@pytest.mark.slow
@pytest.mark.parametrize(
    "sampling",
    [
        {"min_tokens": 12},
        {"repetition_penalty": 1.5},
        {"min_p": 0.2, "temperature": 1.0, "top_k": 0, "seed": 7},
    ],
    ids=["min_tokens", "repetition_penalty", "min_p"],
)
def test_sampling_extensions_reach_the_engine(base_url: str, engine: Any, sampling: dict) -> None:
    kw = {"max_tokens": 24, "temperature": 0, **sampling}
    answer = _answer(base_url, {"messages": FRANCE, **kw})
    assert answer == engine.chat(FRANCE, **kw)
    if "min_tokens" in sampling:  # the end-of-sequence token is masked where it would have come
        assert (
            answer.startswith("The capital of France is Paris.")
            and answer != "The capital of France is Paris."
        )


@pytest.mark.slow
def test_stop_token_ids_end_the_answer_without_their_text(openai_client: Any, engine: Any) -> None:
    (paris,) = engine.tokenizer.encode(" Paris")
    r = openai_client.chat.completions.create(
        model="astrai", messages=FRANCE, max_tokens=24, temperature=0, extra_body={"stop_token_ids": [paris]}
    )
    assert (r.choices[0].message.content, r.choices[0].finish_reason) == (
        "The capital of France is",
        "stop",
    )  # " Paris" holds the space


@pytest.mark.slow
@pytest.mark.parametrize(
    ("extra", "status", "param"),
    [
        ({"min_tokens": 9, "max_tokens": 8}, 400, "min_tokens"),
        ({"repetition_penalty": 0}, 422, "repetition_penalty"),
        ({"min_p": 1.5}, 422, "min_p"),
        ({"stop_token_ids": [-1]}, 400, "stop_token_ids"),
    ],
    ids=["min_tokens", "repetition_penalty", "min_p", "stop_token_ids"],
)
def test_sampling_extension_errors_name_the_field(
    base_url: str, extra: dict, status: int, param: str
) -> None:
    r = httpx.post(base_url + CHAT, json={**BASE, **extra}, timeout=120)
    assert r.status_code == status, r.text
    assert r.json()["error"]["param"] == param


STRICT_TOOL = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "strict": True,
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string"}},
            "required": ["city"],
            "additionalProperties": False,
        },
    },
}


@pytest.mark.slow
def test_a_strict_tool_is_served_where_its_calls_are_enforced_and_refused_where_not(base_url: str) -> None:
    """``strict: true`` (the Agents SDK's default): the default model's calls are enforced by grammar,
    so a required call is one of the tool with schema-valid arguments; beside a response format
    that already constrains the answer nothing enforces a call, and the field is named in a 400."""
    body = {**BASE, "tools": [STRICT_TOOL], "tool_choice": "required", "max_tokens": 48}
    r = httpx.post(base_url + CHAT, json=body, timeout=120)
    assert r.status_code == 200, r.text
    call = r.json()["choices"][0]["message"]["tool_calls"][0]["function"]
    assert call["name"] == "get_weather" and set(json.loads(call["arguments"])) == {"city"}
    body = {**BASE, "tools": [STRICT_TOOL], "response_format": {"type": "json_object"}, "max_tokens": 8}
    r = httpx.post(base_url + CHAT, json=body, timeout=120)
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["param"] == "tools.0.function.strict" and "response format" in error["message"]
