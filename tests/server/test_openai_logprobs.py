"""Chat completion log-probs from a real server on the default model (float32, greedy): OpenAI's shape,
vLLM's choice of tokens (every generated one, the end-of-sequence token included), the same entries
whether streamed or not."""

from __future__ import annotations

import json
from typing import Any

import httpx
import openai
import pytest

from astrai.logprobs import TokenLogprob
from astrai.protocol import ChatResult, Choice, Prepared
from astrai_server.protocols.openai import OpenAIResponseBuilder

FRANCE = [{"role": "user", "content": "What is the capital of France?"}]
ASKED = {
    "model": "astrai",
    "messages": FRANCE,
    "max_tokens": 32,
    "temperature": 0,
    "logprobs": True,
    "top_logprobs": 3,
}


def _eos_texts(engine: Any) -> set[str]:
    return {engine.tokenizer.token_text(t) for t in engine.tokenizer.eos_token_ids}


@pytest.mark.slow  # the real default model
def test_non_streaming_entries_are_every_generated_token(openai_client: Any, engine: Any) -> None:
    r = openai_client.chat.completions.create(**ASKED)
    (choice,) = r.choices
    assert choice.message.content == "The capital of France is Paris." and choice.finish_reason == "stop"
    content = choice.logprobs.content
    assert len(content) == r.usage.completion_tokens and choice.logprobs.refusal is None
    *text, eos = content  # vLLM lists the end-of-sequence token too
    assert eos.token in _eos_texts(engine)
    assert b"".join(bytes(e.bytes) for e in text) == choice.message.content.encode()
    assert "".join(e.token for e in text) == choice.message.content
    for e in content:
        assert e.logprob <= 0 and len(e.top_logprobs) == 3
        assert bytes(e.bytes) == e.token.encode()  # ASCII and special tokens: text and bytes agree
        assert (e.token, e.logprob) == (
            e.top_logprobs[0].token,
            e.top_logprobs[0].logprob,
        )  # greedy: the argmax
        top = [t.logprob for t in e.top_logprobs]
        assert top == sorted(top, reverse=True) and all(t.logprob <= 0 for t in e.top_logprobs)


@pytest.mark.slow  # the real default model
def test_wire_shape_and_off_by_default(base_url: str) -> None:
    body = {k: v for k, v in ASKED.items() if k != "model"} | {"max_tokens": 2, "top_logprobs": 0}
    choice = httpx.post(base_url + "/v1/chat/completions", json=body, timeout=120).json()["choices"][0]
    assert set(choice["logprobs"]) == {"content", "refusal"}
    for entry in choice["logprobs"]["content"]:
        assert set(entry) == {"token", "logprob", "bytes", "top_logprobs"} and entry["top_logprobs"] == []
    plain = httpx.post(
        base_url + "/v1/chat/completions", json={**body, "logprobs": False, "top_logprobs": None}, timeout=120
    )
    assert plain.json()["choices"][0]["logprobs"] is None


@pytest.mark.slow  # the real default model
def test_streamed_entries_follow_their_text_and_equal_the_non_streamed(
    openai_client: Any, engine: Any
) -> None:
    whole = openai_client.chat.completions.create(**ASKED).choices[0].logprobs.content
    chunks = [c for c in openai_client.chat.completions.create(**ASKED, stream=True) if c.choices]
    streamed = []
    for c in chunks:
        choice = c.choices[0]
        if choice.delta.content:
            assert "".join(e.token for e in choice.logprobs.content) == choice.delta.content
        if choice.logprobs is not None:
            streamed += choice.logprobs.content
    (finish,) = [c.choices[0] for c in chunks if c.choices[0].finish_reason]
    assert [e.token for e in finish.logprobs.content] == [whole[-1].token] and whole[-1].token in _eos_texts(
        engine
    )
    assert [(e.token, e.bytes, [t.token for t in e.top_logprobs]) for e in streamed] == [
        (e.token, e.bytes, [t.token for t in e.top_logprobs]) for e in whole
    ]
    # the prefix cache may shape the two prefills differently: equal up to float rounding
    assert [e.logprob for e in streamed] == pytest.approx([e.logprob for e in whole], abs=1e-4)


