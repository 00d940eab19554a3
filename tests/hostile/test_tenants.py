"""Issue 29, finding 1: tenants isolated from each other, against a real ``astrai serve``.

- The prefix cache is namespaced per API key: key B's request never reuses pages key A computed
  (no time-to-first-token side channel), key A's own second request does; ``usage`` reports the
  caller's own cache hits (``prompt_tokens_details.cached_tokens``), on every protocol that has it.
- ``--shared-prefix-cache`` turns sharing back on for one trusted tenant behind several keys.
- A request's ``cache_salt`` (every protocol) splits the cache further, with keys or without.
- ``/stats`` and ``/metrics`` (every tenant's traffic) answer only ``--admin-api-key`` keys.
"""

from __future__ import annotations

from typing import Any

import httpx
import pytest

pytestmark = pytest.mark.slow  # the real default model, in a subprocess

A, B, OPERATOR = "tenant-a-key", "tenant-b-key", "operator-key"
#: ~250 tokens of system prompt: whole pages of it are cached after one request
SYSTEM = " ".join(f"Rule {i}: answer briefly and politely, in plain English." for i in range(25))


def _chat(url: str, key: str | None, question: str, **extra: Any) -> dict[str, Any]:
    body = {
        "messages": [{"role": "system", "content": SYSTEM}, {"role": "user", "content": question}],
        "max_tokens": 1,
        "temperature": 0,
        **extra,
    }
    headers = {"authorization": f"Bearer {key}"} if key else {}
    r = httpx.post(url + "/v1/chat/completions", json=body, headers=headers, timeout=120)
    assert r.status_code == 200, r.text
    return r.json()["usage"]


def _cached(usage: dict[str, Any]) -> int:
    return usage["prompt_tokens_details"]["cached_tokens"]


@pytest.fixture(scope="module")
def servers(start_servers: Any) -> tuple[Any, Any]:
    keys = ("--api-key", A, "--api-key", B, "--admin-api-key", OPERATOR)
    return tuple(start_servers(keys, (*keys, "--shared-prefix-cache")))


def test_two_keys_never_hit_each_others_prefix_and_each_hits_its_own(servers: tuple[Any, Any]) -> None:
    isolated, _ = servers
    first = _chat(isolated.url, A, "What is 2 + 2?")
    assert _cached(first) == 0
    again = _chat(isolated.url, A, "What is 3 + 3?")  # the same system prompt, another question
    assert _cached(again) >= 240 and _cached(again) % 16 == 0
    other = _chat(isolated.url, B, "What is 2 + 2?")  # B sends exactly what A sent: nothing of A's is reused
    assert _cached(other) == 0
    assert _cached(_chat(isolated.url, B, "What is 5 + 5?")) >= 240  # B's own pages
    op = _chat(isolated.url, OPERATOR, "What is 2 + 2?")  # an operator is a tenant of its own too
    assert _cached(op) == 0


def test_a_shared_prefix_cache_serves_every_key(servers: tuple[Any, Any]) -> None:
    _, shared = servers
    assert _cached(_chat(shared.url, A, "What is 2 + 2?")) == 0
    assert _cached(_chat(shared.url, B, "What is 7 + 7?")) >= 240


def test_a_cache_salt_splits_the_cache_on_every_protocol(servers: tuple[Any, Any], server: Any) -> None:
    isolated, _ = servers
    _chat(isolated.url, A, "Salted?")
    assert _cached(_chat(isolated.url, A, "Salted!", cache_salt="s1")) == 0
    assert _cached(_chat(isolated.url, A, "Salted.", cache_salt="s1")) >= 240
    assert _cached(_chat(isolated.url, B, "Salted.", cache_salt="s1")) == 0  # the same salt, another key
    # without keys (the hostile suite's shared server): the salt alone splits; each protocol takes it
    base = server.url
    prompt = SYSTEM + " Tell me a number."
    bodies = {
        "/v1/completions": (
            {"prompt": prompt, "max_tokens": 1},
            lambda u: u["prompt_tokens_details"]["cached_tokens"],
        ),
        "/v1/responses": (
            {"input": prompt, "max_output_tokens": 16},
            lambda u: u["input_tokens_details"]["cached_tokens"],
        ),
    }
    for route, (body, cached) in bodies.items():
        salt = f"salt-of-{route}"
        for expect_hit in (False, True):
            r = httpx.post(base + route, json={**body, "cache_salt": salt}, timeout=120)
            assert r.status_code == 200, r.text
            assert (cached(r.json()["usage"]) > 0) is expect_hit, (route, r.json()["usage"])
    # Anthropic's usage has no cache figures: the server's prefix hits (/stats, open without keys) tell
    messages = {"messages": [{"role": "user", "content": prompt}], "max_tokens": 1, "cache_salt": "anthropic"}
    for expect_hit in (False, True):
        before = httpx.get(base + "/stats", timeout=10).json()["prefix_hit_tokens"]
        assert httpx.post(base + "/v1/messages", json=messages, timeout=120).status_code == 200
        hit = httpx.get(base + "/stats", timeout=10).json()["prefix_hit_tokens"] - before
        assert (hit >= 240) if expect_hit else (hit == 0), (expect_hit, hit)
    for bad in ("", "x" * 1025, 7):
        r = httpx.post(
            base + "/v1/chat/completions",
            json={"messages": [{"role": "user", "content": "hi"}], "max_tokens": 1, "cache_salt": bad},
            timeout=30,
        )
        assert r.status_code == 422 and r.json()["error"]["param"] == "cache_salt", r.text


def test_stats_and_metrics_answer_only_an_operator(servers: tuple[Any, Any]) -> None:
    isolated, _ = servers
    for route in ("/stats", "/metrics"):
        for key in (A, B):
            r = httpx.get(isolated.url + route, headers={"authorization": f"Bearer {key}"}, timeout=10)
            assert r.status_code == 403 and "--admin-api-key" in r.json()["detail"], (route, r.text)
        assert httpx.get(isolated.url + route, timeout=10).status_code == 401
        assert httpx.get(isolated.url + route, headers={"x-api-key": OPERATOR}, timeout=10).status_code == 200
    stats = httpx.get(isolated.url + "/stats", headers={"x-api-key": OPERATOR}, timeout=10).json()
    assert stats["prefix_hit_tokens"] > 0  # the operator sees every tenant's hits
