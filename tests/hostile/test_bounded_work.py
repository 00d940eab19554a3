"""Issue 29, findings 2-4: every request's work bounded before it starts, against a real ``astrai serve``.

- Fan-out: a ``/v1/completions`` request of more choices (prompts x ``n``) than ``--max-choices`` is a
  400 naming the field; one under it is served round-robin with other requests, so a small chat that
  comes after it is not held back until every choice of it ran.
- Grammar compiles: a compile past ``--grammar-compile-timeout`` is stopped (a 400 naming the setting)
  while a plain chat beside it stays fast; a client that leaves stops its compile (the worker is free
  for the next one at once); an oversized schema is refused before anything compiles; the cheap
  checks (the context) come before a compile.
- Stop strings and ``logit_bias``: bounded (400s naming the fields).
"""

from __future__ import annotations

import threading
import time
from typing import Any

import httpx
import pytest

pytestmark = pytest.mark.slow  # the real default model, in a subprocess

CHAT, COMPLETIONS = "/v1/chat/completions", "/v1/completions"
#: xgrammar takes seconds to minutes on an enum this large (2 s for 8,000 strings, 45 s for 20,000),
#: and it stays under --max-grammar-bytes' default (256 KiB)
SLOW_SCHEMA = {"type": "object", "properties": {"x": {"enum": [f"value number {i}" for i in range(12_000)]}}}


def _ask(content: str, **extra: Any) -> dict[str, Any]:
    return {"messages": [{"role": "user", "content": content}], "max_tokens": 4, "temperature": 0, **extra}


@pytest.fixture(scope="module")
def bounded(start_servers: Any) -> tuple[Any, Any]:
    """A small batch (so that a fan-out takes several waves) with a short compile time-out; and one compile
    worker with no queue (so that a busy worker shows as a 429)."""
    return tuple(
        start_servers(
            ("--max-batch-size", "8", "--grammar-compile-timeout", "1", "--log-level", "info"),
            ("--grammar-workers", "1", "--grammar-queue", "0", "--log-level", "info"),
        )
    )


def test_a_fan_out_over_the_cap_is_a_400_naming_the_field(server: Any) -> None:
    cases = [
        ({"prompt": ["a"] * 129}, "prompt", "prompt 129 and n 1 make 129 choices"),
        ({"prompt": ["a"] * 9, "n": 16}, "n", "prompt 9 and n 16 make 144 choices"),
    ]
    for body, param, words in cases:
        r = httpx.post(server.url + COMPLETIONS, json={**body, "max_tokens": 1}, timeout=30)
        error = r.json()["error"]
        assert (r.status_code, error["param"]) == (400, param) and words in error["message"], r.text
        assert "--max-choices" in error["message"]
    # counted before the body is validated (320,000 prompts take 1.5 s to validate): an invalid member
    # past the cap does not make it a 422
    huge = {"prompt": [[1, 2]] * 320_000 + [{"not": "a prompt"}], "max_tokens": 1}
    r = httpx.post(server.url + COMPLETIONS, json=huge, timeout=30)
    assert r.status_code == 400 and "prompt 320001 and n 1 make 320001 choices" in r.text, r.text[:300]
    r = httpx.post(server.url + CHAT, json={**_ask("hi"), "n": 17}, timeout=30)
    assert r.status_code == 422  # n itself stays bounded by the schema


def test_a_fan_out_under_the_cap_does_not_hold_back_a_later_chat(bounded: tuple[Any, Any]) -> None:
    """64 choices on a batch of 8 run in 8 waves; a chat sent just after them is admitted at the first
    free place (admission serves every request's first choice before anyone's second), so it is done in
    about two waves, instead of after all of the fan-out."""
    served, _ = bounded
    done: dict[str, float] = {}

    def fan_out() -> None:
        body = {
            "prompt": [f"Count to ten, number {i}:" for i in range(64)],
            "max_tokens": 8,
            "temperature": 0,
            "ignore_eos": True,
        }
        r = httpx.post(served.url + COMPLETIONS, json=body, timeout=600)
        assert r.status_code == 200 and len(r.json()["choices"]) == 64, r.text
        done["fan_out"] = time.monotonic()

    started = time.monotonic()
    t = threading.Thread(target=fan_out)
    t.start()
    time.sleep(0.5)  # the fan-out is queued and running
    r = httpx.post(
        served.url + CHAT, json={**_ask("Say hi."), "max_tokens": 8, "ignore_eos": True}, timeout=600
    )
    assert r.status_code == 200
    done["chat"] = time.monotonic()
    t.join()
    fan_out_took, chat_took = done["fan_out"] - started, done["chat"] - started
    assert chat_took < fan_out_took / 2, (chat_took, fan_out_took)


