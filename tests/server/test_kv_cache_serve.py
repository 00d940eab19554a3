"""``astrai serve --kv-cache-dtype int8`` and ``--kv-cache-dir``: the default model served on an int8 KV
cache beside one in its own dtype (the same answers, about four times the tokens in the same
``--kv-memory``), what ``/stats`` and ``/metrics`` say of it; the int8 server restarted on its
folder answers its cached system prompt from disk; and the starts either cannot serve exit 2."""

from __future__ import annotations

import re
import signal
import subprocess
import sys

import httpx
import openai
import pytest

FLAGS = ("--kv-memory", "48MiB")
SYSTEM = "You are a careful assistant. " + "Answer briefly, in plain words, and never guess. " * 25
QUESTION = "What is the capital of France?"


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    return tmp_path_factory.mktemp("kv-cache")


@pytest.fixture(scope="module")
def int8_flags(folder):
    return (
        *FLAGS,
        "--kv-cache-dtype",
        "int8",
        "--kv-cache-dir",
        str(folder),
        "--kv-cache-host-memory",
        "16MiB",
    )


@pytest.fixture(scope="module")
def servers(start_servers, int8_flags):
    return start_servers(FLAGS, int8_flags)


def _client(served) -> openai.OpenAI:
    return openai.OpenAI(base_url=served.url + "/v1", api_key="unused", max_retries=0)


def _ask(served) -> str:
    messages = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": QUESTION}]
    reply = _client(served).chat.completions.create(
        model="astrai", messages=messages, temperature=0, max_tokens=12
    )
    return reply.choices[0].message.content


def test_an_int8_cache_serves_the_same_answers_in_a_quarter_of_the_bytes(servers):
    auto, int8 = servers
    answers = [
        _client(s)
        .completions.create(model="astrai", prompt="The capital of France is", temperature=0, max_tokens=24)
        .choices[0]
        .text
        for s in servers
    ]
    assert answers[1] == answers[0] and "Paris" in answers[0]
    a, b = auto.wait_idle(), int8.wait_idle()
    assert (a["kv_cache_dtype_k"], a["kv_cache_dtype_v"]) == ("float32", "float32")
    assert (b["kv_cache_dtype_k"], b["kv_cache_dtype_v"]) == ("int8", "int8")
    assert b["kv_bytes_per_token"] * 256 == a["kv_bytes_per_token"] * 68  # head dim 64: 64 + a float32 scale
    assert b["kv_tokens_total"] >= 3.7 * a["kv_tokens_total"]  # the same 48 MiB
    assert b["kv_tokens_in_use"] == 0  # every request's pages went back
    metrics = httpx.get(int8.url + "/metrics", timeout=10).text
    assert 'astrai:kv_cache_dtype_info{k_dtype="int8",model_name="astrai",v_dtype="int8"} 1.0' in metrics
    assert (
        f'astrai:kv_cache_bytes_per_token{{model_name="astrai"}} {float(b["kv_bytes_per_token"])}' in metrics
    )
    assert f'astrai:kv_cache_capacity_tokens{{model_name="astrai"}} {float(b["kv_tokens_total"])}' in metrics
    assert "K int8, V int8" in int8.log()  # the pool's line at start


def test_a_restarted_server_loads_the_cached_prefix_from_disk(servers, start_server, int8_flags, folder):
    _, first = servers
    want = _ask(first)
    assert _ask(servers[0]) == want  # (the float32 cache's answer too)
    first.proc.send_signal(signal.SIGTERM)  # drains, then the engine writes its cached pages
    assert first.proc.wait(60) == 0, first.log()[-3000:]
    assert "writing the" in first.log() and list(folder.glob("*/*.kv"))
    second = start_server(*int8_flags)
    assert _ask(second) == want
    warm = second.wait_idle()
    pages = warm["kv_tier_disk_hit_pages"]
    assert pages >= 15 and warm["prefix_hit_tokens"] == 16 * pages  # every complete page of the prompt
    assert warm["kv_tier_disk_pages"] >= pages
    metrics = httpx.get(second.url + "/metrics", timeout=10).text
    assert f'astrai:kv_cache_tier_disk_hit_pages_total{{model_name="astrai"}} {float(pages)}' in metrics


@pytest.mark.parametrize(
    ("flags", "message"),
    [
        (
            ("--kv-cache-dtype", "int8", "--attention-backend", "flash"),
            r"attention backend 'flash' \(from EngineConfig.attention_backend\) cannot serve --kv-cache-dtype "
            r"int8/int8 \(K/V\); backends that can: cpu, (cuda, )?torch_native\n",  # cuda where a GPU is
        ),
        (("--kv-cache-dtype", "fp8"), r"argument --kv-cache-dtype: invalid choice: 'fp8'"),
    ],
    ids=["flash", "unknown"],
)
def test_a_kv_cache_the_start_cannot_serve_exits_2(flags, message):
    proc = subprocess.run(
        [sys.executable, "-m", "astrai.cli", "serve", *flags], capture_output=True, text=True, timeout=180
    )
    assert proc.returncode == 2, proc.stderr[-2000:]
    assert re.search(message, proc.stderr), proc.stderr[-2000:]


@pytest.mark.parametrize(
    ("settings", "message"),
    [
        (
            {"kv_cache_dtype_v": "int8", "tensor_parallel_size": 2},
            "--kv-cache-dtype auto/int8 (K/V) is not supported under tensor parallelism",
        ),
        ({"kv_cache_dir": "/tmp/x", "prefix_caching": False}, "they need --paged and --prefix-caching"),
        (
            {"kv_cache_host_memory": "1GiB", "tensor_parallel_size": 2},
            "not supported under tensor parallelism",
        ),
    ],
    ids=["int8-tensor-parallel", "tiers-without-prefix-cache", "tiers-tensor-parallel"],
)
def test_the_start_refuses_the_other_caches_it_cannot_serve(settings, message):
    """The same check as the exit-2 starts above (``ConfigError`` is exit 2), in this process."""
    from astrai_server.cli import _check_kv_cache
    from astrai_server.config import ServerSettings
    from astrai_server.errors import ConfigError

    with pytest.raises(ConfigError, match=message.replace("(", r"\(").replace(")", r"\)")):
        _check_kv_cache(ServerSettings(**settings))
