"""Load shedding and priorities against a real ``astrai serve`` (issue 17).

A bounded flood on ``--max-batch-size 1 --max-queued-requests 2`` gets only 200s and refusals in
each protocol's own shape (OpenAI: 429 ``rate_limit_exceeded``; Anthropic: 529
``overloaded_error``), each with ``Retry-After``; afterwards nothing is held. A request that waits
past ``--queue-timeout`` is refused the same way, streaming or not, while the running one goes
on. Under ``--scheduling-policy priority`` queued requests finish in priority order; under the
default fcfs policy a priority is a 400 naming it.
"""

from __future__ import annotations

import asyncio
import json
import threading
import time

import anthropic
import httpx
import openai
import pytest

pytestmark = pytest.mark.slow  # the real default model, in a subprocess

CHAT, MESSAGES = "/v1/chat/completions", "/v1/messages"
OVERLOADED_OPENAI = {"type": "requests", "param": None, "code": "rate_limit_exceeded"}


def chat(max_tokens: int = 8, **extra) -> dict:
    return {
        "messages": [{"role": "user", "content": "Count to ten."}],
        "max_tokens": max_tokens,
        "temperature": 0,
        "ignore_eos": True,
        **extra,
    }


def message(max_tokens: int = 8) -> dict:
    return {
        "model": "astrai",
        "max_tokens": max_tokens,
        "messages": [{"role": "user", "content": "Count to ten."}],
        "temperature": 0,
    }


async def flood(url: str, n: int) -> list[httpx.Response]:
    async with httpx.AsyncClient(base_url=url, timeout=120) as client:
        calls = [
            client.post(CHAT, json=chat()) if i % 2 else client.post(MESSAGES, json=message())
            for i in range(n)
        ]
        return await asyncio.wait_for(asyncio.gather(*calls), 300)


@pytest.fixture(scope="module")
def servers(start_servers) -> dict[str, object]:
    """The module's three servers, started side by side up front; each serves only its own tests."""
    return dict(
        zip(
            ("bounded", "queue_timeout", "priority"),
            start_servers(
                ("--max-batch-size", "1", "--max-queued-requests", "2"),
                ("--max-batch-size", "1", "--queue-timeout", "0.5"),
                ("--max-batch-size", "1", "--scheduling-policy", "priority"),
            ),
            strict=True,
        )
    )


@pytest.fixture(scope="module")
def bounded(servers):
    return servers["bounded"]


def test_a_bounded_flood_gets_only_answers_and_protocol_shaped_refusals_and_leaves_nothing_held(
    bounded,
) -> None:
    responses = asyncio.run(flood(bounded.url, 12))
    statuses = sorted(r.status_code for r in responses)
    assert set(statuses) <= {200, 429, 529}, statuses
    assert statuses.count(200) >= 2 and statuses.count(200) < 12, (
        statuses
    )  # the queue took some, refused some
    for r in responses:
        path = r.request.url.path
        if r.status_code == 200:
            continue
        assert r.headers["retry-after"] == "1"
        body = r.json()
        if path == CHAT:
            assert r.status_code == 429
            assert {k: body["error"][k] for k in OVERLOADED_OPENAI} == OVERLOADED_OPENAI
            assert body["error"]["message"].startswith("the server is overloaded: ")
        else:
            assert r.status_code == 529
            assert body["type"] == "error" and body["error"]["type"] == "overloaded_error"
            assert body["error"]["message"].startswith("the server is overloaded: ")
    for r in responses:
        if r.status_code == 200 and r.request.url.path == CHAT:
            assert r.json()["usage"]["completion_tokens"] == 8
    stats = bounded.wait_idle()
    assert stats["kv_tokens_in_use"] == 0
    assert stats["total_tasks"] == statuses.count(200)  # a refused request was never queued


