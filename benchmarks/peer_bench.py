"""The five serving workloads side by side: ``astrai serve`` vs vLLM-CPU and llama-server (issue 37).

Each server runs in turn (never two at once) on the default model, driven by serve_bench.py's
OpenAI-streaming client (chat completions, greedy, EOS ignored); one JSON object comes out:

- W1: one stream at a time, 3 requests of 128-token user prompts, 128 new tokens;
- W2: 8 concurrent streams, 8 requests, user prompts of 32 to 512 tokens, 128 new tokens;
- W3n: 8 concurrent, 8 requests of about 1,000 distinct prompt tokens each, 32 new tokens (the
  prefill-bound twin of W3: no prefix to share);
- W3: 8 concurrent, a shared 1,000-token system prompt plus a short distinct user turn, 32 new
  tokens, one untimed request first (the prefix warmed);
- W4: 32 concurrent streams, 64 requests, user prompts of 32 to 512 tokens (about 17k prompt
  tokens), 128 new tokens each (8,192 generated): prefill mixed with 32 decoding streams.

Per system and workload: output tokens/s, time to first token and inter-token latency (p50, p99);
per workload the ratio of each astrai configuration's tokens/s to the best peer's, and W4's
inter-token p99 / p50 and time to first token against vLLM's. ``--astrai NAME=FLAGS`` adds an
astrai configuration (default: ``astrai`` with no flags, and ``astrai_exact`` with
``--activations dtype``: the model's own activations, where the default may take int8).

Peers come from ``../shared/peers`` (``setup.sh`` builds them; ``start.sh vllm|llamacpp PORT``).
``--no-peer`` runs astrai alone.

Usage: python benchmarks/peer_bench.py [--quick] [--no-peer] [--astrai NAME="--flag value" ...]
       [--only W4 ...] [--peers DIR]

Reuses serve_bench.py, which must sit beside it.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import shlex
import sys
import tempfile
from pathlib import Path

import serve_bench as bench  # beside this file: the script's directory is on sys.path

PEERS = Path(__file__).resolve().parents[2] / "shared" / "peers"
PEER_MODEL = "SmolLM2-135M-Instruct"  # vLLM answers 404 for another name; llama-server takes any


def workloads(p: bench.Prompts, quick: bool) -> list[bench.Workload]:
    """serve_bench.py's W1-W3, and W3n and W4 beside them."""
    w1, w2, w3 = bench.workloads(p, quick)
    rng = random.Random(37)
    n8, n32, new, short, long_ = (2, 4, 8, 4, 256) if quick else (8, 64, 128, 32, 1000)
    offsets = iter(rng.sample(range(1, len(p.words)), n8 + n32))

    def user(n_tokens: int) -> list[dict]:
        return [{"role": "user", "content": p.text(n_tokens, next(offsets))}]

    w3n = bench.Workload("W3n", [user(long_) for _ in range(n8)], n8, short)
    w4 = bench.Workload("W4", [user(rng.randint(32, 512)) for _ in range(n32)], 32, new)
    return [w1, w2, w3n, w3, w4]


