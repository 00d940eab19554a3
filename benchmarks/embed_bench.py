"""Embedding throughput: ``astrai serve --embedding-model minilm-l6`` against sentence-transformers'
``encode`` on the same files (in this process, same cores) and llama.cpp's ``llama-server
--embeddings`` on a GGUF of the same model (written by llama.cpp's own ``convert_hf_to_gguf.py``),
same client, one server at a time.

Each in the dtype it computes in by default and in the other: astrai (``astrai``: bf16 on CPUs that
compute it natively, else float32; ``astrai_float32``: ``--dtype float32``), sentence-transformers
(float32; ``sentence_transformers_bf16``: the model loaded in bf16) and llama-server (the converter's
float32 file; ``llama_server_bf16``: its bf16 file).

The texts: 512 sentences of a fixed mix of lengths (8 to 160 words; seeded), the same for every
system. Workloads:

- ``batch64``: 8 requests of 64 sentences each, one after another (sentence-transformers: ``encode``
  of 64 at a time);
- ``single``: 512 requests of one sentence, 8 in flight at a time (sentence-transformers: ``encode``
  of one sentence at a time, 512 times: it has no server and no batching across callers).

Each system's vectors of the first 32 sentences are compared with sentence-transformers' (the least
cosine similarity is reported), so that the speeds are of the same work. Prints one JSON object:
sentences/s per system and workload, astrai over each peer, and the physical floor: the encoder's
FLOPs for the texts' tokens (2 per weight of its layers per token, and attention's) against this
machine's float32 and bf16 matmul rates, as the most sentences/s each allows.

Needs ``../shared/peers`` built (``setup.sh``: llama-server and llama.cpp's source) for the
llama-server run; ``--no-peer`` leaves it out.

Usage: python benchmarks/embed_bench.py [--quick] [--no-peer]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx
import serve_bench as bench  # beside this file: the script's directory is on sys.path

PEERS = Path(os.environ.get("PEERS_DIR", Path.home() / ".cache" / "astrai-peers"))
LLAMA_SERVER = PEERS / "build" / "llama.cpp" / "bin" / "llama-server"
CONVERTER = PEERS / "src" / "llama_cpp_python-0.3.36" / "vendor" / "llama.cpp"
WORDS = (
    "the of and to in is was for on that with as by at from his an were are which this be or has had "
    "not but what all when there can who been one more their if will would about up out them into time "
    "river market garden window letter country morning number system question government company"
).split()


def texts(n: int, seed: int = 0) -> list[str]:
    rng = random.Random(seed)
    lengths = [8, 12, 16, 24, 32, 48, 64, 96, 128, 160]
    return [" ".join(rng.choice(WORDS) for _ in range(rng.choice(lengths))) + "." for _ in range(n)]


def write_gguf(folder: Path, out: Path, outtype: str = "f32") -> Path:
    """MiniLM as llama.cpp's converter writes it (``outtype``: f32 or bf16)."""
    if not out.exists():
        env = {**os.environ, "PYTHONPATH": str(CONVERTER / "gguf-py")}
        cmd = [sys.executable, str(CONVERTER / "convert_hf_to_gguf.py"), str(folder), "--outfile", str(out)]
        subprocess.run([*cmd, "--outtype", outtype], check=True, env=env, capture_output=True)
    return out


async def run_server(base: str, model: str, sentences: list[str], quick: bool) -> dict:
    out: dict = {}
    async with httpx.AsyncClient(base_url=base, timeout=600) as client:

        async def embed(batch: list[str]) -> list[list[float]]:
            r = await client.post("/v1/embeddings", json={"model": model, "input": batch})
            r.raise_for_status()
            return [d["embedding"] for d in sorted(r.json()["data"], key=lambda d: d["index"])]

        out["first32"] = await embed(sentences[:32])  # (also the warm-up)
        start = time.perf_counter()
        for i in range(0, len(sentences), 64):
            await embed(sentences[i : i + 64])
        out["batch64"] = len(sentences) / (time.perf_counter() - start)
        gate = asyncio.Semaphore(8)

        async def one(text: str) -> None:
            async with gate:
                await embed([text])

        start = time.perf_counter()
        await asyncio.gather(*(one(t) for t in sentences))
        out["single"] = len(sentences) / (time.perf_counter() - start)
    return out


def run_sentence_transformers(folder: Path, sentences: list[str], dtype: str = "float32") -> dict:
    import torch
    from sentence_transformers import SentenceTransformer

    torch.set_num_threads(os.cpu_count() or 1)
    kwargs = {"torch_dtype": getattr(torch, dtype)}
    model = SentenceTransformer(str(folder), device="cpu", model_kwargs=kwargs)
    out = {"first32": model.encode(sentences[:32], convert_to_tensor=True).float().tolist()}
    start = time.perf_counter()
    for i in range(0, len(sentences), 64):
        model.encode(sentences[i : i + 64], batch_size=64)
    out["batch64"] = len(sentences) / (time.perf_counter() - start)
    start = time.perf_counter()
    for text in sentences:
        model.encode([text])
    out["single"] = len(sentences) / (time.perf_counter() - start)
    return out


