"""Raw HTTP against the real server: exact SSE transcripts of both protocols (ids and timestamps
normalised), every error path, the API key, the plain endpoints, and aborts on client disconnect."""

from __future__ import annotations

import json
import re
import time
from typing import Any

import httpx
import pytest

pytestmark = pytest.mark.slow  # the real default model

FRANCE = [{"role": "user", "content": "What is the capital of France?"}]
CHAT, MESSAGES = "/v1/chat/completions", "/v1/messages"


def _normalise(body: str) -> str:
    body = re.sub(r'"id":"chatcmpl-[0-9a-f]{24}"', '"id":"chatcmpl-ID"', body)
    body = re.sub(r'"id":"msg_[0-9a-f]{24}"', '"id":"msg_ID"', body)
    return re.sub(r'"created":\d+', '"created":0', body)


def _cached(body: str, n_prompt: int) -> int:
    """The prompt tokens the prefix cache served (the shared server may have seen the prompt): whole pages
    of it, at least one token left to compute."""
    cached = int(re.search(r'"cached_tokens":(\d+)', body).group(1))
    assert cached % 16 == 0 and 0 <= cached < n_prompt
    return cached


def _text(piece: str) -> str:
    return json.dumps(piece, ensure_ascii=False)


def test_openai_sse_transcript_is_exact(base_url: str, engine: Any) -> None:
    body = {"messages": FRANCE, "max_tokens": 32, "temperature": 0, "stream": True}
    r = httpx.post(base_url + CHAT, json=body, timeout=60)
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
    assert len(set(re.findall(r'"id":"(chatcmpl-[0-9a-f]+)"', r.text))) == 1  # one id across the stream
    pieces = list(engine.chat(FRANCE, stream=True, max_tokens=32, temperature=0))
    n_prompt = len(engine.tokenizer.apply_chat_template(FRANCE))
    head = (
        'data: {"id":"chatcmpl-ID","object":"chat.completion.chunk","created":0,"model":"astrai","choices":'
    )
    expected = (
        f'{head}[{{"index":0,"delta":{{"role":"assistant"}},"finish_reason":null}}]}}\n\n'
        + "".join(
            f'{head}[{{"index":0,"delta":{{"content":{_text(p)}}},"finish_reason":null}}]}}\n\n'
            for p in pieces
        )
        + f'{head}[{{"index":0,"delta":{{}},"finish_reason":"stop"}}]}}\n\n'
        + f'{head}[],"usage":{{"prompt_tokens":{n_prompt},"completion_tokens":8,'
        + f'"total_tokens":{n_prompt + 8},'
        + f'"prompt_tokens_details":{{"cached_tokens":{_cached(r.text, n_prompt)}}}}}}}\n\n'
        + "data: [DONE]\n\n"
    )
    assert _normalise(r.text) == expected


def test_anthropic_sse_transcript_is_exact(base_url: str, engine: Any) -> None:
    body = {
        "messages": FRANCE,
        "max_tokens": 32,
        "temperature": 0,
        "stream": True,
        "stop_sequences": ["Paris"],
    }
    r = httpx.post(base_url + MESSAGES, json=body, timeout=60)
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
    pieces = list(engine.chat(FRANCE, stream=True, max_tokens=32, temperature=0, stop=["Paris"]))
    assert "".join(pieces) == "The capital of France is "
    n_prompt = len(engine.tokenizer.apply_chat_template(FRANCE))
    n_out = len(
        engine.tokenizer.encode("The capital of France is Paris")
    )  # the stop string's tokens were generated
    expected = (
        "event: message_start\n"
        'data: {"type":"message_start","message":{"id":"msg_ID","type":"message","role":"assistant",'
        '"model":"astrai","content":[],"stop_reason":null,"stop_sequence":null,'
        f'"usage":{{"input_tokens":{n_prompt},"output_tokens":0}}}}}}\n\n'
        "event: content_block_start\n"
        'data: {"type":"content_block_start","index":0,"content_block":{"type":"text","text":""}}\n\n'
        + "".join(
            "event: content_block_delta\n"
            'data: {"type":"content_block_delta","index":0,'
            f'"delta":{{"type":"text_delta","text":{_text(p)}}}}}\n\n'
            for p in pieces
        )
        + "event: content_block_stop\n"
        'data: {"type":"content_block_stop","index":0}\n\n'
        "event: message_delta\n"
        'data: {"type":"message_delta","delta":{"stop_reason":"stop_sequence","stop_sequence":"Paris"},'
        f'"usage":{{"input_tokens":{n_prompt},"output_tokens":{n_out}}}}}\n\n'
        "event: message_stop\n"
        'data: {"type":"message_stop"}\n\n'
        "data: [DONE]\n\n"
    )
    assert _normalise(r.text) == expected


