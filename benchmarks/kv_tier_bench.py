"""Time to first token after a restart, with the KV cache's disk tier vs cold: ``astrai serve
--kv-cache-dir DIR`` writes the prefix cache's pages to ``DIR`` at a graceful shutdown, and the
next server started on it loads them back instead of recomputing the prompt.

Three servers, one after the other, on the default model with ``--max-seq-len 4096``. Each gets
one untimed warm-up request (a system prompt of its own, shorter than a page: it shares no page
with the workload), then the workload, shaped as serve_bench.py's W3 but sent one request at a
time: ``--requests`` (8) streamed chat completions, greedy, EOS ignored, ``--new-tokens`` (16) new
tokens, sharing a system prompt of ``--system-tokens`` (1,000) random words (seed 0), each with
its own short user question:

- ``cold``: a fresh, empty ``--kv-cache-dir``: the first request prefills the whole system
  prompt, the others find it in the radix cache; then SIGTERM, and the server must exit by itself
  (it writes the pages it still caches to the folder);
- ``restart_disk``: a new server on the same folder: its first request should load the prefix
  from disk;
- ``restart_no_tier``: a new server without ``--kv-cache-dir``: what a restart gives today.

(``--quick``: 4 requests, a 500-token system prompt; the other options still apply.)

Prints one JSON object: per run the first request's TTFT, the median TTFT of the others, what
the first request added to GET /stats ``prefix_hit_tokens`` and ``kv_tier_disk_hit_pages`` (and
the figures at the end), startup and shutdown seconds and exit code; the folder's files and bytes
after the cold server exits; the ratio restart_no_tier / restart_disk of first-request TTFTs (how
much sooner a restarted server answers its first request with the disk tier); and, informative
only, whether the three runs' texts are identical request by request.

Usage: python benchmarks/kv_tier_bench.py [--quick] [--requests 8] [--new-tokens 16] [--system-tokens 1000]
Reuses serve_bench.py, which must sit beside it.

Over 300 lines because the graceful stop (one SIGTERM, then a wait for the server to save its
cache and exit) needs its own copy of serve_bench's start-and-stop, and the chat stream keeps
each answer's text, which serve_bench.one_request drops.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import random
import re
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import serve_bench as bench  # beside this file: the script's directory is on sys.path

MAX_SEQ_LEN = 4096
SHUTDOWN_WAIT_S = 300.0  # a graceful exit writes every cached page first
STATS_KEYS = (
    "prefix_hit_tokens",
    "kv_tier_disk_hit_pages",
    "kv_tier_host_hit_pages",
    "kv_tier_disk_pages",
    "kv_tier_disk_bytes",
    "kv_tier_spilled_pages",
    "kv_tokens_cached",
)
SAVED = re.compile(r"KV cache disk tier: writing the (\d+) page")  # engine.shutdown's log line


def system_prompt(p: bench.Prompts, n_tokens: int, seed: int = 0) -> str:
    """Random words of serve_bench's paragraph, cut to ``n_tokens`` tokens."""
    rng = random.Random(seed)
    vocab = sorted({w.strip(".,;").lower() for w in p.words})
    words = " ".join(rng.choice(vocab) for _ in range(n_tokens + 16))
    return p.tok.decode(p.tok.encode(words, add_special_tokens=False).ids[:n_tokens])


def workload(system: str, n: int) -> list[list[dict]]:
    """serve_bench's W3 turns: the shared system prompt, then a distinct short question."""
    question = "Question {}: in one sentence, what is the main idea above?"
    return [
        [{"role": "system", "content": system}, {"role": "user", "content": question.format(i + 1)}]
        for i in range(n)
    ]


async def chat(client: httpx.AsyncClient, system: bench.System, messages: list[dict], max_tokens: int, p):
    """serve_bench.one_request for a chat completion, also keeping the text: (Sample, text)."""
    body = {
        "model": system.model,
        "messages": messages,
        "max_tokens": max_tokens,
        "temperature": 0,
        "stream": True,
        "stream_options": {"include_usage": True},
        **system.extra,
    }
    stamps: list[float] = []
    text: list[str] = []
    usage = None
    t0 = time.perf_counter()
    try:
        async with client.stream("POST", system.base + "/v1/chat/completions", json=body) as resp:
            if resp.status_code != 200:
                detail = (await resp.aread()).decode(errors="replace")[:300]
                return bench.Sample(error=f"HTTP {resp.status_code}: {detail}"), None
            async for line in resp.aiter_lines():
                if not line.startswith("data:"):
                    continue
                data = line[5:].strip()
                if data == "[DONE]":
                    break
                chunk = json.loads(data)
                if "error" in chunk:
                    return bench.Sample(error=f"in-stream error: {str(chunk['error'])[:300]}"), None
                usage = chunk.get("usage") or usage
                for choice in chunk.get("choices") or []:
                    piece = (choice.get("delta") or {}).get("content")
                    if piece:
                        stamps.append(time.perf_counter())
                        text.append(piece)
    except (httpx.HTTPError, ValueError) as exc:
        return bench.Sample(error=f"{type(exc).__name__}: {exc}"), None
    end = time.perf_counter()
    if not stamps:
        return bench.Sample(error="no content chunk"), None
    gaps = [b - a for a, b in zip(stamps[:-1], stamps[1:], strict=True)]
    s = bench.Sample(ttft=stamps[0] - t0, e2e=end - t0, gaps=gaps)
    if usage and usage.get("completion_tokens") is not None:
        s.output_tokens, s.prompt_tokens = usage["completion_tokens"], usage.get("prompt_tokens")
    else:
        s.output_tokens, s.from_usage = p.count("".join(text)), False
    return s, "".join(text)


