"""The openai builder's side routes on a real server (default model): ``GET /v1/models/{model}`` and
vLLM's ``POST /tokenize`` / ``POST /detokenize``, whose chat form counts what a chat completion counts."""

from __future__ import annotations

from typing import Any

import httpx
import openai
import pytest

pytestmark = pytest.mark.slow  # the real default model

FRANCE = [{"role": "user", "content": "What is the capital of France?"}]
WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}},
    },
}


def _post(base_url: str, path: str, body: dict) -> httpx.Response:
    return httpx.post(base_url + path, json=body, timeout=120)


def test_models_retrieve_the_served_model_and_404_others(openai_client: Any, base_url: str) -> None:
    model = openai_client.models.retrieve("astrai")
    (listed,) = openai_client.models.list().data
    assert model.model_dump() == listed.model_dump() and model.id == "astrai"
    with pytest.raises(openai.NotFoundError) as info:
        openai_client.models.retrieve("gpt-4o")
    assert info.value.body == {
        "message": "The model `gpt-4o` does not exist or you do not have access to it.",
        "type": "invalid_request_error",
        "param": None,
        "code": "model_not_found",
    }
    r = httpx.get(base_url + "/v1/models/org/name")  # a name with a slash reaches the route too
    assert r.status_code == 404 and r.json()["error"]["code"] == "model_not_found"


def test_models_retrieve_needs_the_api_key(keyed_url: str, api_key: str) -> None:
    assert httpx.get(keyed_url + "/v1/models/astrai").status_code == 401
    assert (
        httpx.get(keyed_url + "/v1/models/astrai", headers={"authorization": f"Bearer {api_key}"}).status_code
        == 200
    )


@pytest.mark.parametrize("tools", [None, [WEATHER]], ids=["plain", "tools"])
def test_tokenized_messages_count_what_a_chat_completion_counts(
    openai_client: Any, base_url: str, tools: Any
) -> None:
    body = {"messages": FRANCE} | ({"tools": tools} if tools else {})
    tokenized = _post(base_url, "/tokenize", body).json()
    chat = openai_client.chat.completions.create(model="astrai", max_tokens=1, **body)
    assert tokenized["count"] == len(tokenized["tokens"]) == chat.usage.prompt_tokens
    assert (tokenized["max_model_len"], tokenized["token_strs"]) == (1024, None)


def test_messages_round_trip_to_the_templated_text(base_url: str, engine: Any) -> None:
    tokens = _post(base_url, "/tokenize", {"messages": FRANCE}).json()["tokens"]
    assert tokens == engine.tokenizer.apply_chat_template(FRANCE)
    assert _post(base_url, "/detokenize", {"tokens": tokens}).json() == {
        "prompt": engine.tokenizer.render_chat(FRANCE)
    }


def test_prompt_round_trip_and_token_strings(base_url: str, engine: Any) -> None:
    text = "Hello world, ça va?"
    r = _post(base_url, "/tokenize", {"model": "anything", "prompt": text, "return_token_strs": True}).json()
    assert r["tokens"] == engine.tokenizer.encode(text, add_special_tokens=True) and r["count"] == len(
        r["tokens"]
    )
    assert r["token_strs"] == [engine.tokenizer.token_text(t) for t in r["tokens"]]
    expected = engine.tokenizer.decode(r["tokens"], skip_special_tokens=False)
    assert (
        _post(base_url, "/detokenize", {"tokens": r["tokens"]}).json() == {"prompt": expected}
        and text in expected
    )
    plain = _post(base_url, "/tokenize", {"prompt": text, "add_special_tokens": False}).json()
    assert plain["tokens"] == engine.tokenizer.encode(text, add_special_tokens=False)


@pytest.mark.parametrize(
    ("path", "body", "status", "param"),
    [
        ("/detokenize", {"tokens": [10**9]}, 400, "tokens"),
        ("/detokenize", {"tokens": [-1]}, 400, "tokens"),
        ("/detokenize", {"tokens": "abc"}, 422, "tokens"),
        ("/tokenize", {"prompt": "x", "messages": FRANCE}, 422, None),
        ("/tokenize", {}, 422, None),
        ("/tokenize", {"prompt": "x", "continue_final_message": True}, 400, "continue_final_message"),
        ("/tokenize", {"prompt": "x", "tools": [WEATHER]}, 400, "tools"),
        ("/tokenize", {"messages": FRANCE, "add_special_tokens": True}, 400, "add_special_tokens"),
        ("/tokenize", {"messages": FRANCE, "add_generation_prompt": False}, 400, "add_generation_prompt"),
        ("/tokenize", {"messages": [{"role": "user", "content": "x", "foo": 1}]}, 400, "messages.0.foo"),
    ],
    ids=[
        "vocab",
        "negative",
        "not-ids",
        "both",
        "neither",
        "unknown",
        "tools-prompt",
        "special",
        "no-gen-prompt",
        "nested",
    ],
)
def test_tokenizer_errors_name_the_field(
    base_url: str, path: str, body: dict, status: int, param: Any
) -> None:
    r = _post(base_url, path, body)
    assert r.status_code == status, r.text
    assert r.json()["error"]["param"] == param and r.json()["error"]["type"] == "invalid_request_error"
