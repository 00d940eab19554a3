"""Issue 16, finding 1: one request's parameters cannot take the other requests of its step down.

Against a real ``astrai serve``: ``"top_k": 9223372036854775808`` (2**63) or ``10**30`` passed
validation on both ``/v1/chat/completions`` and ``/v1/messages`` and then overflowed an int64
tensor inside the scheduler step, so six healthy streams sharing it ended with an in-stream 500
and no ``[DONE]``. Now a ``top_k`` at or above the vocabulary is off (vLLM's rule): those requests
complete like ``top_k`` 0, next to the six, and values that can never be served (token ids beyond
the vocabulary, a plugin parameter too large for a float) are a 400 in the route's error shape
before any 200 header, streamed or not. The six streams always complete, and the log has no
failed step.
"""

from __future__ import annotations

import asyncio
import json
from typing import Any

import httpx
import pytest

pytestmark = pytest.mark.slow  # the real default model, in a subprocess

CHAT, MESSAGES = "/v1/chat/completions", "/v1/messages"
HUGE = [2**63, 10**30]


def body(i: int, **fields: Any) -> dict[str, Any]:
    """A request valid on both routes: greedy, 32 tokens unless ``fields`` say otherwise."""
    messages = [{"role": "user", "content": f"Count from {i} to {i + 40}, one number per line."}]
    return {"messages": messages, "max_tokens": 32, "temperature": 0, **fields}


async def stream(
    client: httpx.AsyncClient, route: str, payload: dict, started: asyncio.Event | None = None
) -> dict:
    """POST a streamed request; the status, content type and every ``data:`` payload (``[DONE]`` kept).
    ``started`` is set once the first generated text arrives."""
    events: list[Any] = []
    try:
        async with client.stream("POST", route, json={**payload, "stream": True}) as r:
            if r.status_code != 200:
                return {
                    "status": r.status_code,
                    "type": r.headers["content-type"],
                    "body": json.loads(await r.aread()),
                }
            async for line in r.aiter_lines():
                if line.startswith("data: "):
                    data = line.removeprefix("data: ")
                    events.append(data if data == "[DONE]" else json.loads(data))
                    if started is not None and text_of(route, events[-1:]):
                        started.set()
    finally:  # a stream that ends (or fails) before its first text does not hold the others back
        if started is not None:
            started.set()
    return {"status": 200, "events": events}


def text_of(route: str, events: list[Any]) -> str:
    events = [e for e in events if isinstance(e, dict)]  # not [DONE]
    if route == CHAT:
        return "".join(e["choices"][0]["delta"].get("content") or "" for e in events if e.get("choices"))
    return "".join(e["delta"]["text"] for e in events if e.get("type") == "content_block_delta")


def completed(route: str, result: dict) -> bool:
    """A normal end: a finish reason then ``[DONE]`` (OpenAI), ``message_stop`` then ``[DONE]`` (astrai's
    Anthropic stream), no error event."""
    events = result.get("events") or [None]
    if events[-1] != "[DONE]":
        return False
    if any("error" in e for e in events[:-1]):  # OpenAI's in-stream error, Anthropic's error event
        return False
    if route == CHAT:
        reasons = [e["choices"][0]["finish_reason"] for e in events[:-1] if e.get("choices")]
        return bool(reasons) and reasons[-1] in ("stop", "length")
    return events[-2].get("type") == "message_stop"


async def storm(url: str) -> tuple[list, list, list]:
    async with httpx.AsyncClient(base_url=url, timeout=120) as client:
        started = [asyncio.Event() for _ in range(6)]
        routes = [CHAT, MESSAGES] * 3
        healthy = [asyncio.create_task(stream(client, r, body(i), started[i])) for i, r in enumerate(routes)]
        await asyncio.wait_for(asyncio.gather(*(e.wait() for e in started)), 120)  # all six are decoding now
        # the requests, sent while the six stream: they join the six's steps
        huge = [
            (CHAT, HUGE[0], True),
            (CHAT, HUGE[1], False),
            (MESSAGES, HUGE[0], False),
            (MESSAGES, HUGE[1], True),
        ]
        tasks = []
        for route, k, streamed in huge:  # sampled (a greedy row never builds the sampling tensors)
            payload = body(0, top_k=k, temperature=1.0, max_tokens=12)
            tasks.append(stream(client, route, payload) if streamed else client.post(route, json=payload))
        refused = [
            (CHAT, {"logit_bias": {str(10**30): 1}}, "logit_bias"),
            # the typical_p plugin's parameter (installed with the examples): 10**400 was an OverflowError 500
            (CHAT, {"typical_p": 10**400}, "typical_p"),
            (MESSAGES, {"typical_p": 10**400}, "typical_p"),
            (CHAT, {"stop_token_ids": [2**63]}, "stop_token_ids"),
            (MESSAGES, {"stop_token_ids": [2**63]}, "stop_token_ids"),
            (MESSAGES, {"stop_token_ids": [10**30]}, "stop_token_ids"),
        ]
        for route, fields, _ in refused:
            payload = body(0, temperature=1.0, **fields)
            tasks += [stream(client, route, payload), client.post(route, json=payload)]
        answers = await asyncio.gather(*tasks)
        return (
            list(zip(routes, await asyncio.gather(*healthy), strict=True)),
            list(zip(huge, answers[: len(huge)], strict=True)),
            list(zip([c for c in refused for _ in (0, 1)], answers[len(huge) :], strict=True)),
        )


def test_huge_top_k_and_unservable_values_never_fail_the_streams_they_meet(server):
    healthy, huge, refused = asyncio.run(storm(server.url))
    for route, result in healthy:
        assert result["status"] == 200 and completed(route, result), (route, result)
        assert text_of(route, result["events"]).strip()
    for (route, k, streamed), answer in huge:  # top_k >= the vocabulary: off, as in vLLM
        if streamed:
            assert answer["status"] == 200 and completed(route, answer), (route, k, answer)
        else:
            assert answer.status_code == 200, (route, k, answer.text)
            reason = (
                answer.json()["choices"][0]["finish_reason"]
                if route == CHAT
                else answer.json()["stop_reason"]
            )
            assert reason in ("stop", "length", "end_turn", "max_tokens")
    for (route, _fields, param), answer in refused:
        # a stream too: the 400 is the status line itself, with the route's JSON error body
        status, kind, error = (
            (answer["status"], answer["type"], answer["body"])
            if isinstance(answer, dict)
            else (answer.status_code, answer.headers["content-type"], answer.json())
        )
        assert status == 400 and kind.startswith("application/json"), (route, param, answer)
        if route == CHAT:
            assert error["error"]["param"] == param and param in error["error"]["message"]
            assert error["error"]["type"] == "invalid_request_error"
        else:
            assert error["type"] == "error" and error["error"]["type"] == "invalid_request_error"
            assert param in error["error"]["message"]
    stats = server.wait_idle()
    assert stats["kv_tokens_in_use"] == 0
    log = server.log()
    assert "step of" not in log and "failed in a step" not in log and "Traceback" not in log, log[-3000:]
