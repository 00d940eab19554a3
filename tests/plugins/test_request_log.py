"""The astrai-request-log hook plugin under ``astrai serve``: its option, its JSON lines, its route."""

from __future__ import annotations

import json
import time
from typing import Any

import httpx
import openai
import pytest

pytestmark = pytest.mark.slow  # the real default model

KEYS = {
    "event",
    "model",
    "request_id",
    "prompt_tokens",
    "completion_tokens",
    "cached_tokens",
    "finish_reason",
    "error",
    "submitted_at",
    "queue_time",
    "time_to_first_token",
    "total_time",
}


def _records(served: Any, since: float, n: int) -> list[dict[str, Any]]:
    """The records of requests submitted after ``since`` (Unix time), once there are ``n`` of them
    (the hook runs after the response is sent; earlier tests' records may still be arriving)."""
    deadline = time.monotonic() + 30
    while True:
        lines = served.request_log.read_text().splitlines() if served.request_log.exists() else []
        records = [r for r in map(json.loads, lines) if r["submitted_at"] >= since]
        if len(records) >= n or time.monotonic() > deadline:
            return records
        time.sleep(0.05)


def test_one_json_line_per_finished_request_with_timings(served: Any) -> None:
    client = openai.OpenAI(base_url=served.url + "/v1", api_key="unused", max_retries=0, timeout=120)
    messages = [{"role": "user", "content": "Name three colours of the rainbow, please."}]
    started = time.time()
    first = client.chat.completions.create(model="astrai", messages=messages, max_tokens=5, temperature=0)
    again = client.chat.completions.create(model="astrai", messages=messages, max_tokens=5, temperature=0)
    records = _records(served, started, 2)
    assert len(records) == 2 and all(set(r) == KEYS for r in records)
    for r, response in zip(records, (first, again), strict=True):
        assert r["event"] == "request_finished" and r["model"].startswith("SmolLM2-135M-Instruct")
        assert r["prompt_tokens"] == response.usage.prompt_tokens
        assert r["completion_tokens"] == response.usage.completion_tokens == 5
        assert r["finish_reason"] == "length" and r["error"] is None
        assert r["submitted_at"] <= time.time()
        assert 0 <= r["queue_time"] <= r["time_to_first_token"] <= r["total_time"] < 60
    # the same prompt again: its prefix comes from the radix cache (whole pages of it)
    assert records[0]["cached_tokens"] < records[1]["cached_tokens"] <= records[1]["prompt_tokens"]


def test_rejected_requests_are_not_logged_and_aborted_ones_are(served: Any) -> None:
    started = time.time()
    r = httpx.post(
        served.url + "/v1/chat/completions",
        json={"messages": [{"role": "user", "content": "x"}], "typical_p": 5},
    )
    assert r.status_code == 400  # refused before the engine saw it: nothing finished
    body = {
        "messages": [{"role": "user", "content": "Count to one hundred."}],
        "max_tokens": 400,
        "stream": True,
        "ignore_eos": True,
    }
    with httpx.stream("POST", served.url + "/v1/chat/completions", json=body, timeout=60) as s:
        next(line for line in s.iter_lines() if '"content"' in line)  # a token has come; leave mid-way
    (record,) = _records(served, started, 1)
    assert record["finish_reason"] == "abort" and 0 < record["completion_tokens"] < 400


def test_server_route_lists_recent_records(served: Any) -> None:
    lines = _records(served, 0, 1)
    recent = httpx.get(served.url + "/request-log", timeout=10).json()["requests"]
    assert recent and recent == lines[-len(recent) :]
