"""What constrained decoding costs: astrai serve's W2-shaped load, every request JSON-schema \
constrained vs none.

One ``astrai serve`` (serve_bench's command, dtype and offline setup) runs the same 32 chat
requests, 8 streams at a time, twice per round: unconstrained, and with
``response_format: {"type": "json_schema", ...}`` on every request (``PERSON``: a nested object,
enums, a bounded array, strings with ``maxLength`` and integer ranges, so that every answer
completes well within ``max_tokens``). Both variants sample at temperature 1.0 with a seed per
request (the same seeds in both) and stop at EOS (no ``ignore_eos``: a constrained answer ends
when its grammar completes). The order of the variants alternates over ``--repeats`` rounds.

A constrained answer is about half as long as a free one, so its prefill weighs twice as much
per output token: the raw ratio mixes that in. Each round therefore also runs a third variant,
``matched``: unconstrained, each request with ``max_tokens`` set to the length of the same
request's constrained answer in the latest constrained run and ``ignore_eos``, so both do the same
prefills and decode the same number of tokens per request, and only the cost of the constraint
(fill, apply, accept; the JSON's own tokens) differs. The target is on that ratio.

Reported, as one JSON object: the median output tokens/s of each variant and the ratios
(constrained / matched: the target, >= 0.9; constrained / unconstrained: raw), the median
per-request time per output token, the fraction of constrained answers that ``json.loads`` and
validate against ``PERSON`` with ``jsonschema`` (must be 1.0), and the compile time of a schema,
twice:

- over HTTP: K distinct schemas (``PERSON`` with renamed properties, so that nothing is cached),
  each as one non-streaming request with ``max_tokens`` 1, timed against the same request
  unconstrained; the difference is compile + first mask;
- in-process, cold, on the default model's tokenizer: ``xgrammar``'s own compiler with its
  defaults, and ``astrai.grammar.GrammarCache`` (the server's path: compact JSON, one thread).

Usage: python benchmarks/structured_bench.py [--quick] [--dtype bfloat16] [--repeats 3]

Reuses serve_bench.py, which must sit beside it. Over 300 lines because the two measurements
(serving throughput with answer validation, and compile time over HTTP and in-process) share
one server start and one schema set, and a benchmark is one script to copy and run.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import importlib.metadata as md
import json
import logging
import os
import statistics
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path

import httpx
import jsonschema
import serve_bench as bench  # beside this file: the script's directory is on sys.path

logger = logging.getLogger("structured_bench")
TARGET = 0.9  # constrained / unconstrained output tokens/s
VOCAB_SIZE = 49152  # the default model's (SmolLM2) embedding rows
MAX_TOKENS = 256
TEMPERATURE = 1.0
STRING = {"type": "string", "minLength": 1, "maxLength": 16}
PERSON = {
    "type": "object",
    "properties": {
        "name": STRING,
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "address": {
            "type": "object",
            "properties": {
                "city": STRING,
                "country": {
                    "type": "string",
                    "enum": ["France", "Germany", "Japan", "Brazil", "Canada", "Other"],
                },
            },
            "required": ["city", "country"],
            "additionalProperties": False,
        },
        "job": {"enum": ["student", "engineer", "artist", "doctor", "teacher", "retired"]},
        "hobbies": {"type": "array", "items": STRING, "minItems": 1, "maxItems": 3},
    },
    "required": ["name", "age", "address", "job", "hobbies"],
    "additionalProperties": False,
}


def response_format(schema: dict, name: str = "person") -> dict:
    return {
        "response_format": {
            "type": "json_schema",
            "json_schema": {"name": name, "schema": schema, "strict": True},
        }
    }


def renamed(schema: dict, suffix: str) -> dict:
    """``schema`` with every property name (and ``required`` entry) suffixed: the same shape, a new
    compile."""
    out = dict(schema)
    if "properties" in schema:
        out["properties"] = {k + suffix: renamed(v, suffix) for k, v in schema["properties"].items()}
        out["required"] = [k + suffix for k in schema.get("required", [])]
    return out


def chat_load(quick: bool) -> bench.Workload:
    """W2's shape (8 concurrent streams) over 32 requests asking for a JSON object."""
    n, concurrency = (4, 2) if quick else (32, 8)
    ask = "Describe person #{} as JSON with name, age, city and hobbies."
    return bench.Workload(
        "W2", [[{"role": "user", "content": ask.format(i + 1)}] for i in range(n)], concurrency, MAX_TOKENS
    )