def test_a_hostile_compile_is_stopped_and_a_plain_chat_beside_it_stays_fast(bounded: tuple[Any, Any]) -> None:
    served, _ = bounded
    schema = {"type": "json_schema", "json_schema": {"name": "x", "schema": SLOW_SCHEMA}}
    results: dict[str, Any] = {}

    def hostile() -> None:
        started = time.monotonic()
        r = httpx.post(served.url + CHAT, json={**_ask("Pick one."), "response_format": schema}, timeout=120)
        results["hostile"] = (r, time.monotonic() - started)

    t = threading.Thread(target=hostile)
    t.start()
    time.sleep(0.3)
    took = []
    for _ in range(3):  # plain requests while the compile runs in its worker process
        started = time.monotonic()
        assert httpx.post(served.url + CHAT, json=_ask("Say hi."), timeout=60).status_code == 200
        took.append(time.monotonic() - started)
    t.join()
    r, hostile_took = results["hostile"]
    assert (
        r.status_code == 400 and "took longer than 1 s and was stopped (--grammar-compile-timeout)" in r.text
    )
    assert r.json()["error"]["param"] == "grammar" and hostile_took < 30
    assert max(took) < 5, took  # nothing of the plain requests waits for the compile
    # an oversized schema: refused before anything compiles
    big = {"type": "json_schema", "json_schema": {"name": "x", "schema": {"enum": ["v" * 100] * 3000}}}
    started = time.monotonic()
    r = httpx.post(served.url + CHAT, json={**_ask("x"), "response_format": big}, timeout=30)
    assert r.status_code == 400 and "at most 262144 are compiled (--max-grammar-bytes)" in r.text
    assert time.monotonic() - started < 2
    # a prompt that cannot fit is the context's 400, before its grammar would compile
    long = {**_ask("word " * 1200), "response_format": schema}
    started = time.monotonic()
    r = httpx.post(served.url + CHAT, json=long, timeout=30)
    assert r.status_code == 400 and "context limit" in r.text and time.monotonic() - started < 2


def test_a_client_that_leaves_stops_its_compile(bounded: tuple[Any, Any]) -> None:
    _, served = bounded
    schema = {"type": "json_schema", "json_schema": {"name": "x", "schema": SLOW_SCHEMA}}
    quick = {"type": "json_schema", "json_schema": {"name": "y", "schema": {"type": "object"}}}
    assert (
        httpx.post(
            served.url + CHAT, json={**_ask("warm"), "response_format": quick}, timeout=120
        ).status_code
        == 200
    )
    before = len(served.log())
    with pytest.raises(httpx.ReadTimeout):  # the client gives up after a second and closes the connection
        httpx.post(served.url + CHAT, json={**_ask("Pick one."), "response_format": schema}, timeout=1.0)
    deadline = time.monotonic() + 10
    while "left before its request was submitted: abandoned" not in served.log()[before:]:
        assert time.monotonic() < deadline, served.log()[before:]
        time.sleep(0.05)
    # the only worker is free again: another compile is served (by a new worker), not refused as a full
    # queue (--grammar-queue 0) behind the abandoned one, which would have compiled for a minute
    other = {"type": "json_schema", "json_schema": {"name": "z", "schema": {"type": "array"}}}
    deadline = time.monotonic() + 10  # (the abandoned worker is replaced just after the log line)
    while (
        r := httpx.post(served.url + CHAT, json={**_ask("Go."), "response_format": other}, timeout=60)
    ).status_code == 429:
        assert time.monotonic() < deadline, r.text  # far sooner than the minute it would compile
        time.sleep(0.1)
    assert r.status_code == 200, r.text


def test_compiles_beyond_the_worker_and_its_queue_are_a_429(bounded: tuple[Any, Any]) -> None:
    _, served = bounded
    schema = {"type": "json_schema", "json_schema": {"name": "x", "schema": {**SLOW_SCHEMA, "title": "busy"}}}
    # the worker busy with a slow compile whose client stays (up to 3 s), a second compile is refused at once
    results: list[int] = []

    def slow() -> None:
        try:
            results.append(
                httpx.post(
                    served.url + CHAT, json={**_ask("a"), "response_format": schema}, timeout=3
                ).status_code
            )
        except httpx.ReadTimeout:
            results.append(0)

    t = threading.Thread(target=slow)
    t.start()
    time.sleep(0.5)
    second = {
        "type": "json_schema",
        "json_schema": {"name": "w", "schema": {"type": "object", "required": ["b"]}},
    }
    r = httpx.post(served.url + CHAT, json={**_ask("b"), "response_format": second}, timeout=30)
    t.join()
    assert (
        r.status_code == 429
        and "grammar compiles are under way" in r.text
        and r.headers["retry-after"] == "1"
    )


def test_stop_strings_and_logit_bias_are_bounded(server: Any) -> None:
    cases = [
        ({"stop": [f"s{i}" for i in range(65)]}, "stop", "stop holds 65 strings; at most 64"),
        ({"stop": ["x" * 257]}, "stop", "a stop string is 257 characters long; at most 256"),
        (
            {"logit_bias": {str(i): 1 for i in range(301)}},
            "logit_bias",
            "logit_bias holds 301 entries; at most 300",
        ),
    ]
    for extra, param, words in cases:
        for route, body in (
            (CHAT, _ask("hi", **extra)),
            (COMPLETIONS, {"prompt": "hi", "max_tokens": 2, **extra}),
        ):
            r = httpx.post(server.url + route, json=body, timeout=30)
            assert r.status_code == 400 and r.json()["error"]["param"] == param and words in r.text, (
                route,
                r.text,
            )
    r = httpx.post(
        server.url + "/v1/messages",
        json={**_ask("hi"), "stop_sequences": [f"s{i}" for i in range(65)]},
        timeout=30,
    )
    assert r.status_code == 400 and "at most 64" in r.text
    # at the bounds: served
    ok = _ask("hi", stop=[f"stop-{i}" for i in range(64)], logit_bias={str(i): 0.5 for i in range(300)})
    assert httpx.post(server.url + CHAT, json=ok, timeout=60).status_code == 200