def _assert_shape(path: str, body: Any, status: int) -> str:
    """The protocol's own error body; returns its message."""
    if path == CHAT:
        assert set(body) == {"error"} and set(body["error"]) == {"message", "type", "param", "code"}
        kind = body["error"]["type"]
    else:
        assert (
            set(body) == {"type", "error"}
            and body["type"] == "error"
            and set(body["error"]) == {"type", "message"}
        )
        kind = body["error"]["type"]
    assert kind == {401: "authentication_error"}.get(status, "invalid_request_error")
    return body["error"]["message"]


OK = {"messages": FRANCE}
BAD_BODIES = [
    (b'{"messages": [', 400, "not valid JSON"),
    (b"", 400, "not valid JSON"),
    (b"\xff\xfe{}", 400, "not valid JSON"),
    (b"[1, 2]", 400, "must be a JSON object"),
    (b"null", 400, "must be a JSON object"),
    ({}, 422, "messages: Field required"),
    ({"messages": "hi"}, 422, "messages"),
    ({"messages": [{"role": "user", "content": 5}]}, 422, "messages.0"),
    ({"messages": [{"role": "robot", "content": "x"}]}, 422, "messages.0"),
    ({**OK, "temperature": 2.5}, 422, "temperature"),
    ({**OK, "top_p": -1}, 422, "top_p"),
    ({**OK, "max_tokens": -1}, 422, "max_tokens"),  # 0 is valid on /v1/messages (prompt only)
    ({**OK, "max_tokens": "many"}, 422, "max_tokens"),
    ({**OK, "stream": "maybe"}, 422, "stream"),
    ({**OK, "max_tokens": 10**9}, 400, "1024 tokens"),
    ({"messages": [{"role": "user", "content": "hello " * 1100}], "max_tokens": 4}, 400, "1024 tokens"),
    ({**OK, "top_p": 0}, 400, "top_p"),
]


@pytest.mark.parametrize("path", [CHAT, MESSAGES])
@pytest.mark.parametrize(
    ("body", "status", "says"), BAD_BODIES, ids=[f"{i}-{s}" for i, (_, s, _) in enumerate(BAD_BODIES)]
)
def test_client_errors_are_4xx_in_the_protocols_shape(
    base_url: str, path: str, body: Any, status: int, says: str
) -> None:
    raw = body if isinstance(body, bytes) else json.dumps(body).encode()
    r = httpx.post(base_url + path, content=raw, headers={"content-type": "application/json"}, timeout=60)
    assert r.status_code == status, r.text
    assert says in _assert_shape(path, r.json(), status) and "Traceback" not in r.text