class _Tee(httpx.AsyncByteStream):
    def __init__(self, inner: httpx.AsyncByteStream, sink: list[bytes]) -> None:
        self.inner, self.sink = inner, sink

    async def __aiter__(self):
        async for chunk in self.inner:
            self.sink.append(chunk)
            yield chunk

    async def aclose(self) -> None:
        await self.inner.aclose()


class Recorder(httpx.AsyncBaseTransport):
    """A transport that keeps each request's JSON body with the bytes of its response: the answers
    serve_bench's ``one_request`` streams, which it times but does not return."""

    def __init__(self, inner: httpx.AsyncBaseTransport) -> None:
        self.inner, self.exchanges = inner, []  # [(request body, response chunks)]

    async def handle_async_request(self, request: httpx.Request) -> httpx.Response:
        resp = await self.inner.handle_async_request(request)
        sink: list[bytes] = []
        self.exchanges.append((json.loads(request.content), sink))
        return httpx.Response(
            resp.status_code, headers=resp.headers, stream=_Tee(resp.stream, sink), extensions=resp.extensions
        )

    async def aclose(self) -> None:
        await self.inner.aclose()


def answer(chunks: list[bytes]) -> tuple[str, str | None]:
    """The text and finish reason of one recorded SSE chat stream."""
    text, finish = [], None
    for line in b"".join(chunks).decode(errors="replace").splitlines():
        if line.startswith("data:") and line[5:].strip() != "[DONE]":
            for choice in json.loads(line[5:]).get("choices") or []:
                text.append((choice.get("delta") or {}).get("content") or "")
                finish = choice.get("finish_reason") or finish
    return "".join(text), finish


def score(texts: list[tuple[str, str | None]]) -> dict:
    """Finish reasons, and the fractions of answers that parse as JSON and validate against ``PERSON``."""
    parsed, valid = 0, 0
    for text, _ in texts:
        try:
            obj = json.loads(text)
        except ValueError:
            continue
        parsed += 1
        valid += jsonschema.Draft202012Validator(PERSON).is_valid(obj)
    n = len(texts)
    return {
        "n": n,
        "parse": parsed / n,
        "validate": valid / n,
        "finish_reasons": dict(Counter(f for _, f in texts)),
        "example": texts[0][0] if texts else None,
    }


async def seeded_batch(
    client: httpx.AsyncClient,
    system: bench.System,
    wl: bench.Workload,
    p: bench.Prompts,
    lengths: list[int] | None = None,
) -> dict:
    """serve_bench's ``timed_batch``, with request i seeded i (the server's ``seed``); with ``lengths``,
    request i has ``max_tokens`` ``lengths[i]`` and ``ignore_eos``. ``lengths`` in the result: each
    request's output tokens, in request order."""
    sem = asyncio.Semaphore(wl.concurrency)

    async def go(i: int, messages: list[dict]) -> bench.Sample:
        extra = {**system.extra, "seed": i, **({"ignore_eos": True} if lengths else {})}
        seeded = dataclasses.replace(system, extra=extra)
        async with sem:
            return await bench.one_request(
                client, seeded, messages, lengths[i] if lengths else wl.max_tokens, p
            )

    t0 = time.perf_counter()
    samples = await asyncio.gather(*(go(i, m) for i, m in enumerate(wl.requests)))
    wall = time.perf_counter() - t0
    return {
        "concurrency": wl.concurrency,
        "max_tokens": wl.max_tokens,
        **bench.summarise(samples, wall),
        "lengths": [s.output_tokens for s in samples],
    }


