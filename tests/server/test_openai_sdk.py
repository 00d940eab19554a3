"""The official ``openai`` SDK against a real server on the default model (float32, greedy unless seeded).

References are independent of the HTTP path: the engine's own ``chat()`` and the tokenizer.
"""

from __future__ import annotations

import json
from typing import Any

import openai
import pytest

pytestmark = pytest.mark.slow  # the real default model

FRANCE = [{"role": "user", "content": "What is the capital of France?"}]
WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Get the current weather in a city",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
    },
}
# One worked example in the history teaches the 135M model the <tool_call> format.
ONE_SHOT = [
    {"role": "user", "content": "What is the weather in London?"},
    {
        "role": "assistant",
        "content": None,
        "tool_calls": [
            {
                "id": "call_1",
                "type": "function",
                "function": {"name": "get_weather", "arguments": '{"city": "London"}'},
            }
        ],
    },
    {"role": "user", "content": "What is the weather in Paris?"},
]


def _reference(engine: Any, messages: list[dict], **sampling: Any) -> str:
    return engine.chat(messages, temperature=0, **sampling)


def test_non_streaming_text_usage_and_eos_finish(openai_client: Any, engine: Any) -> None:
    r = openai_client.chat.completions.create(model="astrai", messages=FRANCE, max_tokens=32, temperature=0)
    expected = _reference(engine, FRANCE, max_tokens=32)
    assert expected == "The capital of France is Paris."
    (choice,) = r.choices
    assert (choice.message.role, choice.message.content, choice.finish_reason) == (
        "assistant",
        expected,
        "stop",
    )
    prompt = len(engine.tokenizer.apply_chat_template(FRANCE))
    completion = len(engine.tokenizer.encode(expected)) + 1  # the EOS token was generated too
    assert (r.usage.prompt_tokens, r.usage.completion_tokens, r.usage.total_tokens) == (
        prompt,
        completion,
        prompt + completion,
    )
    assert r.object == "chat.completion" and r.id.startswith("chatcmpl-") and r.model == "astrai"


def test_max_tokens_finish_is_length(openai_client: Any, engine: Any) -> None:
    r = openai_client.chat.completions.create(model="astrai", messages=FRANCE, max_tokens=3, temperature=0)
    assert r.choices[0].finish_reason == "length" and r.usage.completion_tokens == 3
    assert r.choices[0].message.content == _reference(engine, FRANCE, max_tokens=3) == "The capital of"


@pytest.mark.parametrize("include_usage", [True, False])
def test_streaming_equals_non_streaming_and_ends_with_usage(
    openai_client: Any, engine: Any, include_usage: bool
) -> None:
    chunks = list(
        openai_client.chat.completions.create(
            model="astrai",
            messages=FRANCE,
            max_tokens=32,
            temperature=0,
            stream=True,
            stream_options={"include_usage": include_usage},
        )
    )
    assert chunks[0].choices[0].delta.role == "assistant"
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == _reference(engine, FRANCE, max_tokens=32)
    finishes = [c.choices[0].finish_reason for c in chunks if c.choices]
    assert finishes[-1] == "stop" and set(finishes[:-1]) == {None}
    usage = [c for c in chunks if c.usage is not None]
    if include_usage:
        assert chunks[-1] is usage[0] and chunks[-1].choices == []
        assert usage[0].usage.prompt_tokens == len(engine.tokenizer.apply_chat_template(FRANCE))
        assert usage[0].usage.completion_tokens == 8
    else:
        assert usage == []


@pytest.mark.parametrize(
    ("stop", "text"), [(["Paris"], "The capital of France is "), ("ance is", "The capital of Fr")]
)
def test_stop_strings_are_never_returned(openai_client: Any, stop: Any, text: str) -> None:
    kw = {"model": "astrai", "messages": FRANCE, "max_tokens": 32, "temperature": 0, "stop": stop}
    r = openai_client.chat.completions.create(**kw)
    assert (r.choices[0].message.content, r.choices[0].finish_reason) == (text, "stop")
    streamed = "".join(
        c.choices[0].delta.content or ""
        for c in openai_client.chat.completions.create(**kw, stream=True)
        if c.choices
    )
    assert streamed == text


def test_seed_reproduces_and_n_choices_use_consecutive_seeds(openai_client: Any, engine: Any) -> None:
    kw = {
        "model": "astrai",
        "messages": FRANCE,
        "max_tokens": 6,
        "temperature": 1.0,
        "extra_body": {"top_k": 0},
    }
    single = [openai_client.chat.completions.create(**kw, seed=s) for s in (123, 123, 124)]
    text = [r.choices[0].message.content for r in single]
    assert text[0] == text[1]
    r = openai_client.chat.completions.create(**kw, seed=123, n=2)
    assert [c.index for c in r.choices] == [0, 1]
    assert [c.message.content for c in r.choices] == [text[0], text[2]]
    assert r.usage.completion_tokens == single[0].usage.completion_tokens + single[2].usage.completion_tokens
    assert r.usage.prompt_tokens == len(
        engine.tokenizer.apply_chat_template(FRANCE)
    )  # counted once whatever n is


