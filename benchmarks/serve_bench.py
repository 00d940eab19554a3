"""Serving benchmark: ``astrai serve`` vs ``transformers serve --continuous-batching``, same model and dtype.

One run starts each server in turn as a subprocess on a free loopback port (never both at
once: they would share the same cores), waits for ``/health``, drives it with an async
OpenAI-streaming client (SSE ``data:`` lines over httpx), stops it, and prints one JSON
object: per-system metrics per workload and the astrai/transformers ratios.

- W1: one stream at a time, 128 new tokens, 3 requests.
- W2: 8 concurrent, user prompts of 32 to 512 tokens (seed 0), 128 new tokens.
- W3: 8 concurrent, a shared 1,000-token system prompt plus a short distinct user turn,
  32 new tokens; one untimed request with the same system prompt goes first (warms the prefix).

transformers serves a dequantized copy of the default GGUF (loaded by transformers, GGUF
quantization marker dropped from its config, saved once under ``--cache-dir``). Everything
runs offline (``HF_HUB_OFFLINE=1``).

Usage: python benchmarks/serve_bench.py [--quick] [--only astrai|transformers] [--dtype bfloat16]

Over 300 lines because it is one self-contained script: copied to another machine, it runs
with nothing else of the repository's benchmarks beside it.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import importlib.metadata as md
import json
import logging
import os
import random
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import httpx

logger = logging.getLogger("serve_bench")
PARAGRAPH = (
    "The history of computing is a story of abstraction layered upon abstraction. Early machines were "
    "programmed by rewiring panels; later, stored programs let the same hardware run many tasks. Assemblers "
    "gave names to instructions, compilers translated structured languages, and operating systems hid the "
    "details of devices behind files and processes. Networks joined distant machines, databases kept records "
    "consistent under concurrent use, and graphical interfaces let people point instead of type. Each layer "
    "made the one below it easier to forget, and each new generation of programmers built on ground that "
    "the previous one had to lay by hand."
)
TARGETS = {"W1": 2.0, "W2": 3.0, "W3": 8.0}  # issue 4: astrai/transformers output tokens/s
STARTUP_TIMEOUT_S = 900.0
OFFLINE = {"HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"}


@dataclass
class Workload:
    name: str
    requests: list[list[dict]] | list[str]  # chat messages per request, or prompt strings (completions)
    concurrency: int
    max_tokens: int
    warmup: list[dict] | None = None  # sent once first, untimed


@dataclass
class System:
    name: str
    command: list[str]
    # the request's "model": a pinned transformers serve wants exactly the name it was started with
    model: str
    extra: dict  # request fields that make this server ignore EOS
    port: int

    @property
    def base(self) -> str:
        return f"http://127.0.0.1:{self.port}"


@dataclass
class Sample:
    ttft: float = 0.0
    e2e: float = 0.0
    gaps: list[float] = field(default_factory=list)
    output_tokens: int = 0
    prompt_tokens: int | None = None
    from_usage: bool = True
    error: str | None = None


def dequantized_copy(gguf: Path, dtype: str, cache: Path) -> Path:
    """A transformers folder holding ``gguf`` dequantized to ``dtype``; built once, then reused."""
    dest = cache / f"{gguf.stem}-{dtype}"
    if (
        (dest / "config.json").is_file()
        and (dest / "tokenizer.json").is_file()
        and any(dest.glob("*.safetensors"))
    ):
        return dest
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    logger.info("dequantizing %s to %s (once)", gguf.name, dest)
    model = AutoModelForCausalLM.from_pretrained(
        gguf.parent, gguf_file=gguf.name, dtype=getattr(torch, dtype)
    )
    tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    # The weights are already plain dequantized tensors; a config still marked "gguf" would make
    # from_pretrained look for a GGUF file in the folder.
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    model.hf_quantizer = None
    cache.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(dir=cache, prefix=dest.name + ".tmp-"))
    model.save_pretrained(tmp)
    tokenizer.save_pretrained(tmp)
    tmp.rename(dest)  # a half-written copy is never taken for a finished one
    return dest


class Prompts:
    """User texts of a given token length, cut at word boundaries of ``PARAGRAPH`` (stable tokenization)."""

    def __init__(self, tokenizer) -> None:
        self.tok, self.words = tokenizer, PARAGRAPH.split()

    def count(self, text: str) -> int:
        return len(self.tok.encode(text, add_special_tokens=False).ids)

    def text(self, n_tokens: int, offset: int) -> str:
        """The longest run of words from ``offset`` (cycling) with at most ``n_tokens`` tokens."""
        words = [self.words[(offset + i) % len(self.words)] for i in range(n_tokens + 1)]
        lo, hi = 1, len(words)  # every word is at least one token: n_tokens + 1 words are too many
        while lo < hi:
            mid = (lo + hi + 1) // 2
            lo, hi = (mid, hi) if self.count(" ".join(words[:mid])) <= n_tokens else (lo, mid - 1)
        return " ".join(words[:lo])


def workloads(p: Prompts, quick: bool) -> list[Workload]:
    """W1-W3; distinct word offsets keep prompts from sharing a prefix beyond the chat template's."""
    n_words = len(p.words)
    rng = random.Random(0)
    w1_n, w2_n, w3_n = (1, 2, 2) if quick else (3, 8, 8)
    new1, new2, new3 = (8, 8, 4) if quick else (128, 128, 32)
    w1_len, lo, hi, sys_len = (32, 32, 64, 128) if quick else (128, 32, 512, 1000)
    offsets = rng.sample(range(1, n_words), w1_n + w2_n)
    w1 = [[{"role": "user", "content": p.text(w1_len, o)}] for o in offsets[:w1_n]]
    w2 = [[{"role": "user", "content": p.text(rng.randint(lo, hi), o)}] for o in offsets[w1_n:]]
    system = {"role": "system", "content": p.text(sys_len, 0)}

    def turn(i: int) -> list[dict]:
        return [
            system,
            {"role": "user", "content": f"Question {i}: in one sentence, what is the main idea above?"},
        ]

    return [
        Workload("W1", w1, 1, new1),
        Workload("W2", w2, w2_n, new2),
        Workload("W3", [turn(i + 1) for i in range(w3_n)], w3_n, new3, warmup=turn(0)),
    ]


