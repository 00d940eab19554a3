"""Tensor parallel through ``astrai serve`` (issue 18) on the default model, float32, 2 CPU cores.

``--tensor-parallel-size 3`` splits SmolLM2-135M exactly (9 query / 3 KV heads, 3 query heads and
one KV head per rank) over rank 0 and two worker processes: the same chat prompts give the same
greedy tokens as one process. A size the model cannot take stops the command at once, naming
the valid sizes. An idle server outlives its collective time-out; killing a worker turns /health
to 503 and fails requests with 503, without a hang. Under torchrun every process is a rank and
rank 0 alone serves HTTP.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx
import openai
import pytest

pytestmark = pytest.mark.slow  # the real default model, in several processes

PROMPTS = ["Name three colors.", "What is the capital of France?", "Write a haiku about the sea."]


def _answers(url: str) -> list[tuple[str, int]]:
    client = openai.OpenAI(base_url=url + "/v1", api_key="none", max_retries=0)
    out = []
    for prompt in PROMPTS:
        r = client.chat.completions.create(
            model="astrai", messages=[{"role": "user", "content": prompt}], max_tokens=24, temperature=0
        )
        out.append((r.choices[0].message.content, r.usage.completion_tokens))
    return out


def _workers(pid: int) -> list[int]:
    found = subprocess.run(
        ["pgrep", "-P", str(pid), "-f", "astrai.distributed.worker"], capture_output=True, text=True
    )
    return [int(x) for x in found.stdout.split()]


def test_tensor_parallel_3_gives_the_greedy_tokens_of_one_process_and_a_lost_worker_gives_503(
    start_server,
) -> None:
    alone = start_server()
    expected = _answers(alone.url)
    alone.proc.send_signal(signal.SIGTERM)
    assert alone.proc.wait(60) == 0  # one model in memory at a time on this machine
    split = start_server("--tensor-parallel-size", "3", "--tp-timeout", "6", "--log-level", "info")
    assert split.stats()["kv_tokens_total"] > 0
    time.sleep(7)  # idle past the collective time-out: the heartbeat keeps the workers waiting
    assert _answers(split.url) == expected
    assert "tensor parallel: 3 ranks" in split.log()
    workers = _workers(split.proc.pid)
    assert len(workers) == 2
    subprocess.run(["kill", "-9", str(workers[0])], check=True)
    deadline = time.monotonic() + 30
    while httpx.get(split.url + "/health", timeout=10).status_code == 200:
        assert time.monotonic() < deadline, "/health stayed 200 with a worker gone"
        time.sleep(0.1)
    r = httpx.post(
        split.url + "/v1/chat/completions",
        timeout=30,
        json={"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 4},
    )
    assert r.status_code == 503 and r.json()["error"]["type"] == "server_error"
    split.proc.send_signal(signal.SIGTERM)
    assert split.proc.wait(60) == 0
    time.sleep(0.5)
    assert not _workers(split.proc.pid)


def test_a_size_the_model_cannot_take_stops_the_command_naming_the_valid_sizes() -> None:
    done = subprocess.run(
        [sys.executable, "-m", "astrai.cli", "serve", "--tensor-parallel-size", "2"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 2
    assert "tensor parallel size 2 cannot split" in done.stderr and "valid sizes: 1, 3" in done.stderr


def _rank_pids(parent: int) -> dict[int, int]:
    """The ranks torchrun (``parent``) started, by ``RANK``."""
    found = subprocess.run(["pgrep", "-P", str(parent)], capture_output=True, text=True).stdout.split()
    ranks = {}
    for pid in map(int, found):
        try:
            text = Path(f"/proc/{pid}/environ").read_text()
            env = dict(x.split("=", 1) for x in text.split("\0") if "=" in x)
        except OSError:
            continue
        if "RANK" in env:
            ranks[int(env["RANK"])] = pid
    return ranks


def test_under_torchrun_every_process_is_a_rank_and_rank_0_serves(tmp_path) -> None:
    from serving import free_port

    port = free_port()
    log = (tmp_path / "torchrun.log").open("wb")
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--standalone",
            "--nproc-per-node",
            "3",
            "-m",
            "astrai.cli",
            "serve",
            "--tensor-parallel-size",
            "3",
            "--dtype",
            "float32",
            "--max-seq-len",
            "1024",
            "--port",
            str(port),
        ],
        stdout=log,
        stderr=subprocess.STDOUT,
    )
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 240
        while True:
            try:
                if httpx.get(url + "/health", timeout=2).status_code == 200:
                    break
            except httpx.TransportError:
                pass
            assert proc.poll() is None and time.monotonic() < deadline, (
                tmp_path / "torchrun.log"
            ).read_text()
            time.sleep(0.5)
        assert _answers(url)[0][1] > 0
        ranks = _rank_pids(proc.pid)
        assert sorted(ranks) == [0, 1, 2]
        listening = subprocess.run(
            ["ss", "-ltnpH", f"sport = :{port}"], capture_output=True, text=True
        ).stdout
        assert f"pid={ranks[0]}," in listening  # rank 0 serves HTTP; the others only their shard
        assert not any(f"pid={ranks[r]}," in listening for r in (1, 2))
        os.kill(ranks[0], signal.SIGTERM)  # rank 0 drains and stops the others: torchrun ends cleanly
        assert proc.wait(120) == 0, (tmp_path / "torchrun.log").read_text()[-6000:]
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        log.close()
