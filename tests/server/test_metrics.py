"""GET /metrics: ServerMetrics on its own (fake finished requests, a fake engine), then a real
``astrai serve`` subprocess scraped with prometheus_client's parsers while the openai and anthropic
SDKs are served: the counters move by exactly the usage the responses report."""

from __future__ import annotations

import re
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import httpx
import pytest
from prometheus_client.openmetrics.parser import text_string_to_metric_families as openmetrics_families
from prometheus_client.parser import text_string_to_metric_families

from astrai.hooks import PluginManager
from astrai.request import FinishedRequest
from astrai_server.metrics import (
    COUNTERS,
    GAUGES,
    HISTOGRAMS,
    KV_DTYPE_INFO,
    LORA_COUNTERS,
    LORA_RUNNING,
    POOLING_COUNTERS,
    PREEMPTIONS,
    SPEC_COUNTERS,
    TIER_COUNTERS,
    TIER_GAUGES,
    ServerMetrics,
)

KEY = "metrics-key-1"
MODEL = "metrics-model"
OPENMETRICS = "application/openmetrics-text; version=1.0.0; charset=utf-8"
HIST = {key: name for key, (name, _, _) in HISTOGRAMS.items()}
STATS = {
    "active_tasks": 1,
    "waiting_queue": 2,
    "kv_tokens_total": 256,
    "kv_tokens_in_use": 64,
    "kv_tokens_cached": 32,
    "preemptions": 3,
}


def finished(
    rid: str = "r1",
    prompt: int = 10,
    completion: int = 5,
    cached: int = 4,
    reason: str = "length",
    queue: float | None = 0.01,
    ttft: float | None = 0.05,
    total: float = 0.2,
) -> FinishedRequest:
    return FinishedRequest(rid, prompt, completion, cached, reason, None, 0.0, queue, ttft, total)


def value(metrics: ServerMetrics, name: str, **labels: str) -> float | None:
    return metrics.registry.get_sample_value(name, {"model_name": MODEL, **labels})


# ------------------------------------------------------------------ ServerMetrics alone


def test_a_finished_request_moves_each_series_by_its_figures() -> None:
    m = ServerMetrics(MODEL)
    m.astrai_request_finished(finished())
    m.astrai_request_finished(finished("r2", prompt=7, completion=1, cached=0, reason="stop"))
    assert value(m, "astrai:prompt_tokens_total") == 17 and value(m, "astrai:generation_tokens_total") == 6
    assert (
        value(m, "astrai:prefix_cache_queries_total") == 17
        and value(m, "astrai:prefix_cache_hits_total") == 4
    )
    assert value(m, "astrai:request_success_total", finished_reason="length") == 1
    assert value(m, "astrai:request_success_total", finished_reason="stop") == 1
    for key in ("ttft", "e2e", "queue", "prefill", "decode", "inference"):
        assert value(m, HIST[key] + "_count") == 2, key
    assert value(m, HIST["tpot"] + "_count") == 1  # one token: no time per output token
    assert value(m, HIST["tpot"] + "_sum") == pytest.approx((0.2 - 0.05) / 4)
    assert value(m, HIST["prefill"] + "_sum") == pytest.approx(2 * 0.04)
    assert value(m, HIST["inference"] + "_sum") == pytest.approx(2 * 0.19)


def test_a_request_never_admitted_counts_its_end_but_no_queue_prefill_or_cache() -> None:
    m = ServerMetrics(MODEL)
    m.astrai_request_finished(
        finished(reason="abort", completion=0, cached=0, queue=None, ttft=None, total=0.5)
    )
    assert value(m, "astrai:request_success_total", finished_reason="abort") == 1
    assert value(m, HIST["e2e"] + "_count") == 1 and value(m, HIST["e2e"] + "_sum") == 0.5
    assert value(m, "astrai:prompt_tokens_total") == 10
    assert value(m, "astrai:prefix_cache_queries_total") == 0
    for key in ("ttft", "queue", "prefill", "decode", "inference", "tpot"):
        assert value(m, HIST[key] + "_count") == 0, key


def test_admitted_but_ended_before_a_token_has_queue_and_inference_only() -> None:
    m = ServerMetrics(MODEL)
    m.astrai_request_finished(finished(reason="error", completion=0, ttft=None))
    assert value(m, HIST["queue"] + "_count") == 1 and value(m, HIST["inference"] + "_count") == 1
    assert value(m, HIST["ttft"] + "_count") == 0 and value(m, HIST["prefill"] + "_count") == 0


