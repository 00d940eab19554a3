"""The official ``anthropic`` SDK against a real server on the default model (float32, greedy)."""

from __future__ import annotations

from typing import Any

import anthropic
import pytest

pytestmark = pytest.mark.slow  # the real default model

FRANCE = [{"role": "user", "content": "What is the capital of France?"}]
ANSWER = "The capital of France is Paris."
GREEDY = {"temperature": 0}  # this SDK has no sampling keywords: they travel in the body
WEATHER = {
    "name": "get_weather",
    "description": "Get the current weather in a city",
    "input_schema": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
}
ONE_SHOT = [
    {"role": "user", "content": "What is the weather in London?"},
    {
        "role": "assistant",
        "content": [
            {"type": "tool_use", "id": "toolu_1", "name": "get_weather", "input": {"city": "London"}}
        ],
    },
    {"role": "user", "content": "What is the weather in Paris?"},
]


def _prompt_tokens(engine: Any, messages: list[dict], system: str | None = None) -> int:
    head = [{"role": "system", "content": system}] if system else []
    return len(engine.tokenizer.apply_chat_template(head + messages))


def test_non_streaming_text_usage_and_end_turn(anthropic_client: Any, engine: Any) -> None:
    m = anthropic_client.messages.create(model="astrai", max_tokens=32, messages=FRANCE, extra_body=GREEDY)
    assert engine.chat(FRANCE, max_tokens=32, temperature=0) == ANSWER
    assert [(b.type, b.text) for b in m.content] == [("text", ANSWER)]
    assert (m.role, m.stop_reason, m.stop_sequence, m.type) == ("assistant", "end_turn", None, "message")
    assert m.usage.input_tokens == _prompt_tokens(engine, FRANCE)
    assert m.usage.output_tokens == len(engine.tokenizer.encode(ANSWER)) + 1  # + the EOS token
    assert m.id.startswith("msg_")


def test_streaming_reports_real_input_tokens_from_message_start(anthropic_client: Any, engine: Any) -> None:
    with anthropic_client.messages.stream(
        model="astrai", max_tokens=32, messages=FRANCE, extra_body=GREEDY
    ) as stream:
        events = list(stream)
        final = stream.get_final_message()
    start = events[0]
    assert start.type == "message_start" and start.message.usage.input_tokens == _prompt_tokens(
        engine, FRANCE
    )
    text = "".join(e.delta.text for e in events if e.type == "content_block_delta")
    assert text == ANSWER and final.content[0].text == ANSWER
    assert (final.stop_reason, final.usage.output_tokens) == ("end_turn", 8)
    assert final.usage.input_tokens == _prompt_tokens(engine, FRANCE)


@pytest.mark.parametrize("stream", [False, True])
def test_stop_sequence_reports_which_one_and_is_not_returned(anthropic_client: Any, stream: bool) -> None:
    kw = {
        "model": "astrai",
        "max_tokens": 32,
        "messages": FRANCE,
        "extra_body": GREEDY,
        "stop_sequences": ["nope", "Paris"],
    }
    if stream:
        with anthropic_client.messages.stream(**kw) as s:
            m = s.get_final_message()
    else:
        m = anthropic_client.messages.create(**kw)
    assert (m.content[0].text, m.stop_reason, m.stop_sequence) == (
        "The capital of France is ",
        "stop_sequence",
        "Paris",
    )


def test_max_tokens_and_system_forms(anthropic_client: Any, engine: Any) -> None:
    kw = {"model": "astrai", "max_tokens": 3, "messages": FRANCE, "extra_body": GREEDY}
    as_text = anthropic_client.messages.create(**kw, system="Answer briefly.")
    as_blocks = anthropic_client.messages.create(
        **kw, system=[{"type": "text", "text": "Answer "}, {"type": "text", "text": "briefly."}]
    )
    assert as_text.stop_reason == "max_tokens" and as_text.usage.output_tokens == 3
    assert as_text.content[0].text == as_blocks.content[0].text
    assert (
        as_text.usage.input_tokens
        == as_blocks.usage.input_tokens
        == _prompt_tokens(engine, FRANCE, "Answer briefly.")
    )


def test_tool_call_comes_back_as_tool_use(anthropic_client: Any) -> None:
    kw = {"model": "astrai", "max_tokens": 40, "messages": ONE_SHOT, "tools": [WEATHER], "extra_body": GREEDY}
    m = anthropic_client.messages.create(**kw)
    assert m.stop_reason == "tool_use"
    (block,) = [b for b in m.content if b.type == "tool_use"]
    assert (block.name, block.input) == ("get_weather", {"city": "Paris"}) and block.id.startswith("toolu_")
    with anthropic_client.messages.stream(**kw) as s:
        final = s.get_final_message()
    assert [(b.name, b.input) for b in final.content if b.type == "tool_use"] == [
        ("get_weather", {"city": "Paris"})
    ]
    assert final.stop_reason == "tool_use"


ANSWERED = [
    *ONE_SHOT[:2],
    {
        "role": "user",
        "content": [{"type": "tool_result", "tool_use_id": "toolu_1", "content": "12 degrees, cloudy"}],
    },
    {"role": "assistant", "content": "It is 12 degrees and cloudy in London."},
    {"role": "user", "content": "Is Rome sunny right now?"},
]


