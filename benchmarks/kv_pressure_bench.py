"""KV-pressure benchmark (issue 16, finding 7): many long requests on a KV pool that holds a few of them.

Prints one JSON object. The default model runs in this process; the same requests (chat prompts of
``--prompt-min`` to ``--prompt-max`` tokens, ``--max-tokens`` greedy tokens each, EOS ignored, all
submitted at once) go to an engine on a roomy pool (room for all of them at full length) and to one
on a tight pool of ``--kv-tokens`` slots. For each: wall time, preemptions in total and the most of
any one request (counted from the batching policy's "preempting request" log lines, so any policy
version is measured alike), median and p90 time to first token, whether the pool is left holding
nothing. Then whether every request produced the same tokens on both pools, and on the tight pool
alone, one at a time (the requests preempted most, up to ``--alone``), and the tight / roomy
wall-time ratio.

float32 by default, so that greedy texts can be compared (in bfloat16 a row's rounding depends on
the batch it shares). ``--policy PATH`` runs both engines with the ``BatchPolicy`` of another
``batching.py`` (a copy of an earlier version, to measure before and after a change; it must match
this tree's scheduler).

Usage: python benchmarks/kv_pressure_bench.py [--kv-tokens 2000] [--requests 32] [--dtype bfloat16]
       [--weights gguf] [--quick]
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import logging
import random
import statistics
import sys
import threading
import time
from collections import Counter

import torch

import astrai.scheduler
from astrai.cpu_tuning import run_off_thread
from astrai.engine import EngineConfig, InferenceEngine
from astrai.kvcache import assert_nothing_held, check_pool_invariants
from astrai.model import load_model
from astrai.sampling import SamplingParams

WORDS = (
    "river stone quiet market lantern orbit velvet harbor signal meadow copper thunder garden pixel "
    "winter canyon ember silver compass falcon marble prairie harvest beacon glacier ribbon timber "
    "voyage crystal saddle anchor violet summit meadowlark ferry cinder willow plaza tundra mosaic"
).split()


class PreemptionLog(logging.Handler):
    """Counts the policy's ``preempting request %s at %d tokens`` records, by request id."""

    def __init__(self) -> None:
        super().__init__(logging.INFO)
        self.counts: Counter[str] = Counter()

    def emit(self, record: logging.LogRecord) -> None:
        if record.msg.startswith("preempting request"):
            self.counts[record.args[0]] += 1


def prompts(tokenizer, n: int, lo: int, hi: int, seed: int = 0) -> list[list[int]]:
    """``n`` chat prompts of about ``lo`` to ``hi`` tokens (template included), no two sharing a user turn."""
    rng = random.Random(seed)
    overhead = len(
        tokenizer.apply_chat_template([{"role": "user", "content": ""}], add_generation_prompt=True)
    )
    out = []
    for i in range(n):
        target = rng.randint(lo, hi) - overhead
        text = f"Request {i}: " + " ".join(rng.choice(WORDS) for _ in range(target))
        ids = tokenizer.encode(text)[:target]
        messages = [{"role": "user", "content": tokenizer.decode(ids)}]
        out.append(tokenizer.apply_chat_template(messages, add_generation_prompt=True))
    return out


def run(engine: InferenceEngine, batch: list[list[int]], max_tokens: int, log: PreemptionLog) -> dict:
    """Submit ``batch`` at once; timings, preemptions and each request's output ids."""
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    log.counts.clear()
    first: dict[int, float] = {}
    lock = threading.Lock()
    t0 = time.perf_counter()

    def on_piece_for(i: int):
        def cb(_piece: str) -> None:
            with lock:
                first.setdefault(i, time.perf_counter() - t0)

        return cb

    steps = engine.scheduler.iterations
    results = [engine.submit(p, params, on_piece=on_piece_for(i)) for i, p in enumerate(batch)]
    for r in results:
        r.wait_completion()
        r.raise_for_error()
    wall = time.perf_counter() - t0
    deadline = time.monotonic() + 10
    while engine.get_stats()["active_tasks"] and time.monotonic() < deadline:
        time.sleep(0.01)  # stats are published after the step that released the last request
    stats = engine.get_stats()
    # on a short-lived thread: a parallel torch op on this long-lived one would leave it an OpenMP
    # team, and the next engine's scheduler thread would then run throttled (astrai.cpu_tuning)
    run_off_thread(lambda: (check_pool_invariants(engine.pool), assert_nothing_held(engine.pool)))
    per_request = [log.counts[r.request_id] for r in results]
    ttft = sorted(first.values())
    return {
        "wall_s": round(wall, 2),
        "steps": engine.scheduler.iterations - steps,  # scheduler iterations: a load-independent measure
        "complete": all(r.completion_tokens == max_tokens for r in results),
        "preemptions": sum(per_request),
        "preemptions_stats": stats["preemptions"],
        "max_preemptions_per_request": max(per_request),
        "requests_preempted": sum(1 for c in per_request if c),
        "median_ttft_s": round(statistics.median(ttft), 2),
        "p90_ttft_s": round(ttft[int(0.9 * (len(ttft) - 1))], 2),
        "kv_tokens_total": stats["kv_tokens_total"],
        "leak_free": True,  # the pool checks above raise otherwise
        "_outputs": [r.output_ids for r in results],
        "_per_request": per_request,
    }


