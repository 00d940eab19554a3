"""A mixture-of-experts model served by astrai and by llama.cpp's ``llama-server`` from the same GGUF file.

No MoE checkpoint can be downloaded here, so the script writes one: a Qwen3-MoE of random weights
(``--size``: ``small`` is 8 layers of hidden 1024, 32 experts of 512 rows with 4 chosen per token,
16 query and 4 KV heads; ``large`` 12 layers, 64 experts, 8 chosen), the default model's tokenizer
(its ``tokenizer.ggml.*`` metadata copied), written the way llama.cpp's converter writes ``qwen3moe``
(``blk.N.ffn_{gate,up,down}_exps`` stacking every expert, the router ``ffn_gate_inp`` in F32) with
every other 2-D tensor and the experts in Q8_0 (``gguf.quants``). llama-server loads the same file.

Then family_bench.py's measurement, on that file: start-up, load time, the cold first request, the
W1 / B8 / B32 workloads (``/v1/completions``, EOS ignored, 128 new tokens) and each server's
resident set, which the script also states against the sum of the file's tensor bytes. Prints one
JSON object. astrai keeps the file's blocks (``--weights auto``: quantized on AVX2 and AVX512
machines) and runs each chosen expert on its rows (``astrai.model.moe``).

Usage: python benchmarks/moe_bench.py [--size small|large] [--quick] [--no-peer] [--out DIR]
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


def write_moe_gguf(path: Path, size: dict, seed: int = 0) -> dict:
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
    w.add_file_type(gguf.LlamaFileType.MOSTLY_Q8_0)
    w.add_quantization_version(gguf.GGML_QUANT_VERSION)
    for field in default.fields.values():  # the default model's tokenizer, as its file holds it
        if field.name.startswith("tokenizer."):
            kind = field.types[0]
            value = field.contents()
            sub = field.types[-1] if kind == gguf.GGUFValueType.ARRAY else None
            w.add_key_value(field.name, value, kind, sub_type=sub)
    total = 0

    def put(name: str, shape: tuple[int, ...], q8: bool = True) -> None:
        nonlocal total
        values = (rng.standard_normal(shape, dtype=np.float32) / np.sqrt(shape[-1])).astype(np.float32)
        if q8:
            raw = quantize(values, GGMLQuantizationType.Q8_0)
            w.add_tensor(name, raw, raw_dtype=GGMLQuantizationType.Q8_0)
            total += raw.nbytes
        else:
            w.add_tensor(name, values)
            total += values.nbytes

    def norm(name: str, n: int) -> None:
        nonlocal total
        values = (1.0 + 0.1 * rng.standard_normal(n)).astype(np.float32)
        w.add_tensor(name, values)
        total += values.nbytes

    put("token_embd.weight", (vocab, h))
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
        put(b + "ffn_gate_inp.weight", (e, h), q8=False)
        put(b + "ffn_gate_exps.weight", (e, inter, h))
        put(b + "ffn_up_exps.weight", (e, inter, h))
        put(b + "ffn_down_exps.weight", (e, h, inter))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    per_token = size["layers"] * 3 * size["used"] * inter * h * 34 / 32  # chosen experts' Q8_0 bytes
    return {**size, "vocab": vocab, "tensor_bytes": total, "expert_bytes_per_token": int(per_token)}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--size", choices=sorted(SIZES), default="small")
    ap.add_argument("--quick", action="store_true", help="tiny workloads (smoke run)")
    ap.add_argument("--no-peer", action="store_true", help="without llama-server")
    ap.add_argument("--out", type=Path, default=None, help="where the GGUF is written (default: a temp dir)")
    args = ap.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s", stream=sys.stderr)
    out = args.out or Path(tempfile.mkdtemp(prefix="moe-bench-"))
    path = out / f"qwen3moe-{args.size}-q8_0.gguf"
    if path.exists():  # written by an earlier run: its shape and tensor bytes from the file
        from gguf import GGUFReader

        tensors = GGUFReader(str(path)).tensors
        model = {
            **SIZES[args.size],
            "tensor_bytes": int(sum(int(t.n_bytes) for t in tensors)),
            "reused": True,
        }
    else:
        model = write_moe_gguf(path, SIZES[args.size])
    argv = ["family_bench.py", "--models", str(path), "--workloads", str(path)]
    argv += ["--quick"] * args.quick + ["--no-peer"] * args.no_peer
    import family_bench  # beside this file

    sys.argv = argv
    from contextlib import redirect_stdout
    from io import StringIO

    buffer = StringIO()
    with redirect_stdout(buffer):
        code = family_bench.main()
    result = json.loads(buffer.getvalue())
    result["config"]["moe_model"] = {**model, "gguf": str(path), "file_bytes": os.path.getsize(path)}
    for name, system in result.get("headline", {}).get(str(path), {}).items():
        if name in ("astrai", "llama_server") and system.get("rss_mib"):  # the resident set / the weights
            system["rss_over_tensor_bytes"] = system["rss_mib"] * 2**20 / model["tensor_bytes"]
    print(json.dumps(result, indent=2))
    return code


if __name__ == "__main__":
    raise SystemExit(main())
