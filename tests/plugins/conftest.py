"""Fixtures of the plugin tests: the example distributions as users install them, a real ``astrai serve``.

The examples (``examples/astrai-ollama``, ``astrai-typical-p``, ``astrai-request-log``) and the
deliberately broken ``tests/plugins/broken_plugin`` are pip-installed by the README's test
command; nothing here registers or patches a plugin. Without them the tests skip locally
and fail under CI, where their absence is a broken setup.
"""

from __future__ import annotations

import importlib.metadata
import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest

DISTRIBUTIONS = ("astrai-ollama", "astrai-typical-p", "astrai-request-log", "astrai-broken-plugin")
INSTALL = (
    "pip install ./examples/astrai-ollama ./examples/astrai-typical-p ./examples/astrai-request-log "
    "./tests/plugins/broken_plugin"
)


@pytest.fixture(autouse=True, scope="session")
def _plugins_installed() -> None:
    missing = []
    for name in DISTRIBUTIONS:
        try:
            importlib.metadata.distribution(name)
        except importlib.metadata.PackageNotFoundError:
            missing.append(name)
    if missing:
        reason = f"plugin distributions not installed: {', '.join(missing)} ({INSTALL})"
        if os.environ.get("CI"):
            pytest.fail(f"{reason}; CI installs them: see the README's test command")
        pytest.skip(reason)


@dataclass
class Served:
    """A running ``astrai serve`` subprocess."""

    url: str
    request_log: Path  # the file the request-log plugin writes (set in serve.yaml)
    output: Path  # the server's stdout and stderr


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="session")
def served(tmp_path_factory: pytest.TempPathFactory, default_model_path: Path) -> Iterator[Served]:
    """``astrai serve`` on the default model (float32) with every installed plugin, and the embedding
    model ``minilm-l6`` beside it (Ollama's ``/api/embed``).

    Configured as a user would: ``serve.yaml`` sets the request-log plugin's
    ``request_log`` key; the flag ``--sampling typical_p=1e-9`` leaves every sampled
    request one token per step (its most typical one, whatever the seed) unless it sets
    ``typical_p`` itself.
    """
    tmp = tmp_path_factory.mktemp("served")
    log, output = tmp / "requests.jsonl", tmp / "server.log"
    config = tmp / "serve.yaml"
    config.write_text(f"server:\n  dtype: float32\n  max_seq_len: 1024\n  request_log: {log}\n")
    port = _free_port()
    cmd = [sys.executable, "-m", "astrai.cli", "serve", "--config", str(config), "--port", str(port)]
    cmd += ["--sampling", "typical_p=1e-9", "--log-level", "warning", "--embedding-model", "minilm-l6"]
    with output.open("wb") as out:
        proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 180
        while not _healthy(url):
            if proc.poll() is not None or time.monotonic() > deadline:
                pytest.fail(f"astrai serve did not become healthy:\n{output.read_text()}")
            time.sleep(0.25)
        yield Served(url, log, output)
    finally:
        proc.send_signal(signal.SIGINT)  # graceful: the engine shuts down, plugins close their files
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def _healthy(url: str) -> bool:
    try:
        return httpx.get(url + "/health", timeout=2).status_code == 200
    except httpx.TransportError:
        return False


@pytest.fixture(scope="session")
def plugin_engine(real_model: tuple) -> Iterator:
    """An in-process engine on the default model with the installed sampling plugins and no hooks."""
    from astrai.engine import EngineConfig, InferenceEngine
    from astrai.hooks import PluginManager

    model, tokenizer = real_model
    engine = InferenceEngine(model, tokenizer, EngineConfig(max_seq_len=512), plugins=PluginManager())
    yield engine
    engine.shutdown()