def test_logit_bias_and_presence_penalty_are_applied(openai_client: Any, engine: Any) -> None:
    (yes,) = engine.tokenizer.encode(" yes")
    r = openai_client.chat.completions.create(
        model="astrai", messages=FRANCE, max_tokens=3, temperature=0, logit_bias={str(yes): 100}
    )
    assert r.choices[0].message.content == engine.tokenizer.decode([yes] * 3) == " yes yes yes"
    kw = {"max_tokens": 12, "presence_penalty": 2.0}
    r = openai_client.chat.completions.create(model="astrai", messages=FRANCE, temperature=0, **kw)
    assert r.choices[0].message.content == _reference(engine, FRANCE, **kw)


def test_tool_call_comes_back_as_tool_calls(openai_client: Any) -> None:
    kw = {"model": "astrai", "messages": ONE_SHOT, "tools": [WEATHER], "max_tokens": 40, "temperature": 0}
    r = openai_client.chat.completions.create(**kw)
    (choice,) = r.choices
    assert choice.finish_reason == "tool_calls" and choice.message.content is None
    (call,) = choice.message.tool_calls
    assert (call.type, call.function.name, json.loads(call.function.arguments)) == (
        "function",
        "get_weather",
        {"city": "Paris"},
    )
    chunks = list(openai_client.chat.completions.create(**kw, stream=True))
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == ""
    assert _streamed_calls(chunks) == [("get_weather", {"city": "Paris"})]
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "tool_calls"


def _streamed_calls(chunks: list[Any]) -> list[tuple[str, dict]]:
    """The calls of a stream as the SDK's own accumulator assembles them, checked to have streamed:
    the first delta of a call carries its id and name, later ones more of its arguments."""
    from openai.lib.streaming.chat import ChatCompletionStreamState

    state = ChatCompletionStreamState()
    for chunk in chunks:
        state.handle_chunk(chunk)
    deltas = [
        t
        for c in chunks
        if c.choices and c.choices[0].delta.tool_calls
        for t in c.choices[0].delta.tool_calls
    ]
    firsts = [t for t in deltas if t.id]
    assert all(t.function.name and t.type == "function" for t in firsts)
    assert all(t.function.name is None for t in deltas if not t.id)
    assert len(deltas) > len(firsts)  # the arguments came in pieces after the call's start
    calls = state.get_final_completion().choices[0].message.tool_calls or []
    assert [c.id for c in calls] == [t.id for t in firsts]
    return [(c.function.name, json.loads(c.function.arguments)) for c in calls]


# The weather came back and was answered: asked about another city, the model answers from thin air
# ("Yes, Rome is sunny right now.") unless the request requires a call.
ANSWERED = [
    *ONE_SHOT[:2],
    {"role": "tool", "tool_call_id": "call_1", "content": "12 degrees, cloudy"},
    {"role": "assistant", "content": "It is 12 degrees and cloudy in London."},
    {"role": "user", "content": "Is Rome sunny right now?"},
]


def test_tool_choice_required_or_named_makes_the_answer_a_call(openai_client: Any) -> None:
    kw = {"model": "astrai", "messages": ANSWERED, "tools": [WEATHER], "max_tokens": 40, "temperature": 0}
    free = openai_client.chat.completions.create(**kw).choices[0]
    assert free.finish_reason == "stop" and free.message.tool_calls is None and "Rome" in free.message.content
    named = {"type": "function", "function": {"name": "get_weather"}}
    for choice in ("required", named):
        (forced,) = openai_client.chat.completions.create(**kw, tool_choice=choice).choices
        assert forced.finish_reason == "tool_calls" and forced.message.content is None
        assert [(c.function.name, json.loads(c.function.arguments)) for c in forced.message.tool_calls] == [
            ("get_weather", {"city": "Rome"})
        ]
    chunks = list(openai_client.chat.completions.create(**kw, tool_choice=named, stream=True))
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == ""
    assert _streamed_calls(chunks) == [("get_weather", {"city": "Rome"})]
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "tool_calls"


def test_errors_are_typed_sdk_exceptions(
    openai_client: Any, engine: Any, keyed_url: str, api_key: str
) -> None:
    long = [{"role": "user", "content": "hello " * 1100}]
    with pytest.raises(openai.BadRequestError) as info:
        openai_client.chat.completions.create(model="astrai", messages=long, max_tokens=4)
    n = len(engine.tokenizer.apply_chat_template(long))
    assert f"{n} tokens" in info.value.message and "1024 tokens" in info.value.message
    with pytest.raises(openai.UnprocessableEntityError) as bad:
        openai_client.chat.completions.create(model="astrai", messages=FRANCE, temperature=3)
    assert bad.value.body["param"] == "temperature" and bad.value.body["type"] == "invalid_request_error"
    wrong = openai.OpenAI(base_url=keyed_url + "/v1", api_key="wrong", max_retries=0)
    with pytest.raises(openai.AuthenticationError):
        wrong.chat.completions.create(model="astrai", messages=FRANCE, max_tokens=1)
    right = openai.OpenAI(base_url=keyed_url + "/v1", api_key=api_key, max_retries=0)
    assert (
        right.chat.completions.create(model="astrai", messages=FRANCE, max_tokens=1).usage.completion_tokens
        == 1
    )


def test_models_lists_the_served_model(openai_client: Any) -> None:
    (model,) = openai_client.models.list().data
    assert (model.id, model.owned_by, model.model_extra["context_length"]) == ("astrai", "astrai", 1024)
