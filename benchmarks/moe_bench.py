"""A mixture-of-experts model served by astrai and by llama.cpp's ``llama-server`` from the same GGUF file.

No MoE checkpoint can be downloaded here, so the script writes one: a Qwen3-MoE of random weights
(``--size``: ``small`` is 8 layers of hidden 1024, 32 experts of 512 rows with 4 chosen per token,
16 query and 4 KV heads; ``large`` 12 layers, 64 experts, 8 chosen), the default model's tokenizer
(its ``tokenizer.ggml.*`` metadata copied), written the way llama.cpp's converter writes ``qwen3moe``
(``blk.N.ffn_{gate,up,down}_exps`` stacking every expert, the router ``ffn_gate_inp`` in F32) with
the experts and the attention projections in ``--qtype`` (Q4_0, the default, Q5_0 or Q8_0; ``gguf.quants``)
and the embeddings (tied to the LM head) in Q8_0, as llama.cpp's ``Q4_0`` files keep them. llama-server
loads the same file.

Then family_bench.py's measurement, on that file: start-up, load time, the cold first request, the
W1 / B8 / B32 workloads (``/v1/completions``, EOS ignored, 128 new tokens) and each server's
resident set, which the script also states against the sum of the file's tensor bytes. Prints one
JSON object. astrai keeps the file's blocks (``--weights auto``: quantized on AVX2 and AVX512
machines) and runs each chosen expert on its rows (``astrai.model.moe``).

Usage: python benchmarks/moe_bench.py [--size small|large] [--qtype Q4_0|Q5_0|Q8_0] [--quick] [--no-peer] [--out DIR]
       [--astrai-arg=ARG ...]
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys
import tempfile
from pathlib import Path

import numpy as np

SIZES = {
    "small": dict(layers=8, hidden=1024, heads=16, kv=4, experts=32, used=4, inter=512),
    "large": dict(layers=12, hidden=1024, heads=16, kv=4, experts=64, used=8, inter=512),
}


#: bytes per weight of each block type (a block of 32 weights: Q4_0 18 bytes, Q8_0 34)
BYTES_PER_WEIGHT = {"Q4_0": 18 / 32, "Q5_0": 22 / 32, "Q8_0": 34 / 32}


def write_moe_gguf(path: Path, size: dict, qtype: str = "Q4_0", seed: int = 0) -> dict:
    """Write the random Qwen3-MoE; returns its shape and the bytes of its tensors."""
    import gguf
    from gguf import GGMLQuantizationType, GGUFReader, GGUFWriter
    from gguf.quants import quantize

    from astrai.model.resolve import resolve_model

    default = GGUFReader(str(resolve_model(None)[1]))
    vocab = len(default.fields["tokenizer.ggml.tokens"].data)
    rng = np.random.default_rng(seed)
    h, d = size["hidden"], 64
    w = GGUFWriter(str(path), "qwen3moe")
    w.add_name(f"random-qwen3moe-{size['experts']}x{size['used']}")
    w.add_block_count(size["layers"])
    w.add_context_length(4096)
    w.add_embedding_length(h)
    w.add_feed_forward_length(size["inter"])
    w.add_head_count(size["heads"])
    w.add_head_count_kv(size["kv"])
    w.add_rope_freq_base(1000000.0)
    w.add_layer_norm_rms_eps(1e-6)
    w.add_key_length(d)
    w.add_value_length(d)
    w.add_expert_count(size["experts"])
    w.add_expert_used_count(size["used"])
    w.add_expert_feed_forward_length(size["inter"])
    w.add_file_type(gguf.LlamaFileType[f"MOSTLY_{qtype}"])
    w.add_quantization_version(gguf.GGML_QUANT_VERSION)
    for field in default.fields.values():  # the default model's tokenizer, as its file holds it
        if field.name.startswith("tokenizer."):
            kind = field.types[0]
            value = field.contents()
            sub = field.types[-1] if kind == gguf.GGUFValueType.ARRAY else None
            w.add_key_value(field.name, value, kind, sub_type=sub)
    total = 0

    def put(name: str, shape: tuple[int, ...], kind: str | None = qtype) -> None:
        nonlocal total
        values = (rng.standard_normal(shape, dtype=np.float32) / np.sqrt(shape[-1])).astype(np.float32)
        if kind is not None:
            raw = quantize(values, GGMLQuantizationType[kind])
            w.add_tensor(name, raw, raw_dtype=GGMLQuantizationType[kind])
            total += raw.nbytes
        else:
            w.add_tensor(name, values)
            total += values.nbytes

    def norm(name: str, n: int) -> None:
        nonlocal total
        values = (1.0 + 0.1 * rng.standard_normal(n)).astype(np.float32)
        w.add_tensor(name, values)
        total += values.nbytes

    put("token_embd.weight", (vocab, h), "Q8_0")
    norm("output_norm.weight", h)
    e, inter = size["experts"], size["inter"]
    for i in range(size["layers"]):
        b = f"blk.{i}."
        norm(b + "attn_norm.weight", h)
        put(b + "attn_q.weight", (size["heads"] * d, h))
        put(b + "attn_k.weight", (size["kv"] * d, h))
        put(b + "attn_v.weight", (size["kv"] * d, h))
        put(b + "attn_output.weight", (h, size["heads"] * d))
        norm(b + "attn_q_norm.weight", d)
        norm(b + "attn_k_norm.weight", d)
        norm(b + "ffn_norm.weight", h)
        put(b + "ffn_gate_inp.weight", (e, h), None)
        put(b + "ffn_gate_exps.weight", (e, inter, h))
        put(b + "ffn_up_exps.weight", (e, inter, h))
        put(b + "ffn_down_exps.weight", (e, h, inter))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return {
        **size,
        "qtype": qtype,
        "vocab": vocab,
        "tensor_bytes": total,
        **bytes_per_token(size, qtype, vocab),
    }


def bytes_per_token(size: dict, qtype: str, vocab: int) -> dict:
    """The weight bytes a decoded token reads (one stream): the chosen experts', the attention
    projections', the routers' (F32) and the LM head's (the Q8_0 embeddings); the KV cache's aside."""
    h, d, per = size["hidden"], 64, BYTES_PER_WEIGHT[qtype]
    experts = size["layers"] * 3 * size["used"] * size["inter"] * h * per
    attention = size["layers"] * (2 * size["heads"] + 2 * size["kv"]) * d * h * per
    routers = size["layers"] * size["experts"] * h * 4
    head = vocab * h * BYTES_PER_WEIGHT["Q8_0"]
    total = experts + attention + routers + head
    return {"expert_bytes_per_token": int(experts), "weight_bytes_per_token": int(total)}


def read_bandwidth(gib: float = 1.0, repeats: int = 5) -> float:
    """This machine's read bandwidth in GB/s: the best of ``repeats`` sums over ``gib`` GiB of float32
    (every thread torch has), the physical floor of a decode step that reads its weights once."""
    import time

    import torch

    data = torch.ones(int(gib * 2**28), dtype=torch.float32)
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        data.sum()
        best = min(best, time.perf_counter() - start)
    return data.numel() * 4 / best / 1e9


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--size", choices=sorted(SIZES), default="small")
    ap.add_argument("--qtype", choices=sorted(BYTES_PER_WEIGHT), default="Q4_0", help="the experts' blocks")
    ap.add_argument("--quick", action="store_true", help="tiny workloads (smoke run)")
    ap.add_argument("--no-peer", action="store_true", help="without llama-server")
    ap.add_argument("--out", type=Path, default=None, help="where the GGUF is written (default: a temp dir)")
    ap.add_argument(
        "--astrai-arg", action="append", default=[], help="an extra astrai serve argument, repeatable"
    )
    args = ap.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s", stream=sys.stderr)
    out = args.out or Path(tempfile.mkdtemp(prefix="moe-bench-"))
    path = out / f"qwen3moe-{args.size}-{args.qtype.lower()}.gguf"
    if path.exists():  # written by an earlier run: its shape and tensor bytes from the file
        from gguf import GGUFReader

        reader = GGUFReader(str(path))
        model = {
            **SIZES[args.size],
            "qtype": args.qtype,
            "tensor_bytes": int(sum(int(t.n_bytes) for t in reader.tensors)),
            **bytes_per_token(SIZES[args.size], args.qtype, len(reader.fields["tokenizer.ggml.tokens"].data)),
            "reused": True,
        }
    else:
        model = write_moe_gguf(path, SIZES[args.size], args.qtype)
    argv = ["family_bench.py", "--models", str(path), "--workloads", str(path)]
    argv += ["--quick"] * args.quick + ["--no-peer"] * args.no_peer
    argv += [f"--astrai-arg={arg}" for arg in args.astrai_arg]
    import family_bench  # beside this file

    sys.argv = argv
    from contextlib import redirect_stdout
    from io import StringIO

    buffer = StringIO()
    with redirect_stdout(buffer):
        code = family_bench.main()
    result = json.loads(buffer.getvalue())
    result["config"]["moe_model"] = {**model, "gguf": str(path), "file_bytes": os.path.getsize(path)}
    bandwidth = read_bandwidth()
    result["config"]["floor"] = {  # one stream's tokens/s were it to read only its weights at full speed
        "read_gb_per_s": round(bandwidth, 1),
        "single_stream_tokens_per_s": round(bandwidth * 1e9 / model["weight_bytes_per_token"], 1),
    }
    for name, system in result.get("headline", {}).get(str(path), {}).items():
        if name in ("astrai", "llama_server") and system.get("rss_mib"):  # the resident set / the weights
            system["rss_over_tensor_bytes"] = system["rss_mib"] * 2**20 / model["tensor_bytes"]
    print(json.dumps(result, indent=2))
    return code


if __name__ == "__main__":
    raise SystemExit(main())