async def compile_over_http(client: httpx.AsyncClient, system: bench.System, k: int) -> dict:
    """K distinct schemas, each as one ``max_tokens`` 1 request (cold: a new schema), then again
    (warm: cached), against the same request unconstrained (before or after, alternating). Raises
    unless each constrained answer starts the object (a server that ignored the field would look free)."""
    body = {
        "model": system.model,
        "messages": [{"role": "user", "content": "Describe a person as JSON."}],
        "max_tokens": 1,
        "temperature": 0,
    }

    async def timed(extra: dict) -> float:
        t0 = time.perf_counter()
        resp = await client.post(system.base + "/v1/chat/completions", json={**body, **extra})
        elapsed = time.perf_counter() - t0
        if resp.status_code != 200:
            raise RuntimeError(f"max_tokens 1 request: HTTP {resp.status_code}: {resp.text[:300]}")
        if extra and not resp.json()["choices"][0]["message"]["content"].startswith("{"):
            raise RuntimeError(f"constrained answer does not start an object: {resp.text[:300]}")
        return elapsed

    await timed({})  # untimed: caches the prompt's prefix for all three
    t: dict[str, list[float]] = {"unconstrained": [], "cold": [], "warm": []}
    for i in range(k):
        fmt = response_format(renamed(PERSON, f"_{i}"), f"person_{i}")
        if i % 2 == 0:
            t["unconstrained"].append(await timed({}))
        t["cold"].append(await timed(fmt))
        t["warm"].append(await timed(fmt))
        if i % 2 == 1:
            t["unconstrained"].append(await timed({}))
    overhead = [c - u for c, u in zip(t["cold"], t["unconstrained"], strict=True)]
    compile_ = [c - w for c, w in zip(t["cold"], t["warm"], strict=True)]
    return {
        "k": k,
        "overhead_s": bench.pct(overhead),
        "cold_minus_warm_s": bench.pct(compile_),
        "request_s": {name: bench.pct(v) for name, v in t.items()},
        "overhead_values_s": overhead,
    }


async def measure(
    plain: bench.System, constrained: bench.System, wl: bench.Workload, p: bench.Prompts, repeats: int, k: int
) -> dict:
    """Warm-up, compile over HTTP, then ``repeats`` rounds of both variants, alternating the order."""
    recorder = Recorder(httpx.AsyncHTTPTransport(limits=httpx.Limits(max_connections=64)))
    runs: dict[str, list[dict]] = {"unconstrained": [], "constrained": [], "matched": []}
    texts: dict[str, list] = {"unconstrained": [], "constrained": [], "matched": []}
    variants = [("unconstrained", plain), ("constrained", constrained), ("matched", plain)]
    lengths: list[int] | None = None  # the latest constrained run's, for "matched"
    async with httpx.AsyncClient(timeout=httpx.Timeout(3600.0, connect=10.0), transport=recorder) as client:
        for _, system in variants[
            :2
        ]:  # untimed: lazy initialisation, and PERSON compiled once (cached by spec)
            warm = await bench.one_request(client, system, wl.requests[0], 16, p)
            if warm.error:
                raise RuntimeError(f"warm-up request failed: {warm.error}")
        http = await compile_over_http(client, plain, k)
        for r in range(repeats):  # "matched" always after a constrained run; the other two alternate
            for name, system in variants if r % 2 == 0 else [variants[1], variants[2], variants[0]]:
                recorder.exchanges.clear()
                result = await seeded_batch(client, system, wl, p, lengths if name == "matched" else None)
                if result["errors"]:
                    raise RuntimeError(f"{name}: {result['errors'][:3]}")
                if name == "constrained":
                    lengths = result["lengths"]
                runs[name].append(result)
                texts[name] += [answer(chunks) for _, chunks in recorder.exchanges]
                logger.info("round %d %s: %.2f output tokens/s", r, name, result["output_tokens_per_s"])
    rate = {name: statistics.median(x["output_tokens_per_s"] for x in v) for name, v in runs.items()}
    tpot = {name: statistics.median(x["tpot_s"]["p50"] for x in v) for name, v in runs.items()}
    mean_out = {
        name: sum(x["output_tokens"] for x in v) / sum(x["requests"] for x in v) for name, v in runs.items()
    }
    ratio = rate["constrained"] / rate["matched"]
    return {
        "output_tokens_per_s": {
            **rate,
            "ratio": ratio,
            "raw_ratio": rate["constrained"] / rate["unconstrained"],
            "target": TARGET,
            "meets_target": ratio >= TARGET,
        },
        "tpot_p50_s": {**tpot, "ratio": tpot["constrained"] / tpot["matched"]},
        "output_tokens_per_request_mean": mean_out,
        "answers": {name: score(t) for name, t in texts.items()},
        "compile_over_http": http,
        "runs": runs,
    }


