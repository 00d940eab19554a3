"""Tensor parallel on CUDA (NCCL): a random 2-layer Llama split over 2 GPUs against one GPU.

Run by scripts/gpu_check.sh on a machine with at least 2 GPUs; prints one JSON object (and writes
it to --json): the largest logit difference of a prefill and 3 decode steps, float32 and bf16.
"""

from __future__ import annotations

import argparse
import json
import tempfile

import torch

from astrai.distributed.launch import load_tensor_parallel, save_state
from astrai.kvcache import KVConfig, PagePool
from astrai.model import ModelConfig, build_model

CONFIG = ModelConfig(
    architecture="llama",
    vocab_size=512,
    hidden_size=256,
    intermediate_size=512,
    num_hidden_layers=2,
    num_attention_heads=8,
    num_key_value_heads=4,
    head_dim=32,
    max_position_embeddings=512,
)
PROMPTS = [[5, 17, 42, 99, 3, 250, 77], list(range(40, 140))]


def steps(model, config, dtype, device):
    pool = PagePool(
        config.num_hidden_layers,
        config.num_attention_heads,
        config.num_key_value_heads,
        config.head_dim,
        KVConfig(max_batch_size=2, max_seq_len=256, page_size=16, n_tokens=512),
        dtype,
        device,
    )
    rows = [pool.task_alloc() for _ in PROMPTS]
    lens = [len(p) for p in PROMPTS]
    for r, n in zip(rows, lens, strict=True):
        pool.extend(r, n + 3)
    ids = torch.tensor([t for p in PROMPTS for t in p], device=device)
    positions = torch.cat([torch.arange(n) for n in lens]).to(device)
    out = [
        model(
            ids, positions, pool.bind_tasks(rows, lens, lens), (torch.tensor(lens).cumsum(0) - 1).to(device)
        )
    ]
    for s in range(3):
        tokens = out[-1].argmax(-1)
        kv = pool.bind_tasks(rows, [1, 1], [n + s + 1 for n in lens])
        out.append(
            model(
                tokens, torch.tensor([n + s for n in lens], device=device), kv, torch.arange(2, device=device)
            )
        )
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--json", default=None)
    ap.add_argument("--device", default="cuda:0", help="cuda:0 (NCCL); cpu runs the same check over gloo")
    args = ap.parse_args()
    dev = args.device
    torch.manual_seed(0)
    base = build_model(CONFIG, torch.float32)
    with torch.no_grad():
        for p in base.parameters():
            p.copy_(torch.randn(p.shape) / p.shape[-1] ** 0.5)
    result = {"device": dev, "gpus": torch.cuda.device_count()}
    with tempfile.NamedTemporaryFile(suffix=".pt") as f:
        save_state(f.name, CONFIG, base.state_dict())
        for dtype in (torch.float32, torch.bfloat16):
            ref = build_model(CONFIG, dtype, dev)
            ref.load_weights({k: v.to(dtype).to(dev) for k, v in base.state_dict().items()})
            ref.fuse_projections()
            model, _ = load_tensor_parallel(None, dtype, dev, 2, timeout=60, state_file=f.name)
            try:
                want, got = steps(ref, ref.config, dtype, dev), steps(model, model.config, dtype, dev)
                result[str(dtype).removeprefix("torch.")] = max(
                    float((a - b).abs().max()) for a, b in zip(want, got, strict=True)
                )
            finally:
                model.close()
    print(json.dumps(result))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f)


if __name__ == "__main__":
    main()
