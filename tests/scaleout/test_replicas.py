"""Data parallel (issue 18): ``astrai serve --data-parallel-size 2`` behind the SGLang Model Gateway.

One real supervisor for the module (the default model, float32, an API key): two replicas on
loopback and ``smg`` in front with its cache-aware policy. Through the gateway the official
``openai`` SDK (chat, streaming, completions) and ``anthropic`` SDK (messages, streaming, token
counting) get what a replica answers directly; the key is refused and accepted at the gateway and
again at each replica; requests that share a long prefix land on one replica (its prefix-hit
counter grows, the other's does not); a replica killed outright is restarted while the other
serves every request; SIGTERM stops the gateway and both replicas and exits 0.
"""

from __future__ import annotations

import os
import re
import signal
import time
from dataclasses import dataclass

import anthropic
import httpx
import openai
import pytest

pytestmark = pytest.mark.slow  # the real default model, in three processes

KEY = "dp-key-1"
OTHER_KEY = "dp-key-2"
AUTH = {"Authorization": f"Bearer {KEY}"}
FRANCE = [{"role": "user", "content": "What is the capital of France?"}]
ANSWER = "The capital of France is Paris."
STARTED = re.compile(r"(replica \d+|gateway) started: pid (\d+), (\S+)")


@dataclass
class Replicas:
    url: str  # the gateway
    served: object  # serving.Served: the supervisor

    def children(self) -> dict[str, tuple[int, str]]:
        """The latest pid and URL of each child, from the supervisor's log."""
        return {name: (int(pid), url) for name, pid, url in STARTED.findall(self.served.log())}

    def replica_urls(self) -> list[str]:
        children = self.children()
        return [children[f"replica {i}"][1] for i in range(2)]

    def readiness(self) -> dict:
        r = httpx.get(self.url + "/readiness", timeout=5)
        return r.json()

    def wait(self, condition, what: str, timeout: float = 120.0) -> None:
        deadline = time.monotonic() + timeout
        while not condition():
            if time.monotonic() > deadline:
                pytest.fail(f"{what} did not happen in {timeout} s:\n{self.served.log()[-4000:]}")
            time.sleep(0.25)


@pytest.fixture(scope="module")
def dp(start_server) -> Replicas:
    # KEY is an operator's (/stats and /metrics of a replica answer it), OTHER_KEY a tenant's
    served = start_server(
        "--data-parallel-size", "2", "--admin-api-key", KEY, "--api-key", OTHER_KEY, "--shutdown-timeout", "5"
    )
    replicas = Replicas(served.url, served)
    replicas.wait(lambda: "ready: the gateway" in served.log(), "the gateway's registration of both replicas")
    assert replicas.readiness()["healthy_workers"] == 2
    return replicas


def _openai(url: str, key: str = KEY) -> openai.OpenAI:
    return openai.OpenAI(base_url=url + "/v1", api_key=key, max_retries=0, timeout=120)


def _anthropic(url: str, **auth: str) -> anthropic.Anthropic:
    return anthropic.Anthropic(base_url=url, max_retries=0, timeout=120, **auth)


def _stats(url: str) -> dict:
    return httpx.get(url + "/stats", headers=AUTH, timeout=10).json()


def test_the_key_is_enforced_at_the_gateway_and_again_at_every_replica(dp: Replicas) -> None:
    body = {"model": "astrai", "messages": FRANCE, "max_tokens": 1}
    for headers in (
        {},
        {"Authorization": "Bearer wrong"},
        {"x-api-key": KEY},
    ):  # the gateway reads Bearer only
        for path in ("/v1/chat/completions", "/v1/messages"):
            r = httpx.post(dp.url + path, json=body, headers=headers, timeout=30)
            assert r.status_code == 401, (path, headers, r.text)
    for key in (KEY, OTHER_KEY):  # smg's --api-key and a --tenant-api-key
        r = httpx.post(
            dp.url + "/v1/chat/completions", json=body, headers={"Authorization": f"Bearer {key}"}, timeout=60
        )
        assert r.status_code == 200, r.text
    for url in dp.replica_urls():  # behind the gateway, on loopback, each replica asks for the key too
        assert httpx.post(url + "/v1/chat/completions", json=body, timeout=30).status_code == 401
        assert httpx.get(url + "/metrics", timeout=10).status_code == 401
        assert httpx.get(url + "/metrics", headers=AUTH, timeout=10).status_code == 200
    with pytest.raises(openai.AuthenticationError):
        _openai(dp.url, "wrong").chat.completions.create(model="astrai", messages=FRANCE, max_tokens=1)
    with pytest.raises(anthropic.AuthenticationError) as info:
        _anthropic(dp.url, api_key="wrong").messages.create(model="astrai", max_tokens=1, messages=FRANCE)
    assert info.value.body["error"]["type"] == "authentication_error"  # in Anthropic's shape
    # this SDK sends its api_key as Authorization: Bearer (a bare x-api-key header is refused above)
    assert (
        _anthropic(dp.url, api_key=KEY)
        .messages.create(model="astrai", max_tokens=1, messages=FRANCE)
        .usage.output_tokens
        == 1
    )


