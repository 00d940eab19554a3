"""Perplexity of a held text with the model's activations and with int8 ones (``--activations int8``).

The text: chapters 1-4 of *Pride and Prejudice* (``benchmarks/data/``), cut to ``--tokens`` tokens
(default 4,000). Each model is loaded from its GGUF file with the blocks kept quantized, in
``--dtype`` (default: the CPU's, bf16 where it has AVX512-BF16), twice: as it is and switched to
8-bit activations
(``astrai.model.activations.use_int8_activations``). Each scores the text through its own KV path
in chunks of ``--chunk`` tokens (default 256), each chunk attending to those before it, and every
token's log-probability given the ones before it is kept (the chunk's logits never whole: Gemma 3's
vocabulary is 262,144 wide).

Prints one JSON object: per model the two perplexities, their ratio (the bar for making int8 the
default: within 1%), the mean and largest change of a token's log-probability, and how often the
top token differs. Models: the default (SmolLM2-135M Q4_1) and ``gemma3-270m`` where installed.

Usage: python benchmarks/activations_ppl.py [--tokens 4000] [--chunk 256] [--dtype auto|bfloat16|float32]
       [--models default gemma3-270m]
"""

from __future__ import annotations

import argparse
import json
import math
from pathlib import Path

import torch

TEXT = Path(__file__).parent / "data" / "pride_and_prejudice_1-4.txt"


@torch.inference_mode()
def scores(model, ids: list[int], chunk: int, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """Each token's log-probability given the ones before it and the top token there (``[n - 1]``)."""
    from astrai.kvcache import KVConfig, PagePool, assert_nothing_held

    cfg, n = model.config, len(ids)
    config = KVConfig(max_batch_size=1, max_seq_len=n, page_size=16, n_tokens=n + 16)
    pool = PagePool(
        cfg.num_hidden_layers,
        cfg.num_attention_heads,
        cfg.num_key_value_heads,
        cfg.head_dim,
        config,
        dtype,
        torch.device("cpu"),
        cfg.windows,
    )
    row, logp, top, start = pool.task_alloc(), [], [], 0
    target = torch.tensor(ids[1:] + [0])
    while start < n:
        end = min(n, start + chunk)
        assert pool.extend(row, end)
        kv = pool.bind_tasks([row], [end - start], [end])
        out = model(torch.tensor(ids[start:end]), torch.arange(start, end), kv, torch.arange(end - start))
        lp = torch.log_softmax(out.float(), -1)
        logp.append(lp.gather(1, target[start:end, None])[:, 0])
        top.append(lp.argmax(-1))
        start = end
    pool.task_free(row)
    assert_nothing_held(pool)
    return torch.cat(logp)[:-1], torch.cat(top)[:-1]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tokens", type=int, default=4000)
    parser.add_argument("--chunk", type=int, default=256)
    parser.add_argument("--models", nargs="+", default=["default", "gemma3-270m"])
    parser.add_argument("--dtype", default="auto", choices=["auto", "bfloat16", "float32"])
    args = parser.parse_args()
    from astrai.extension import load_backends
    from astrai.model import default_dtype, load_model
    from astrai.model.activations import use_int8_activations

    load_backends()
    dtype = default_dtype("cpu") if args.dtype == "auto" else getattr(torch, args.dtype)
    base_name = str(dtype).removeprefix("torch.")
    report: dict = {"text": TEXT.name, "dtype": base_name, "models": {}}
    for name in args.models:
        runs = {}
        for activations in ("auto", "int8"):
            try:
                model, tokenizer = load_model(
                    None if name == "default" else name, dtype=dtype, weights="gguf"
                )
            except Exception as exc:  # e.g. gemma3-270m not installed
                report["models"][name] = {"skipped": f"{type(exc).__name__}: {exc}"}
                break
            if activations == "int8":
                use_int8_activations(model)
            ids = tokenizer.encode(TEXT.read_text(), add_special_tokens=True)[: args.tokens]
            runs[activations] = scores(model, ids, args.chunk, dtype)
            del model
        if len(runs) < 2:
            continue
        (base, base_top), (q, q_top) = runs["auto"], runs["int8"]
        ppl, ppl8 = math.exp(-float(base.mean())), math.exp(-float(q.mean()))
        report["models"][name] = {
            "tokens": int(base.numel()) + 1,
            f"perplexity_{base_name}": round(ppl, 4),
            "perplexity_int8": round(ppl8, 4),
            "ratio": round(ppl8 / ppl, 5),
            "mean_abs_logprob_change": round(float((q - base).abs().mean()), 5),
            "max_abs_logprob_change": round(float((q - base).abs().max()), 4),
            "top_token_differs": round(float((q_top != base_top).float().mean()), 4),
        }
    print(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()
