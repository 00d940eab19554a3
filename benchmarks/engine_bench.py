"""Engine benchmark: astrai vs HF transformers ``generate`` on the default model, same dtype.

Prints one JSON object. Three workloads; astrai and transformers each run in a fresh process
of this script, one after the other:

- offline: N requests (prompts of mixed length), M new tokens each, all submitted at once;
  output tokens/s; transformers runs one left-padded batched ``generate``.
- single: one request, decode tokens/s (time after the first token); 3 fresh processes per
  system, alternating, medians compared.
- prefix: K requests sharing a long system prompt; mean time to first token with the
  prefix cache vs with it disabled (astrai only: the ratio is the cache's effect); and the
  same K requests arriving together on a prompt the cache has not seen (cold burst: the
  first computes the shared pages, the others wait for them).

Usage: python benchmarks/engine_bench.py [--dtype bfloat16] [--quick]
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import subprocess
import sys
import threading
import time

import torch

from astrai.engine import EngineConfig, InferenceEngine
from astrai.model import load_model
from astrai.model.resolve import resolve_model
from astrai.sampling import SamplingParams

TEXT = (
    "The history of computing is a story of abstraction layered upon abstraction. Early machines "
    "were programmed by rewiring panels; later, stored programs let the same hardware run many "
    "tasks. Assemblers gave names to instructions, compilers translated structured languages, and "
    "operating systems hid the details of devices behind files and processes. "
)


def _token_pool(tokenizer, n: int) -> list[int]:
    ids: list[int] = []
    while len(ids) < n:
        ids += tokenizer.encode(TEXT)
    return ids[:n]


def _prompts(tokenizer, count: int, lo: int, hi: int, seed: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    pool = _token_pool(tokenizer, hi + 64)
    out = []
    for _ in range(count):
        n = rng.randint(lo, hi)
        start = rng.randint(0, 63)
        out.append(pool[start : start + n])
    return out


#: The single-request decode rate is measured in this many fresh processes per system, astrai and
#: transformers alternating, and the medians are compared: on a shared machine the rate of one short
#: run drifts by 10% and more over minutes, and alternating spreads that drift over both systems.
SINGLE_RUNS = 3


def _run_astrai(engine: InferenceEngine, prompts: list[list[int]], new_tokens: int) -> dict:
    params = SamplingParams(max_tokens=new_tokens, temperature=0.0, ignore_eos=True)
    first: dict[int, float] = {}
    lock = threading.Lock()
    t0 = time.perf_counter()

    def on_piece_for(i):
        def cb(_piece):
            with lock:
                first.setdefault(i, time.perf_counter() - t0)

        return cb

    results = [engine.submit(p, params, on_piece=on_piece_for(i)) for i, p in enumerate(prompts)]
    for r in results:
        r.wait_completion()
    wall = time.perf_counter() - t0
    out_tokens = sum(r.completion_tokens for r in results)
    return {
        "wall_s": wall,
        "output_tokens": out_tokens,
        "tokens_per_s": out_tokens / wall,
        "mean_ttft_s": sum(first.values()) / max(len(first), 1),
    }


def _run_hf(hf, prompts: list[list[int]], new_tokens: int, pad_id: int) -> dict:
    width = max(len(p) for p in prompts)
    ids = torch.full((len(prompts), width), pad_id, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for i, p in enumerate(prompts):  # left padding
        ids[i, width - len(p) :] = torch.tensor(p)
        mask[i, width - len(p) :] = 1
    t0 = time.perf_counter()
    with torch.inference_mode():
        out = hf.generate(
            input_ids=ids,
            attention_mask=mask,
            max_new_tokens=new_tokens,
            min_new_tokens=new_tokens,
            do_sample=False,
            pad_token_id=pad_id,
        )
    wall = time.perf_counter() - t0
    produced = (out.shape[1] - width) * len(prompts)
    return {"wall_s": wall, "output_tokens": produced, "tokens_per_s": produced / wall}


def _decode_rate_astrai(engine, prompt: list[int], new_tokens: int) -> float:
    params = SamplingParams(max_tokens=new_tokens, temperature=0.0, ignore_eos=True)
    stamps: list[float] = []
    r = engine.submit(prompt, params, on_piece=lambda _p: stamps.append(time.perf_counter()))
    r.wait_completion()
    # pieces can be held back (UTF-8, stop strings); tokens counted from the result
    return (r.completion_tokens - 1) / (stamps[-1] - stamps[0])


def _decode_rate_hf(hf, prompt: list[int], new_tokens: int, pad_id: int) -> float:
    ids = torch.tensor([prompt])
    with torch.inference_mode():
        t0 = time.perf_counter()
        hf.generate(input_ids=ids, max_new_tokens=1, do_sample=False, pad_token_id=pad_id)
        t1 = time.perf_counter()
        hf.generate(
            input_ids=ids,
            max_new_tokens=new_tokens,
            min_new_tokens=new_tokens,
            do_sample=False,
            pad_token_id=pad_id,
        )
        t2 = time.perf_counter()
    # time for new_tokens minus the time of the prefill + first token
    return (new_tokens - 1) / ((t2 - t1) - (t1 - t0))


def _prefix_ttft(
    model, tokenizer, prefix_caching: bool, n_req: int, prefix_len: int, warm: bool = True
) -> float:
    """Mean TTFT of ``n_req`` requests sharing a ``prefix_len``-token system prompt, submitted at once;
    ``warm``: one request with that prompt has finished before them (else they arrive cold, together)."""
    cfg = EngineConfig(prefix_caching=prefix_caching)
    engine = InferenceEngine(model, tokenizer, cfg)
    try:
        system = _token_pool(tokenizer, prefix_len)
        users = _prompts(tokenizer, n_req, 8, 24, seed=1)
        if warm:
            engine.submit(system + users[0], SamplingParams(max_tokens=1, temperature=0.0)).wait_completion()
        res = _run_astrai(engine, [system + u for u in users], 4)
        return res["mean_ttft_s"]
    finally:
        engine.shutdown()


def _astrai_side(args, dtype, n_req: int, new_tok: int, only: set[str]) -> dict:
    model, tokenizer = load_model(None, dtype=dtype)
    out: dict = {"model": model.config.name}
    engine = InferenceEngine(model, tokenizer, EngineConfig())
    try:
        _run_astrai(engine, _prompts(tokenizer, 2, 16, 32), 4)  # warm-up
        if "offline" in only:
            out["offline"] = _run_astrai(engine, _prompts(tokenizer, n_req, 32, 512), new_tok)
        if "single" in only:
            prompt = _prompts(tokenizer, 1, 32, 32)[0]
            out["single"] = _decode_rate_astrai(engine, prompt, new_tok)
    finally:
        engine.shutdown()
    if "prefix" in only:
        n_pref = 4 if args.quick else 16
        on = _prefix_ttft(model, tokenizer, True, n_pref, 1000)
        off = _prefix_ttft(model, tokenizer, False, n_pref, 1000)
        cold = _prefix_ttft(model, tokenizer, True, n_pref, 1000, warm=False)
        out["prefix"] = {
            "requests": n_pref,
            "prefix_tokens": 1000,
            "ttft_cached_s": on,
            "ttft_uncached_s": off,
            "ratio": off / on,
            "ttft_cold_burst_s": cold,
            "cold_burst_ratio": off / cold,
        }
    return out


def _hf_side(dtype, n_req: int, new_tok: int, only: set[str]) -> dict:
    import transformers

    from astrai.model.tokenizer import Tokenizer

    _, path = resolve_model(None)
    tokenizer = Tokenizer.from_gguf(path)
    hf = transformers.AutoModelForCausalLM.from_pretrained(
        str(path.parent), gguf_file=path.name, dtype=dtype, local_files_only=True
    ).eval()
    pad = tokenizer.eos_token_ids[0]
    out: dict = {}
    _run_hf(hf, _prompts(tokenizer, 2, 16, 32), 4, pad)  # warm-up
    if "offline" in only:
        out["offline"] = _run_hf(hf, _prompts(tokenizer, n_req, 32, 512), new_tok, pad)
    if "single" in only:
        prompt = _prompts(tokenizer, 1, 32, 32)[0]
        out["single"] = _decode_rate_hf(hf, prompt, new_tok, pad)
    return out


def _run_side(side: str, args: argparse.Namespace, only: set[str]) -> dict:
    """Re-run this script for one system and the workloads ``only`` in a fresh process; its JSON result."""
    cmd = [sys.executable, __file__, "--dtype", args.dtype, "--only", ",".join(sorted(only)), "--side", side]
    cmd += ["--quick"] if args.quick else []
    done = subprocess.run(cmd, check=True, capture_output=True, text=True)
    return json.loads(done.stdout)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    ap.add_argument("--quick", action="store_true", help="smaller workloads (smoke run)")
    ap.add_argument("--only", default="offline,single,prefix", help="comma-separated workloads to run")
    ap.add_argument("--side", choices=["astrai", "transformers"], help=argparse.SUPPRESS)
    args = ap.parse_args()
    dtype = getattr(torch, args.dtype)
    torch.manual_seed(0)
    n_req, new_tok = (8, 32) if args.quick else (32, 128)
    only = set(args.only.split(","))
    if args.side == "astrai":
        print(json.dumps(_astrai_side(args, dtype, n_req, new_tok, only)))
        return
    if args.side == "transformers":
        print(json.dumps(_hf_side(dtype, n_req, new_tok, only)))
        return

    # Each system in its own process, one after the other: no shared OpenMP teams or
    # allocator state (see astrai.cpu_tuning), and neither runs while the other does.
    batch = only - {"single"}
    a = _run_side("astrai", args, batch) if batch else {}
    h = _run_side("transformers", args, batch) if batch else {}
    if "single" in only:
        pairs = [
            (_run_side("astrai", args, {"single"}), _run_side("transformers", args, {"single"}))
            for _ in range(SINGLE_RUNS)
        ]
        a = {**pairs[0][0], **a, "single": [x["single"] for x, _ in pairs]}
        h = {**h, "single": [y["single"] for _, y in pairs]}
    summary: dict = {
        "cores": os.cpu_count(),
        "torch_threads": torch.get_num_threads(),
        "dtype": args.dtype,
        "model": a["model"],
    }
    if "offline" in only:
        summary["offline"] = {
            "requests": n_req,
            "new_tokens": new_tok,
            "astrai": a["offline"],
            "transformers": h["offline"],
            "ratio": a["offline"]["tokens_per_s"] / h["offline"]["tokens_per_s"],
        }
    if "single" in only:
        mine, theirs = statistics.median(a["single"]), statistics.median(h["single"])
        summary["single"] = {
            "astrai_tokens_per_s": mine,
            "transformers_tokens_per_s": theirs,
            "ratio": mine / theirs,
            "runs": {"astrai": a["single"], "transformers": h["single"]},
        }
    if "prefix" in only:
        summary["prefix"] = a["prefix"]
    print(json.dumps(summary, indent=2))


if __name__ == "__main__":
    main()