def test_the_openai_sdk_gets_through_the_gateway_what_a_replica_answers(dp: Replicas) -> None:
    gateway, replica = _openai(dp.url), _openai(dp.replica_urls()[0])
    kw = {"model": "astrai", "messages": FRANCE, "max_tokens": 32, "temperature": 0}
    r, direct = gateway.chat.completions.create(**kw), replica.chat.completions.create(**kw)
    assert (r.choices[0].message.content, r.choices[0].finish_reason) == (ANSWER, "stop")

    def counts(u):  # cache hits differ, the counts do not
        return (u.prompt_tokens, u.completion_tokens, u.total_tokens)

    assert counts(r.usage) == counts(direct.usage) and r.id.startswith("chatcmpl-") and r.model == "astrai"
    chunks = list(gateway.chat.completions.create(**kw, stream=True, stream_options={"include_usage": True}))
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == ANSWER
    assert (
        counts(chunks[-1].usage) == counts(r.usage)
        and [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "stop"
    )
    ckw = {"model": "astrai", "prompt": "The capital of France is", "max_tokens": 8, "temperature": 0}
    c, cdirect = gateway.completions.create(**ckw), replica.completions.create(**ckw)
    assert (c.choices[0].text, counts(c.usage)) == (
        cdirect.choices[0].text,
        counts(cdirect.usage),
    ) and c.choices[0].text
    streamed = list(gateway.completions.create(**ckw, stream=True))
    assert "".join(s.choices[0].text for s in streamed if s.choices) == c.choices[0].text
    assert [m.id for m in gateway.models.list()] == ["astrai"]
    with pytest.raises(openai.BadRequestError, match="1024"):  # the replica's error, passed on
        gateway.chat.completions.create(
            model="astrai", messages=[{"role": "user", "content": "hello " * 1100}], max_tokens=4
        )
    # what the gateway does not pass on (docs/scale-out.md): smg rewrites a Responses request with
    # vLLM's sampling fields (top_k: -1, ...) and store: true, which astrai refuses
    with pytest.raises(openai.BadRequestError, match="top_k"):
        gateway.responses.create(model="astrai", input="Hi", max_output_tokens=4, store=False)
    for method, path in [
        ("POST", "/tokenize"),
        ("POST", "/detokenize"),
        ("GET", "/stats"),
        ("GET", "/metrics"),
        ("GET", "/openapi.json"),
    ]:
        assert httpx.request(method, dp.url + path, headers=AUTH, json={}, timeout=10).status_code == 404, (
            path
        )


def test_the_anthropic_sdk_gets_through_the_gateway_what_a_replica_answers(dp: Replicas) -> None:
    gateway, replica = _anthropic(dp.url, auth_token=KEY), _anthropic(dp.replica_urls()[1], auth_token=KEY)
    kw = {"model": "astrai", "max_tokens": 32, "messages": FRANCE, "extra_body": {"temperature": 0}}
    m, direct = gateway.messages.create(**kw), replica.messages.create(**kw)
    assert [(b.type, b.text) for b in m.content] == [("text", ANSWER)] and m.stop_reason == "end_turn"
    assert (
        m.usage.input_tokens == direct.usage.input_tokens
        and m.usage.output_tokens == direct.usage.output_tokens
    )
    with gateway.messages.stream(**kw) as stream:
        events = list(stream)
        final = stream.get_final_message()
    assert events[0].type == "message_start" and events[0].message.usage.input_tokens == m.usage.input_tokens
    assert "".join(e.delta.text for e in events if e.type == "content_block_delta") == ANSWER
    assert (final.stop_reason, final.usage.output_tokens) == ("end_turn", m.usage.output_tokens)
    stopped = gateway.messages.create(**kw, stop_sequences=["nope", "Paris"])
    assert (stopped.stop_reason, stopped.stop_sequence) == ("stop_sequence", "Paris")
    counted = gateway.messages.count_tokens(model="astrai", messages=FRANCE)
    assert counted.input_tokens == m.usage.input_tokens
    with pytest.raises(
        anthropic.BadRequestError, match="temperature"
    ):  # smg validates it first (a replica: 422)
        gateway.messages.create(model="astrai", max_tokens=4, messages=FRANCE, extra_body={"temperature": 5})


def test_requests_that_share_a_long_prefix_land_on_one_replica(dp: Replicas) -> None:
    urls = dp.replica_urls()
    system = "You are the catalogue assistant of the municipal library of Lyon, answering in one line. " * 8
    before = [_stats(u)["prefix_hit_tokens"] for u in urls]
    routed = set()
    for i in range(4):
        messages = [
            {"role": "system", "content": system},
            {"role": "user", "content": f"Is book number {i} on the shelf?"},
        ]
        r = httpx.post(
            dp.url + "/v1/chat/completions",
            headers=AUTH,
            timeout=60,
            json={"model": "astrai", "messages": messages, "max_tokens": 2, "temperature": 0},
        )
        assert r.status_code == 200, r.text
        routed.add(r.headers.get("x-smg-routed-worker-id"))
    after = [_stats(u)["prefix_hit_tokens"] for u in urls]
    grown = [a - b for a, b in zip(after, before, strict=True)]
    assert sorted(g > 0 for g in grown) == [False, True], f"prefix hits grew by {grown} on {urls}"
    assert max(grown) >= 3 * 100  # the three requests after the first each reused the system prompt
    assert len(routed) == 1


def test_a_killed_replica_is_restarted_and_the_other_serves_meanwhile(dp: Replicas) -> None:
    pid, url = dp.children()["replica 0"]
    os.kill(pid, signal.SIGKILL)
    client = _openai(dp.url)
    for i in range(4):  # at once: the gateway retries what reached the dead one on the other
        r = client.chat.completions.create(
            model="astrai", messages=[{"role": "user", "content": f"Say {i}."}], max_tokens=2, temperature=0
        )  # greedy: two sampled tokens can be a held-back partial character
        assert r.choices[0].message.content and r.usage.completion_tokens == 2
    stream = client.chat.completions.create(
        model="astrai", messages=FRANCE, max_tokens=32, temperature=0, stream=True
    )
    assert "".join(c.choices[0].delta.content or "" for c in stream if c.choices) == ANSWER
    assert f"replica 0 (pid {pid}) exited with status -9: restarting it" in dp.served.log()
    dp.wait(
        lambda: dp.readiness()["healthy_workers"] == 1, "the gateway's readiness counting one replica", 30
    )
    dp.wait(
        lambda: dp.children()["replica 0"][0] != pid and "replica 0 is ready again" in dp.served.log(),
        "the restart",
    )
    assert dp.children()["replica 0"][1] == url  # on the same port: the gateway's worker URL holds
    dp.wait(
        lambda: dp.readiness()["healthy_workers"] == 2, "the gateway's readiness counting both replicas", 30
    )
    assert (
        client.chat.completions.create(model="astrai", messages=FRANCE, max_tokens=3, temperature=0)
        .choices[0]
        .message.content
    )


def test_sigterm_stops_the_gateway_and_every_replica_and_exits_0(dp: Replicas) -> None:
    pids = [pid for pid, _ in dp.children().values()]
    proc = dp.served.proc
    proc.send_signal(signal.SIGTERM)
    assert proc.wait(60) == 0, dp.served.log()[-4000:]
    for pid in pids:
        with pytest.raises(ProcessLookupError):
            os.kill(pid, 0)
    assert "astrai_server.replicas: stopped" in dp.served.log()
