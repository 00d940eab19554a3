"""Decode at long context with the KV cache in the model's dtype vs int8: ``astrai serve
--kv-cache-dtype auto`` vs ``--kv-cache-dtype int8`` and, side by side (one server at a time),
llama.cpp's ``llama-server`` with a q8_0 K and V cache (``-ctk q8_0 -ctv q8_0 -fa on``).

Both astrai servers run the default model with the same ``--kv-memory`` (default: room for the
largest workload in the model's dtype, plus a tenth), ``--max-seq-len 8192`` and
``--max-batch-size 32``; their ``GET /stats`` gives each pool's ``kv_tokens_total``. llama-server
serves the same GGUF through ``../shared/peers/start.sh llamacpp`` with ``-c`` and ``-np`` sized to
each workload (32 slots, then 1). Workloads, each ``/v1/completions`` streamed, greedy, EOS ignored,
``--new-tokens`` (64) new tokens after prompts of random words, distinct from their first tokens:

- ``streams_32``: 32 concurrent requests with 2,000-token prompts;
- ``single_8k``: one request with an 8,000-token prompt.

(``--quick``: 8 streams of 1,000 tokens, one of 2,000, 16 new tokens; the names stay.)

Prints one JSON object: per server and workload the decode rate (tokens streamed while every
request of the workload is past its first token and none has finished, over that window: no
prefill in it), per-request decode rates ((n - 1) / (t_last - t_first)), an ITL-based rate (streams /
the median inter-token gap, steadier on a busy machine), time to first token and inter-token
latency; each astrai pool's ``kv_tokens_total`` and the int8 / auto ratio (the issue's
target: at least 1.8); the int8 / auto decode ratio per workload (target: at least 1.3) and astrai
int8 / llama-server q8_0; and, informative only, how many requests got the same text from both
astrai servers and their mean common prefix.

Usage: python benchmarks/kv_quant_bench.py [--quick] [--no-peer] [--peers DIR] [--new-tokens 64]
       [--kv-memory 4GiB]
Reuses serve_bench.py, which must sit beside it.

Over 300 lines because the three servers' starts, the two workloads and the decode-window
arithmetic read together, as in lora_bench.py.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import json
import os
import random
import sys
import tempfile
import time
from pathlib import Path

import httpx
import serve_bench as bench  # beside this file: the script's directory is on sys.path

START_SH = Path(__file__).resolve().parents[2] / "shared" / "peers" / "start.sh"
MAX_SEQ_LEN = 8192
SLACK = 64  # tokens per request beyond prompt + new ones (page rounding, llama.cpp's slot context)
DECODE_TARGET = 1.3  # int8 / auto decode tokens/s
CAPACITY_TARGET = 1.8  # int8 / auto kv_tokens_total
STATS_KEYS = ("kv_tokens_total", "kv_bytes_per_token", "kv_cache_dtype_k", "kv_cache_dtype_v")


@dataclasses.dataclass
class Load:
    name: str
    streams: int  # all sent at once
    prompt_tokens: int


@dataclasses.dataclass
class Run:
    sample: bench.Sample
    text: str = ""
    stamps: list[float] = dataclasses.field(default_factory=list)  # perf_counter of each content chunk


def loads(quick: bool) -> list[Load]:
    return [
        Load("streams_32", *((8, 1000) if quick else (32, 2000))),
        Load("single_8k", 1, 2000 if quick else 8000),
    ]


def make_prompts(p: bench.Prompts, load: Load, seed: int) -> list[str]:
    """``load.streams`` texts of random words, each cut to ``load.prompt_tokens`` tokens; no two
    share their first 16 tokens (no prefix-cache hit)."""
    rng = random.Random(seed)
    vocab = sorted({w.strip(".,;").lower() for w in p.words})
    out: list[str] = []
    heads: set[tuple[int, ...]] = set()
    while len(out) < load.streams:
        words = " ".join(rng.choice(vocab) for _ in range(load.prompt_tokens + 16))
        ids = p.tok.encode(words, add_special_tokens=False).ids[: load.prompt_tokens]
        if tuple(ids[:16]) not in heads:
            heads.add(tuple(ids[:16]))
            out.append(p.tok.decode(ids))
    return out


async def stream(client: httpx.AsyncClient, system: bench.System, prompt: str, max_tokens: int, p) -> Run:
    """serve_bench.one_request for a completion, also keeping the text and each chunk's arrival."""
    body = {
        "model": system.model,
        "prompt": prompt,
        "max_tokens": max_tokens,
        "temperature": 0,
        "stream": True,
        "stream_options": {"include_usage": True},
        **system.extra,
    }
    run, usage, text = Run(bench.Sample()), None, []
    t0 = time.perf_counter()
    try:
        async with client.stream("POST", system.base + "/v1/completions", json=body) as resp:
            if resp.status_code != 200:
                detail = (await resp.aread()).decode(errors="replace")[:300]
                return Run(bench.Sample(error=f"HTTP {resp.status_code}: {detail}"))
            async for line in resp.aiter_lines():
                if not line.startswith("data:"):
                    continue
                data = line[5:].strip()
                if data == "[DONE]":
                    break
                chunk = json.loads(data)
                if "error" in chunk:
                    return Run(bench.Sample(error=f"in-stream error: {str(chunk['error'])[:300]}"))
                usage = chunk.get("usage") or usage
                for choice in chunk.get("choices") or []:
                    if choice.get("text"):
                        run.stamps.append(time.perf_counter())
                        text.append(choice["text"])
    except (httpx.HTTPError, ValueError) as exc:
        return Run(bench.Sample(error=f"{type(exc).__name__}: {exc}"))
    end = time.perf_counter()
    if not run.stamps:
        return Run(bench.Sample(error="no content chunk"))
    run.text = "".join(text)
    s = run.sample
    s.ttft, s.e2e = run.stamps[0] - t0, end - t0
    s.gaps = [b - a for a, b in zip(run.stamps[:-1], run.stamps[1:], strict=True)]
    if usage and usage.get("completion_tokens") is not None:
        s.output_tokens, s.prompt_tokens = usage["completion_tokens"], usage.get("prompt_tokens")
    else:
        s.output_tokens, s.from_usage = p.count(run.text), False
    return run