async def one_request(
    client: httpx.AsyncClient, system: System, messages: list[dict] | str, max_tokens: int, p: Prompts
) -> Sample:
    """Stream one chat completion, or one completion (``/v1/completions``) when ``messages`` is a
    prompt string (a base model has no chat template); times are perf_counter seconds from the send."""
    chat = not isinstance(messages, str)
    body = {
        "model": system.model,
        **({"messages": messages} if chat else {"prompt": messages}),
        "max_tokens": max_tokens,
        "temperature": 0,
        "stream": True,
        "stream_options": {"include_usage": True},
        **system.extra,
    }
    stamps: list[float] = []
    text: list[str] = []
    usage = None
    t0 = time.perf_counter()
    try:
        route = "/v1/chat/completions" if chat else "/v1/completions"
        async with client.stream("POST", system.base + route, json=body) as resp:
            if resp.status_code != 200:
                detail = (await resp.aread()).decode(errors="replace")[:300]
                return Sample(error=f"HTTP {resp.status_code}: {detail}")
            async for line in resp.aiter_lines():
                if not line.startswith("data:"):
                    continue
                data = line[5:].strip()
                if data == "[DONE]":
                    break
                chunk = json.loads(data)
                if "error" in chunk:
                    return Sample(error=f"in-stream error: {str(chunk['error'])[:300]}")
                usage = chunk.get("usage") or usage
                for choice in chunk.get("choices") or []:
                    piece = (choice.get("delta") or {}).get("content") if chat else choice.get("text")
                    if piece:
                        stamps.append(time.perf_counter())
                        text.append(piece)
    except (httpx.HTTPError, ValueError) as exc:
        return Sample(error=f"{type(exc).__name__}: {exc}")
    end = time.perf_counter()
    if not stamps:
        return Sample(error="no content chunk")
    gaps = [b - a for a, b in zip(stamps[:-1], stamps[1:], strict=True)]
    out = Sample(ttft=stamps[0] - t0, e2e=end - t0, gaps=gaps)
    if usage and usage.get("completion_tokens") is not None:
        out.output_tokens, out.prompt_tokens = usage["completion_tokens"], usage.get("prompt_tokens")
    else:
        out.output_tokens, out.from_usage = p.count("".join(text)), False
    return out


