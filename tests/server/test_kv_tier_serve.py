"""``astrai serve --kv-cache-dir``: a restarted server answers a cached system prompt from the disk
tier (the same answer, its pages loaded rather than recomputed), says so in ``/stats`` and
``/metrics``, and a start whose tiers cannot work exits 2."""

from __future__ import annotations

import signal
import subprocess
import sys

import httpx
import openai
import pytest

SYSTEM = "You are a careful assistant. " + "Answer briefly, in plain words, and never guess. " * 25
QUESTION = "What is the capital of France?"


def _ask(served) -> str:
    client = openai.OpenAI(base_url=served.url + "/v1", api_key="unused", max_retries=0)
    messages = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": QUESTION}]
    reply = client.chat.completions.create(model="astrai", messages=messages, temperature=0, max_tokens=12)
    return reply.choices[0].message.content


def _stop(served) -> None:
    served.proc.send_signal(signal.SIGTERM)  # drains, then the engine writes its cached pages
    assert served.proc.wait(60) == 0, served.log()[-3000:]


def test_a_restarted_server_loads_the_cached_prefix_from_disk(start_server, tmp_path):
    folder = tmp_path / "kv"
    flags = ("--kv-cache-dir", str(folder), "--kv-cache-host-memory", "16MiB")
    first = start_server(*flags)
    want = _ask(first)
    cold = first.wait_idle()
    assert cold["prefix_hit_tokens"] == 0 and cold["kv_tier_disk_pages"] == 0
    _stop(first)
    assert "writing the" in first.log() and list(folder.glob("*/*.kv"))
    second = start_server(*flags)
    assert _ask(second) == want
    warm = second.wait_idle()
    pages = warm["kv_tier_disk_hit_pages"]
    assert pages >= 15 and warm["prefix_hit_tokens"] == 16 * pages  # every complete page of the prompt
    assert warm["kv_tier_disk_pages"] >= pages
    metrics = httpx.get(second.url + "/metrics", timeout=10).text
    assert f'astrai:kv_cache_tier_disk_hit_pages_total{{model_name="astrai"}} {float(pages)}' in metrics
    _stop(second)


@pytest.mark.parametrize(
    ("flags", "message"),
    [
        (("--kv-cache-dir", "/tmp/x", "--no-prefix-caching"), "they need --paged and --prefix-caching"),
        (
            ("--kv-cache-host-memory", "1GiB", "--tensor-parallel-size", "2"),
            "not supported under tensor parallelism",
        ),
    ],
    ids=["no-prefix-cache", "tensor-parallel"],
)
def test_tiers_that_cannot_work_stop_the_start_with_exit_2(flags, message):
    proc = subprocess.run(
        [sys.executable, "-m", "astrai.cli", "serve", *flags], capture_output=True, text=True, timeout=180
    )
    assert proc.returncode == 2, proc.stderr[-2000:]
    assert message in proc.stderr