def decode_figures(runs: list[Run]) -> dict:
    """Decode rates without prefill: over the window where every request has its first token and
    none has its last (chunks in it / its length), and per request (n - 1) / (t_last - t_first)
    with n its chunks."""
    ok = [r for r in runs if r.sample.error is None and len(r.stamps) > 1]
    if not ok:
        return {"decode_tok_s": None}
    per = [(len(r.stamps) - 1) / (r.stamps[-1] - r.stamps[0]) for r in ok]
    w0, w1 = max(r.stamps[0] for r in ok), min(r.stamps[-1] for r in ok)
    inside = sum(w0 < t <= w1 for r in ok for t in r.stamps)
    window = inside / (w1 - w0) if w1 > w0 and inside else None
    return {
        "decode_tok_s": window if window is not None else sum(per),
        "decode_basis": "all-decoding window" if window is not None else "sum of per-request rates",
        "decode_window_s": max(w1 - w0, 0.0),
        "decode_window_chunks": inside,
        "decode_tok_s_per_request": bench.pct(per),
        "decode_tok_s_sum_of_requests": sum(per),
        "chunks_per_request": sorted({len(r.stamps) for r in ok}),
    }


async def run_load(
    system: bench.System, load: Load, prompts: list[str], new_tokens: int, p
) -> tuple[dict, list]:
    timeout = httpx.Timeout(3600.0, connect=10.0)
    async with httpx.AsyncClient(timeout=timeout, limits=httpx.Limits(max_connections=64)) as client:
        warm = await stream(client, system, "Hello", 4, p)  # untimed: lazy initialisation
        if warm.sample.error:
            raise RuntimeError(f"warm-up request failed: {warm.sample.error}")
        t0 = time.perf_counter()
        runs = await asyncio.gather(*(stream(client, system, t, new_tokens, p) for t in prompts))
        wall = time.perf_counter() - t0
    result = {
        "streams": load.streams,
        **decode_figures(runs),
        **bench.summarise([r.sample for r in runs], wall),
    }
    itl = (result["itl_s"] or {}).get("p50")
    result["decode_tok_s_itl_p50"] = load.streams / itl if itl else None  # robust to a few stalls
    bench.logger.info("%s %s: decode %.1f tokens/s", system.name, load.name, result["decode_tok_s"] or 0)
    return result, [r.text if r.sample.error is None else None for r in runs]


def stats(system: bench.System) -> dict:
    try:
        got = httpx.get(system.base + "/stats", timeout=10.0).json()
    except (httpx.HTTPError, ValueError) as exc:
        return {"error": f"GET /stats: {exc}"}
    return {k: got.get(k) for k in STATS_KEYS}


