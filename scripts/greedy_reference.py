"""Record (or check) the engine's greedy token ids for the benchmark prompts, per dtype and backend.

The file it writes, ``tests/data/greedy_reference.json``, pins what the engine generates:
``tests/core/test_greedy_reference.py`` replays every case through the current code and
asserts the same ids, token for token. Re-record only for a change that is meant to alter
the numbers (and say so in its commit)::

    python scripts/greedy_reference.py --record     # writes the file (the commit is noted in it)
    python scripts/greedy_reference.py              # checks the current code against it

Prompts are ``benchmarks/engine_bench.py``'s offline workload (32 prompts of 32 to 512 tokens,
seed 0) and its single-request prompt, all queued together as the benchmark submits them; every
request generates ``NEW_TOKENS`` tokens (``ignore_eos``).
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import random
import subprocess
import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
REFERENCE = ROOT / "tests" / "data" / "greedy_reference.json"
NEW_TOKENS = 24
DTYPES = ("float32", "bfloat16")
BACKENDS = ("auto", "torch_native")  # auto: what automatic selection picks (cpu where installed)

TEXT = (
    "The history of computing is a story of abstraction layered upon abstraction. Early machines "
    "were programmed by rewiring panels; later, stored programs let the same hardware run many "
    "tasks. Assemblers gave names to instructions, compilers translated structured languages, and "
    "operating systems hid the details of devices behind files and processes. "
)


def benchmark_prompts(tokenizer) -> list[list[int]]:
    """engine_bench's offline prompts (32, 32-512 tokens, seed 0) and its single-request prompt."""
    pool: list[int] = []
    while len(pool) < 512 + 64:
        pool += tokenizer.encode(TEXT)

    def draw(count: int, lo: int, hi: int) -> list[list[int]]:
        rng = random.Random(0)
        out = []
        for _ in range(count):
            n = rng.randint(lo, hi)
            start = rng.randint(0, 63)
            out.append(pool[start : start + n])
        return out

    return draw(32, 32, 512) + draw(1, 32, 32)


@functools.cache
def _model(dtype: str):
    """The default model in ``dtype`` and its tokenizer, loaded once per process (each dtype's two
    backend cases share it: the backend is the scheduler's, the model holds no state of a run)."""
    from astrai.model import load_model

    return load_model(None, dtype=getattr(torch, dtype))


def generate(dtype: str, backend: str, prompts: list[list[int]]) -> list[list[int]]:
    """Greedy ids of every prompt, all queued before the first step (the engine's default pool and
    prefill budget), the scheduler stepped on this thread: every step's batch is the same on every
    run, so even a kernel whose rounding depends on the batch gives reproducible ids."""
    from astrai.engine import EngineConfig, GenerateResult
    from astrai.kvcache import PagePool
    from astrai.kvcache.sizing import kv_config
    from astrai.model import IncrementalDecoder
    from astrai.request import Request
    from astrai.sampling import SamplingParams
    from astrai.scheduler import InferenceScheduler
    from astrai.stopping import StopChecker

    model, tokenizer = _model(dtype)
    _load_backends()
    config, mc = EngineConfig(attention_backend=None if backend == "auto" else backend), model.config
    dtype = model.lm_head.weight.dtype
    kv = kv_config(config, mc, dtype)
    pool = PagePool(
        mc.num_hidden_layers, mc.num_attention_heads, mc.num_key_value_heads, mc.head_dim, kv, dtype
    )
    sched = InferenceScheduler(model, pool, config, tokenizer.eos_token_ids)
    params = SamplingParams(max_tokens=NEW_TOKENS, temperature=0.0, ignore_eos=True)
    results = []
    for i, ids in enumerate(prompts):
        results.append(GenerateResult(f"r{i}", len(ids)))
        sched.submit(
            Request(f"r{i}", list(ids), params, results[-1], StopChecker(IncrementalDecoder(tokenizer), []))
        )
    with torch.inference_mode():
        while not all(r.done for r in results):
            sched.step()
    for r in results:
        r.raise_for_error()
    return [list(r.output_ids) for r in results]


def _load_backends() -> None:
    """Load every attention backend as the engine does at start (the CPU plugin's fused kernels)."""
    from astrai.extension import load_backends

    load_backends()


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--record", action="store_true", help=f"write {REFERENCE.relative_to(ROOT)}")
    args = ap.parse_args()
    from astrai.model import load_model

    _, tokenizer = load_model(None, dtype=torch.float32)
    prompts = benchmark_prompts(tokenizer)
    cases = {f"{d}/{b}": generate(d, b, prompts) for d in DTYPES for b in BACKENDS}
    if args.record:
        commit = subprocess.run(
            ["git", "rev-parse", "HEAD"], cwd=ROOT, capture_output=True, text=True
        ).stdout.strip()
        REFERENCE.parent.mkdir(parents=True, exist_ok=True)
        body = {"commit": commit, "new_tokens": NEW_TOKENS, "prompts": prompts, "outputs": cases}
        REFERENCE.write_text(json.dumps(body, separators=(",", ":")) + "\n")
        print(f"recorded {len(cases)} cases of {len(prompts)} prompts at {commit}")  # noqa: T201
        return 0
    ref = json.loads(REFERENCE.read_text())
    bad = [
        (k, i)
        for k, outs in cases.items()
        for i, (a, b) in enumerate(zip(outs, ref["outputs"][k], strict=True))
        if a != b
    ]
    print(  # noqa: T201
        json.dumps({"reference_commit": ref["commit"], "cases": len(cases), "differing": bad})
    )
    return 1 if bad else 0


if __name__ == "__main__":
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    sys.exit(main())
