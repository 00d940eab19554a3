"""How fast the CPU backend's LoRA updates read their adapters' weights, against the machine's read
bandwidth: what bounds ``lora_bench.py``'s ``lora_8 / base_8``.

In process, no server: the default model's projection shapes (q/k/v, o, gate/up, down) for its 30
layers, each a Q4_1 linear (random blocks, bf16 rows) with
``--adapters`` (8) random rank-``--rank`` (16) adapters in float16 on every part, every layer its
own weights so that a step reads them from memory as a decode step does. For 1 and for 8 rows
(row ``i`` on adapter ``i % adapters``): the median time of a step of the 120 linears alone
(``quant_linear``), with their rows' updates in their regions (``quant_linear_lora``, the
whole-step kernel's way), and of the updates alone (``lora_apply``); the adapter bytes a step
reads, and the rates they are read at, beside the machine's read bandwidth (``moe_bench.py``'s).

Usage: python benchmarks/lora_bytes_bench.py [--rounds 15] [--adapters 8] [--rank 16]
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import numpy as np
import torch
from moe_bench import read_bandwidth  # beside this file: the script's directory is on sys.path
from torch import nn
from torch.nn.utils import skip_init

# the default model's projections: input width, parts' output widths
SHAPES = {
    "qkv": (576, [576, 192, 192]),
    "o": (576, [576]),
    "gate_up": (576, [1536, 1536]),
    "down": (1536, [576]),
}
LAYERS = 30


def q4_1(n: int, k: int, rng: np.random.Generator) -> np.ndarray:
    """Random Q4_1 blocks for an [n, k] weight: per 32 values a float16 scale and minimum, 16 bytes of codes."""
    raw = rng.integers(0, 256, size=(n * k // 32, 20), dtype=np.uint8)
    raw[:, 0:4] = rng.uniform(-0.05, 0.05, size=(len(raw), 2)).astype(np.float16).view(np.uint8)
    return raw.reshape(n, -1)


def build(adapters: int, rank: int) -> list[tuple]:
    from astrai.lora import LoraLinear, LoraSet
    from astrai.model.quant import NATIVE, pack, split_blocks

    rng = np.random.default_rng(0)
    torch.manual_seed(0)
    out = []
    for _ in range(LAYERS):
        for k, parts in SHAPES.values():
            n = sum(parts)
            packed, layout = pack(*split_blocks(q4_1(n, k, rng), "Q4_1"), NATIVE["Q4_1"])
            base = skip_init(nn.Linear, k, n, bias=False)  # (its weight never read: memory never touched)
            mod = LoraLinear(base, LoraSet(adapters, torch.float16))
            for slot in range(adapters):
                o0, update = 0, []
                for width in parts:
                    update.append(
                        (o0, o0 + width, torch.randn(rank, k) * 0.05, torch.randn(width, rank) * 0.05)
                    )
                    o0 += width
                mod.set_slot(slot, update)
            out.append((k, packed, layout.ints(), mod))
    return out


def measure(linears: list[tuple], rows: int, adapters: int, rounds: int) -> dict:
    """One row count's medians, bytes and rates (see the module's docstring)."""
    ops = torch.ops.astrai_cpu
    slots = torch.arange(rows, dtype=torch.int32) % adapters
    xs = {k: torch.randn(rows, k).to(torch.bfloat16) for k, _ in SHAPES.values()}
    ys = [ops.quant_linear(xs[k], packed, lay, None) for k, packed, lay, _ in linears]

    def alone():
        for k, packed, lay, _ in linears:
            ops.quant_linear(xs[k], packed, lay, None)

    def around():
        for k, packed, lay, mod in linears:
            ops.quant_linear_lora(xs[k], packed, lay, None, slots, mod.a, mod.b, mod.spans)

    def updates():
        for (k, _, _, mod), y in zip(linears, ys, strict=True):
            ops.lora_apply(y, xs[k], slots, mod.a, mod.b, mod.spans)

    runs = {"linears": alone, "linears_with_updates": around, "updates_alone": updates}
    times: dict[str, list[float]] = {name: [] for name in runs}
    for _ in range(3):
        for f in runs.values():
            f()
    for _ in range(rounds):  # interleaved: a slow spell falls on all three
        for name, f in runs.items():
            start = time.perf_counter()
            f()
            times[name].append(time.perf_counter() - start)
    med = {name: statistics.median(t) for name, t in times.items()}
    used = sorted(set(slots.tolist()))
    nbytes = sum(
        t.numel() * t.element_size() for *_, mod in linears for s in used for t in (mod.a[s], mod.b[s])
    )
    extra = med["linears_with_updates"] - med["linears"]
    return {
        **{f"{name}_ms": round(m * 1e3, 2) for name, m in med.items()},
        "adapter_mb": round(nbytes / 1e6, 1),
        "updates_gb_per_s": round(nbytes / med["updates_alone"] / 1e9, 1),
        "in_region_gb_per_s": round(nbytes / extra / 1e9, 1) if extra > 0 else None,
        "linears_over_with_updates": round(med["linears"] / med["linears_with_updates"], 3),
    }


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=15)
    ap.add_argument("--adapters", type=int, default=8)
    ap.add_argument("--rank", type=int, default=16)
    args = ap.parse_args()
    from astrai_backend_cpu import load_kernels

    load_kernels()
    linears = build(args.adapters, args.rank)
    result = {"read_gb_per_s": round(read_bandwidth(), 1)}
    result["rows"] = {rows: measure(linears, rows, args.adapters, args.rounds) for rows in (1, 8)}
    print(json.dumps(result, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
