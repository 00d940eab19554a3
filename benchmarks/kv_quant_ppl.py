"""Perplexity of a held text with the KV cache in the model's dtype and in int8 (``--kv-cache-dtype``).

The text: the docstrings of a dozen standard-library modules (prose, offline, the same for every
run of one Python version), tokenized once and cut to ``--tokens`` tokens (default 1,500). The
default model scores it in float32 through the engine's own KV path: the text goes in chunks of
``--chunk`` tokens (default 64), each attending to the positions before it as the pool holds them,
so every score after the first chunk reads quantized K/V. Runs once per cache type (K/V: auto/auto,
int8/auto, auto/int8, int8/int8) on the attention backend of automatic selection.

Prints one JSON object: per cache type the perplexity, its ratio to auto/auto's (the issue's
bound: within 1%), the mean and largest change in a token's log-probability, and the pool's
bytes per token. Usage: python benchmarks/kv_quant_ppl.py [--tokens 1500] [--chunk 64]
"""

from __future__ import annotations

import argparse
import importlib
import json
import math

import torch

MODULES = [
    "argparse",
    "asyncio",
    "csv",
    "decimal",
    "difflib",
    "ftplib",
    "heapq",
    "pickle",
    "shlex",
    "tarfile",
    "textwrap",
    "zipfile",
]
KINDS = [("auto", "auto"), ("int8", "auto"), ("auto", "int8"), ("int8", "int8")]


def held_text() -> str:
    return "\n\n".join((importlib.import_module(m).__doc__ or "").strip() for m in MODULES)


@torch.inference_mode()
def token_logprobs(model, ids: list[int], kinds: tuple[str, str], chunk: int) -> tuple[torch.Tensor, int]:
    """Each token's log-probability given the ones before it (``[len(ids) - 1]``), and the pool's
    bytes per token."""
    from astrai.kvcache import KVConfig, PagePool, assert_nothing_held

    cfg = model.config
    n = len(ids)
    config = KVConfig(max_batch_size=1, max_seq_len=n, page_size=16, n_tokens=n + 16, kinds=kinds)
    pool = PagePool(
        cfg.num_hidden_layers,
        cfg.num_attention_heads,
        cfg.num_key_value_heads,
        cfg.head_dim,
        config,
        torch.float32,
    )
    row, logits, start = pool.task_alloc(), [], 0
    while start < n:
        end = min(n, start + chunk)
        assert pool.extend(row, end)
        kv = pool.bind_tasks([row], [end - start], [end])
        out = model(torch.tensor(ids[start:end]), torch.arange(start, end), kv, torch.arange(end - start))
        logits.append(out.float())
        start = end
    per_token = pool.stats()["kv_bytes_per_token"]
    pool.task_free(row)
    assert_nothing_held(pool)
    logp = torch.log_softmax(torch.cat(logits)[:-1], -1)
    return logp.gather(1, torch.tensor(ids[1:])[:, None])[:, 0], per_token


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tokens", type=int, default=1500)
    parser.add_argument("--chunk", type=int, default=64)
    args = parser.parse_args()
    from astrai.extension import load_backends
    from astrai.model import load_model

    model, tokenizer = load_model(None, dtype=torch.float32)
    load_backends()
    ids = tokenizer.encode(held_text(), add_special_tokens=True)[: args.tokens]
    base, _ = token_logprobs(model, ids, KINDS[0], args.chunk)
    base_ppl = math.exp(-float(base.mean()))
    runs = {}
    for kinds in KINDS:
        logp, per_token = token_logprobs(model, ids, kinds, args.chunk)
        ppl = math.exp(-float(logp.mean()))
        runs["/".join(kinds)] = {
            "perplexity": round(ppl, 4),
            "ratio_to_auto": round(ppl / base_ppl, 5),
            "mean_abs_logprob_change": round(float((logp - base).abs().mean()), 5),
            "max_abs_logprob_change": round(float((logp - base).abs().max()), 4),
            "kv_bytes_per_token": per_token,
        }
    print(json.dumps({"tokens": len(ids), "chunk": args.chunk, "dtype": "float32", "runs": runs}, indent=2))


if __name__ == "__main__":
    main()