@pytest.mark.slow  # the real default model
def test_a_stop_strings_token_goes_with_the_text_it_brought(openai_client: Any) -> None:
    kw = {**ASKED, "stop": ["Paris"]}
    whole = openai_client.chat.completions.create(**kw).choices[0]
    assert whole.message.content == "The capital of France is " and whole.finish_reason == "stop"
    assert [e.token for e in whole.logprobs.content][
        -1
    ] == " Paris"  # generated, its text cut at the stop string
    chunks = [c.choices[0] for c in openai_client.chat.completions.create(**kw, stream=True) if c.choices]
    streamed = [e.token for c in chunks if c.logprobs is not None for e in c.logprobs.content]
    assert streamed == [e.token for e in whole.logprobs.content]
    *_, last_text, finish = chunks
    assert (last_text.delta.content, [e.token for e in last_text.logprobs.content]) == (" ", [" Paris"])
    assert finish.finish_reason == "stop" and finish.logprobs.content == []


@pytest.mark.slow
@pytest.mark.parametrize(
    ("extra", "error", "param"),
    [
        ({"top_logprobs": 2}, openai.BadRequestError, "top_logprobs"),
        ({"top_logprobs": 2, "logprobs": False}, openai.BadRequestError, "top_logprobs"),
        ({"top_logprobs": 21, "logprobs": True}, openai.UnprocessableEntityError, "top_logprobs"),
    ],
    ids=["without-logprobs", "logprobs-false", "too-many"],
)
def test_top_logprobs_needs_logprobs_and_a_range(
    openai_client: Any, extra: dict, error: type, param: str
) -> None:
    with pytest.raises(error) as info:
        openai_client.chat.completions.create(model="astrai", messages=FRANCE, max_tokens=1, **extra)
    assert info.value.body["param"] == param


class _Tokens:
    """Token ``i`` is the letter ``chr(97 + i)``."""

    def token_text(self, token_id: int) -> str:
        return chr(97 + token_id)

    def token_bytes(self, token_id: int) -> bytes:
        return self.token_text(token_id).encode()


def test_builder_renders_entries_only_when_asked_and_clamps_minus_infinity() -> None:
    b = OpenAIResponseBuilder()
    entries = [TokenLogprob(0, -0.5, ((0, -0.5), (1, -1.0))), TokenLogprob(2, float("-inf"), ())]
    result = ChatResult([Choice(0, "ac", "stop", 2, logprobs=entries, logprobs_streamed=1)], prompt_tokens=1)
    asked = Prepared(
        request=None, prompt_ids=[1], params=None, response_id="id", state={"tokenizer": _Tokens()}
    )  # type: ignore[arg-type]
    content = b.format_response(asked, result)["choices"][0]["logprobs"]["content"]
    assert content == [
        {
            "token": "a",
            "logprob": -0.5,
            "bytes": [97],
            "top_logprobs": [
                {"token": "a", "logprob": -0.5, "bytes": [97]},
                {"token": "b", "logprob": -1.0, "bytes": [98]},
            ],
        },
        {"token": "c", "logprob": -9999.0, "bytes": [99], "top_logprobs": []},
    ]
    (chunk,) = b.format_chunk(asked, 0, "a", logprobs=entries[:1])
    assert json.loads(chunk[6:])["choices"][0]["logprobs"]["content"] == content[:1]
    finish = [json.loads(f[6:]) for f in b.format_stream_end(asked, result) if '"finish_reason":"stop"' in f]
    assert finish[0]["choices"][0]["logprobs"] == {"content": content[1:], "refusal": None}  # the rest
    plain = Prepared(request=None, prompt_ids=[1], params=None, response_id="id")  # type: ignore[arg-type]
    assert b.format_response(plain, result)["choices"][0]["logprobs"] is None
    assert "logprobs" not in b.format_chunk(plain, 0, "a", logprobs=entries[:1])[0]