def pct(values: list[float]) -> dict | None:
    """p50/p90/p99 and mean (linear interpolation between order statistics); None for no values."""
    if not values:
        return None
    v = sorted(values)

    def q(f: float) -> float:
        k = f * (len(v) - 1)
        i = int(k)
        return v[i] + (v[min(i + 1, len(v) - 1)] - v[i]) * (k - i)

    return {"p50": q(0.5), "p90": q(0.9), "p99": q(0.99), "mean": sum(v) / len(v), "n": len(v)}


def summarise(samples: list[Sample], wall: float) -> dict:
    ok = [s for s in samples if s.error is None]
    out_tokens = sum(s.output_tokens for s in ok)
    prompt = [s.prompt_tokens for s in ok if s.prompt_tokens is not None]
    return {
        "requests": len(samples),
        "errors": [s.error for s in samples if s.error],
        "wall_s": wall,
        "output_tokens": out_tokens,
        "output_tokens_per_s": out_tokens / wall if ok else None,
        "output_tokens_per_request": sorted({s.output_tokens for s in ok}),
        "prompt_tokens_mean": sum(prompt) / len(prompt) if prompt else None,
        "tokens_counted_from": sorted({"usage" if s.from_usage else "tokenizer" for s in ok}),
        "ttft_s": pct([s.ttft for s in ok]),
        "itl_s": pct([g for s in ok for g in s.gaps]),
        "tpot_s": pct([(s.e2e - s.ttft) / (s.output_tokens - 1) for s in ok if s.output_tokens > 1]),
        "e2e_s": pct([s.e2e for s in ok]),
    }


async def timed_batch(client: httpx.AsyncClient, system: System, wl: Workload, p: Prompts) -> dict:
    """All of ``wl.requests``, at most ``wl.concurrency`` in flight; wall time from the first send."""
    sem = asyncio.Semaphore(wl.concurrency)

    async def go(messages: list[dict]) -> Sample:
        async with sem:
            return await one_request(client, system, messages, wl.max_tokens, p)

    t0 = time.perf_counter()
    samples = await asyncio.gather(*(go(m) for m in wl.requests))
    wall = time.perf_counter() - t0
    return {"concurrency": wl.concurrency, "max_tokens": wl.max_tokens, **summarise(samples, wall)}