def test_the_sdks_see_a_rate_limit_and_an_overloaded_error(bounded) -> None:
    """While one request runs and two wait, the official SDKs (retries off) get their own error classes."""
    stop = threading.Event()

    def occupy() -> None:  # the running request and two queued ones, one after the other, until told to stop
        with httpx.Client(base_url=bounded.url, timeout=120) as client:
            while not stop.is_set():
                client.post(CHAT, json=chat(max_tokens=64))

    workers = [threading.Thread(target=occupy) for _ in range(3)]
    for w in workers:
        w.start()
    try:
        deadline = time.monotonic() + 60
        while bounded.stats()["waiting_queue"] < 2:  # published by the loop after its last step
            assert time.monotonic() < deadline, "the queue never filled"
            time.sleep(0.02)
        oai = openai.OpenAI(base_url=bounded.url + "/v1", api_key="none", max_retries=0)
        ant = anthropic.Anthropic(base_url=bounded.url, api_key="none", max_retries=0)
        for _ in range(20):  # a worker between two requests leaves a place free for a moment: try again
            try:
                oai.chat.completions.create(
                    model="astrai", messages=[{"role": "user", "content": "Hi"}], max_tokens=2
                )
            except openai.RateLimitError as exc:
                assert exc.status_code == 429 and exc.response.headers["retry-after"] == "1"
                assert exc.code == "rate_limit_exceeded"
                break
        else:
            pytest.fail("no 429 while the queue was full")
        for _ in range(20):
            try:
                ant.messages.create(
                    model="astrai", max_tokens=2, messages=[{"role": "user", "content": "Hi"}]
                )
            except anthropic.OverloadedError as exc:
                assert exc.status_code == 529 and exc.body["error"]["type"] == "overloaded_error"
                break
        else:
            pytest.fail("no 529 while the queue was full")
    finally:
        stop.set()
        for w in workers:
            w.join(120)
    assert bounded.wait_idle()["kv_tokens_in_use"] == 0


def test_a_priority_under_fcfs_is_a_400_naming_it(bounded) -> None:
    r = httpx.post(bounded.url + CHAT, json=chat(priority=3), timeout=60)
    assert r.status_code == 400
    assert r.json()["error"]["param"] == "priority"
    assert "--scheduling-policy priority" in r.json()["error"]["message"]
    assert httpx.post(bounded.url + CHAT, json=chat(priority=0), timeout=60).status_code == 200


def _stream_lines(url: str, payload: dict) -> tuple[int, list[str], dict]:
    with httpx.Client(base_url=url, timeout=120) as client, client.stream("POST", CHAT, json=payload) as r:
        return r.status_code, [line for line in r.iter_lines() if line], dict(r.headers)


def test_a_request_past_the_queue_timeout_is_refused_streaming_or_not_and_the_running_one_completes(
    servers,
) -> None:
    served = servers["queue_timeout"]
    results: dict[str, tuple] = {}
    occupant = threading.Thread(
        # outlasts two requests' 0.5 s each in the queue: 300 tokens are 1.7 s at 170 tok/s (100
        # tokens took about 1 s once the whole-step decode kernel ran on AVX2, too few)
        target=lambda: results.setdefault("occupant", _stream_lines(served.url, chat(300, stream=True)))
    )
    occupant.start()
    deadline = time.monotonic() + 60
    while not served.stats()["active_tasks"]:
        assert time.monotonic() < deadline
        time.sleep(0.02)
    late = httpx.post(served.url + CHAT, json=chat(), timeout=60)
    status, lines, headers = _stream_lines(served.url, chat(stream=True))
    occupant.join(120)
    assert late.status_code == 429 and late.headers["retry-after"] == "1"
    assert "waited 0.5 s in the queue" in late.json()["error"]["message"]
    assert status == 429 and headers["retry-after"] == "1"  # a stream refused before its status line
    assert json.loads(lines[0])["error"]["code"] == "rate_limit_exceeded"
    status, lines, _ = results["occupant"]
    assert status == 200 and lines[-1] == "data: [DONE]"
    events = [json.loads(x.removeprefix("data: ")) for x in lines[:-1] if x.startswith("data: ")]
    assert [c["finish_reason"] for e in events for c in e["choices"] if c["finish_reason"]] == ["length"]
    assert served.wait_idle()["kv_tokens_in_use"] == 0


def test_queued_requests_finish_in_priority_order(servers) -> None:
    served = servers["priority"]
    done: list[int] = []
    lock = threading.Lock()

    def call(priority: int, max_tokens: int = 4) -> None:
        r = httpx.post(served.url + CHAT, json=chat(max_tokens, priority=priority), timeout=120)
        assert r.status_code == 200, r.text
        with lock:
            done.append(priority)

    occupant = threading.Thread(target=call, args=(0, 150))  # busy while the four are queued
    occupant.start()
    deadline = time.monotonic() + 60
    while not served.stats()["active_tasks"]:
        assert time.monotonic() < deadline
        time.sleep(0.02)
    queued = []
    for i, priority in enumerate([5, -1, 3, 1]):  # each is queued behind the occupant before the next arrives
        t = threading.Thread(target=call, args=(priority,))
        t.start()
        queued.append(t)
        while served.stats()["waiting_queue"] < i + 1:
            assert time.monotonic() < deadline, "a request never reached the queue"
            time.sleep(0.01)
    for t in [occupant, *queued]:
        t.join(120)
    assert done == [0, -1, 1, 3, 5]
    assert served.wait_idle()["kv_tokens_in_use"] == 0