def use_policy(path: str) -> None:
    """Make the scheduler build the ``BatchPolicy`` of the ``batching.py`` at ``path``."""
    spec = importlib.util.spec_from_file_location("astrai_batching_under_test", path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    astrai.scheduler.BatchPolicy = module.BatchPolicy


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--kv-tokens", type=int, default=2000, help="tight pool size in token slots")
    ap.add_argument("--requests", type=int, default=32)
    ap.add_argument("--prompt-min", type=int, default=300)
    ap.add_argument("--prompt-max", type=int, default=550)
    ap.add_argument("--max-tokens", type=int, default=200)
    ap.add_argument(
        "--alone", type=int, default=4, help="requests rerun alone on the tight pool (most preempted first)"
    )
    ap.add_argument(
        "--dtype",
        default="float32",
        choices=["bfloat16", "float32"],
        help="float32 by default: in bfloat16 a row's greedy text depends on its batch",
    )
    ap.add_argument(
        "--weights",
        default="dense",
        choices=["dense", "gguf", "auto"],
        help="load_model's: GGUF weights kept quantized or not (auto: astrai serve's default)",
    )
    ap.add_argument("--policy", default=None, help="path of another batching.py whose BatchPolicy to measure")
    ap.add_argument(
        "--quick", action="store_true", help="smoke run: 8 requests of 60-110 tokens, 16 new, 400 slots"
    )
    args = ap.parse_args()
    if args.quick:
        args.requests, args.prompt_min, args.prompt_max, args.max_tokens, args.kv_tokens = 8, 60, 110, 16, 400
    if args.policy:
        use_policy(args.policy)
    log = PreemptionLog()
    policy_logger = logging.getLogger(astrai.scheduler.BatchPolicy.__module__)
    policy_logger.setLevel(logging.INFO)
    policy_logger.addHandler(log)
    policy_logger.propagate = False  # the counts only; one INFO line per preemption is noise here

    model, tokenizer = load_model(None, dtype=getattr(torch, args.dtype), weights=args.weights)
    batch = prompts(tokenizer, args.requests, args.prompt_min, args.prompt_max)
    out: dict = {
        "config": {
            "model": model.config.name,
            "dtype": str(next(model.parameters()).dtype).removeprefix("torch."),
            "requests": len(batch),
            "prompt_tokens": [min(map(len, batch)), max(map(len, batch))],
            "max_tokens": args.max_tokens,
            "weights": args.weights,
            "policy": args.policy or "this tree",
            "threads": torch.get_num_threads(),
        },
    }
    results = {}
    roomy = len(batch) * (
        max(map(len, batch)) + args.max_tokens + 16
    )  # every request at once, at full length
    for name, config in (
        ("roomy", EngineConfig(n_tokens=roomy)),
        ("tight", EngineConfig(n_tokens=args.kv_tokens)),
    ):
        print(f"{name} pool ...", file=sys.stderr)
        with InferenceEngine(model, tokenizer, config) as engine:
            run(
                engine, prompts(tokenizer, 2, 32, 48, seed=1), 4, log
            )  # warm-up: first-use costs of the shapes
            results[name] = run(engine, batch, args.max_tokens, log)
            if name == "tight":  # the most preempted requests, each alone on this pool
                order = sorted(range(len(batch)), key=lambda i: -results[name]["_per_request"][i])[
                    : args.alone
                ]
                alone = {i: run(engine, [batch[i]], args.max_tokens, log)["_outputs"][0] for i in order}
    tight, roomy = results["tight"], results["roomy"]
    same = [a == b for a, b in zip(tight["_outputs"], roomy["_outputs"], strict=True)]
    out["identical_tight_vs_roomy"] = all(same)
    out["identical_vs_alone"] = all(tight["_outputs"][i] == ids for i, ids in alone.items())
    out["alone_checked"] = sorted(alone)
    for name, res in results.items():
        out[name] = {k: v for k, v in res.items() if not k.startswith("_")}
    out["wall_ratio_tight_over_roomy"] = round(tight["wall_s"] / roomy["wall_s"], 2)
    print(json.dumps(out, indent=2))


if __name__ == "__main__":
    main()
