"""``astrai plugins`` and the plugin options of ``astrai serve``, run as a user runs them (subprocesses)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest


def astrai(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "astrai.cli", *args], capture_output=True, text=True, timeout=120
    )


def test_plugins_lists_every_group_with_distribution_version_and_status() -> None:
    done = astrai("plugins", "--json")
    assert done.returncode == 0, done.stderr
    rows = {(r["group"], r["name"]): r for r in json.loads(done.stdout)}
    expected = {
        ("astrai.attention_backends", "torch_native"): "astrai-core",
        ("astrai.protocols", "openai"): "astrai-server",
        ("astrai.protocols", "ollama"): "astrai-ollama",
        ("astrai.protocols", "ollama_generate"): "astrai-ollama",
        ("astrai.sampling", "top_p"): "astrai-core",
        ("astrai.sampling", "typical_p"): "astrai-typical-p",
        ("astrai.models", "qwen2"): "astrai-core",
        ("astrai.plugins", "request_log"): "astrai-request-log",
        ("astrai.plugins", "astrai_server"): "astrai-server",  # its hook adds `astrai serve`
        ("astrai.reasoning_parsers", "qwen3"): "astrai-core",
        ("astrai.reasoning_parsers", "deepseek_r1"): "astrai-core",
        ("astrai.reasoning_parsers", "none"): "astrai-core",
        ("astrai.tool_parsers", "hermes"): "astrai-core",
        ("astrai.tool_parsers", "llama3_json"): "astrai-core",
    }
    for key, dist in expected.items():
        assert (
            rows[key]["distribution"] == dist and rows[key]["version"] == "0.1.0" and rows[key]["loaded"]
        ), key
    assert rows["astrai.attention_backends", "torch_native"]["can_run"] is True
    assert rows["astrai.protocols", "ollama"]["can_run"] is None  # only backends say whether they can run
    broken = {key: r for key, r in rows.items() if r["distribution"] == "astrai-broken-plugin"}
    assert set(broken) == {
        ("astrai.protocols", "broken"),
        ("astrai.sampling", "not_a_strategy"),
        ("astrai.models", "broken_arch"),
        ("astrai.plugins", "broken_hooks"),
    }
    assert not any(r["loaded"] for r in broken.values())
    assert "needs libbroken" in broken["astrai.protocols", "broken"]["error"]
    assert (
        "not a subclass of astrai.sampling.base.SamplingStrategy"
        in broken["astrai.sampling", "not_a_strategy"]["error"]
    )
    assert "unknown hook 'astrai_request_finsihed'" in broken["astrai.plugins", "broken_hooks"]["error"]


def test_plugins_table() -> None:
    done = astrai("plugins")
    assert done.returncode == 0, done.stderr
    lines = done.stdout.splitlines()
    assert lines[0].split() == ["GROUP", "NAME", "DISTRIBUTION", "VERSION", "LOADED", "CAN", "RUN"]
    assert any(
        line.split()[:6]
        == ["astrai.attention_backends", "torch_native", "astrai-core", "0.1.0", "yes", "yes"]
        for line in lines
    )
    broken = lines.index(next(line for line in lines if line.split()[1:2] == ["broken"]))
    assert lines[broken].split()[2:5] == ["astrai-broken-plugin", "0.1.0", "no"]
    assert "error: ImportError: astrai-broken-plugin needs libbroken" in lines[broken + 1]
    assert (
        "hook plugin skipped" in done.stderr and "astrai-broken-plugin 0.1.0" in done.stderr
    )  # reported, not fatal


def test_hook_plugins_add_options_to_the_engine_commands() -> None:
    for command in ("serve", "chat", "generate"):
        done = astrai(command, "--help")
        assert done.returncode == 0, done.stderr
        plugin_section = done.stdout.split("plugin options:")[1]
        assert "--request-log PATH" in plugin_section, command
        assert "--sampling KEY=VALUE" in done.stdout


def test_bad_sampling_configuration_stops_serve() -> None:
    done = astrai("serve", "--sampling", "typical_p=5", "--port", "0")
    assert done.returncode == 2 and "typical_p must be in (0, 1]" in done.stderr
    done = astrai("serve", "--sampling", "not_a_strategy=1", "--port", "0")  # selects the broken plugin
    assert done.returncode == 2 and "astrai-broken-plugin 0.1.0" in done.stderr


def test_an_attention_backend_named_but_unusable_here_stops_serve(monkeypatch) -> None:
    """Unavailable on this machine, misspelled (from ASTR_BACKEND too): exit 2 with the registry's
    reason, before any model loads, rather than a server whose every request fails."""
    from astrai.extension.backend.policy import get_registry

    if get_registry().availability("flash")[0]:
        pytest.skip("flash is available here")
    done = astrai("serve", "--attention-backend", "flash", "--port", "0")
    assert done.returncode == 2, done.stderr[-2000:]
    assert (
        "astrai serve: error: attention backend 'flash' (from EngineConfig.attention_backend) is unavailable: "
        in (done.stderr)
    )
    monkeypatch.setenv("ASTR_BACKEND", "tourch")
    done = astrai("serve", "--port", "0")
    assert done.returncode == 2
    assert (
        "invalid attention backend 'tourch' (from ASTR_BACKEND=tourch); valid values: cpu, cuda, flash"
        in (done.stderr)
    )


def test_explicitly_selected_broken_protocol_stops_serve() -> None:
    done = astrai("serve", "--protocols", "openai,broken", "--port", "0")
    assert done.returncode == 2
    assert "astrai serve: error:" in done.stderr and "astrai-broken-plugin 0.1.0" in done.stderr
    assert "needs libbroken" in done.stderr


@pytest.mark.slow
def test_chat_takes_sampling_defaults_and_plugin_options(plugin_engine: Any, tmp_path: Path) -> None:
    """``astrai chat --sampling typical_p=1e-9 --request-log PATH``: the same for any seed, one line
    logged."""
    question = "What is the capital of France?"
    sampled = {
        "temperature": 1.0,
        "max_tokens": 12,
        "typical_p": 1e-9,
    }  # one token per step: the most typical
    expected = plugin_engine.chat([{"role": "user", "content": question}], seed=0, **sampled)
    log = tmp_path / "requests.jsonl"
    done = astrai(
        "chat",
        question,
        "--dtype",
        "float32",
        "--max-tokens",
        "12",
        "--temperature",
        "1.0",
        "--seed",
        "5",
        "--sampling",
        "typical_p=1e-9",
        "--request-log",
        str(log),
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout == expected + "\n"
    (line,) = log.read_text().splitlines()
    record = json.loads(line)
    assert record["finish_reason"] in ("stop", "length") and record["completion_tokens"] <= 12


def _quant_kernel_dtypes() -> tuple[str, ...]:
    """The activation dtypes of this machine's build of ``quant_linear`` (built here first, so that
    the subprocess loads it from the cache); none without a compiler or a kernel."""
    import torch

    try:
        from astrai_backend_cpu import load_kernels

        load_kernels()
    except Exception:  # no compiler, or no astrai-backend-cpu: no quantized kernels
        return ()
    ops = torch.ops.astrai_cpu
    if not ops.has_quant_linear():
        return ()
    return ("bfloat16", "float32") if ops.has_quant_linear_bf16() else ("float32",)


def test_chat_keeps_a_gguf_files_blocks_quantized_in_float32_by_default() -> None:
    """float32 (the default ``--dtype`` without native bf16) on the blocks where the build has the
    float32 kernel (AVX2 + FMA, or AVX512-BF16)."""
    if "float32" not in _quant_kernel_dtypes():
        pytest.skip("this build has no float32 quant_linear (a CPU without AVX2 + FMA)")
    done = astrai("-v", "chat", "What is the capital of France?", "--dtype", "float32", "--max-tokens", "8")
    assert done.returncode == 0, done.stderr
    assert "quantized linears" in done.stderr
    assert "Paris" in done.stdout


@pytest.mark.parametrize("flags", [(), ("--weights", "dense")], ids=["default", "dense"])
def test_chat_keeps_a_gguf_files_blocks_quantized_in_bfloat16_by_default(flags: tuple[str, ...]) -> None:
    """``astrai chat`` takes ``--weights`` as ``astrai serve`` does, ``auto`` by default (the load line names
    the quantized linears)."""
    if "bfloat16" not in _quant_kernel_dtypes():
        pytest.skip("bf16 quant_linear needs the build for AVX512-BF16")
    done = astrai(
        "-v", "chat", "What is the capital of France?", "--dtype", "bfloat16", "--max-tokens", "8", *flags
    )
    assert done.returncode == 0, done.stderr
    assert ("quantized linears" in done.stderr) == (flags == ())
    assert "Paris" in done.stdout
