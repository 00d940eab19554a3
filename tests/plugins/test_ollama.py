"""The astrai-ollama protocol plugin, installed and served by ``astrai serve``, through the official ``ollama`` client."""

from __future__ import annotations

import json
from typing import Any

import httpx
import ollama
import pytest

pytestmark = pytest.mark.slow  # the real default model

FRANCE = [{"role": "user", "content": "What is the capital of France?"}]
GREEDY = {"temperature": 0, "num_predict": 12}


@pytest.fixture
def client(served: Any) -> ollama.Client:
    return ollama.Client(host=served.url, timeout=120)


def test_chat_non_streaming(client: ollama.Client) -> None:
    r = client.chat(model="astrai", messages=FRANCE, options=GREEDY)
    assert r.model == "astrai" and r.done and r.message.role == "assistant"
    assert "Paris" in r.message.content
    assert r.done_reason in ("stop", "length") and 0 < r.eval_count <= 12
    assert r.prompt_eval_count > 5 and r.total_duration > 0


def test_chat_streaming_matches_non_streaming(client: ollama.Client) -> None:
    whole = client.chat(model="astrai", messages=FRANCE, options=GREEDY)
    parts = list(client.chat(model="astrai", messages=FRANCE, options=GREEDY, stream=True))
    assert [p.done for p in parts] == [False] * (len(parts) - 1) + [True]
    assert "".join(p.message.content for p in parts) == whole.message.content
    assert parts[-1].message.content == "" and parts[-1].eval_count == whole.eval_count
    assert parts[-1].done_reason == whole.done_reason


def test_stream_is_the_default_and_is_ndjson(served: Any) -> None:
    body = {"model": "astrai", "messages": FRANCE, "options": GREEDY}
    r = httpx.post(served.url + "/api/chat", json=body, timeout=120)
    assert r.status_code == 200 and r.headers["content-type"].startswith("application/x-ndjson")
    lines = [json.loads(line) for line in r.text.splitlines()]
    assert len(lines) > 2 and lines[-1]["done"] is True and not any(x["done"] for x in lines[:-1])
    assert r.text.endswith("\n")


def test_list_models(client: ollama.Client) -> None:
    (model,) = client.list().models
    assert model.model == "astrai"
    assert model.details.family == "llama" and model.details.parameter_size == "135M"
    assert model.size > 100_000_000 and model.modified_at is not None


def test_errors_are_ollama_shaped(client: ollama.Client, served: Any) -> None:
    with pytest.raises(ollama.ResponseError) as bad:
        client.chat(model="astrai", messages=FRANCE, options={"min_p": 3})
    assert bad.value.status_code == 400 and "min_p must be in [0, 1]" in bad.value.error
    r = httpx.post(served.url + "/api/chat", json={"model": "astrai", "messages": []}, timeout=30)
    assert r.status_code == 422 and set(r.json()) == {"error"} and "messages" in r.json()["error"]


def test_options_reach_sampling_and_plugins(client: ollama.Client) -> None:
    """The server runs with --sampling min_p=1.0: sampled requests are greedy unless they set min_p."""
    greedy = client.chat(model="astrai", messages=FRANCE, options=GREEDY).message.content
    seeded = {"temperature": 1.0, "top_k": 0, "top_p": 1.0, "num_predict": 12}
    filtered = {client.chat(model="astrai", messages=FRANCE, options={**seeded, "seed": s}).message.content for s in range(3)}
    assert filtered == {greedy}
    free = {
        client.chat(model="astrai", messages=FRANCE, options={**seeded, "seed": s, "min_p": 0.0}).message.content
        for s in range(4)
    }
    assert len(free) > 1