async def run_workloads(system: System, loads: list[Workload], p: Prompts) -> dict:
    results: dict = {}
    timeout = httpx.Timeout(3600.0, connect=10.0)
    async with httpx.AsyncClient(timeout=timeout, limits=httpx.Limits(max_connections=64)) as client:
        # one short untimed request: lazy initialisation (transformers builds its CB manager here)
        warm = await one_request(client, system, [{"role": "user", "content": "Hello"}], 4, p)
        if warm.error:
            raise RuntimeError(f"warm-up request failed: {warm.error}")
        for wl in loads:
            if wl.warmup is not None:
                await one_request(client, system, wl.warmup, wl.max_tokens, p)
            results[wl.name] = await timed_batch(client, system, wl, p)
            rate = results[wl.name]["output_tokens_per_s"] or 0.0
            logger.info("%s %s: %.2f output tokens/s", system.name, wl.name, rate)
    return results


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextlib.contextmanager
def serving(system: System, log_dir: Path) -> Iterator[dict]:
    """Start ``system``, wait for /health, yield its startup time, command and process id; stop it
    on exit (its own process group only)."""
    log_path = log_dir / f"{system.name}.log"
    with open(log_path, "wb") as log:
        env = {**os.environ, **OFFLINE}
        proc = subprocess.Popen(
            system.command, stdout=log, stderr=subprocess.STDOUT, env=env, start_new_session=True
        )
    try:
        t0 = time.perf_counter()
        while True:
            if proc.poll() is not None:
                raise RuntimeError(f"exited with {proc.returncode} before /health was 200: {tail(log_path)}")
            if time.perf_counter() - t0 > STARTUP_TIMEOUT_S:
                raise RuntimeError(f"/health not 200 after {STARTUP_TIMEOUT_S:.0f} s: {tail(log_path)}")
            try:
                if httpx.get(system.base + "/health", timeout=2.0).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            time.sleep(1.0)
        yield {"startup_s": time.perf_counter() - t0, "command": " ".join(system.command), "pid": proc.pid}
    finally:
        stop(proc)


def serve_and_run(system: System, loads: list[Workload], p: Prompts, log_dir: Path) -> dict:
    """Start ``system``, run the workloads, stop it."""
    with serving(system, log_dir) as head:
        return {**head, **asyncio.run(run_workloads(system, loads, p))}


def stop(proc: subprocess.Popen) -> None:
    for sig, wait in ((signal.SIGINT, 30), (signal.SIGTERM, 10), (signal.SIGKILL, 10)):
        if proc.poll() is not None:
            return
        try:
            os.killpg(proc.pid, sig)  # the server's own session: start_new_session=True
        except ProcessLookupError:
            return
        try:
            proc.wait(wait)
        except subprocess.TimeoutExpired:
            continue


def tail(path: Path, n: int = 1500) -> str:
    return path.read_text(errors="replace")[-n:]


def ratios(a: dict, t: dict) -> dict:
    """astrai / transformers per workload: throughput > 1 and latency < 1 favour astrai."""
    out = {}
    for name, target in TARGETS.items():
        x, y = a.get(name), t.get(name)
        if not x or not y or x["errors"] or y["errors"] or not y["output_tokens_per_s"]:
            continue
        r = x["output_tokens_per_s"] / y["output_tokens_per_s"]
        latency = {
            f"{k}_p50": x[k]["p50"] / y[k]["p50"] for k in ("ttft_s", "tpot_s", "e2e_s") if x[k] and y[k]
        }
        out[name] = {"output_tokens_per_s": r, "target": target, "meets_target": r >= target, **latency}
    return out


NOTES = [
    "ratios are astrai / transformers: output_tokens_per_s > 1 and *_p50 latency < 1 favour astrai",
    "astrai gets ignore_eos: true; transformers serve answers 422 to fields it does not know (ignore_eos, "
    "min_tokens), so it gets generation_config '{\"eos_token_id\": -1}', which its continuous-batching path "
    "passes per request as the stop set (-1: none); both therefore emit max_tokens tokens "
    "(see output_tokens_per_request)",
    "output tokens come from the usage the server streams (transformers puts it on its finish chunk and "
    "logs stream_options as unsupported); a stream without usage is counted with the model tokenizer",
    "itl_s: gaps between content chunks as received (a chunk may carry several tokens; special tokens are "
    "not streamed); tpot_s: per request (e2e - ttft) / (output_tokens - 1)",
    "each server gets one untimed 4-token request before W1; W3 sends one untimed request with the shared "
    "system prompt first; wall_s spans the timed requests of a workload",
    "both servers use the model's chat template (a default system prompt when none is given); "
    "transformers serve busy-polls a core while idle, so the servers never run at the same time",
]


