"""Quantized-kernel step benchmark: decode steps by rows, and the prefill linears by path.

Prints one JSON object. The default model in this process, in the CPU's default dtype (bf16 with
AVX512-BF16, float32 on AVX2 only: ``astrai.model.default_dtype``), on its GGUF blocks
(``--weights gguf``) and dense (``--weights dense``):

- decode: the median time of a whole decode step (``ModelRunner.run``: the forward and
  sampling) with 1, 3 and 32 rows, each row's context about ``--context`` tokens;
  the dense / gguf ratio per row count.
- prefill_request_ms (an AMX CPU with ``astrai_cpu::quant_linear_amx``): one-token requests
  (a whole prefill) of 100 to 2,000 prompt tokens on the model's own routing
  (``QuantLinearKernel.wide``: quant_linear_amx up to ``amx_rows`` rows; the limit is lifted to
  the prompt here) against every prefill step sent the old way (each weight dequantized whole into
  oneDNN's GEMM), taking turns, each prompt new; the ratio.

Figures are medians in milliseconds; compare ratios, not runs (the machines are shared).

Usage: python benchmarks/quant_step_bench.py [--context 550] [--quick]
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
from astrai.extension.fused import kernel_for
from astrai.model import default_dtype, load_model
from astrai.sampling import SamplingParams


def decode_steps(weights: str, rows: list[int], context: int, tokens: int) -> dict[int, float]:
    """Median whole decode-step time (ms) for each row count, each row at about ``context`` tokens."""
    model, tok = load_model(None, dtype=default_dtype("cpu"), weights=weights)
    times: list[tuple[int, float]] = []
    original = astrai.runner.ModelRunner.run

    def timed(self, plan):
        start = time.perf_counter()
        result = original(self, plan)
        if plan.is_decode:  # decode rows only
            times.append((len(plan.q_lens), (time.perf_counter() - start) * 1e3))
        return result

    astrai.runner.ModelRunner.run = timed
    result = {}
    try:
        with InferenceEngine(
            model, tok, EngineConfig(n_tokens=max(rows) * (context + tokens + 32))
        ) as engine:
            for n in rows:
                times.clear()
                params = SamplingParams(max_tokens=tokens, temperature=0.0, ignore_eos=True)
                for r in [engine.submit(p, params) for p in prompts(tok, n, context, context + 5, seed=n)]:
                    r.wait_completion()
                steady = [t for k, t in times if k == n][5:]  # past the first steps' warm-up
                result[n] = round(statistics.median(steady), 2)
    finally:
        astrai.runner.ModelRunner.run = original
    return result


def prefill_requests(lengths: list[int], repeats: int) -> dict | None:
    """One-token requests (a whole prefill) of each prompt length, every prompt new (no prefix
    hit), taking turns between the model's routing and every prefill step sent the old way;
    median wall time (ms) of each. None where the CPU has no AMX tiles for quant_linear_amx."""
    if default_dtype("cpu") != torch.bfloat16:
        return None  # quant_linear_amx takes bf16 rows
    model, tok = load_model(None, dtype=torch.bfloat16, weights="gguf")
    with InferenceEngine(model, tok, EngineConfig(n_tokens=max(lengths) + 64)) as engine:
        with torch.inference_mode():  # kernels are for inference only
            kernel = kernel_for("quant_linear", torch.zeros(1, 1, dtype=torch.bfloat16))
        if kernel is None or not getattr(kernel, "amx_kernel", False):
            return None  # no AMX tiles here: prefill runs quant_linear_wide, which this does not compare
        limit, out = kernel.amx_rows, {}
        params = SamplingParams(max_tokens=1, temperature=0.0)
        for n in lengths:
            times: dict[str, list[float]] = {"amx": [], "whole": []}
            batch = prompts(tok, 2 * repeats + 2, n, n + 2, seed=n)
            for i, prompt in enumerate(batch):
                way = "amx" if i % 2 == 0 else "whole"
                kernel.amx_rows = max(limit, n + 8) if way == "amx" else 0  # 0: the whole weight into oneDNN
                start = time.perf_counter()
                engine.submit(prompt, params).wait_completion()
                if i >= 2:  # past a first request of each way
                    times[way].append((time.perf_counter() - start) * 1e3)
            kernel.amx_rows = limit
            amx, whole = statistics.median(times["amx"]), statistics.median(times["whole"])
            out[n] = {
                "amx_ms": round(amx, 1),
                "whole_weight_onednn_ms": round(whole, 1),
                "ratio": round(whole / amx, 2),
            }
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--context", type=int, default=550, help="prompt tokens of each decoding row")
    ap.add_argument("--quick", action="store_true", help="fewer rows and tokens (a smoke run)")
    args = ap.parse_args()
    rows = [1, 3] if args.quick else [1, 3, 32]
    tokens = 20 if args.quick else 60
    decode = {w: decode_steps(w, rows, args.context, tokens) for w in ("gguf", "dense")}
    report = {
        "config": {"context": args.context, "threads": torch.get_num_threads(), "decode_tokens": tokens},
        "decode_step_ms": decode,
        "decode_dense_over_gguf": {n: round(decode["dense"][n] / decode["gguf"][n], 2) for n in rows},
        "prefill_request_ms": prefill_requests(
            [100, 400] if args.quick else [100, 200, 400, 700, 1000, 2000], 2 if args.quick else 4
        ),
    }
    json.dump(report, sys.stdout, indent=2)
    print()


if __name__ == "__main__":
    main()
