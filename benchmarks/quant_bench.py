"""Quantized GGUF weights: ``astrai serve --weights gguf`` vs ``--weights dense`` \
vs llama.cpp's ``llama-server``.

Each server runs in turn (never two at once) on the default model's file, driven by
serve_bench.py's OpenAI-streaming client with EOS ignored, and the script prints one JSON object:

- W1: one stream at a time, 8 requests, user prompts of 32 to 512 tokens, 128 new tokens:
  inter-token latency (p50) and time to first token;
- B8 / B32: 8 and 32 concurrent requests of the same shape (prompts 32-512 tokens, 128 new):
  output tokens/s;
- the resident set of each server after the run (``/proc/<pid>/status`` VmRSS; astrai with its
  default 512 MiB KV pool and with ``--kv-memory 64MiB``, near llama-server's context).

llama-server comes from ``../shared/peers`` (``setup.sh`` builds it, ``start.sh llamacpp`` runs it:
2 threads, 8 slots, continuous batching, the GGUF's own Q4_1). ``--no-peer`` skips it.

Usage: python benchmarks/quant_bench.py [--quick] [--no-peer] [--peers DIR] [--llama-arg=ARG ...]

Reuses serve_bench.py, which must sit beside it.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import sys
import tempfile
from pathlib import Path

import serve_bench as bench  # beside this file: the script's directory is on sys.path

PEERS = Path(__file__).resolve().parents[2] / "shared" / "peers"


def workloads(p: bench.Prompts, quick: bool) -> list[bench.Workload]:
    rng = random.Random(1)
    n1, n8, n32, new = (2, 4, 8, 16) if quick else (8, 16, 64, 128)

    def requests(n: int) -> list[list[dict]]:
        offsets = rng.sample(range(1, len(p.words)), n)
        return [[{"role": "user", "content": p.text(rng.randint(32, 512), o)}] for o in offsets]

    return [
        bench.Workload("W1", requests(n1), 1, new),
        bench.Workload("B8", requests(n8), 8, new),
        bench.Workload("B32", requests(n32), 32, new),
    ]


def resident_mib(pid: int) -> float | None:
    try:
        line = next(x for x in Path(f"/proc/{pid}/status").read_text().splitlines() if x.startswith("VmRSS:"))
    except (OSError, StopIteration):
        return None
    return int(line.split()[1]) / 1024


def run(system: bench.System, loads: list[bench.Workload], p: bench.Prompts, log_dir: Path) -> dict:
    with bench.serving(system, log_dir) as head:
        result = {**head, **asyncio.run(bench.run_workloads(system, loads, p))}
        pids = [int(x) for x in os.popen(f"pgrep -f -- '--port {system.port}'").read().split()]
        result["rss_mib"] = max((resident_mib(pid) or 0 for pid in pids), default=None)
        return result


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="tiny workloads (smoke run)")
    ap.add_argument("--no-peer", action="store_true", help="without llama-server")
    ap.add_argument("--peers", type=Path, default=PEERS, help="the peers folder (setup.sh, start.sh)")
    ap.add_argument(
        "--llama-arg",
        action="append",
        default=[],
        help=(
            "an extra llama-server argument, repeatable "
            "(--llama-arg=--no-repack: its AMX repacking crashed at start on an AMX Xeon)"
        ),
    )
    ap.add_argument("--cache-dir", type=Path, default=Path.home() / ".cache" / "astrai-bench")
    args = ap.parse_args()
    args.dtype = "bfloat16"
    gguf, _folder, prompts = bench.prepare(args)
    loads = workloads(prompts, args.quick)
    bindir = Path(sys.executable).parent
    astrai = [str(bindir / "astrai"), "serve", "--dtype", "bfloat16", "--log-level", "warning"]

    def astrai_system(name: str, *flags: str):
        return lambda port: bench.System(
            name,
            [*astrai, "--host", "127.0.0.1", "--port", str(port), *flags],
            "astrai",
            {"ignore_eos": True},
            port,
        )

    systems = {
        "astrai_gguf": astrai_system("astrai_gguf", "--weights", "gguf"),
        "astrai_dense": astrai_system("astrai_dense", "--weights", "dense"),
        "astrai_gguf_kv64": astrai_system("astrai_gguf_kv64", "--weights", "gguf", "--kv-memory", "64MiB"),
    }
    if not args.no_peer:
        systems["llama_server"] = lambda port: bench.System(
            "llama_server",
            ["bash", str(args.peers / "start.sh"), "llamacpp", str(port), *args.llama_arg],
            "astrai",
            {"ignore_eos": True},
            port,
        )
    log_dir = Path(tempfile.mkdtemp(prefix="quant-bench-"))
    results: dict = {}
    for name, make in systems.items():
        try:
            results[name] = run(make(bench.free_port()), loads, prompts, log_dir)
        except RuntimeError as exc:
            results[name] = {"error": str(exc)}

    def metric(name: str, wl: str, key: str):
        r = results.get(name, {}).get(wl) or {}
        return (r.get("itl_s") or {}).get("p50") if key == "itl" else r.get("output_tokens_per_s")

    ratios = {}
    for other in ("astrai_dense", "llama_server"):
        if other in results and "error" not in results[other] and "error" not in results["astrai_gguf"]:
            ratios[f"W1_itl_p50_{other}_over_gguf"] = metric(other, "W1", "itl") / metric(
                "astrai_gguf", "W1", "itl"
            )
            for wl in ("B8", "B32"):
                ratios[f"{wl}_tok_s_gguf_over_{other}"] = metric("astrai_gguf", wl, "tok") / metric(
                    other, wl, "tok"
                )
    summary = {
        "config": {
            "quick": args.quick,
            "gguf": gguf.name,
            "cores": os.cpu_count(),
            "server_logs": str(log_dir),
            "prompt_tokens": {w.name: [prompts.count(m[-1]["content"]) for m in w.requests] for w in loads},
        },
        "headline": {
            name: {
                "W1_itl_p50_ms": (metric(name, "W1", "itl") or 0) * 1e3,
                "B8_tok_s": metric(name, "B8", "tok"),
                "B32_tok_s": metric(name, "B32", "tok"),
                "rss_mib": results[name].get("rss_mib"),
            }
            for name in results
            if "error" not in results[name]
        },
        "ratios": ratios,
        "systems": results,
    }
    sys.stdout.write(json.dumps(summary, indent=2) + "\n")
    return 0 if all("error" not in r for r in results.values()) else 1


if __name__ == "__main__":
    raise SystemExit(main())
