"""Shipped models: ``astrai serve`` vs llama.cpp's ``llama-server`` on the same GGUF file.

For each model (``--models``; default gemma3-270m, the Gemma 3 270M base model, then smollm2-135m,
the default model), each server in turn (never two at once) is started on the model's GGUF and
reports:

- start-up: seconds from the process start to ``/health`` 200, and astrai's own load time (its
  ``loaded ... in X s`` log line: reading, checking and building the model);
- the first request on the cold server (time to first token and end to end) and a second one
  like it (a 128-token prompt, 8 new tokens, another part of the text);
- for the models in ``--workloads`` (default gemma3-270m), quant_bench.py's workloads with the
  same streaming client: W1 (8 requests one at a time), B8 (16 requests, 8 at a time) and B32
  (64, 32 at a time), user prompts of 32 to 512 tokens, 128 new tokens, EOS ignored: output
  tokens/s, time to first token, inter-token latency;
- the server's resident set after the run and at its peak (``/proc/<pid>/status`` VmRSS and
  VmHWM, summed over the server's process tree).

Requests go to ``/v1/completions`` (a base model has no chat template), the prompt sent as
written, streamed, greedy unless ``--sampling`` gives the sampling fields every request sends to
both servers; astrai and llama-server both take ``ignore_eos``. astrai runs with its defaults
for this machine (dtype, ``--weights auto``: say which in ``config.astrai_log``); llama-server
is ``../shared/peers/start.sh llamacpp`` (2 threads, 8 slots of 2,048 tokens, continuous batching,
the file's own quantization), with ``PEER_GGUF`` set to the model's file.

Usage: python benchmarks/family_bench.py [--quick] [--models gemma3-270m,smollm2-135m]
       [--workloads gemma3-270m] [--no-peer] [--peers DIR] [--llama-arg=ARG ...] [--astrai-arg=ARG ...]
       [--sampling JSON]

Reuses serve_bench.py and quant_bench.py, which must sit beside it.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import json
import logging
import os
import re
import sys
import tempfile
from pathlib import Path

import httpx
import quant_bench
import serve_bench as bench  # beside this file: the script's directory is on sys.path

COLD_PROMPT_TOKENS, COLD_NEW_TOKENS = 128, 8


async def measure(system: bench.System, loads: list[bench.Workload], p: bench.Prompts) -> dict:
    """The cold server's first request and a second like it, then ``loads`` (prompt strings)."""
    out: dict = {}
    timeout = httpx.Timeout(3600.0, connect=10.0)
    async with httpx.AsyncClient(timeout=timeout, limits=httpx.Limits(max_connections=64)) as client:
        for key, offset in (("cold_first_request", 3), ("second_request", 40)):
            s = await bench.one_request(
                client, system, p.text(COLD_PROMPT_TOKENS, offset), COLD_NEW_TOKENS, p
            )
            if s.error:
                raise RuntimeError(f"{key} failed: {s.error}")
            out[key] = {"ttft_s": s.ttft, "e2e_s": s.e2e, "output_tokens": s.output_tokens}
        for wl in loads:
            out[wl.name] = await bench.timed_batch(client, system, wl, p)
            rate = out[wl.name]["output_tokens_per_s"] or 0.0
            bench.logger.info("%s %s: %.2f output tokens/s", system.name, wl.name, rate)
    return out


def _tree(pid: int) -> list[int]:
    """``pid`` and its descendants (Linux /proc)."""
    found, todo = [], [pid]
    while todo:
        p = todo.pop()
        found.append(p)
        for task in Path(f"/proc/{p}/task").glob("*"):
            try:
                todo += [int(c) for c in (task / "children").read_text().split()]
            except OSError:
                pass
    return found


def memory_mib(pid: int) -> dict:
    """VmRSS and VmHWM (the peak) in MiB, summed over ``pid``'s process tree."""
    total = {"VmRSS": 0, "VmHWM": 0}
    for p in _tree(pid):
        try:
            for line in Path(f"/proc/{p}/status").read_text().splitlines():
                key = line.split(":")[0]
                if key in total:
                    total[key] += int(line.split()[1])
        except OSError:
            continue
    return {"rss_mib": total["VmRSS"] / 1024, "rss_peak_mib": total["VmHWM"] / 1024}


def load_seconds(log: Path) -> float | None:
    """astrai's own model load time, from its ``loaded NAME (...) in X s`` log line."""
    found = re.search(r"astrai\.model: loaded .* in ([0-9.]+) s", log.read_text(errors="replace"))
    return float(found.group(1)) if found else None


def run(system: bench.System, loads: list[bench.Workload], p: bench.Prompts, log_dir: Path) -> dict:
    with bench.serving(system, log_dir) as head:
        result = {**head, **asyncio.run(measure(system, loads, p)), **memory_mib(head["pid"])}
    log = log_dir / f"{system.name}.log"
    if system.name.startswith("astrai"):
        result["load_s"] = load_seconds(log)
        result["log_model_line"] = next(
            (x for x in log.read_text(errors="replace").splitlines() if "astrai.model: loaded" in x), None
        )
    return result