def same_answers(a: list, b: list, p: bench.Prompts) -> dict:
    """Requests with identical text, and the mean common prefix in tokens and characters."""
    pairs = [(x, y) for x, y in zip(a, b, strict=True) if x is not None and y is not None]

    def common(u, v) -> int:
        return next((i for i, (s, t) in enumerate(zip(u, v, strict=False)) if s != t), min(len(u), len(v)))

    ids = [
        (p.tok.encode(x, add_special_tokens=False).ids, p.tok.encode(y, add_special_tokens=False).ids)
        for x, y in pairs
    ]
    return {
        "requests": len(pairs),
        "identical": sum(x == y for x, y in pairs),
        "mean_common_prefix_tokens": sum(common(u, v) for u, v in ids) / len(ids) if ids else None,
        "mean_tokens": sum(len(u) for u, _ in ids) / len(ids) if ids else None,
        "mean_common_prefix_chars": sum(common(x, y) for x, y in pairs) / len(pairs) if pairs else None,
    }


def kv_bytes_per_token(hf_folder: Path) -> tuple[int, str]:
    """A KV slot's bytes in the dtype ``astrai serve`` picks on this machine by default, and that dtype."""
    from astrai.kvcache.storage import KVStorage
    from astrai.model import default_dtype

    c = json.loads((hf_folder / "config.json").read_text())
    head_dim = c.get("head_dim") or c["hidden_size"] // c["num_attention_heads"]
    dtype = default_dtype("cpu")
    n = KVStorage.bytes_per_token(c["num_hidden_layers"], c["num_key_value_heads"], head_dim, dtype)
    return n, str(dtype).removeprefix("torch.")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="8 streams of 1,000 tokens, one of 2,000, 16 new")
    ap.add_argument("--no-peer", action="store_true", help="astrai only")
    ap.add_argument("--peers", type=Path, default=Path.home() / ".cache" / "astrai-peers", help="PEERS_DIR")
    ap.add_argument("--new-tokens", type=int, default=64)
    ap.add_argument("--kv-memory", help="both astrai pools' budget, e.g. 4GiB (default: the workloads' need)")
    ap.add_argument("--cache-dir", type=Path, default=Path.home() / ".cache" / "astrai-bench")
    args = ap.parse_args()
    args.dtype = "float32"  # serve_bench's dequantized copy: only its tokenizer and config are read
    gguf, hf_folder, p = bench.prepare(args)
    new_tokens = 16 if args.quick else args.new_tokens
    work = loads(args.quick)
    prompts = {load.name: make_prompts(p, load, seed=i) for i, load in enumerate(work)}
    per_token, model_dtype = kv_bytes_per_token(hf_folder)
    need = max(load.streams * (load.prompt_tokens + new_tokens + SLACK) for load in work)
    if args.kv_memory is None:
        args.kv_memory = f"{-(-need * per_token * 11 // 10) // 2**20}MiB"
    log_dir = Path(tempfile.mkdtemp(prefix="kv-quant-bench-"))
    bindir = Path(sys.executable).parent
    batch = max(32, *(load.streams for load in work))

    def astrai(kind: str) -> bench.System:
        port = bench.free_port()
        flags = ["--kv-cache-dtype", kind, "--kv-memory", args.kv_memory]
        flags += ["--max-seq-len", str(MAX_SEQ_LEN), "--max-batch-size", str(batch)]
        command = [str(bindir / "astrai"), "serve", "--host", "127.0.0.1", "--port", str(port)]
        return bench.System(
            f"astrai_{kind}",
            [*command, "--log-level", "warning", *flags],
            "astrai",
            {"ignore_eos": True},
            port,
        )

    def llama(load: Load) -> bench.System:
        port = bench.free_port()
        ctx = load.streams * (load.prompt_tokens + new_tokens + SLACK)  # -c is split over the -np slots
        quant = ["-ctk", "q8_0", "-ctv", "q8_0", "-fa", "on", "-c", str(ctx), "-np", str(load.streams)]
        command = ["bash", str(START_SH), "llamacpp", str(port), *quant]
        return bench.System(f"llama_server_q8_{load.name}", command, "astrai", {"ignore_eos": True}, port)

    results: dict = {}
    texts: dict = {}
    for kind in ("auto", "int8"):  # one server at a time: a waiting server still takes CPU
        system = astrai(kind)
        try:
            with bench.serving(system, log_dir) as head:
                results[system.name] = dict(head)
                for load in work:
                    r, texts[system.name, load.name] = asyncio.run(
                        run_load(system, load, prompts[load.name], new_tokens, p)
                    )
                    results[system.name][load.name] = r
                results[system.name]["stats"] = stats(system)
        except RuntimeError as exc:
            bench.logger.error("%s failed: %s", system.name, exc)
            results[system.name] = {"error": str(exc)}
    if not args.no_peer:
        os.environ["PEERS_DIR"] = str(args.peers)
        os.environ["PEER_GGUF"] = str(gguf)
        peer = results["llama_server_q8"] = {}
        for load in work:  # its slots are sized per workload: one server per workload
            system = llama(load)
            try:
                with bench.serving(system, log_dir) as head:
                    r, _ = asyncio.run(run_load(system, load, prompts[load.name], new_tokens, p))
                    peer[load.name] = {**head, **r}
            except RuntimeError as exc:
                bench.logger.error("%s failed: %s", system.name, exc)
                peer[load.name] = {"error": str(exc)}

    def decode(name: str, load: str, key: str = "decode_tok_s") -> float | None:
        return ((results.get(name) or {}).get(load) or {}).get(key)

    def ratio(a: float | None, b: float | None) -> float | None:
        return a / b if a and b else None

    names = [load.name for load in work]
    totals = {
        k: ((results.get(f"astrai_{k}") or {}).get("stats") or {}).get("kv_tokens_total")
        for k in ("auto", "int8")
    }
    capacity = ratio(totals["int8"], totals["auto"])
    speed = {n: ratio(decode("astrai_int8", n), decode("astrai_auto", n)) for n in names}
    headline = {}
    for name, r in results.items():
        headline[name] = {}
        for n in names:
            x = r.get(n) or {}
            headline[name][n] = {
                "decode_tok_s": x.get("decode_tok_s"),
                "decode_tok_s_itl_p50": x.get("decode_tok_s_itl_p50"),
                "ttft_p50_s": (x.get("ttft_s") or {}).get("p50"),
                "itl_p50_ms": ((x.get("itl_s") or {}).get("p50") or 0) * 1e3 or None,
            }
    answers = {
        n: same_answers(texts[("astrai_auto", n)], texts[("astrai_int8", n)], p)
        for n in names
        if ("astrai_auto", n) in texts and ("astrai_int8", n) in texts
    }
    summary = {
        "config": {
            "quick": args.quick,
            "cores": os.cpu_count(),
            "gguf": str(gguf),
            "model_dtype": model_dtype,
            "kv_memory": args.kv_memory,
            "kv_bytes_per_token_model_dtype": per_token,
            "max_seq_len": MAX_SEQ_LEN,
            "max_batch_size": batch,
            "new_tokens": new_tokens,
            "workloads": {
                load.name: {"streams": load.streams, "prompt_tokens": load.prompt_tokens} for load in work
            },
            "server_logs": str(log_dir),
        },
        "headline": headline,
        "context_capacity": {
            "kv_tokens_total": totals,
            "int8_over_auto": capacity,
            "target": CAPACITY_TARGET,
            "meets_target": capacity is not None and capacity >= CAPACITY_TARGET,
        },
        "decode_int8_over_auto": {
            **speed,
            "target": DECODE_TARGET,
            "meets_target": {n: r is not None and r >= DECODE_TARGET for n, r in speed.items()},
        },
        "decode_int8_over_auto_itl_p50": {
            n: ratio(
                decode("astrai_int8", n, "decode_tok_s_itl_p50"),
                decode("astrai_auto", n, "decode_tok_s_itl_p50"),
            )
            for n in names
        },
        "decode_astrai_int8_over_llama_q8": {
            n: ratio(decode("astrai_int8", n), decode("llama_server_q8", n)) for n in names
        },
        "same_answers_auto_vs_int8": answers,
        "systems": results,
        "notes": [
            "decode_tok_s: content chunks streamed while every request of the workload is past its first "
            "token and none has finished, over that window (no prefill in it); where the window is empty, "
            "the sum of per-request (n - 1) / (t_last - t_first) (decode_basis says which); a chunk is a token "
            "(see chunks_per_request against output_tokens_per_request)",
            "decode_tok_s_itl_p50: streams / the median gap between chunks (all requests' gaps, prefill "
            "steps included): less swayed by a few stalls on a busy machine",
            "ttft_s, itl_s, tpot_s, e2e_s as in serve_bench.py; each server gets one untimed 4-token request "
            "before each workload",
            "llama-server: the same GGUF, -ctk q8_0 -ctv q8_0 -fa on, -np = the workload's streams, "
            "-c = streams x (prompt + new + 64), one server per workload (start.sh's -c/-np overridden)",
            "same_answers compares the astrai auto and int8 texts request by request (greedy); informative only",
        ],
    }
    sys.stdout.write(json.dumps(summary, indent=2) + "\n")
    failed = any("error" in r for r in results.values()) or any(
        "error" in x for x in (results.get("llama_server_q8") or {}).values()
    )
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
