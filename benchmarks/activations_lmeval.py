"""lm-eval accuracy with the model's own activations and with int8 ones (``--activations int8``).

Serves the default model with ``astrai serve`` twice in turn, in its default dtype (bf16 with
AVX512-BF16): with ``--activations dtype`` (exact) and with ``--activations int8`` and runs lm-eval's ``local-completions`` model
on a multiple-choice task through ``POST /v1/completions`` (log-likelihoods of each choice, echoed
prompt log-probabilities): by default the 24 hand-written items of ``tests/data/lm_eval``
(capitals, numbers, colours, animals). Prints one JSON object: each run's accuracy, the items whose
chosen answer differs, and whether int8 is within one item of the base run (issue 37's bar).

Usage: python benchmarks/activations_lmeval.py [--task-dir tests/data/lm_eval] [--task astrai_easy_mc]
       [--astrai-arg=--dtype --astrai-arg=float32 ...]

Reuses serve_bench.py (servers, the dequantized folder's tokenizer), which must sit beside it.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import sys
import tempfile
from pathlib import Path

import serve_bench as bench  # beside this file: the script's directory is on sys.path

ROOT = Path(__file__).resolve().parents[1]


def evaluate(base_url: str, tokenizer: Path, task_dir: Path, task: str) -> tuple[float, list[int]]:
    """Accuracy and each item's chosen answer (the choice of highest log-likelihood)."""
    import lm_eval
    from lm_eval.tasks import TaskManager

    args = {
        "base_url": base_url + "/v1/completions",
        "model": "astrai",
        "tokenizer": str(tokenizer),
        "tokenizer_backend": "huggingface",
        "tokenized_requests": True,
        "add_bos_token": False,
        "num_concurrent": 2,
        "max_retries": 1,
    }
    here = Path.cwd()
    os.chdir(task_dir)  # the task's data_files path is relative to its folder
    try:
        out = lm_eval.simple_evaluate(
            model="local-completions",
            model_args=args,
            tasks=[task],
            batch_size=4,
            task_manager=TaskManager(include_path=str(task_dir), include_defaults=False),
            log_samples=True,
            bootstrap_iters=0,
        )
    finally:
        os.chdir(here)
    samples = sorted(out["samples"][task], key=lambda s: s["doc_id"])
    chosen = [
        max(range(len(s["filtered_resps"])), key=lambda i: float(s["filtered_resps"][i][0])) for s in samples
    ]
    return out["results"][task]["acc,none"], chosen


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--task-dir", type=Path, default=ROOT / "tests" / "data" / "lm_eval")
    ap.add_argument("--task", default="astrai_easy_mc")
    ap.add_argument("--astrai-arg", action="append", default=[], help="a flag for both servers (repeatable)")
    ap.add_argument("--cache-dir", type=Path, default=Path.home() / ".cache" / "astrai-bench")
    args = ap.parse_args()
    args.dtype = "bfloat16"  # the dequantized folder: only its tokenizer is used
    _gguf, folder, _prompts = bench.prepare(args)
    astrai = [
        str(Path(sys.executable).parent / "astrai"),
        "serve",
        "--log-level",
        "warning",
        *args.astrai_arg,
    ]
    log_dir = Path(tempfile.mkdtemp(prefix="activations-lmeval-"))
    runs: dict = {}
    for name, extra in (("base", ["--activations", "dtype"]), ("int8", ["--activations", "int8"])):
        port = bench.free_port()
        system = bench.System(
            name, [*astrai, "--host", "127.0.0.1", "--port", str(port), *extra], "astrai", {}, port
        )
        with contextlib.ExitStack() as stack:
            stack.enter_context(bench.serving(system, log_dir))
            acc, chosen = evaluate(system.base, folder, args.task_dir.resolve(), args.task)
        runs[name] = {"acc": acc, "chosen": chosen}
    base, int8 = runs["base"], runs["int8"]
    differ = [i for i, (a, b) in enumerate(zip(base["chosen"], int8["chosen"], strict=True)) if a != b]
    n = len(base["chosen"])
    correct = {name: round(r["acc"] * n) for name, r in runs.items()}
    report = {
        "task": args.task,
        "items": n,
        "astrai_args": args.astrai_arg,
        "correct": correct,
        "acc": {name: r["acc"] for name, r in runs.items()},
        "items_answered_differently": differ,
        "int8_within_one_item": abs(correct["int8"] - correct["base"]) <= 1,
        "server_logs": str(log_dir),
    }
    print(json.dumps(report, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
