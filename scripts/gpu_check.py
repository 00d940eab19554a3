"""Everything of the CUDA backend that needs a GPU, in one run (< 8 minutes on an H200).

Sections, each timed and fenced (a failure is reported and the next section runs):

- ``build``: load (JIT-compile on first use) the kernels;
- ``kernels``: random ragged batches against the reference, outputs poisoned (NaN) first,
  sizes off the tiles, errors against the bounds of the package README;
- ``engine``: every available backend but torch_native (``cuda``, ``flash`` when flash_attn
  imports) against torch_native on the default model in bf16: same greedy text for a set of
  prompts, and last-token logits of a ragged prefill within 2% of the logit range;
- ``decode_bench``: decode attention time and K/V bandwidth at batch 1, 8, 64 x context
  512 .. 8192 (Llama-3-8B layer shape: 32 q / 8 kv heads of 128), against the measured
  device copy bandwidth; plus the default model's shape (9 q / 3 kv heads of 64);
- ``prefill_bench``: ragged prefill TFLOP/s, fresh and after a prefix hit;
- ``throughput``: engine output tokens/s against HF transformers ``generate``, same model,
  dtype and batch (64 prompts x 128 new tokens).

Prints a markdown summary on stdout and writes the full JSON (``--json``) and markdown
(``--markdown``); sections that would overrun ``--budget`` seconds are cut or skipped.
Usage: ``python scripts/gpu_check.py [--json F] [--markdown F] [--quick] [--budget S]``.

Over 300 lines because a lent GPU is rare and short: every check runs from this one prepared
file, in one call of the device tool.
"""

from __future__ import annotations

import argparse
import json
import random
import sys
import time
import traceback
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT / "scripts"), str(ROOT / "tests" / "backend_cuda")]

import gpu_bench  # noqa: E402
from cuda_steps import check_decode, check_prefill, check_rotary, make_step, output_bound  # noqa: E402

PROMPTS = [
    "The capital of France is",
    "Write a haiku about the sea.",
    "def fibonacci(n):",
    "Explain in one sentence why the sky is blue.",
    "List three prime numbers:",
    "Translate to German: good morning",
    "Once upon a time, in a small village,",
    "Q: What is 12 times 12?\nA:",
]
LLAMA8B, SMOLLM2 = (32, 8, 128), (9, 3, 64)  # (q heads, kv heads, head dim)


class Report:
    """Results by section; ``run`` fences a section and records its time, status and output."""

    def __init__(self, budget_s: float) -> None:
        self.start, self.budget_s = time.monotonic(), budget_s
        self.sections: dict[str, dict] = {}

    def left(self) -> float:
        """Seconds left of the budget."""
        return self.budget_s - (time.monotonic() - self.start)

    def run(self, name, fn, *args):
        t0 = time.monotonic()
        print(f"== {name}", file=sys.stderr, flush=True)
        try:
            self.sections[name] = {"status": "ok", **fn(*args)}
        except Exception as err:
            self.sections[name] = {
                "status": "failed",
                "error": f"{type(err).__name__}: {err}",
                "traceback": traceback.format_exc(limit=6),
            }
        self.sections[name]["seconds"] = round(time.monotonic() - t0, 1)
        return self.sections[name]


def build() -> dict:
    from astrai_backend_cuda import load_kernels

    props = torch.cuda.get_device_properties(0)
    return {
        "how": load_kernels(),
        "device": props.name,
        "sms": props.multi_processor_count,
        "capability": f"{props.major}.{props.minor}",
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
    }