def test_tool_choice_any_or_tool_makes_the_answer_a_tool_use(anthropic_client: Any) -> None:
    kw = {"model": "astrai", "max_tokens": 40, "messages": ANSWERED, "tools": [WEATHER], "extra_body": GREEDY}
    free = anthropic_client.messages.create(**kw)
    assert free.stop_reason == "end_turn" and [b.type for b in free.content] == ["text"]
    for choice in ({"type": "any"}, {"type": "tool", "name": "get_weather"}):
        m = anthropic_client.messages.create(**kw, tool_choice=choice)
        assert m.stop_reason == "tool_use" and m.stop_sequence is None
        assert [(b.name, b.input) for b in m.content if b.type == "tool_use"] == [
            ("get_weather", {"city": "Rome"})
        ]
    with anthropic_client.messages.stream(**kw, tool_choice={"type": "any"}) as s:
        final = s.get_final_message()
    assert [(b.name, b.input) for b in final.content if b.type == "tool_use"] == [
        ("get_weather", {"city": "Rome"})
    ]
    prefilled = [*ANSWERED, {"role": "assistant", "content": "Let me check"}]
    with pytest.raises(anthropic.BadRequestError, match="cannot continue a prefilled assistant turn"):
        anthropic_client.messages.create(**{**kw, "messages": prefilled}, tool_choice={"type": "any"})


def test_errors_are_typed_sdk_exceptions(
    anthropic_client: Any, engine: Any, keyed_url: str, api_key: str
) -> None:
    long = [{"role": "user", "content": "hello " * 1100}]
    with pytest.raises(anthropic.BadRequestError) as info:
        anthropic_client.messages.create(model="astrai", max_tokens=4, messages=long)
    body = info.value.body
    assert body["type"] == "error" and body["error"]["type"] == "invalid_request_error"
    assert (
        f"{_prompt_tokens(engine, long)} tokens" in body["error"]["message"]
        and "1024" in body["error"]["message"]
    )
    with pytest.raises(anthropic.UnprocessableEntityError, match="temperature"):
        anthropic_client.messages.create(
            model="astrai", max_tokens=4, messages=FRANCE, extra_body={"temperature": 5}
        )
    with pytest.raises(
        anthropic.BadRequestError, match=r"messages\.0\.role"
    ):  # the SDK can send it; astrai refuses it
        anthropic_client.messages.create(
            model="astrai", max_tokens=4, messages=[{"role": "system", "content": "x"}]
        )
    with pytest.raises(anthropic.BadRequestError, match=r"thinking\.budget_tokens"):
        anthropic_client.messages.create(
            model="astrai", max_tokens=4, messages=FRANCE, thinking={"type": "enabled", "budget_tokens": 1024}
        )
    wrong = anthropic.Anthropic(base_url=keyed_url, api_key="wrong", max_retries=0)
    with pytest.raises(anthropic.AuthenticationError) as auth:
        wrong.messages.create(model="astrai", max_tokens=1, messages=FRANCE)
    assert auth.value.body["error"]["type"] == "authentication_error"
    right = anthropic.Anthropic(base_url=keyed_url, api_key=api_key, max_retries=0)
    assert right.messages.create(model="astrai", max_tokens=1, messages=FRANCE).usage.output_tokens == 1


@pytest.mark.parametrize(
    "case",
    [
        {"messages": FRANCE},
        {"messages": ONE_SHOT, "tools": [WEATHER], "system": "You can look up the weather."},
        {
            "messages": [*FRANCE, {"role": "assistant", "content": "The capital"}],
            "system": [{"type": "text", "text": "Answer briefly."}],
        },
    ],
    ids=["plain", "tools", "prefill"],
)
def test_count_tokens_is_the_input_tokens_of_the_same_messages(anthropic_client: Any, case: dict) -> None:
    counted = anthropic_client.messages.count_tokens(model="astrai", **case)
    created = anthropic_client.messages.create(model="astrai", max_tokens=1, extra_body=GREEDY, **case)
    assert counted.input_tokens == created.usage.input_tokens > 0


def test_ignored_fields_leave_the_greedy_answer_as_it_is(anthropic_client: Any) -> None:
    kw = {"model": "astrai", "max_tokens": 12, "extra_body": GREEDY}
    plain = anthropic_client.messages.create(**kw, messages=FRANCE, system="Answer briefly.")
    marked = {"type": "ephemeral", "ttl": "5m"}
    decorated = anthropic_client.messages.create(
        **kw,
        system=[{"type": "text", "text": "Answer briefly.", "cache_control": marked}],
        messages=[
            {
                "role": "user",
                "content": [
                    {"type": "text", "text": FRANCE[0]["content"], "cache_control": marked, "citations": None}
                ],
            }
        ],
        metadata={"user_id": "u-1"},
        service_tier="standard_only",
        inference_geo="us",
        speed="standard",
        cache_control={"type": "ephemeral"},
        thinking={"type": "disabled"},
        output_config={},
        container=None,
    )
    assert decorated.content[0].text == plain.content[0].text and plain.content[0].text
    assert (decorated.usage, decorated.stop_reason) == (plain.usage, plain.stop_reason)


def test_max_tokens_zero_computes_the_prompt_only(anthropic_client: Any, engine: Any) -> None:
    m = anthropic_client.messages.create(model="astrai", max_tokens=0, messages=FRANCE)
    assert (m.stop_reason, m.usage.output_tokens, [b.text for b in m.content]) == ("max_tokens", 0, [""])
    assert m.usage.input_tokens == _prompt_tokens(engine, FRANCE)