def floor(folder: Path, sentences: list[str], dtype: object = None) -> dict:
    """The most sentences/s ``dtype`` (float32 by default) arithmetic allows here: the encoder's
    FLOPs for the texts (no padding) at the best rate of a 1024^3 matmul in it on every core."""
    import torch
    from transformers import AutoConfig, AutoTokenizer

    cfg = AutoConfig.from_pretrained(folder)
    lengths = [len(ids) for ids in AutoTokenizer.from_pretrained(folder)(sentences)["input_ids"]]
    h, inter, layers = cfg.hidden_size, cfg.intermediate_size, cfg.num_hidden_layers
    per_token = 2 * layers * (4 * h * h + 2 * h * inter)  # q, k, v, o and the MLP
    attention = sum(4 * layers * n * n * h for n in lengths)  # scores and their sum of values
    flops = per_token * sum(lengths) + attention
    a, b = torch.randn(1024, 1024, dtype=dtype), torch.randn(1024, 1024, dtype=dtype)
    best = float("inf")
    for _ in range(20):
        start = time.perf_counter()
        torch.mm(a, b)
        best = min(best, time.perf_counter() - start)
    rate = 2 * 1024**3 / best
    return {
        "tokens": sum(lengths),
        "gflop": round(flops / 1e9, 1),
        "matmul_gflop_per_s": round(rate / 1e9, 1),
        "sentences_per_s": round(len(sentences) / (flops / rate), 1),
    }


def least_cosine(a: list[list[float]], b: list[list[float]]) -> float:
    import torch

    return float(torch.nn.functional.cosine_similarity(torch.tensor(a), torch.tensor(b)).min())


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="64 sentences (a smoke run)")
    ap.add_argument("--no-peer", action="store_true", help="without llama-server")
    args = ap.parse_args()
    from astrai.model.resolve import resolve_model

    folder = resolve_model("minilm-l6")[1]
    sentences = texts(64 if args.quick else 512)
    log_dir = Path(tempfile.mkdtemp(prefix="embed-bench-"))
    results: dict = {"sentence_transformers": run_sentence_transformers(folder, sentences)}
    results["sentence_transformers_bf16"] = run_sentence_transformers(folder, sentences, "bfloat16")
    bindir = Path(sys.executable).parent
    systems = []
    for name, flags in (("astrai", []), ("astrai_float32", ["--dtype", "float32"])):
        port = bench.free_port()
        serve = [str(bindir / "astrai"), "serve", "--embedding-model", "minilm-l6", "--port", str(port)]
        systems.append(bench.System(name, serve + flags, "minilm-l6", {}, port))
    if not args.no_peer:
        for name, outtype in (("llama_server", "f32"), ("llama_server_bf16", "bf16")):
            gguf = write_gguf(folder, log_dir / f"minilm-{outtype}.gguf", outtype)
            port = bench.free_port()
            llama = [str(LLAMA_SERVER), "-m", str(gguf), "--embeddings", "--pooling", "mean"]
            llama += ["-t", "2", "-tb", "2", "-c", "4096", "-np", "8", "-b", "4096", "-ub", "4096"]
            llama += ["--host", "127.0.0.1", "--port", str(port)]
            systems.append(bench.System(name, llama, "minilm", {}, port))
    for system in systems:
        with bench.serving(system, log_dir) as head:
            results[system.name] = {
                "startup_s": head["startup_s"],
                **asyncio.run(run_server(system.base, system.model, sentences, args.quick)),
            }
    reference = results["sentence_transformers"]["first32"]
    summary: dict = {}
    for name, r in results.items():
        summary[name] = {
            "sentences_per_s": {w: round(r[w], 1) for w in ("batch64", "single")},
            "least_cosine_vs_sentence_transformers": round(least_cosine(r.pop("first32"), reference), 6),
        }
    for ours, peer in (
        ("astrai", "sentence_transformers"),
        ("astrai", "sentence_transformers_bf16"),
        ("astrai", "llama_server"),
        ("astrai", "llama_server_bf16"),
        ("astrai_float32", "sentence_transformers"),
        ("astrai_float32", "llama_server"),
    ):
        if peer in summary:
            summary[f"{ours}_over_{peer}"] = {
                w: round(summary[ours]["sentences_per_s"][w] / summary[peer]["sentences_per_s"][w], 2)
                for w in ("batch64", "single")
            }
    import torch

    from astrai.model import default_dtype

    config = {"sentences": len(sentences), "cores": os.cpu_count(), "logs": str(log_dir), "quick": args.quick}
    config["astrai_dtype"] = str(default_dtype("cpu")).removeprefix("torch.")
    config["float32_floor"] = floor(folder, sentences)
    config["bf16_floor"] = floor(folder, sentences, torch.bfloat16)
    print(json.dumps({"config": config, "results": summary}, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