def prompts_for(gguf: Path) -> bench.Prompts:
    """serve_bench's prompt maker on this model's own tokenizer (its ``tokenizers`` backend)."""
    from astrai.model import Tokenizer

    return bench.Prompts(Tokenizer.from_gguf(gguf).hf.backend_tokenizer)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="tiny workloads (smoke run)")
    ap.add_argument(
        "--models", default="gemma3-270m,smollm2-135m", help="shipped model names, comma-separated"
    )
    ap.add_argument("--workloads", default="gemma3-270m", help="the models that also run W1, B8, B32")
    ap.add_argument("--no-peer", action="store_true", help="without llama-server")
    ap.add_argument(
        "--peers", type=Path, default=quant_bench.PEERS, help="the peers folder (setup.sh, start.sh)"
    )
    ap.add_argument(
        "--llama-arg", action="append", default=[], help="an extra llama-server argument, repeatable"
    )
    ap.add_argument(
        "--astrai-arg", action="append", default=[], help="an extra astrai serve argument, repeatable"
    )
    ap.add_argument(
        "--sampling",
        type=json.loads,
        default={},
        help="sampling fields every request sends to both servers (JSON; default greedy), e.g. "
        '\'{"temperature": 1.0, "top_p": 0.95, "top_k": 0, "min_p": 0}\' (llama-server applies its own '
        "top_k 40 and min_p 0.05 unless told)",
    )
    args = ap.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s", stream=sys.stderr)
    logging.getLogger("httpx").setLevel(logging.WARNING)
    os.environ.update(bench.OFFLINE)
    from astrai.model.resolve import resolve_model

    bindir = Path(sys.executable).parent
    astrai = (
        [str(bindir / "astrai"), "serve"]
        if (bindir / "astrai").exists()
        else [sys.executable, "-m", "astrai_server"]
    )
    log_dir = Path(tempfile.mkdtemp(prefix="family-bench-"))
    results: dict = {}
    config: dict = {
        "quick": args.quick,
        "cores": os.cpu_count(),
        "server_logs": str(log_dir),
        "loadavg_at_start": os.getloadavg(),
        "sampling": args.sampling or {"temperature": 0},
    }
    for model in args.models.split(","):
        gguf = resolve_model(model)[1]
        label = Path(model).name  # a shipped name, or a GGUF file's name (server and log names)
        prompts = prompts_for(gguf)
        loads = [  # quant_bench's, each request's user turn sent as the prompt
            dataclasses.replace(w, requests=[m[-1]["content"] for m in w.requests])
            for w in quant_bench.workloads(prompts, args.quick)
            if model in args.workloads.split(",")
        ]
        config[model] = {
            "gguf": str(gguf),
            "prompt_tokens": {w.name: [prompts.count(text) for text in w.requests] for w in loads},
        }
        systems = {
            "astrai": lambda port, model=model, label=label: bench.System(
                f"astrai-{label}",
                [*astrai, model, "--host", "127.0.0.1", "--port", str(port), *args.astrai_arg],
                "astrai",
                {"ignore_eos": True, **args.sampling},
                port,
            )
        }
        if not args.no_peer:
            systems["llama_server"] = lambda port, model=model, gguf=gguf, label=label: bench.System(
                f"llama_server-{label}",
                [
                    "env",
                    f"PEER_GGUF={gguf}",
                    "bash",
                    str(args.peers / "start.sh"),
                    "llamacpp",
                    str(port),
                    *args.llama_arg,
                ],
                model,
                {"ignore_eos": True, **args.sampling},
                port,
            )
        results[model] = {}
        for name, make in systems.items():
            try:
                results[model][name] = run(make(bench.free_port()), loads, prompts, log_dir)
            except RuntimeError as exc:
                bench.logger.error("%s %s failed: %s", model, name, exc)
                results[model][name] = {"error": str(exc)}
    config["loadavg_at_end"] = os.getloadavg()
    summary = {"config": config, "headline": headline(results), "systems": results}
    sys.stdout.write(json.dumps(summary, indent=2) + "\n")
    return 0 if all("error" not in r for m in results.values() for r in m.values()) else 1


def headline(results: dict) -> dict:
    """Per model and server the figures that matter, and astrai over llama-server where both ran
    (tokens/s above 1, times and memory below 1 favour astrai)."""
    out: dict = {}
    for model, systems in results.items():
        rows = {}
        for name, r in systems.items():
            if "error" in r:
                continue
            row = {
                "startup_s": r["startup_s"],
                "load_s": r.get("load_s"),
                "cold_ttft_s": r["cold_first_request"]["ttft_s"],
                "second_ttft_s": r["second_request"]["ttft_s"],
                "rss_mib": r["rss_mib"],
                "rss_peak_mib": r["rss_peak_mib"],
            }
            for wl in ("W1", "B8", "B32"):
                if wl in r:
                    row[f"{wl}_tok_s"] = r[wl]["output_tokens_per_s"]
                    row[f"{wl}_ttft_p50_s"] = (r[wl]["ttft_s"] or {}).get("p50")
                    row[f"{wl}_itl_p50_ms"] = ((r[wl]["itl_s"] or {}).get("p50") or 0) * 1e3
            rows[name] = row
        if "astrai" in rows and "llama_server" in rows:
            a, b = rows["astrai"], rows["llama_server"]
            rows["astrai_over_llama_server"] = {
                k: a[k] / b[k]
                for k in a
                if k in b and isinstance(a[k], float) and isinstance(b[k], float) and b[k]
            }
        out[model] = rows
    return out


if __name__ == "__main__":
    raise SystemExit(main())