def test_gauges_read_the_engine_lazily_and_are_absent_without_one() -> None:
    state = SimpleNamespace(engine=None)
    m = ServerMetrics(MODEL, lambda: state.engine)
    assert value(m, "astrai:num_requests_running") is None
    state.engine = SimpleNamespace(get_stats=lambda: STATS)  # loaded later, as astrai serve does
    assert value(m, "astrai:num_requests_running") == 1 and value(m, "astrai:num_requests_waiting") == 2
    assert (
        value(m, "astrai:kv_cache_usage_perc") == 0.25 and value(m, "astrai:kv_cache_capacity_tokens") == 256
    )
    assert (
        value(m, "astrai:kv_cache_usage_tokens") == 64
        and value(m, "astrai:kv_cache_cached_only_tokens") == 32
    )
    assert value(m, "astrai:num_preemptions_total") == 3


def test_an_engine_that_publishes_less_gets_the_gauges_it_can() -> None:
    m = ServerMetrics(
        MODEL, lambda: SimpleNamespace(get_stats=lambda: {"active_tasks": 0, "waiting_queue": 0})
    )
    assert value(m, "astrai:num_requests_running") == 0 and value(m, "astrai:kv_cache_usage_perc") is None
    assert m.exposition(None)[0]  # the scrape still succeeds


def test_a_plugin_manager_calls_it_as_a_hook_plugin() -> None:
    pm, m = PluginManager(), ServerMetrics(MODEL)
    pm.register_checked(m, None, "metrics")
    assert pm.has_impls("astrai_request_finished")
    pm.notify("astrai_request_finished", engine=None, request=finished())
    assert value(m, "astrai:generation_tokens_total") == 5


def test_openmetrics_names_match_their_metadata_and_carry_the_request_id() -> None:
    m = ServerMetrics(MODEL, lambda: SimpleNamespace(get_stats=lambda: STATS))
    long_id = (
        "x" * 300
    )  # a client's X-Request-Id may be long: OpenMetrics bounds an exemplar to 128 characters
    m.astrai_request_finished(finished("req-abc"))
    m.astrai_request_finished(finished(long_id, total=9.0))
    body, content_type = m.exposition("application/openmetrics-text; version=1.0.0,text/plain;q=0.5")
    assert content_type.startswith("application/openmetrics-text")
    families = {f.name: f for f in openmetrics_families(body.decode())}
    for f in (
        families.values()
    ):  # prometheus/client_python#1177: no "astrai_..." sample under "astrai:..." metadata
        assert all(s.name.startswith(f.name) for s in f.samples), f.name
    e2e = {s.exemplar.labels["request_id"] for s in families[HIST["e2e"]].samples if s.exemplar}
    assert e2e == {"req-abc", long_id[: 128 - len("request_id")]}
    success = families["astrai:request_success"].samples[0]
    assert success.exemplar is not None and success.exemplar.labels["request_id"].startswith("x")
    body, content_type = m.exposition(None)
    assert content_type == "text/plain; version=0.0.4; charset=utf-8" and b"# {" not in body


def test_every_metric_is_documented_with_its_type() -> None:
    documented = _documented_metrics()
    names = {name + "_total": "counter" for name, _ in COUNTERS.values()}
    names |= {name: "histogram" for name in HIST.values()} | {name: "gauge" for name in GAUGES}
    names |= {PREEMPTIONS[0] + "_total": "counter", "astrai:request_success_total": "counter"}
    names |= {name + "_total": "counter" for name in (*SPEC_COUNTERS, *POOLING_COUNTERS)}
    names |= {name + "_total": "counter" for name in LORA_COUNTERS} | {LORA_RUNNING[0]: "gauge"}
    names[KV_DTYPE_INFO[0]] = "gauge"
    names |= {name: "gauge" for name in TIER_GAUGES} | {name + "_total": "counter" for name in TIER_COUNTERS}
    names["astrai:requests_total"] = "counter"
    assert documented == names


def _documented_metrics() -> dict[str, str]:
    page = (Path(__file__).resolve().parents[2] / "docs" / "http-api.md").read_text(encoding="utf-8")
    section = page.split("\n## GET /metrics\n", 1)[1].split("\n## ", 1)[0]
    return dict(re.findall(r"^\| `(astrai:\w+)` \| (\w+) \|", section, flags=re.M))


# ------------------------------------------------------------------ a real server


def scrape(url: str, accept: str | None = None, key: str | None = KEY) -> httpx.Response:
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    if accept:
        headers["Accept"] = accept
    return httpx.get(url + "/metrics", headers=headers, timeout=10)


def samples(url: str) -> dict[tuple[str, frozenset], float]:
    """Every sample of a classic-format scrape, by (name, labels without model_name); checks model_name."""
    r = scrape(url)
    assert r.status_code == 200 and r.headers["content-type"] == "text/plain; version=0.0.4; charset=utf-8"
    out = {}
    for family in text_string_to_metric_families(r.text):
        for s in family.samples:
            labels = dict(s.labels)
            assert labels.pop("model_name") == MODEL, s
            out[(s.name, frozenset(labels.items()))] = s.value
    return out


