"""Hostile loads beside a plain streaming client: what one client's request costs everyone else.

One ``astrai serve`` (the default model, default bounds) is started under ``ulimit -n 1024`` (soft
and hard, as on a host where nothing raised it). A plain client streams short chat completions, one
after another; its end-to-end latency is measured alone, then while each hostile load of the issue-29
probe runs beside it:

- ``fan_out``: a ``/v1/completions`` body of 320,000 prompts (1.4 MB; refused: ``--max-choices``),
  then one at the bound (128 prompts, 48 tokens each) that is served beside the client;
- ``compiles``: 8 concurrent requests each with a distinct enum of 20,000 strings (refused by
  ``--max-grammar-bytes``), then 8 of 12,000 strings each (under the size bound; each compile takes
  seconds, in the compile worker, stopped at ``--grammar-compile-timeout``);
- ``stop_strings``: 100,000 stop strings with ``n`` 16 (refused), then 64 (the bound) with ``n`` 16,
  served beside the client;
- ``logit_bias``: the whole vocabulary with ``n`` 16 (refused), then 300 entries (the bound) with ``n`` 16;
- ``slowloris``: 1,100 connections that trickle a request head one byte a second.

For each load it prints the hostile requests' answers and how long they took, and the plain
client's p50/p99 latency with and without the load. The goal (issue 29): the client's p99 within
2x its unloaded p99, or the hostile request refused in under a second. One JSON object on stdout.

Usage: python benchmarks/hostile_bench.py [--quick] [--only fan_out,compiles,...] [--dtype float32]

Over 300 lines because it is one self-contained script: copied to another machine, it runs with
nothing else of the repository's benchmarks beside it.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import resource
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import httpx

CHAT, COMPLETIONS = "/v1/chat/completions", "/v1/completions"
PLAIN = {
    "messages": [{"role": "user", "content": "Tell me a short story about a lighthouse keeper."}],
    "max_tokens": 24,
    "temperature": 0,
    "ignore_eos": True,
    "stream": True,
}
FD_LIMIT = 1024
VOCAB = 49152  # the default model's (SmolLM2-135M)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_server(dtype: str | None, log: Path) -> tuple[subprocess.Popen, str]:
    port = free_port()
    cmd = [sys.executable, "-m", "astrai.cli", "serve", "--port", str(port), "--log-level", "warning"]
    if dtype:
        cmd += ["--dtype", dtype]

    def limit() -> None:  # as a host that never raised the descriptor limit
        resource.setrlimit(resource.RLIMIT_NOFILE, (FD_LIMIT, FD_LIMIT))

    proc = subprocess.Popen(cmd, stdout=log.open("wb"), stderr=subprocess.STDOUT, preexec_fn=limit)
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 900
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise SystemExit(f"astrai serve exited:\n{log.read_text()[-3000:]}")
        try:
            if httpx.get(url + "/health", timeout=2).status_code == 200:
                return proc, url
        except httpx.TransportError:
            pass
        time.sleep(0.2)
    raise SystemExit("astrai serve did not become healthy")


def plain_request(url: str) -> float | None:
    """One streamed chat completion of the plain client: seconds from send to its last byte (None: failed)."""
    started = time.perf_counter()
    try:
        with httpx.stream("POST", url + CHAT, json=PLAIN, timeout=300) as r:
            if r.status_code != 200:
                return None
            for _ in r.iter_lines():
                pass
    except httpx.HTTPError:
        return None
    return time.perf_counter() - started


def latencies(url: str, n: int, during: threading.Event | None = None) -> list[float | None]:
    """``n`` plain requests one after another (while ``during`` is unset, when given: at least one)."""
    out: list[float | None] = []
    while len(out) < n and (during is None or not during.is_set() or not out):
        out.append(plain_request(url))
    return out


def summary(samples: list[float | None]) -> dict[str, Any]:
    ok = sorted(s for s in samples if s is not None)
    if not ok:
        return {"requests": len(samples), "failed": len(samples)}
    p99 = ok[min(len(ok) - 1, round(0.99 * (len(ok) - 1)))]
    return {
        "requests": len(samples),
        "failed": len(samples) - len(ok),
        "p50_s": round(statistics.median(ok), 3),
        "p99_s": round(p99, 3),
    }


def timed(fn: Callable[[], Any]) -> tuple[Any, float]:
    started = time.perf_counter()
    value = fn()
    return value, round(time.perf_counter() - started, 3)


def post(url: str, route: str, body: dict[str, Any], timeout: float = 600) -> dict[str, Any]:
    try:
        r = httpx.post(url + route, json=body, timeout=timeout)
    except httpx.HTTPError as e:
        return {"status": None, "error": type(e).__name__}
    detail = r.json().get("error", {}).get("message", "") if r.status_code >= 400 else ""
    return {"status": r.status_code, "message": detail[:160]}


def beside(url: str, load: Callable[[], Any], n: int) -> tuple[Any, dict[str, Any]]:
    """Run ``load`` on a thread while the plain client sends up to ``n`` requests (until the load ends)."""
    done = threading.Event()
    result: dict[str, Any] = {}

    def run() -> None:
        try:
            result["value"] = load()
        finally:
            done.set()

    t = threading.Thread(target=run)
    t.start()
    time.sleep(0.2)  # the load is under way
    samples = latencies(url, n, done)
    t.join()
    return result.get("value"), summary(samples)


def many(n: int, fn: Callable[[int], Any]) -> Callable[[], list[Any]]:
    """A load of ``n`` concurrent calls of ``fn(i)``."""

    def run() -> list[Any]:
        out: list[Any] = [None] * n
        threads = [
            threading.Thread(target=lambda i=i: out.__setitem__(i, timed(lambda: fn(i)))) for i in range(n)
        ]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        return out

    return run


def enum_schema(size: int, salt: int) -> dict[str, Any]:
    schema = {"type": "object", "properties": {"x": {"enum": [f"value {salt} {i}" for i in range(size)]}}}
    return {"type": "json_schema", "json_schema": {"name": f"s{salt}", "schema": schema}}


def case_fan_out(url: str, n: int) -> dict[str, Any]:
    huge = {"prompt": [[1, 2]] * 320_000, "max_tokens": 1}
    refused, took = timed(lambda: post(url, COMPLETIONS, huge))
    at_cap = {
        "prompt": [f"Count slowly, story {i}:" for i in range(128)],
        "max_tokens": 48,
        "temperature": 0,
        "ignore_eos": True,
    }
    served, plain = beside(url, lambda: timed(lambda: post(url, COMPLETIONS, at_cap)), n)
    return {
        "hostile": {**refused, "seconds": took},
        "at_bound": {**served[0], "seconds": served[1]},
        "plain": plain,
    }


def case_compiles(url: str, n: int) -> dict[str, Any]:
    ask = {"messages": [{"role": "user", "content": "Pick one."}], "max_tokens": 8}
    refused, plain_refused = beside(
        url, many(8, lambda i: post(url, CHAT, {**ask, "response_format": enum_schema(20_000, i)})), n
    )
    stopped, plain = beside(
        url, many(8, lambda i: post(url, CHAT, {**ask, "response_format": enum_schema(12_000, 100 + i)})), n
    )
    return {
        "hostile": [{**r, "seconds": s} for r, s in refused],
        "plain_beside_refused": plain_refused,
        "under_size_bound": [{**r, "seconds": s} for r, s in stopped],
        "plain": plain,
    }


def case_stop_strings(url: str, n: int) -> dict[str, Any]:
    ask = {
        "messages": [{"role": "user", "content": "Write a long poem."}],
        "max_tokens": 64,
        "n": 16,
        "ignore_eos": True,
    }
    refused, took = timed(lambda: post(url, CHAT, {**ask, "stop": [f"stop-{i}-x" for i in range(100_000)]}))
    served, plain = beside(
        url, lambda: timed(lambda: post(url, CHAT, {**ask, "stop": [f"never-{i}" for i in range(64)]})), n
    )
    return {
        "hostile": {**refused, "seconds": took},
        "at_bound": {**served[0], "seconds": served[1]},
        "plain": plain,
    }


def case_logit_bias(url: str, n: int) -> dict[str, Any]:
    vocab = VOCAB
    ask = {
        "messages": [{"role": "user", "content": "Write a long poem."}],
        "max_tokens": 64,
        "n": 16,
        "ignore_eos": True,
    }
    refused, took = timed(lambda: post(url, CHAT, {**ask, "logit_bias": {str(i): 0.1 for i in range(vocab)}}))
    served, plain = beside(
        url,
        lambda: timed(lambda: post(url, CHAT, {**ask, "logit_bias": {str(i): 0.1 for i in range(300)}})),
        n,
    )
    return {
        "hostile": {**refused, "seconds": took},
        "at_bound": {**served[0], "seconds": served[1]},
        "plain": plain,
    }


def case_slowloris(url: str, n: int, count: int = 1100) -> dict[str, Any]:
    port = int(url.rsplit(":", 1)[1])

    async def trickle(stop: asyncio.Event, stats: dict[str, int]) -> None:
        head = b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
        try:
            reader, writer = await asyncio.open_connection("127.0.0.1", port)
        except OSError:
            stats["refused"] += 1
            return
        stats["opened"] += 1
        try:
            for byte in head:
                if stop.is_set():
                    break
                writer.write(bytes([byte]))
                await writer.drain()
                try:  # one byte a second, unless the server closes the connection first
                    if await asyncio.wait_for(reader.read(1024), 1.0) == b"":
                        stats["closed_by_server"] += 1
                        break
                except asyncio.TimeoutError:
                    pass
        except (ConnectionError, OSError):
            stats["closed_by_server"] += 1
        finally:
            writer.close()

    stats = {"opened": 0, "refused": 0, "closed_by_server": 0}

    def load() -> dict[str, int]:
        async def main() -> None:
            stop = asyncio.Event()
            tasks = [asyncio.create_task(trickle(stop, stats)) for _ in range(count)]
            await asyncio.sleep(30)
            stop.set()
            await asyncio.gather(*tasks, return_exceptions=True)

        asyncio.run(main())
        return dict(stats)

    result, plain = beside(url, load, n)
    healthy = httpx.get(url + "/health", timeout=10).status_code
    return {"hostile": {**result, "connections": count, "health_after": healthy}, "plain": plain}


CASES = {
    "fan_out": case_fan_out,
    "compiles": case_compiles,
    "stop_strings": case_stop_strings,
    "logit_bias": case_logit_bias,
    "slowloris": case_slowloris,
}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="fewer plain requests per measurement")
    parser.add_argument("--only", default=",".join(CASES), help="comma-separated cases")
    parser.add_argument("--dtype", default=None, help="astrai serve --dtype (default: the server's)")
    args = parser.parse_args()
    n = 5 if args.quick else 20
    log = Path(tempfile.mkdtemp(prefix="hostile-bench-")) / "server.log"
    proc, url = start_server(args.dtype, log)
    out: dict[str, Any] = {"fd_limit": FD_LIMIT, "server_log": str(log)}
    try:
        plain_request(url)  # warm: the first request builds the kernels' first step
        out["unloaded"] = unloaded = summary(latencies(url, n))
        for name in args.only.split(","):
            result = CASES[name](url, n)
            hostile = result["hostile"] if isinstance(result["hostile"], list) else [result["hostile"]]
            refused_fast = all(
                h.get("status") in (400, 413, 429) and h.get("seconds", 0) < 1.0 for h in hostile
            )
            ratio = result["plain"].get("p99_s", float("inf")) / unloaded["p99_s"]
            result["plain_p99_ratio"] = round(ratio, 2)
            result["hostile_refused_under_1s"] = refused_fast
            result["goal_met"] = refused_fast or ratio <= 2.0
            out[name] = result
            print(json.dumps({name: result}), file=sys.stderr)
    finally:
        proc.send_signal(signal.SIGINT)
        try:
            proc.wait(60)
        except subprocess.TimeoutExpired:
            proc.kill()
    print(json.dumps(out, indent=1))


if __name__ == "__main__":
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    main()