def kernels(report: Report, cases: int, impl=None, device: str = "cuda", sms: int | None = None) -> dict:
    """The ops (or ``impl``) against the reference on ``cases`` random ragged batches per op."""
    from astrai.extension import ops
    from astrai_backend_cuda.plan import decode_num_splits

    impl = impl or ops
    sms = sms or torch.cuda.get_device_properties(0).multi_processor_count
    rng = random.Random(0)
    worst = {"decode": 0.0, "prefill": 0.0, "rotary": 0.0}
    done = 0
    for i in range(cases):
        if report.left() < 0.6 * report.budget_s:  # the sweep gets at most 40% of the budget
            break
        done += 1
        dtype = rng.choice([torch.bfloat16, torch.float16])
        n_kv, group, head_dim = (
            rng.choice([1, 2, 3, 8]),
            rng.choice([1, 3, 4, 7, 8, 16]),
            rng.choice([64, 128]),
        )
        batch = rng.choice([1, 3, 17, 33])
        prefix = [rng.randint(0, rng.choice([100, 1000, 3000])) for _ in range(batch)]
        kv, q, k, v = make_step(
            [1] * batch, prefix, n_kv * group, n_kv, head_dim, dtype, seed=i, device=device
        )
        for splits in {1, 32, decode_num_splits(batch, n_kv, kv.max_len, sms, 3, 32)}:
            err = check_decode(impl, kv, q, k, v, splits)["out"]
            worst["decode"] = max(worst["decode"], err / output_bound(dtype))
        q_lens = [rng.randint(1, 700) for _ in range(rng.randint(1, 6))]
        prefix = [rng.choice([0, rng.randint(1, 2000)]) for _ in q_lens]
        kv, q, k, v = make_step(q_lens, prefix, n_kv * group, n_kv, head_dim, dtype, seed=i, device=device)
        worst["prefill"] = max(
            worst["prefill"], check_prefill(impl, kv, q, k, v)["out"] / output_bound(dtype)
        )
        x = torch.randn(1, 37, n_kv * group, head_dim, device=device).to(torch.bfloat16)
        angles = torch.rand(1, 37, head_dim // 2, device=device) * 100
        worst["rotary"] = max(
            worst["rotary"],
            check_rotary(impl, x, torch.stack([angles.cos(), angles.sin()], -1), in_place=bool(i % 2))["out"]
            / 2**-8,
        )
    return {"cases": done, "worst_error_over_bound": worst}


def _engine_backends() -> list[str]:
    from astrai.extension import available_backends

    return [name for name, ok, _ in available_backends() if ok and name != "torch_native"]


def engine(model, tokenizer, new_tokens: int, device: str = "cuda") -> dict:
    """Each available backend against torch_native: greedy texts and ragged-prefill logits."""
    from astrai.engine import EngineConfig, InferenceEngine
    from astrai.extension import attn_backend
    from astrai.kvcache import KVConfig, PagePool

    def texts(backend):
        with InferenceEngine(model, tokenizer, EngineConfig(attention_backend=backend)) as eng:
            return eng.generate(PROMPTS, max_tokens=new_tokens, temperature=0.0)

    def prefill_logits(backend):
        c = model.config
        pool = PagePool(
            c.num_hidden_layers,
            c.num_attention_heads,
            c.num_key_value_heads,
            c.head_dim,
            KVConfig(max_batch_size=8, max_seq_len=256, page_size=16, n_tokens=4096),
            dtype=torch.bfloat16,
            device=device,
        )
        ids = [tokenizer.encode(p, add_special_tokens=True) for p in PROMPTS]
        rows = [pool.task_alloc() for _ in ids]
        for r, p in zip(rows, ids, strict=True):
            pool.extend(r, len(p))
        kv = pool.bind_tasks(rows, [len(p) for p in ids], [len(p) for p in ids])
        flat = torch.tensor([t for p in ids for t in p], device=device)
        pos = torch.cat([torch.arange(len(p)) for p in ids]).to(device)
        last = torch.tensor([len(p) for p in ids]).cumsum(0).to(device) - 1
        with attn_backend(backend):
            return model(flat, pos, kv, last)

    expected, ref_logits = texts("torch_native"), prefill_logits("torch_native")
    result = {}
    for name in _engine_backends():
        got = texts(name)
        diff = float((prefill_logits(name) - ref_logits).abs().max() / ref_logits.abs().max())
        result[name] = {
            "same_text": sum(a == b for a, b in zip(got, expected, strict=True)),
            "prompts": len(PROMPTS),
            "prefill_logit_rel_diff": diff,
            "logits_within_2pct": diff <= 0.02,
            "differing": [
                {"prompt": p, "torch_native": a, name: b}
                for p, a, b in zip(PROMPTS, expected, got, strict=True)
                if a != b
            ],
        }
    return result


def decode_bench(report: Report, quick: bool) -> dict:
    from astrai.extension.backend.policy import get_registry

    registry = get_registry()
    names = [*_engine_backends(), "torch_native"]
    copy_bw = gpu_bench.copy_bandwidth()
    rows = []
    shapes = {"llama3-8b": LLAMA8B, "smollm2": SMOLLM2}
    for shape, (hq, hkv, d) in shapes.items():
        for batch in (1, 8, 64):
            for ctx in (512, 4096) if quick else (512, 1024, 2048, 4096, 8192):
                for name in names:
                    if report.left() < 90 or (shape == "smollm2" and ctx not in (512, 4096)):
                        continue
                    r = gpu_bench.decode_bench(registry.instance(name), batch, ctx, hq, hkv, d)
                    rows.append(
                        {
                            "backend": name,
                            "shape": shape,
                            "batch": batch,
                            "ctx": ctx,
                            **r,
                            "of_copy_bw": r["bandwidth_GBps"] * 1e9 / copy_bw,
                        }
                    )
    target = next(
        (
            r
            for r in rows
            if r["backend"] == "cuda" and r["shape"] == "llama3-8b" and r["batch"] == 64 and r["ctx"] == 4096
        ),
        None,
    )
    return {
        "copy_bandwidth_GBps": copy_bw / 1e9,
        "rows": rows,
        "target_b64_ctx4096_of_copy_bw": target and target["of_copy_bw"],
        "target_met": bool(target and target["of_copy_bw"] >= 0.70),
    }


def prefill_bench() -> dict:
    from astrai.extension.backend.policy import get_registry

    registry = get_registry()
    rows = []
    for name in [*_engine_backends(), "torch_native"]:
        for label, q_lens, prefix in (
            ("fresh 4x2048", [2048] * 4, [0] * 4),
            ("prefix-hit 4x1024 after 3072", [1024] * 4, [3072] * 4),
        ):
            r = gpu_bench.prefill_bench(registry.instance(name), q_lens, prefix, *LLAMA8B)
            rows.append({"backend": name, "case": label, **r})
    return {"rows": rows}


def throughput(model, tokenizer, hf, n_req: int, new_tokens: int, device="cuda", backend="cuda") -> dict:
    """Output tokens/s of the engine (``backend``) and of HF ``generate``, same prompts and batch."""
    from astrai.engine import EngineConfig, InferenceEngine
    from astrai.sampling import SamplingParams

    rng = random.Random(0)
    base = tokenizer.encode(" ".join(PROMPTS) * 20)
    prompts = [base[(s := rng.randint(0, 64)) : s + rng.randint(32, 256)] for _ in range(n_req)]
    params = SamplingParams(max_tokens=new_tokens, temperature=0.0, ignore_eos=True)
    with InferenceEngine(
        model, tokenizer, EngineConfig(attention_backend=backend, max_batch_size=n_req)
    ) as eng:
        eng.generate(PROMPTS[:2], max_tokens=4)  # warm-up
        t0 = time.perf_counter()
        results = [eng.submit(p, params) for p in prompts]
        for r in results:
            r.wait_completion()
        astrai_tps = sum(r.completion_tokens for r in results) / (time.perf_counter() - t0)
    pad = model.config.eos_token_ids[0]
    width = max(map(len, prompts))
    ids = torch.full((n_req, width), pad, device=device)
    mask = torch.zeros_like(ids)
    for i, p in enumerate(prompts):  # left padding
        ids[i, width - len(p) :], mask[i, width - len(p) :] = torch.tensor(p), 1
    with torch.inference_mode():
        hf.generate(input_ids=ids[:2], attention_mask=mask[:2], max_new_tokens=4, pad_token_id=pad)  # warm-up
        t0 = time.perf_counter()
        out = hf.generate(
            input_ids=ids,
            attention_mask=mask,
            max_new_tokens=new_tokens,
            min_new_tokens=new_tokens,
            do_sample=False,
            pad_token_id=pad,
        )
        out.tolist()  # generate synchronises on every step anyway; this makes the end explicit
        hf_tps = (out.shape[1] - width) * n_req / (time.perf_counter() - t0)
    return {
        "requests": n_req,
        "new_tokens": new_tokens,
        f"astrai_{backend}_tokens_per_s": astrai_tps,
        "hf_generate_tokens_per_s": hf_tps,
        "ratio": astrai_tps / hf_tps,
        "target_met": astrai_tps >= 3 * hf_tps,
    }


def load_models(device: str = "cuda"):
    """The default model in bf16 (astrai's and HF transformers' import of the same GGUF) on ``device``."""
    import transformers

    from astrai.model import load_model
    from astrai.model.resolve import resolve_model

    model, tokenizer = load_model(None, dtype=torch.bfloat16, device=device)
    _, path = resolve_model(None)
    # A plain bf16 model for HF: newer transformers keep GGUF weights packed unless told not to.
    extra = (
        {"quantization_config": transformers.GgufConfig(dequantize=True)}
        if hasattr(transformers, "GgufConfig")
        else {}
    )
    hf = transformers.AutoModelForCausalLM.from_pretrained(
        str(path.parent), gguf_file=path.name, dtype=torch.bfloat16, local_files_only=True, **extra
    )
    return model, tokenizer, hf.to(device).eval()


def markdown(report: Report) -> str:
    lines = ["# gpu_check", "", "| section | status | seconds | summary |", "|---|---|---|---|"]
    for name, s in report.sections.items():
        brief = {k: v for k, v in s.items() if k not in ("status", "seconds", "rows", "traceback")}
        lines.append(
            f"| {name} | {s['status']} | {s['seconds']} | `{json.dumps(brief, default=str)[:400]}` |"
        )
    for name in ("decode_bench", "prefill_bench"):
        rows = report.sections.get(name, {}).get("rows", [])
        if rows:
            keys = list(rows[0])
            lines += ["", f"## {name}", "", "| " + " | ".join(keys) + " |", "|" + "---|" * len(keys)]
            lines += [
                "| "
                + " | ".join(f"{r[k]:.3g}" if isinstance(r[k], float) else str(r[k]) for k in keys)
                + " |"
                for r in rows
            ]
    return "\n".join(lines) + "\n"


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--json", type=Path)
    ap.add_argument("--markdown", type=Path)
    ap.add_argument("--quick", action="store_true", help="fewer cases and sizes (a smoke run)")
    ap.add_argument("--budget", type=float, default=450, help="seconds; later sections are cut to fit")
    args = ap.parse_args()
    report = Report(args.budget)
    if not torch.cuda.is_available():
        report.sections["build"] = {"status": "skipped", "seconds": 0, "error": "no CUDA device"}
    elif report.run("build", build)["status"] == "ok":
        report.run("kernels", kernels, report, 4 if args.quick else 24)
        models = report.run("load_models", lambda: {"models": load_models()})
        loaded = models.pop("models", None)
        model, tokenizer, hf = loaded or (None, None, None)
        if loaded and report.left() > 150:
            report.run("engine", engine, model, tokenizer, 16 if args.quick else 48)
        report.run("decode_bench", decode_bench, report, args.quick)
        if report.left() > 60:
            report.run("prefill_bench", prefill_bench)
        if loaded and report.left() > 45:
            report.run("throughput", throughput, model, tokenizer, hf, 64, 32 if args.quick else 128)
    report.sections["total"] = {"status": "ok", "seconds": round(time.monotonic() - report.start, 1)}
    text = markdown(report)
    print(text)
    if args.json:
        args.json.write_text(json.dumps(report.sections, indent=2, default=str))
    if args.markdown:
        args.markdown.write_text(text)
    return 0 if all(s["status"] == "ok" for s in report.sections.values()) else 1


if __name__ == "__main__":
    sys.exit(main())
