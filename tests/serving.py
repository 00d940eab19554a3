"""Real ``astrai serve`` subprocesses on loopback ports, for tests that need the whole server.

``start_server`` (the module-scoped fixture in tests/conftest.py) starts ``python -m astrai.cli serve``
on the default model (float32, ``max_seq_len`` 1024 unless the flags say otherwise) and returns a
``Served`` once /health is 200 (``healthy=False``: at once); every server it started is stopped
(SIGINT, then kill) when the test module ends. The server's combined stdout/stderr is in
``Served.output``, so a test can assert what the log says.
"""

from __future__ import annotations

import signal
import socket
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest


@dataclass
class Served:
    """A running ``astrai serve`` subprocess."""

    url: str
    output: Path  # the server's stdout and stderr
    proc: subprocess.Popen

    def log(self) -> str:
        return self.output.read_text(errors="replace")

    def stats(self) -> dict:
        return httpx.get(self.url + "/stats", timeout=10).json()

    def wait_idle(self, timeout: float = 30.0) -> dict:
        """The engine's stats once no request is running or waiting (fails the test otherwise)."""
        deadline = time.monotonic() + timeout
        while True:
            stats = self.stats()
            if not stats["active_tasks"] and not stats["waiting_queue"]:
                return stats
            if time.monotonic() > deadline:
                pytest.fail(f"the engine is still busy: {stats}")
            time.sleep(0.1)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _healthy(url: str) -> bool:
    try:
        return httpx.get(url + "/health", timeout=2, verify=False).status_code == 200
    except httpx.TransportError:
        return False


def _stop(proc: subprocess.Popen) -> None:
    if proc.poll() is None:
        proc.send_signal(signal.SIGINT)
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


class ServerStarter:
    """Starts ``astrai serve`` subprocesses (``start``) and stops them all (``close``)."""

    def __init__(self, tmp_path_factory: pytest.TempPathFactory) -> None:
        self.tmp_path_factory = tmp_path_factory
        self.procs: list[subprocess.Popen] = []

    def start(self, *flags: str, healthy: bool = True, env: dict[str, str] | None = None, scheme: str = "http") -> Served:
        """``astrai serve`` with ``flags`` (and ``env`` over this process's environment); ``scheme``
        "https" when the flags turn TLS on (/health is then polled without verifying the certificate)."""
        import os

        tmp = self.tmp_path_factory.mktemp("serve")
        output = tmp / "server.log"
        port = free_port()
        cmd = [sys.executable, "-m", "astrai.cli", "serve", "--port", str(port), "--dtype", "float32"]
        if "--max-seq-len" not in flags:
            cmd += ["--max-seq-len", "1024"]
        cmd += list(flags)
        with output.open("wb") as out:
            proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, env={**os.environ, **(env or {})})
        self.procs.append(proc)
        served = Served(f"{scheme}://127.0.0.1:{port}", output, proc)
        if not healthy:
            return served
        deadline = time.monotonic() + 180
        while not _healthy(served.url):
            if proc.poll() is not None or time.monotonic() > deadline:
                pytest.fail(f"astrai serve did not become healthy:\n{served.log()}")
            time.sleep(0.25)
        return served

    def close(self) -> None:
        for proc in self.procs:
            _stop(proc)