def stats(system: bench.System) -> dict:
    time.sleep(0.2)  # /stats is the scheduler's snapshot after its last step
    try:
        got = httpx.get(system.base + "/stats", timeout=10.0).json()
    except (httpx.HTTPError, ValueError) as exc:
        return {"error": f"GET /stats: {exc}"}
    return {k: got.get(k) for k in STATS_KEYS}


async def run_workload(
    system: bench.System, turns: list[list[dict]], new_tokens: int, p
) -> tuple[dict, list]:
    """The warm-up, then ``turns`` one at a time; /stats before and after the first."""
    timeout = httpx.Timeout(3600.0, connect=10.0)
    async with httpx.AsyncClient(timeout=timeout) as client:
        warm = [
            {"role": "system", "content": f"Warm-up of {system.name}."},
            {"role": "user", "content": "Hello"},
        ]
        sample, _ = await chat(client, system, warm, 4, p)
        if sample.error:
            raise RuntimeError(f"warm-up request failed: {sample.error}")
        before = stats(system)
        samples, texts, after_first = [], [], None
        for messages in turns:
            sample, text = await chat(client, system, messages, new_tokens, p)
            samples.append(sample)
            texts.append(text)
            if after_first is None:
                after_first = stats(system)
        end = stats(system)
    first, rest = samples[0], [s for s in samples[1:] if s.error is None]

    def gain(key: str) -> int | None:
        a, b = after_first.get(key), before.get(key)
        return a - b if a is not None and b is not None else None

    result = {
        "first_ttft_s": first.ttft if first.error is None else None,
        "first_prompt_tokens": first.prompt_tokens,
        "others_ttft_p50_s": statistics.median(s.ttft for s in rest) if rest else None,
        "ttft_s": [s.ttft if s.error is None else None for s in samples],
        "errors": [s.error for s in samples if s.error],
        "first_request_stats_gain": {k: gain(k) for k in ("prefix_hit_tokens", "kv_tier_disk_hit_pages")},
        "stats_after_warm_up": before,
        "stats_at_end": end,
    }
    bench.logger.info(
        "%s: first TTFT %.3f s, others p50 %.3f s",
        system.name,
        result["first_ttft_s"] or 0,
        result["others_ttft_p50_s"] or 0,
    )
    return result, texts


@contextlib.contextmanager
def serving(system: bench.System, log_dir: Path) -> Iterator[dict]:
    """bench.serving, but stopped by one SIGTERM and a wait for the server to exit by itself (it writes
    its cache then): the yielded dict gets ``shutdown_s``, ``exit_code`` and ``clean_exit`` afterwards."""
    log_path = log_dir / f"{system.name}.log"
    with open(log_path, "wb") as log:
        env = {**os.environ, **bench.OFFLINE}
        proc = subprocess.Popen(
            system.command, stdout=log, stderr=subprocess.STDOUT, env=env, start_new_session=True
        )
    head: dict = {"command": " ".join(system.command), "log": str(log_path)}
    try:
        t0 = time.perf_counter()
        while True:
            if proc.poll() is not None:
                raise RuntimeError(
                    f"exited with {proc.returncode} before /health was 200: {bench.tail(log_path)}"
                )
            if time.perf_counter() - t0 > bench.STARTUP_TIMEOUT_S:
                raise RuntimeError(
                    f"/health not 200 after {bench.STARTUP_TIMEOUT_S:.0f} s: {bench.tail(log_path)}"
                )
            try:
                if httpx.get(system.base + "/health", timeout=2.0).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            time.sleep(0.5)
        head["startup_s"] = time.perf_counter() - t0
        yield head
        t0 = time.perf_counter()
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGTERM)  # the server's own session: start_new_session=True
        with contextlib.suppress(subprocess.TimeoutExpired):
            proc.wait(SHUTDOWN_WAIT_S)
        head["shutdown_s"] = time.perf_counter() - t0
        head["exit_code"] = proc.poll()
        head["clean_exit"] = head["exit_code"] == 0
        saved = SAVED.findall(log_path.read_text(errors="replace"))
        head["pages_saved_at_shutdown"] = int(saved[-1]) if saved else None
    finally:
        bench.stop(proc)  # only where it is still running: SIGINT, SIGTERM, SIGKILL


