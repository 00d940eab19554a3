"""Engine benchmark: astrai vs HF transformers ``generate`` on the default model, same dtype.

Prints one JSON object. Three workloads, each run for both systems in this process:

- offline: N requests (prompts of mixed length), M new tokens each, all submitted at once;
  output tokens/s; transformers runs one left-padded batched ``generate``.
- single: one request, decode tokens/s (time after the first token).
- prefix: K requests sharing a long system prompt; mean time to first token with the
  prefix cache vs with it disabled (astrai only: the ratio is the cache's effect).

Usage: python benchmarks/engine_bench.py [--dtype bfloat16] [--quick]
"""

from __future__ import annotations

import argparse
import json
import os
import random
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
        out.append(pool[start:start + n])
    return out


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
    return {"wall_s": wall, "output_tokens": out_tokens, "tokens_per_s": out_tokens / wall,
            "mean_ttft_s": sum(first.values()) / max(len(first), 1)}


def _run_hf(hf, prompts: list[list[int]], new_tokens: int, pad_id: int) -> dict:
    width = max(len(p) for p in prompts)
    ids = torch.full((len(prompts), width), pad_id, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for i, p in enumerate(prompts):  # left padding
        ids[i, width - len(p):] = torch.tensor(p)
        mask[i, width - len(p):] = 1
    t0 = time.perf_counter()
    with torch.inference_mode():
        out = hf.generate(input_ids=ids, attention_mask=mask, max_new_tokens=new_tokens,
                          min_new_tokens=new_tokens, do_sample=False, pad_token_id=pad_id)
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
        hf.generate(input_ids=ids, max_new_tokens=new_tokens, min_new_tokens=new_tokens,
                    do_sample=False, pad_token_id=pad_id)
        t2 = time.perf_counter()
    # time for new_tokens minus the time of the prefill + first token
    return (new_tokens - 1) / ((t2 - t1) - (t1 - t0))


def _prefix_ttft(model, tokenizer, prefix_caching: bool, n_req: int, prefix_len: int) -> float:
    cfg = EngineConfig(prefix_caching=prefix_caching)
    engine = InferenceEngine(model, tokenizer, cfg)
    try:
        system = _token_pool(tokenizer, prefix_len)
        users = _prompts(tokenizer, n_req, 8, 24, seed=1)
        warm = engine.submit(system + users[0], SamplingParams(max_tokens=1, temperature=0.0))
        warm.wait_completion()
        res = _run_astrai(engine, [system + u for u in users], 4)
        return res["mean_ttft_s"]
    finally:
        engine.shutdown()


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    ap.add_argument("--quick", action="store_true", help="smaller workloads (smoke run)")
    ap.add_argument("--only", default="offline,single,prefix", help="comma-separated workloads to run")
    args = ap.parse_args()
    dtype = getattr(torch, args.dtype)
    torch.manual_seed(0)
    n_req, new_tok = (8, 32) if args.quick else (32, 128)

    import transformers

    model, tokenizer = load_model(None, dtype=dtype)
    _, path = resolve_model(None)
    hf = transformers.AutoModelForCausalLM.from_pretrained(
        str(path.parent), gguf_file=path.name, dtype=dtype, local_files_only=True).eval()
    pad = model.config.eos_token_ids[0]

    summary: dict = {"cores": os.cpu_count(), "torch_threads": torch.get_num_threads(),
                     "dtype": args.dtype, "model": model.config.name}
    engine = InferenceEngine(model, tokenizer, EngineConfig())
    try:
        # warm-up both
        _run_astrai(engine, _prompts(tokenizer, 2, 16, 32), 4)
        _run_hf(hf, _prompts(tokenizer, 2, 16, 32), 4, pad)

        only = set(args.only.split(","))
        prompts = _prompts(tokenizer, n_req, 32, 512)
        a = h = None
        if "offline" in only:
            a = _run_astrai(engine, prompts, new_tok)
            h = _run_hf(hf, prompts, new_tok, pad)
            summary["offline"] = {"requests": n_req, "new_tokens": new_tok, "astrai": a, "transformers": h,
                                  "ratio": a["tokens_per_s"] / h["tokens_per_s"]}
        if "single" in only:
            single = _prompts(tokenizer, 1, 32, 32)[0]
            ra = _decode_rate_astrai(engine, single, new_tok)
            rh = _decode_rate_hf(hf, single, new_tok, pad)
            summary["single"] = {"astrai_tokens_per_s": ra, "transformers_tokens_per_s": rh, "ratio": ra / rh}
    finally:
        engine.shutdown()

    if "prefix" in args.only.split(","):
        n_pref = 4 if args.quick else 16
        on = _prefix_ttft(model, tokenizer, True, n_pref, 1000)
        off = _prefix_ttft(model, tokenizer, False, n_pref, 1000)
        summary["prefix"] = {"requests": n_pref, "prefix_tokens": 1000, "ttft_cached_s": on,
                             "ttft_uncached_s": off, "ratio": off / on}
    print(json.dumps(summary, indent=2))


if __name__ == "__main__":
    main()