def metric(result: dict, wl: str, key: str, q: str = "p50") -> float | None:
    r = result.get(wl) or {}
    if key == "tok_s":
        return r.get("output_tokens_per_s")
    return ((r.get(key) or {}).get(q)) if r else None


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="tiny workloads (smoke run)")
    ap.add_argument("--no-peer", action="store_true", help="astrai alone")
    ap.add_argument("--peers", type=Path, default=PEERS, help="the peers folder (setup.sh, start.sh)")
    ap.add_argument(
        "--astrai",
        action="append",
        default=[],
        metavar="NAME=FLAGS",
        help="an astrai configuration: a name and its serve flags (repeatable)",
    )
    ap.add_argument("--only", nargs="+", help="run only these workloads")
    ap.add_argument("--cache-dir", type=Path, default=Path.home() / ".cache" / "astrai-bench")
    args = ap.parse_args()
    args.dtype = "bfloat16"
    gguf, folder, prompts = bench.prepare(args)
    loads = [w for w in workloads(prompts, args.quick) if not args.only or w.name in args.only]
    bindir = Path(sys.executable).parent
    configs = dict(c.split("=", 1) for c in args.astrai) or {
        "astrai": "",
        "astrai_exact": "--activations dtype",
    }

    def astrai_system(name: str, flags: str):
        return lambda port: bench.System(
            name,
            [
                str(bindir / "astrai"),
                "serve",
                "--log-level",
                "warning",
                "--host",
                "127.0.0.1",
                "--port",
                str(port),
                *shlex.split(flags),
            ],
            PEER_MODEL,
            {"ignore_eos": True},
            port,
        )

    def peer(name: str, kind: str):
        return lambda port: bench.System(
            name,
            ["bash", str(args.peers / "start.sh"), kind, str(port)],
            PEER_MODEL,
            {"ignore_eos": True},
            port,
        )

    systems = {name: astrai_system(name, flags) for name, flags in configs.items()}
    peers = [] if args.no_peer else ["vllm", "llama_server"]
    if not args.no_peer:
        systems["vllm"] = peer("vllm", "vllm")
        systems["llama_server"] = peer("llama_server", "llamacpp")
    log_dir = Path(tempfile.mkdtemp(prefix="peer-bench-"))
    results: dict = {}
    for name, make in systems.items():  # in turn: a server that waits still takes CPU
        try:
            results[name] = bench.serve_and_run(make(bench.free_port()), loads, prompts, log_dir)
        except RuntimeError as exc:
            results[name] = {"error": str(exc)}

    ok = {name: r for name, r in results.items() if "error" not in r}
    headline = {
        name: {
            wl.name: {
                "tok_s": round(metric(r, wl.name, "tok_s") or 0, 1),
                "ttft_p50_ms": round((metric(r, wl.name, "ttft_s") or 0) * 1e3, 1),
                "itl_p50_ms": round((metric(r, wl.name, "itl_s") or 0) * 1e3, 1),
                "itl_p99_ms": round((metric(r, wl.name, "itl_s", "p99") or 0) * 1e3, 1),
            }
            for wl in loads
        }
        for name, r in ok.items()
    }
    ratios: dict = {}
    for name in configs:
        if name not in ok:
            continue
        for wl in loads:
            rates = {p: metric(ok[p], wl.name, "tok_s") for p in peers if p in ok}
            if rates:
                best = max(rates, key=lambda p: rates[p] or 0)
                ratios[f"{name}_{wl.name}_over_best_peer"] = {
                    "peer": best,
                    "ratio": round((metric(ok[name], wl.name, "tok_s") or 0) / (rates[best] or 1), 2),
                }
        w4 = headline[name].get("W4")
        if w4:
            ratios[f"{name}_W4_itl_p99_over_p50"] = round(w4["itl_p99_ms"] / max(w4["itl_p50_ms"], 1e-9), 2)
            if "vllm" in headline and "W4" in headline["vllm"]:
                ratios[f"{name}_W4_ttft_p50_over_vllm"] = round(
                    w4["ttft_p50_ms"] / max(headline["vllm"]["W4"]["ttft_p50_ms"], 1e-9), 2
                )
    summary = {
        "config": {
            "quick": args.quick,
            "gguf": gguf.name,
            "cores": os.cpu_count(),
            "astrai": configs,
            "server_logs": str(log_dir),
            "prompt_tokens": {
                w.name: sum(prompts.count(m[-1]["content"]) for m in w.requests) for w in loads
            },
        },
        "headline": headline,
        "ratios": ratios,
        "errors": {name: r["error"] for name, r in results.items() if "error" in r},
        "systems": results,
    }
    sys.stdout.write(json.dumps(summary, indent=2) + "\n")
    return 0 if all("error" not in r for r in results.values()) else 1


if __name__ == "__main__":
    raise SystemExit(main())