def make_systems(dtype: str, folder: Path) -> dict:
    """name -> (port -> System): the two servers, started from this venv's console scripts."""
    bindir = Path(sys.executable).parent
    astrai = [str(bindir / "astrai"), "serve"]
    if not (bindir / "astrai").exists():
        astrai = [sys.executable, "-m", "astrai_server"]
    no_eos = {"generation_config": json.dumps({"eos_token_id": -1, "do_sample": False})}  # see NOTES
    hf = [str(bindir / "transformers"), "serve", "--continuous-batching", "--dtype", dtype, "--device", "cpu"]

    def address(port: int) -> list[str]:
        return ["--host", "127.0.0.1", "--port", str(port)]

    return {
        "astrai": lambda port: System(
            "astrai",
            [*astrai, *address(port), "--dtype", dtype, "--log-level", "warning"],
            "astrai",
            {"ignore_eos": True},
            port,
        ),
        "transformers": lambda port: System(
            "transformers",
            [*hf, *address(port), str(folder)],
            str(folder),
            no_eos,
            port,
        ),
    }


def add_common_arguments(ap: argparse.ArgumentParser) -> None:
    """The options this script shares with the scripts that reuse it (logprobs_bench.py)."""
    ap.add_argument("--quick", action="store_true", help="tiny workloads (smoke run)")
    ap.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    ap.add_argument("--cache-dir", type=Path, default=Path.home() / ".cache" / "astrai-bench")


def prepare(args: argparse.Namespace) -> tuple[Path, Path, Prompts]:
    """Logging to stderr, offline, then the default GGUF, its dequantized copy and the prompt maker."""
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s", stream=sys.stderr)
    logging.getLogger("httpx").setLevel(logging.WARNING)  # one INFO line per request otherwise
    os.environ.update(OFFLINE)

    from tokenizers import Tokenizer

    from astrai.model.resolve import resolve_model

    _, gguf = resolve_model(None)
    folder = dequantized_copy(gguf, args.dtype, args.cache_dir.expanduser())
    return gguf, folder, Prompts(Tokenizer.from_file(str(folder / "tokenizer.json")))


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_common_arguments(ap)
    ap.add_argument("--only", choices=["astrai", "transformers"], help="run one system")
    args = ap.parse_args()
    gguf, folder, prompts = prepare(args)
    loads = workloads(prompts, args.quick)
    systems = make_systems(args.dtype, folder)
    log_dir = Path(tempfile.mkdtemp(prefix="serve-bench-"))
    results: dict = {}
    for name, make in systems.items():  # in turn: a server that waits still takes CPU
        if args.only in (None, name):
            try:
                results[name] = serve_and_run(make(free_port()), loads, prompts, log_dir)
            except RuntimeError as exc:
                logger.error("%s failed: %s", name, exc)
                results[name] = {"error": str(exc)}
    versions = {d: md.version(d) for d in ("astrai-core", "astrai-server", "transformers", "torch")}
    lengths = {w.name: [prompts.count(m[-1]["content"]) for m in w.requests] for w in loads}
    summary = {
        "config": {
            "quick": args.quick,
            "dtype": args.dtype,
            "device": "cpu",
            "cores": os.cpu_count(),
            "gguf": gguf.name,
            "transformers_model": str(folder),
            "server_logs": str(log_dir),
            "versions": versions,
            "user_prompt_tokens": lengths,
            "w3_system_prompt_tokens": prompts.count(loads[2].requests[0][0]["content"]),
        },
        "systems": results,
        "ratios": ratios(results.get("astrai", {}), results.get("transformers", {})),
        "notes": NOTES,
    }
    sys.stdout.write(json.dumps(summary, indent=2) + "\n")  # the benchmark's output: one JSON object
    return 0 if all("error" not in r for r in results.values()) else 1


if __name__ == "__main__":
    sys.exit(main())
