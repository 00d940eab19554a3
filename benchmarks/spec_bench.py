"""N-gram speculative decoding on and off, in one process: decode rate, identical text (issue 19).

Two engines on the default model (bf16 by default), one with ``speculative="ngram"``, run the
same workloads in alternating rounds (the order flips each round, so drift on a shared machine
hits both):

- ``repeat``: answers that repeat their prompt, each request alone (batch 1): rewrite a paragraph
  fixing its typos, and rename a function through a short module. Reported: decode tokens/s of
  each (tokens after the first over the time since the first), the ratio (target >= 1.6), and
  whether the greedy texts are identical;
- ``W2``: 8 concurrent chat requests of 32 to 512 prompt tokens (seed 0), EOS ignored, 128 new
  tokens each. Reported: output tokens/s of the batch, the ratio (target: at most 3% slower).

Prints one JSON object (progress on stderr). Never part of the test run.

Usage: python benchmarks/spec_bench.py [--dtype bfloat16] [--rounds 2] [--k 4] [--quick]
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import sys
import time

import torch

from astrai.engine import EngineConfig, InferenceEngine
from astrai.sampling import SamplingParams

TEXT = (
    "Speculative decoding lets a large langauge model produce several tokens in one step. A cheap "
    "drafter guesses the next few tokens, and the model checks all of the guesses at once; the guesses "
    "it agrees with are kept, and the first one it disagrees with is replaced by its own choice. When "
    "the answer copies much of the prompt, as when a text is edited or a piece of code is changed a "
    "little, the guesses can simply be taken from the prompt itself, which costs almost nothing. The "
    "output is exactly what the model would have writen without the guesses: only the speed changes."
)
CODE = '''def load_users(path):
    """Read the users file and return a list of dicts."""
    users = []
    with open(path) as handle:
        for line in handle:
            name, email, age = line.strip().split(",")
            users.append({"name": name, "email": email, "age": int(age)})
    return users


def adults(users):
    return [user for user in users if user["age"] >= 18]
'''
REPEAT = [
    f"Rewrite the following text, fixing the typos. Change nothing else.\n\n{TEXT}",
    f"Rename the function load_users to read_users in this code and print the whole code again.\n\n{CODE}",
]
PARAGRAPH = (
    TEXT + " " + "The history of the city is long and its streets are narrow; people walk along the river in "
    "the evening, talk about the weather, the markets, the news of the day and the plans for tomorrow. "
    "Old houses stand beside new ones, and the bridges connect the quarters that grew up on both banks."
) * 8


def log(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


def chat_ids(engine: InferenceEngine, text: str) -> list[int]:
    return engine.tokenizer.apply_chat_template(
        [{"role": "user", "content": text}], add_generation_prompt=True
    )


def w2_prompts(engine: InferenceEngine, n: int) -> list[list[int]]:
    """``n`` chat prompts of 32 to 512 tokens from word offsets of ``PARAGRAPH`` (seed 0)."""
    rng, words = random.Random(0), PARAGRAPH.split()
    out = []
    for _ in range(n):
        want, at = rng.randint(32, 512), rng.randrange(len(words))
        text = " ".join(words[(at + i) % len(words)] for i in range(want))
        ids = engine.tokenizer.encode(text, add_special_tokens=False)[:want]
        out.append(chat_ids(engine, engine.tokenizer.decode(ids)))
    return out


def run_repeat(engine: InferenceEngine, prompts: list[list[int]], max_tokens: int) -> tuple[float, list[str]]:
    """Each prompt alone; decode tokens/s over all of them, and the texts."""
    tokens, seconds, texts = 0, 0.0, []
    for ids in prompts:
        first: list[float] = []
        r = engine.submit(
            ids,
            SamplingParams(max_tokens=max_tokens, temperature=0.0),
            on_piece=lambda _, first=first: first or first.append(time.perf_counter()),
        )
        r.wait_completion()
        end = time.perf_counter()
        r.raise_for_error()
        tokens += len(r.output_ids) - 1
        seconds += end - first[0]
        texts.append(r.text)
    return tokens / seconds, texts


def run_w2(engine: InferenceEngine, prompts: list[list[int]], max_tokens: int) -> float:
    """All at once, EOS ignored; output tokens/s of the batch."""
    start = time.perf_counter()
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    results = [engine.submit(ids, params) for ids in prompts]
    for r in results:
        r.wait_completion()
        r.raise_for_error()
    return sum(len(r.output_ids) for r in results) / (time.perf_counter() - start)


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--k", type=int, default=4, help="num_speculative_tokens")
    ap.add_argument("--ngram-min", type=int, default=2)
    ap.add_argument("--ngram-max", type=int, default=4)
    ap.add_argument("--quick", action="store_true", help="fewer tokens: a smoke run")
    args = ap.parse_args()
    repeat_new, w2_new = (48, 16) if args.quick else (200, 128)
    base = {"max_batch_size": 8, "max_seq_len": 2048, "n_tokens": 16384}
    spec = {
        "speculative": "ngram",
        "num_speculative_tokens": args.k,
        "ngram_min": args.ngram_min,
        "ngram_max": args.ngram_max,
    }
    plain_engine = InferenceEngine.from_model(
        None, dtype=getattr(torch, args.dtype), config=EngineConfig(**base)
    )
    spec_engine = InferenceEngine(plain_engine.model, plain_engine.tokenizer, EngineConfig(**base, **spec))
    engines = {"off": plain_engine, "on": spec_engine}
    repeat = [chat_ids(plain_engine, p) for p in REPEAT]
    w2 = w2_prompts(plain_engine, 8)
    rates: dict[str, dict[str, list[float]]] = {k: {"repeat": [], "w2": []} for k in engines}
    texts: dict[str, list[str]] = {}
    w2_spec: dict[str, int] = {}
    try:
        run_repeat(plain_engine, repeat[:1], 8)  # warm both up (kernels, first-use packing)
        run_repeat(spec_engine, repeat[:1], 8)
        for n in range(args.rounds):
            order = ["off", "on"] if n % 2 == 0 else ["on", "off"]
            for name in order:
                rate, texts[name] = run_repeat(engines[name], repeat, repeat_new)
                rates[name]["repeat"].append(rate)
                log(f"round {n} {name}: repeat {rate:.1f} tok/s")
            for name in order:
                before = dict(spec_engine.get_stats())
                rates[name]["w2"].append(run_w2(engines[name], w2, w2_new))
                if name == "on":
                    after = spec_engine.get_stats()
                    w2_spec = {
                        k: after[k] - before[k]
                        for k in ("spec_drafts", "spec_draft_tokens", "spec_accepted_tokens")
                    }
                log(f"round {n} {name}: W2 {rates[name]['w2'][-1]:.1f} tok/s")
        stats = spec_engine.get_stats()
    finally:
        spec_engine.shutdown()
        plain_engine.shutdown()
    med = {k: {w: statistics.median(v) for w, v in r.items()} for k, r in rates.items()}
    out = {
        "config": {
            "dtype": args.dtype,
            "rounds": args.rounds,
            **spec,
            "threads": torch.get_num_threads(),
            "repeat_max_tokens": repeat_new,
            "w2_max_tokens": w2_new,
        },
        "repeat": {
            "decode_tok_s_off": round(med["off"]["repeat"], 2),
            "decode_tok_s_on": round(med["on"]["repeat"], 2),
            "ratio": round(med["on"]["repeat"] / med["off"]["repeat"], 3),
            "target": ">= 1.6",
            "identical_text": texts["on"] == texts["off"],
            "runs_off": [round(x, 2) for x in rates["off"]["repeat"]],
            "runs_on": [round(x, 2) for x in rates["on"]["repeat"]],
        },
        "w2": {
            "output_tok_s_off": round(med["off"]["w2"], 2),
            "output_tok_s_on": round(med["on"]["w2"], 2),
            "ratio": round(med["on"]["w2"] / med["off"]["w2"], 3),
            "target": ">= 0.97",
            "runs_off": [round(x, 2) for x in rates["off"]["w2"]],
            "runs_on": [round(x, 2) for x in rates["on"]["w2"]],
            "spec_last_round": w2_spec,
        },
        "spec_stats": {k: v for k, v in stats.items() if k.startswith("spec_")},
    }
    print(json.dumps(out, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
