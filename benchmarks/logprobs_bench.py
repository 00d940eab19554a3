"""What log-probs cost: astrai serve's W2 chat workload with ``logprobs: true, top_logprobs: 5`` vs without.

One ``astrai serve`` (serve_bench's command, dtype and offline setup) runs both variants of the
concurrent workload W2 (8 streams, user prompts of 32 to 512 tokens, 128 new tokens,
``ignore_eos``), alternating which goes first over ``--repeats`` rounds so that a drift of the
machine does not favour one. Before timing, one streamed and one plain request check that the
server really returns ``top_logprobs`` entries for every generated token (a server that
ignored the fields would look free). Prints one JSON object: each run's W2 summary, the
median output tokens/s of each variant and their ratio (with / without; < 1 is the cost).

Usage: python benchmarks/logprobs_bench.py [--quick] [--dtype bfloat16] [--repeats 2]

Reuses serve_bench.py, which must sit beside it.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import importlib.metadata as md
import json
import logging
import os
import statistics
import sys
import tempfile
from pathlib import Path

import httpx
import serve_bench as bench  # beside this file: the script's directory is on sys.path

logger = logging.getLogger("logprobs_bench")
TOP_LOGPROBS = 5
LOGPROBS = {"logprobs": True, "top_logprobs": TOP_LOGPROBS}


async def check_logprobs(system: bench.System, messages: list[dict], max_tokens: int) -> dict:
    """One plain and one streamed request with ``LOGPROBS``; raises unless each generated token has
    its entry with ``TOP_LOGPROBS`` alternatives. Returns the entry counts."""
    body = {
        "model": system.model,
        "messages": messages,
        "max_tokens": max_tokens,
        "temperature": 0,
        **system.extra,
    }
    got: dict[str, tuple[list[dict], int | None]] = {}  # variant -> (entries, completion tokens)
    async with httpx.AsyncClient(timeout=httpx.Timeout(600.0, connect=10.0)) as client:
        resp = await client.post(system.base + "/v1/chat/completions", json=body)
        if resp.status_code != 200:
            raise RuntimeError(f"logprobs request: HTTP {resp.status_code}: {resp.text[:300]}")
        out = resp.json()
        got["plain"] = (out["choices"][0]["logprobs"]["content"], out["usage"]["completion_tokens"])
        stream = {**body, "stream": True, "stream_options": {"include_usage": True}}
        entries, usage = [], None
        async with client.stream("POST", system.base + "/v1/chat/completions", json=stream) as resp:
            if resp.status_code != 200:
                raise RuntimeError(f"streamed logprobs request: HTTP {resp.status_code}")
            async for line in resp.aiter_lines():
                if not line.startswith("data:") or line[5:].strip() == "[DONE]":
                    continue
                chunk = json.loads(line[5:])
                usage = chunk.get("usage") or usage
                for choice in chunk.get("choices", []):
                    entries += (choice.get("logprobs") or {}).get("content") or []
        got["stream"] = (entries, usage["completion_tokens"] if usage else None)
    for name, (entries, tokens) in got.items():
        if len(entries) != tokens:
            raise RuntimeError(f"{name}: {len(entries)} logprobs entries for {tokens} completion tokens")
        if any(len(e["top_logprobs"]) != TOP_LOGPROBS for e in entries):
            raise RuntimeError(f"{name}: an entry without {TOP_LOGPROBS} top_logprobs")
    return {name: len(entries) for name, (entries, _) in got.items()}


def compare(
    plain: bench.System, with_lp: bench.System, wl: bench.Workload, p: bench.Prompts, repeats: int
) -> dict:
    """``repeats`` rounds of ``wl`` in each variant on the running server, alternating the order."""
    runs: dict[str, list[dict]] = {"without_logprobs": [], "with_logprobs": []}
    variants = [("without_logprobs", plain), ("with_logprobs", with_lp)]
    for r in range(repeats):
        for name, system in variants if r % 2 == 0 else variants[::-1]:
            result = asyncio.run(bench.run_workloads(system, [wl], p))[wl.name]
            if result["errors"]:
                raise RuntimeError(f"{name}: {result['errors'][:3]}")
            runs[name].append(result)
    rate = {k: statistics.median(x["output_tokens_per_s"] for x in v) for k, v in runs.items()}
    tpot = {k: statistics.median(x["tpot_s"]["p50"] for x in v) for k, v in runs.items()}
    return {
        "output_tokens_per_s": {**rate, "ratio": rate["with_logprobs"] / rate["without_logprobs"]},
        "tpot_p50_s": {**tpot, "ratio": tpot["with_logprobs"] / tpot["without_logprobs"]},
        "runs": runs,
    }


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    bench.add_common_arguments(ap)
    ap.add_argument("--repeats", type=int, default=2, help="rounds of each variant (medians are reported)")
    args = ap.parse_args()
    gguf, folder, prompts = bench.prepare(args)
    w2 = next(w for w in bench.workloads(prompts, args.quick) if w.name == "W2")
    plain = bench.make_systems(args.dtype, folder)["astrai"](bench.free_port())
    with_lp = dataclasses.replace(plain, extra={**plain.extra, **LOGPROBS})
    log_dir = Path(tempfile.mkdtemp(prefix="logprobs-bench-"))
    try:
        with bench.serving(plain, log_dir) as head:
            checked = asyncio.run(check_logprobs(with_lp, w2.requests[0], 16))
            result = {**head, "logprobs_check": checked, **compare(plain, with_lp, w2, prompts, args.repeats)}
    except RuntimeError as exc:
        logger.error("astrai failed: %s", exc)
        result = {"error": str(exc)}
    versions = {d: md.version(d) for d in ("astrai-core", "astrai-server", "torch")}
    summary = {
        "config": {
            "quick": args.quick,
            "dtype": args.dtype,
            "device": "cpu",
            "cores": os.cpu_count(),
            "gguf": gguf.name,
            "repeats": args.repeats,
            "workload": "W2",
            "concurrency": w2.concurrency,
            "max_tokens": w2.max_tokens,
            "logprobs_fields": LOGPROBS,
            "server_logs": str(log_dir),
            "versions": versions,
        },
        "astrai": result,
    }
    sys.stdout.write(json.dumps(summary, indent=2) + "\n")  # the benchmark's output: one JSON object
    return 0 if "error" not in result else 1


if __name__ == "__main__":
    sys.exit(main())