@pytest.mark.parametrize(
    ("path", "body"),
    [
        (CHAT, {**OK, "stop": 5}),
        (CHAT, {**OK, "logit_bias": {"x": 1}}),
        (CHAT, {**OK, "logit_bias": {"99999999": 1}}),
        (CHAT, {**OK, "n": 10**6}),
        (CHAT, {**OK, "tools": [{"type": "function"}]}),
        (CHAT, {**OK, "tool_choice": {"type": "function", "function": {"name": "missing"}}, "tools": []}),
        (
            CHAT,
            {"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]},
        ),
        (MESSAGES, {**OK, "stop_sequences": "Paris"}),
        (MESSAGES, {**OK, "system": 5}),
        (MESSAGES, {"messages": [{"role": "user", "content": [{"type": "tool_result"}]}]}),
        (MESSAGES, {**OK, "tools": [{"name": ""}]}),
        (MESSAGES, {**OK, "tool_choice": {"type": "any"}}),
    ],
    ids=[
        "stop",
        "bias-key",
        "bias-range",
        "n",
        "tool",
        "tool-choice",
        "image",
        "stop-seq",
        "system",
        "tool-result",
        "tool-name",
        "any-tool",
    ],
)
def test_odd_requests_never_produce_a_500(base_url: str, path: str, body: dict) -> None:
    r = httpx.post(base_url + path, json={"max_tokens": 1, **body}, timeout=60)
    assert 400 <= r.status_code < 500, r.text


def test_api_key_bearer_or_x_api_key_and_health_stays_open(keyed_url: str, api_key: str) -> None:
    body = {"messages": FRANCE, "max_tokens": 1}
    for path in (CHAT, MESSAGES):
        for headers in ({}, {"authorization": "Bearer wrong"}, {"x-api-key": "wrong"}):
            r = httpx.post(keyed_url + path, json=body, headers=headers, timeout=60)
            assert r.status_code == 401 and "API key" in _assert_shape(path, r.json(), 401)
        for headers in ({"authorization": f"Bearer {api_key}"}, {"x-api-key": api_key}):
            assert httpx.post(keyed_url + path, json=body, headers=headers, timeout=60).status_code == 200
    assert httpx.post(keyed_url + CHAT, json=body).json()["error"]["code"] == "invalid_api_key"
    assert httpx.get(keyed_url + "/health").status_code == 200
    assert httpx.get(keyed_url + "/stats").status_code == 401
    assert (
        httpx.get(keyed_url + "/v1/models", headers={"authorization": f"Bearer {api_key}"}).status_code == 200
    )


def test_health_stats_models_and_unknown_routes(base_url: str) -> None:
    health = httpx.get(base_url + "/health")
    assert (health.status_code, health.json()) == (200, {"status": "ok", "model_loaded": True})
    stats = httpx.get(base_url + "/stats").json()
    assert {"total_tasks", "total_tokens", "active_tasks", "waiting_queue", "kv_tokens_total"} <= set(stats)
    models = httpx.get(base_url + "/v1/models").json()
    assert models["object"] == "list" and [(m["id"], m["context_length"]) for m in models["data"]] == [
        ("astrai", 1024)
    ]
    assert httpx.get(base_url + "/v1/nothing").status_code == 404
    assert httpx.get(base_url + CHAT).status_code == 405


def _wait_idle(base_url: str, timeout: float = 10.0) -> dict:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        stats = httpx.get(base_url + "/stats").json()
        if stats["active_tasks"] == 0 and stats["waiting_queue"] == 0:
            return stats
        time.sleep(0.05)
    raise AssertionError(f"the request was not aborted: {stats}")


def test_client_disconnect_aborts_streaming_and_non_streaming(base_url: str) -> None:
    long = {"messages": FRANCE, "max_tokens": 300, "temperature": 0, "ignore_eos": True}
    before = _wait_idle(base_url)["total_tokens"]
    with httpx.stream("POST", base_url + CHAT, json={**long, "stream": True}, timeout=60) as r:
        lines = r.iter_lines()
        while '"content"' not in next(lines):  # the first text chunk: generation is under way
            pass
    mid = _wait_idle(base_url)["total_tokens"]
    assert 0 < mid - before < 100
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(base_url + CHAT, json=long, timeout=2.0)
    assert _wait_idle(base_url)["total_tokens"] - mid < 150