def get(snapshot: dict, name: str, **labels: str) -> float:
    return snapshot.get((name, frozenset(labels.items())), 0.0)


def successes(snapshot: dict) -> float:
    """Finished engine requests, every finish reason."""
    return sum(v for (name, _), v in snapshot.items() if name == "astrai:request_success_total")


@pytest.fixture(scope="module")
def served(start_server: Any) -> Any:
    """One server for the module, with n-gram speculation on (greedy output is the same with it)."""
    return start_server(
        "--admin-api-key", KEY, "--served-model-name", MODEL, "--speculative", "ngram", "--ngram-max", "3"
    )


@pytest.fixture(scope="module")
def clients(served: Any) -> Iterator[SimpleNamespace]:
    import anthropic
    import openai

    oa = openai.OpenAI(base_url=served.url + "/v1", api_key=KEY, max_retries=0)
    an = anthropic.Anthropic(base_url=served.url, api_key=KEY, max_retries=0)
    with oa, an:
        yield SimpleNamespace(openai=oa, anthropic=an)


def settled(url: str, finished_before: float, expected: int, timeout: float = 30.0) -> dict:
    """A scrape once ``expected`` more requests finished (the hook thread records them just after
    the responses) and none runs or waits."""
    deadline = time.monotonic() + timeout
    while True:
        snap = samples(url)
        done = successes(snap) - finished_before
        idle = not get(snap, "astrai:num_requests_running") and not get(snap, "astrai:num_requests_waiting")
        if done >= expected and idle:
            assert done == expected, snap
            return snap
        assert time.monotonic() < deadline, f"{done} of {expected} requests recorded: {snap}"
        time.sleep(0.05)


CHAT = [{"role": "user", "content": "Name a colour."}]
GREEDY = {"temperature": 0}  # the anthropic SDK has no sampling keywords: they travel in the body
OPENAI_REASON = {"stop": "stop", "length": "length"}
ANTHROPIC_REASON = {"end_turn": "stop", "max_tokens": "length", "stop_sequence": "stop_sequence"}


@pytest.mark.slow
def test_metrics_needs_the_key(served: Any) -> None:
    assert scrape(served.url, key=None).status_code == 401
    assert scrape(served.url, key="wrong").status_code == 401
    r = httpx.get(served.url + "/metrics", headers={"x-api-key": KEY}, timeout=10)
    assert r.status_code == 200 and "astrai:num_requests_running" in r.text


@pytest.mark.slow
def test_counters_move_by_exactly_the_tokens_served(served: Any, clients: SimpleNamespace) -> None:
    before = samples(served.url)
    finished_before = successes(before)
    usage: list[tuple[int, int, str]] = []  # (prompt, completion, engine finish reason) per response

    r = clients.openai.chat.completions.create(model=MODEL, messages=CHAT, max_tokens=4, temperature=0)
    usage.append(
        (r.usage.prompt_tokens, r.usage.completion_tokens, OPENAI_REASON[r.choices[0].finish_reason])
    )
    stream = clients.openai.chat.completions.create(
        model=MODEL,
        messages=CHAT,
        max_tokens=3,
        temperature=0,
        stream=True,
        stream_options={"include_usage": True},
    )
    chunks = list(stream)
    reason = next(c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason)
    usage.append((chunks[-1].usage.prompt_tokens, chunks[-1].usage.completion_tokens, OPENAI_REASON[reason]))
    m = clients.anthropic.messages.create(model=MODEL, messages=CHAT, max_tokens=4, extra_body=GREEDY)
    usage.append((m.usage.input_tokens, m.usage.output_tokens, ANTHROPIC_REASON[m.stop_reason]))
    with clients.anthropic.messages.stream(model=MODEL, messages=CHAT, max_tokens=2, extra_body=GREEDY) as s:
        m = s.get_final_message()
    usage.append((m.usage.input_tokens, m.usage.output_tokens, ANTHROPIC_REASON[m.stop_reason]))
    refused = httpx.post(
        served.url + "/v1/chat/completions", json={"model": MODEL, "messages": CHAT}, timeout=10
    )
    assert refused.status_code == 401  # arrives, is counted by protocol, never reaches the engine

    after = settled(served.url, finished_before, len(usage))
    moved = lambda name, **labels: get(after, name, **labels) - get(before, name, **labels)  # noqa: E731
    assert moved("astrai:prompt_tokens_total") == sum(p for p, _, _ in usage)
    assert moved("astrai:generation_tokens_total") == sum(c for _, c, _ in usage)
    assert moved("astrai:prefix_cache_queries_total") == sum(p for p, _, _ in usage)
    assert (
        0 < moved("astrai:prefix_cache_hits_total") <= moved("astrai:prefix_cache_queries_total")
    )  # one prompt, 4 times
    for reason in {r for _, _, r in usage}:
        assert moved("astrai:request_success_total", finished_reason=reason) == [r for *_, r in usage].count(
            reason
        )
    assert moved("astrai:requests_total", protocol="openai") == 3  # the refused one included
    assert moved("astrai:requests_total", protocol="anthropic") == 2
    for key in ("ttft", "e2e", "queue", "prefill", "decode", "inference"):
        assert moved(HIST[key] + "_count") == len(usage), key
        assert moved(HIST[key] + "_bucket", le="+Inf") == len(usage), key
    assert moved(HIST["tpot"] + "_count") == sum(c > 1 for _, c, _ in usage)
    assert moved(HIST["e2e"] + "_sum") >= moved(HIST["ttft"] + "_sum") > 0