def compile_in_process(gguf: Path, k: int) -> dict:
    """Cold compiles of K distinct schemas: xgrammar's compiler with its defaults, and GrammarCache."""
    import xgrammar

    from astrai.grammar import GrammarCache, GrammarSpec
    from astrai.model.tokenizer import Tokenizer

    tokenizer = Tokenizer.from_gguf(gguf)
    schemas = [renamed(PERSON, f"_{i}") for i in range(k)]
    t0 = time.perf_counter()
    compiler = xgrammar.GrammarCompiler(
        xgrammar.TokenizerInfo.from_huggingface(tokenizer.hf, vocab_size=VOCAB_SIZE)
    )
    info_s = time.perf_counter() - t0
    direct = []
    for schema in schemas:
        t0 = time.perf_counter()
        compiler.compile_json_schema(json.dumps(schema))
        direct.append(time.perf_counter() - t0)
    cache = GrammarCache(tokenizer, VOCAB_SIZE, sorted(tokenizer.eos_token_ids))
    t0 = time.perf_counter()
    _ = cache.backend  # made on first use: its TokenizerInfo
    backend_s = time.perf_counter() - t0
    cached = []
    for schema in schemas:
        t0 = time.perf_counter()
        cache.compile(GrammarSpec.of("json_schema", schema))
        cached.append(time.perf_counter() - t0)
    return {
        "k": k,
        "xgrammar": {"tokenizer_info_s": info_s, "compile_s": bench.pct(direct), "values_s": direct},
        "grammar_cache": {"backend_s": backend_s, "compile_s": bench.pct(cached), "values_s": cached},
    }


NOTES = [
    "ratio is constrained / matched output tokens/s (medians over rounds): matched is unconstrained "
    "with each request's max_tokens the length of its constrained answer and ignore_eos, so that both "
    "variants do the same prefills and decode as many tokens; raw_ratio is constrained / unconstrained, "
    "whose answers are about twice as long (see output_tokens_per_request_mean), which makes its "
    "prefill cost less per output token",
    "all variants: temperature 1.0, request i seeded i; unconstrained and constrained stop at EOS or "
    "max_tokens (no ignore_eos); one untimed request of each first, so PERSON is compiled (and cached) "
    "before the timed rounds",
    "answers.*.validate: json.loads + jsonschema (Draft 2020-12) against PERSON, "
    "over every answer of every round",
    "compile_over_http.overhead_s: a max_tokens 1 request with a new schema minus the same request "
    "unconstrained (compile on the server's worker thread + first mask); cold_minus_warm_s: the new schema's "
    "request minus its repeat (cached): compile alone; the prompt's prefix is cached for all",
    "compile_in_process: cold (each schema new to its compiler); "
    "xgrammar's defaults (any_whitespace, 8 threads) "
    "vs GrammarCache, the server's path (compact JSON, max_threads 1); measured before the server starts",
]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    bench.add_common_arguments(ap)
    ap.add_argument("--repeats", type=int, default=3, help="rounds of each variant (medians are reported)")
    ap.add_argument("--schemas", type=int, default=16, help="K distinct schemas for the compile times")
    args = ap.parse_args()
    gguf, folder, prompts = bench.prepare(args)
    k = min(args.schemas, 4) if args.quick else args.schemas
    wl = chat_load(args.quick)
    in_process = compile_in_process(gguf, k)  # before the server: the two would share the cores
    plain = dataclasses.replace(
        bench.make_systems(args.dtype, folder)["astrai"](bench.free_port()),
        extra={"temperature": TEMPERATURE},
    )
    constrained = dataclasses.replace(plain, extra={**plain.extra, **response_format(PERSON)})
    log_dir = Path(tempfile.mkdtemp(prefix="structured-bench-"))
    try:
        with bench.serving(plain, log_dir) as head:
            result = {**head, **asyncio.run(measure(plain, constrained, wl, prompts, args.repeats, k))}
    except RuntimeError as exc:
        logger.error("astrai failed: %s", exc)
        result = {"error": str(exc)}
    versions = {d: md.version(d) for d in ("astrai-core", "astrai-server", "torch", "xgrammar")}
    summary = {
        "config": {
            "quick": args.quick,
            "dtype": args.dtype,
            "device": "cpu",
            "cores": os.cpu_count(),
            "gguf": gguf.name,
            "repeats": args.repeats,
            "requests": len(wl.requests),
            "concurrency": wl.concurrency,
            "max_tokens": wl.max_tokens,
            "temperature": TEMPERATURE,
            "schema": PERSON,
            "server_logs": str(log_dir),
            "versions": versions,
        },
        "astrai": result,
        "compile_in_process": in_process,
        "notes": NOTES,
    }
    sys.stdout.write(json.dumps(summary, indent=2) + "\n")  # the benchmark's output: one JSON object
    ok = "error" not in result and result["answers"]["constrained"]["validate"] == 1.0
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
