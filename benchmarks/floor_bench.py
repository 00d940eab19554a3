"""Prefill and batched decode against the CPU's compute floors, bf16 (or float32) and int8 activations.

Prints one JSON object. The CPU's multiply-add peaks are measured first (``astrai_cpu::dot_peak``:
register-only loops of float32 FMA, ``vdpbf16ps`` and ``vpdpbusd`` on every thread at once). The
model's multiply-adds per token are counted from its linears (the layers' projections, and the LM
head, which a prefill runs for the prompt's last row only; not attention, whose work grows with the
context). Then, for each ``--activations`` (the model's own
dtype, "auto", and "int8" where the kernel takes them), the model is loaded afresh from its GGUF
blocks in the CPU's default dtype and runs in this process:

- prefill: one-token requests of ``--prompt`` new tokens (no prefix hit), the median wall time
  of ``--repeats`` after a first; tokens/s against the floor (peak / 2 x the layers' multiply-adds
  a token) of bf16 and of int8 arithmetic;
- decode: the median whole decode step (``ModelRunner.run``: forward and sampling) with 1, 8 and
  32 rows, each row at about ``--context`` tokens; the 32-row step against its floors.

Figures are medians in milliseconds; compare ratios (the machines are shared).

Usage: python benchmarks/floor_bench.py [--model default|gemma3-270m] [--prompt 512] [--context 200]
       [--repeats 4] [--activations auto int8]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time

import torch
from kv_pressure_bench import prompts  # chat prompts of a given length, no two alike

import astrai.runner
from astrai.engine import EngineConfig, InferenceEngine
from astrai.model import default_dtype, load_model
from astrai.sampling import SamplingParams


def peaks() -> dict[str, float]:
    """G multiply-add operations a second (two a multiply-add), all threads: fma, bf16, int8."""
    ops = torch.ops.astrai_cpu
    out = {}
    for kind in ("fma", "bf16", "int8"):
        ops.dot_peak(kind, 1_000_000)  # threads up, clocks up
        best = max(ops.dot_peak(kind, 20_000_000) for _ in range(3))
        if best > 0:
            out[kind] = round(best, 1)
    return out


def macs_per_token(model: torch.nn.Module) -> tuple[int, int]:
    """Multiply-adds of a token through the layers' linears, and through the LM head (which a
    prefill runs for one row of each prompt only)."""
    head = getattr(model, "lm_head", None)
    layers = sum(
        m.in_features * m.out_features
        for m in model.modules()
        if m is not head and hasattr(m, "in_features") and hasattr(m, "out_features")
    )
    return layers, model.config.hidden_size * model.config.vocab_size


def measure(name: str | None, activations: str, prompt: int, context: int, repeats: int) -> dict:
    model, tok = load_model(name, dtype=default_dtype("cpu"), weights="gguf")
    layers, head = macs_per_token(model)
    rows = [1, 8, 32]
    times: list[tuple[int, float]] = []
    original = astrai.runner.ModelRunner.run

    def timed(self, plan):
        start = time.perf_counter()
        result = original(self, plan)
        if plan.is_decode:
            times.append((len(plan.q_lens), (time.perf_counter() - start) * 1e3))
        return result

    config = EngineConfig(activations=activations, n_tokens=max(rows) * (context + 96) + prompt + 64)
    astrai.runner.ModelRunner.run = timed
    out: dict = {"layer_macs_per_token": layers, "head_macs_per_token": head}
    try:
        with InferenceEngine(model, tok, config) as engine:
            first = SamplingParams(max_tokens=1, temperature=0.0)
            walls = []
            for i, ids in enumerate(prompts(tok, repeats + 1, prompt, prompt, seed=7)):
                start = time.perf_counter()
                engine.submit(ids, first).wait_completion()
                if i:
                    walls.append((time.perf_counter() - start) * 1e3)
            out["prefill_ms"] = round(statistics.median(walls), 1)
            out["prefill_tokens_s"] = round(prompt / statistics.median(walls) * 1e3, 1)
            steps = {}
            for n in rows:
                times.clear()
                params = SamplingParams(max_tokens=48, temperature=0.0, ignore_eos=True)
                for r in [engine.submit(p, params) for p in prompts(tok, n, context, context + 5, seed=n)]:
                    r.wait_completion()
                steady = [t for k, t in times if k == n][5:]  # past the first steps' warm-up
                steps[n] = round(statistics.median(steady), 2)
            out["decode_step_ms"] = steps
    finally:
        astrai.runner.ModelRunner.run = original
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="default", help="default, or a name/path load_model takes")
    ap.add_argument("--prompt", type=int, default=512, help="prompt tokens of each prefill request")
    ap.add_argument("--context", type=int, default=200, help="prompt tokens of each decoding row")
    ap.add_argument("--repeats", type=int, default=4)
    ap.add_argument("--activations", nargs="+", default=["auto", "int8"])
    args = ap.parse_args()
    from astrai.extension import load_backends

    load_backends()
    peak = peaks()
    report: dict = {
        "config": {
            "model": args.model,
            "prompt": args.prompt,
            "context": args.context,
            "threads": torch.get_num_threads(),
            "dtype": str(default_dtype("cpu")).removeprefix("torch."),
        },
        "peak_gops": peak,
        "runs": {},
    }
    for activations in args.activations:
        run = measure(
            None if args.model == "default" else args.model,
            activations,
            args.prompt,
            args.context,
            args.repeats,
        )
        layers, head = run["layer_macs_per_token"], run["head_macs_per_token"]
        for kind in ("bf16", "int8"):
            if kind in peak:
                floor_tps = peak[kind] * 1e9 / (2 * layers)  # (the head: one row of the prompt)
                run[f"prefill_floor_tokens_s_{kind}"] = round(floor_tps, 1)
                run[f"prefill_fraction_of_{kind}_floor"] = round(run["prefill_tokens_s"] / floor_tps, 3)
                floor_ms = 32 * 2 * (layers + head) / (peak[kind] * 1e9) * 1e3
                run[f"decode32_floor_ms_{kind}"] = round(floor_ms, 2)
                run[f"decode32_fraction_of_{kind}_floor"] = round(floor_ms / run["decode_step_ms"][32], 3)
        report["runs"][activations] = run
    json.dump(report, sys.stdout, indent=2)
    print()


if __name__ == "__main__":
    main()