@pytest.mark.slow
def test_gauges_are_sane_when_idle(served: Any, clients: SimpleNamespace) -> None:
    before = successes(samples(served.url))
    clients.openai.chat.completions.create(model=MODEL, messages=CHAT, max_tokens=2, temperature=0)
    snap = settled(served.url, before, 1)
    assert get(snap, "astrai:num_requests_running") == 0 and get(snap, "astrai:num_requests_waiting") == 0
    total = get(snap, "astrai:kv_cache_capacity_tokens")
    used, cached = get(snap, "astrai:kv_cache_usage_tokens"), get(snap, "astrai:kv_cache_cached_only_tokens")
    assert total > 0 and 0 <= used + cached <= total
    assert 0.0 <= get(snap, "astrai:kv_cache_usage_perc") <= 1.0
    assert get(snap, "astrai:kv_cache_usage_perc") == pytest.approx(used / total)
    assert cached > 0  # the prefix cache keeps the pages of the prompts served
    assert get(snap, "astrai:num_preemptions_total") >= 0


@pytest.mark.slow
def test_openmetrics_exemplars_carry_the_request_id(served: Any, clients: SimpleNamespace) -> None:
    rid = f"metrics-{uuid.uuid4().hex[:12]}"
    before = successes(samples(served.url))
    raw = clients.openai.chat.completions.with_raw_response.create(
        model=MODEL, messages=CHAT, max_tokens=2, temperature=0, extra_headers={"X-Request-Id": rid}
    )
    settled(served.url, before, 1)
    r = scrape(served.url, accept="application/openmetrics-text; version=1.0.0")
    assert r.status_code == 200 and r.headers["content-type"] == OPENMETRICS
    families = {f.name: f for f in openmetrics_families(r.text)}
    latest: dict[str, Any] = {}  # each histogram: the exemplar of its latest observation
    for key, name in HIST.items():
        exemplars = [s.exemplar for s in families[name].samples if s.exemplar is not None]
        if key != "tpot":  # 2 tokens or fewer may stop at 1
            latest[key] = max(exemplars, key=lambda e: (e.timestamp.sec, e.timestamp.nsec))
    ids = {e.labels["request_id"] for e in latest.values()}
    assert len(ids) == 1, latest  # the request just served, in every histogram
    assert ids == {rid} and raw.headers["x-request-id"] == rid  # the client's X-Request-Id names the request


def test_stats_and_metrics_count_the_speculative_drafts(served: Any) -> None:
    text = "The quick brown fox jumps over the lazy dog. Pack my box with five dozen liquor jugs."
    body = {
        "model": MODEL,
        "messages": [{"role": "user", "content": f"Repeat this text exactly: {text}"}],
        "max_tokens": 24,
        "temperature": 0,
    }
    r = httpx.post(
        served.url + "/v1/chat/completions",
        json=body,
        headers={"Authorization": f"Bearer {KEY}"},
        timeout=120,
    )
    assert r.status_code == 200
    stats = httpx.get(served.url + "/stats", headers={"Authorization": f"Bearer {KEY}"}, timeout=10).json()
    assert stats["spec_drafts"] > 0 and 0 < stats["spec_accepted_tokens"] <= stats["spec_draft_tokens"]
    assert stats["spec_acceptance_rate"] == pytest.approx(
        stats["spec_accepted_tokens"] / stats["spec_draft_tokens"]
    )
    snap = samples(served.url)
    assert get(snap, "astrai:spec_decode_num_drafts_total") == stats["spec_drafts"]
    assert get(snap, "astrai:spec_decode_num_draft_tokens_total") == stats["spec_draft_tokens"]
    assert get(snap, "astrai:spec_decode_num_accepted_tokens_total") == stats["spec_accepted_tokens"]