def folder_size(path: Path) -> dict:
    files = [f for f in path.rglob("*") if f.is_file()]
    return {"files": len(files), "bytes": sum(f.stat().st_size for f in files)}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="4 requests, a 500-token system prompt")
    ap.add_argument("--requests", type=int, help="requests per run (default 8; --quick: 4)")
    ap.add_argument("--new-tokens", type=int, default=16)
    ap.add_argument("--system-tokens", type=int, help="the shared system prompt (default 1000; --quick: 500)")
    ap.add_argument("--cache-dir", type=Path, default=Path.home() / ".cache" / "astrai-bench")
    args = ap.parse_args()
    args.dtype = "float32"  # serve_bench's dequantized copy: only its tokenizer is read
    requests = args.requests or (4 if args.quick else 8)
    system_tokens = args.system_tokens or (500 if args.quick else 1000)
    if requests < 2:
        ap.error("--requests must be at least 2 (the first, then the others)")
    gguf, _, p = bench.prepare(args)
    system = system_prompt(p, system_tokens)
    turns = workload(system, requests)
    work_dir = Path(tempfile.mkdtemp(prefix="kv-tier-bench-"))
    kv_dir = work_dir / "kv-cache"
    kv_dir.mkdir()
    bindir = Path(sys.executable).parent

    def astrai(name: str, *flags: str) -> bench.System:
        port = bench.free_port()
        command = [str(bindir / "astrai"), "serve", "--host", "127.0.0.1", "--port", str(port)]
        command += ["--log-level", "info", "--max-seq-len", str(MAX_SEQ_LEN), *flags]
        return bench.System(name, command, "astrai", {"ignore_eos": True}, port)

    runs = [
        astrai("cold", "--kv-cache-dir", str(kv_dir)),
        astrai("restart_disk", "--kv-cache-dir", str(kv_dir)),
        astrai("restart_no_tier"),
    ]
    results: dict = {}
    texts: dict = {}
    folder: dict = {}
    for server in runs:  # one at a time: a waiting server still takes CPU
        try:
            with serving(server, work_dir) as head:
                results[server.name] = head
                r, texts[server.name] = asyncio.run(run_workload(server, turns, args.new_tokens, p))
                head.update(r)
        except RuntimeError as exc:
            bench.logger.error("%s failed: %s", server.name, exc)
            results[server.name] = {**results.get(server.name, {}), "error": str(exc)}
        if server.name == "cold":
            folder = folder_size(kv_dir)

    def first(name: str) -> float | None:
        return (results.get(name) or {}).get("first_ttft_s")

    def ratio(a: float | None, b: float | None) -> float | None:
        return a / b if a and b else None

    names = [s.name for s in runs]
    per_request = [
        len({(texts.get(n) or [None] * requests)[i] for n in names}) == 1
        and (texts.get(names[0]) or [None])[i] is not None
        for i in range(requests)
    ]
    headline = {
        name: {
            "first_ttft_s": r.get("first_ttft_s"),
            "others_ttft_p50_s": r.get("others_ttft_p50_s"),
            **{f"first_request_{k}": v for k, v in (r.get("first_request_stats_gain") or {}).items()},
        }
        for name, r in results.items()
    }
    summary = {
        "config": {
            "quick": args.quick,
            "cores": os.cpu_count(),
            "gguf": gguf.name,
            "max_seq_len": MAX_SEQ_LEN,
            "requests": requests,
            "new_tokens": args.new_tokens,
            "system_prompt_tokens": p.count(system),
            "kv_cache_dir": str(kv_dir),
            "server_logs": str(work_dir),
        },
        "headline": headline,
        "first_ttft_restart_no_tier_over_restart_disk": ratio(
            first("restart_no_tier"), first("restart_disk")
        ),
        "first_ttft_cold_over_restart_disk": ratio(first("cold"), first("restart_disk")),
        "kv_cache_dir_after_cold_exit": folder,
        "same_answers": {"identical_per_request": per_request, "all_identical": all(per_request)},
        "runs": results,
        "notes": [
            "first_ttft_s: the first workload request after the untimed warm-up; others_ttft_p50_s: the "
            "median TTFT of the rest (the radix cache then holds the system prompt)",
            "first_request_*: what the first request added to GET /stats (read before and after it)",
            "restart_disk's later requests find their whole prompt on disk too (the cold run saved every request's pages at exit), so its others_ttft_p50_s is below the other runs', which "
            "prefill each question's last pages",
            "the folder's pages were written moments before restart_disk reads them: they are likely "
            "still in the OS page cache (a warm disk)",
            "same_answers: the three runs' texts request by request (greedy, EOS ignored); informative only",
        ],
    }
    sys.stdout.write(json.dumps(summary, indent=2) + "\n")
    cold = results.get("cold") or {}
    failed = any("error" in r or r.get("errors") for r in results.values()) or not cold.get("clean_exit")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
