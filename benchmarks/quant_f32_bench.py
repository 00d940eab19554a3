"""Float32 on kept-quantized GGUF weights against the dense float32 model (the AVX2 CPU path).

Prints one JSON object. For each model (``--models``: ``gemma3-270m`` and the default model, whose
name is ``default``), in this process, one after the other, ``InferenceEngine.from_model(name,
dtype=torch.float32, weights=...)`` with ``weights`` "dense" (dequantized at load) and "gguf" (the
file's blocks kept, ``astrai serve --weights gguf``):

- decode_step_ms: the median time of a whole decode step (``ModelRunner.run``: the forward and
  sampling) at 1, 8 and 32 rows, each row's context about ``--context``
  tokens, past the first steps' warm-up;
- prefill_ms: the median wall time of a one-token request of ``--prefill`` prompt tokens (a whole
  prefill, each prompt new), and of one of 9 tokens (``short_request_ms``);
- greedy_equal: whether the greedy tokens of a few prompts are the same on both weights (with the
  first position that differs where not: float32 sums in another order can flip a near-tie).

Figures are medians in milliseconds; the ratios are dense / gguf. Compare ratios, not runs: the
machines are shared. Measured on 2 vCPUs of an AVX2 EPYC shared with other work (load average
8-12), ``--threads 1`` (two OpenMP threads there wait out the scheduler at every parallel region:
the 2-thread figures were noise), two runs, decode steps dense / gguf: gemma3-270m 1 row 276 / 76
and 173 / 41 ms, 8 rows 804 / 247 and 454 / 144, 32 rows 1,104 / 954 and 1,119 / 366; the default
model 139 / 61 and 57 / 26, 343 / 149 and 121 / 63, 670 / 507 and 276 / 244. A 9-token request:
gemma3-270m 397 / 245 and 377 / 111 ms, the default model 413 / 163 and 108 / 66. 512-token
prefills varied from run to run (gemma3-270m 3.9 / 4.9 and 2.7 / 2.4 s); dense and gguf engines
taking turns in one process (4 requests each), both models 4.9 / 4.9 s. Greedy tokens equal.

Usage: python benchmarks/quant_f32_bench.py [--models gemma3-270m default] [--context 64] [--threads N] [--quick]
"""

from __future__ import annotations

import argparse
import gc
import json
import random
import statistics
import sys
import time

import torch
from kv_pressure_bench import WORDS

import astrai.runner
from astrai.engine import EngineConfig, InferenceEngine
from astrai.sampling import SamplingParams

GREEDY = ["The water cycle is", "def fibonacci(n):", "The first three primes are", "The sky is blue because"]


def prompts(tokenizer, n: int, length: int, seed: int) -> list[list[int]]:
    """``n`` plain prompts of ``length`` tokens, no two alike (gemma3-270m's file has no chat template)."""
    rng = random.Random(seed)
    out = []
    for i in range(n):
        text = f"Request {seed}-{i}: " + " ".join(rng.choice(WORDS) for _ in range(length))
        out.append(tokenizer.encode(text)[:length])
    return out


def measure(name: str | None, weights: str, args: argparse.Namespace) -> dict:
    rows = [1, 8] if args.quick else [1, 8, 32]
    config = EngineConfig(n_tokens=max(max(rows) * (args.context + args.tokens + 32), args.prefill + 64))
    times: list[tuple[int, float]] = []
    original = astrai.runner.ModelRunner.run

    def timed(self, plan):
        start = time.perf_counter()
        result = original(self, plan)
        if sum(plan.q_lens) == len(plan.q_lens):  # decode rows only
            times.append((len(plan.q_lens), (time.perf_counter() - start) * 1e3))
        return result

    out: dict = {"decode_step_ms": {}, "prefill_ms": {}}
    engine = InferenceEngine.from_model(name, dtype=torch.float32, config=config, weights=weights)
    astrai.runner.ModelRunner.run = timed
    try:
        tok = engine.tokenizer
        greedy = SamplingParams(max_tokens=args.tokens, temperature=0.0, ignore_eos=True)
        results = [engine.submit(tok.encode(p), greedy) for p in GREEDY]
        out["greedy"] = [r.wait_completion() and r.output_ids for r in results]
        for n in rows:
            times.clear()
            for r in [engine.submit(p, greedy) for p in prompts(tok, n, args.context, seed=n)]:
                r.wait_completion()
            steady = [t for k, t in times if k == n][3:]
            out["decode_step_ms"][n] = round(statistics.median(steady), 1)
        one = SamplingParams(max_tokens=1, temperature=0.0)
        for length in (9, args.prefill):
            walls = []
            for prompt in prompts(tok, args.repeats + 1, length, seed=length):
                start = time.perf_counter()
                engine.submit(prompt, one).wait_completion()
                walls.append((time.perf_counter() - start) * 1e3)
            out["prefill_ms"][length] = round(statistics.median(walls[1:]), 1)
    finally:
        astrai.runner.ModelRunner.run = original
        engine.shutdown()
        del engine
        gc.collect()
    return out


def first_difference(a: list[list[int]], b: list[list[int]]) -> list[int | None]:
    return [
        next((i for i, (x, y) in enumerate(zip(p, q, strict=True)) if x != y), None)
        for p, q in zip(a, b, strict=True)
    ]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--models", nargs="+", default=["gemma3-270m", "default"])
    ap.add_argument("--context", type=int, default=64, help="prompt tokens of each decoding row")
    ap.add_argument("--tokens", type=int, default=16, help="greedy tokens of each decoding row")
    ap.add_argument("--prefill", type=int, default=512, help="prompt tokens of the prefill request")
    ap.add_argument("--repeats", type=int, default=3, help="prefill requests timed per length")
    ap.add_argument("--threads", type=int, default=None, help="torch's threads (default: torch's choice)")
    ap.add_argument("--quick", action="store_true", help="1 and 8 rows only")
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    report: dict = {"config": {**vars(args), "threads": torch.get_num_threads()}}
    for model in args.models:
        name = None if model == "default" else model
        runs = {w: measure(name, w, args) for w in ("dense", "gguf")}
        dense, gguf = runs["dense"], runs["gguf"]
        report[model] = {
            "decode_step_ms": {w: r["decode_step_ms"] for w, r in runs.items()},
            "decode_dense_over_gguf": {
                n: round(dense["decode_step_ms"][n] / gguf["decode_step_ms"][n], 2)
                for n in gguf["decode_step_ms"]
            },
            "prefill_ms": {w: r["prefill_ms"] for w, r in runs.items()},
            "greedy_equal": dense["greedy"] == gguf["greedy"],
            "greedy_first_difference": first_difference(dense["greedy"], gguf["greedy"]),
        }
        print(json.dumps({model: report[model]}), file=sys.stderr)
    json.dump(report, sys.stdout, indent=2)
    print()


if __name__ == "__main__":
    main()
