"""``astrai serve --kv-cache-dtype int8``: the default model served on an int8 KV cache beside one in
its own dtype (the same answers, about four times the tokens in the same ``--kv-memory``), what
``/stats`` and ``/metrics`` say of it, and the starts it refuses (exit 2)."""

from __future__ import annotations

import subprocess
import sys

import httpx
import openai
import pytest

FLAGS = ("--dtype", "float32", "--max-seq-len", "1024", "--kv-memory", "48MiB")
PROMPTS = ["The capital of France is", "def fibonacci(n):"]


@pytest.fixture(scope="module")
def servers(start_servers):
    auto, int8 = start_servers(FLAGS, (*FLAGS, "--kv-cache-dtype", "int8"))
    return auto, int8


def test_an_int8_cache_serves_the_same_answers_in_a_quarter_of_the_bytes(servers):
    auto, int8 = servers
    answers = []
    for served in servers:
        client = openai.OpenAI(base_url=served.url + "/v1", api_key="unused", max_retries=0)
        answers.append(
            [
                client.completions.create(model="astrai", prompt=p, temperature=0, max_tokens=24)
                .choices[0]
                .text
                for p in PROMPTS
            ]
        )
    assert answers[1] == answers[0] and "Paris" in answers[0][0]
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


@pytest.mark.parametrize(
    ("flags", "message"),
    [
        (
            ("--kv-cache-dtype", "int8", "--attention-backend", "cuda"),
            "attention backend 'cuda' (from EngineConfig.attention_backend) cannot serve --kv-cache-dtype "
            "int8/int8 (K/V); backends that can: cpu, torch_native",
        ),
        (
            ("--kv-cache-dtype-v", "int8", "--tensor-parallel-size", "2"),
            "--kv-cache-dtype auto/int8 (K/V) is not supported under tensor parallelism",
        ),
        (("--kv-cache-dtype", "fp8"), "argument --kv-cache-dtype: invalid choice: 'fp8'"),
    ],
    ids=["cuda", "tensor-parallel", "unknown"],
)
def test_a_cache_dtype_the_start_cannot_serve_exits_2(flags, message):
    proc = subprocess.run(
        [sys.executable, "-m", "astrai.cli", "serve", *flags], capture_output=True, text=True, timeout=180
    )
    assert proc.returncode == 2, proc.stderr[-2000:]
    assert message in proc.stderr
