"""How often a greedy request's text changes when it runs inside a batch, per dtype.

For each prompt: greedy text alone, then the same prompt inside a batch of 8 mixed-length
requests. Prints a JSON summary (prompts compared, how many differ, first differing token).
In float32 the texts must all agree (a test asserts it); in bfloat16 the batch changes the
reduction order of some kernels, so a near-tie between two tokens can flip.

Usage: python benchmarks/batch_invariance.py [--dtype bfloat16] [--n 16] [--max-tokens 48]
"""

from __future__ import annotations

import argparse
import json

import torch

from astrai.engine import InferenceEngine
from astrai.sampling import SamplingParams

TOPICS = [
    "the ocean",
    "a lighthouse",
    "machine learning",
    "the Roman empire",
    "coffee",
    "a rainy day",
    "volcanoes",
    "the moon landing",
    "jazz music",
    "honey bees",
    "chess openings",
    "the printing press",
    "deserts",
    "a city at night",
    "glaciers",
    "paper airplanes",
    "bread baking",
    "the internet",
    "tigers",
    "clocks",
]
FILLERS = [
    "Hi.",
    "Tell me a long story about a dragon who learns to paint.",
    "Count to ten.",
    "List five fruits and describe each one in detail.",
    "What is 2+2?",
    "Explain photosynthesis to a child, step by step, with examples.",
    "Say hello.",
]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    ap.add_argument("--n", type=int, default=16)
    ap.add_argument("--max-tokens", type=int, default=48)
    args = ap.parse_args()
    engine = InferenceEngine.from_model(None, dtype=getattr(torch, args.dtype))
    sampling = {"max_tokens": args.max_tokens, "temperature": 0.0}
    differ = []
    try:
        for topic in TOPICS[: args.n]:
            msg = [{"role": "user", "content": f"Write two sentences about {topic}."}]
            alone = engine.chat(msg, **sampling)
            batch = [msg] + [[{"role": "user", "content": f}] for f in FILLERS]
            results = [
                engine.submit(engine.tokenizer.apply_chat_template(m), SamplingParams(**sampling))
                for m in batch
            ]
            for r in results:
                r.wait_completion()
            together = results[0].text
            if together != alone:
                cut = next(
                    i for i, (a, b) in enumerate(zip(alone + "\0", together + "\0", strict=False)) if a != b
                )
                differ.append({"topic": topic, "first_diff_char": cut})
    finally:
        engine.shutdown()
    print(
        json.dumps(
            {
                "dtype": args.dtype,
                "prompts": args.n,
                "max_tokens": args.max_tokens,
                "differ": len(differ),
                "cases": differ,
            },
            indent=2,
        )
    )


if __name__ == "__main__":
    main()
