"""Real ``astrai serve`` subprocesses on loopback ports, for tests that need the whole server.

``start_server`` (the module-scoped fixture in tests/conftest.py) starts ``python -m astrai.cli serve``
on the default model (float32, ``max_seq_len`` 1024 unless the flags say otherwise) and returns a
``Served`` once /health is 200 (``healthy=False``: at once); every server it started is stopped
(SIGINT, then kill) when the test module ends. The server's combined stdout/stderr is in
``Served.output``, so a test can assert what the log says. ``start_servers`` (the same module's
starter) starts several private servers side by side: ``start_servers(flags_a, flags_b, ...)``.

``SharedServers.get`` (tests/hostile/conftest.py's ``shared_server``): one server
per set of flags, started at its first use and reused by every module of the test directory that
asks for the same flags, stopped when the directory's last test ends. Only for tests that neither stop,
signal nor reconfigure the server, and that read its log and counters from their own starting
point (``len(served.log())`` before, deltas of /stats or /metrics), never from the server's start.
"""

from __future__ import annotations

import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable
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


def wait_healthy(served: Served, timeout: float = 180.0) -> None:
    """Until ``served`` answers /health with 200 (fails the test if it exits or times out first)."""
    deadline = time.monotonic() + timeout
    while not _healthy(served.url):
        if served.proc.poll() is not None or time.monotonic() > deadline:
            pytest.fail(f"astrai serve did not become healthy:\n{served.log()}")
        time.sleep(0.05)  # poll often: the sooner a test starts, the shorter the suite


def _stop(procs: list[subprocess.Popen]) -> None:
    """SIGINT to every process still running, all at once (each drains in parallel), then kill the
    ones that have not exited 30 s later."""
    running = [proc for proc in procs if proc.poll() is None]
    for proc in running:
        proc.send_signal(signal.SIGINT)
    deadline = time.monotonic() + 30
    for proc in running:
        try:
            proc.wait(max(0.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


class ServerStarter:
    """Starts ``astrai serve`` subprocesses (``start``) and stops them all (``close``)."""

    def __init__(self, tmp_path_factory: pytest.TempPathFactory) -> None:
        self.tmp_path_factory = tmp_path_factory
        self.procs: list[subprocess.Popen] = []

    def start(
        self,
        *flags: str,
        healthy: bool = True,
        env: dict[str, str] | None = None,
        scheme: str = "http",
        preexec_fn: Callable[[], None] | None = None,
    ) -> Served:
        """``astrai serve`` with ``flags`` (and ``env`` over this process's environment); ``scheme``
        "https" when the flags turn TLS on (/health is then polled without verifying the certificate);
        ``preexec_fn`` runs in the child before it starts (to lower a resource limit, say)."""
        import os

        tmp = self.tmp_path_factory.mktemp("serve")
        output = tmp / "server.log"
        port = free_port()
        cmd = [sys.executable, "-m", "astrai.cli", "serve", "--port", str(port), "--dtype", "float32"]
        if "--max-seq-len" not in flags:
            cmd += ["--max-seq-len", "1024"]
        cmd += list(flags)
        with output.open("wb") as out:
            environ = {**os.environ, **(env or {})}
            proc = subprocess.Popen(
                cmd, stdout=out, stderr=subprocess.STDOUT, env=environ, preexec_fn=preexec_fn
            )
        self.procs.append(proc)
        served = Served(f"{scheme}://127.0.0.1:{port}", output, proc)
        if healthy:
            wait_healthy(served)
        return served

    def start_many(self, *flag_sets: tuple[str, ...]) -> list[Served]:
        """One healthy server per flag set, started side by side (their start-ups overlap) for
        tests that each need a private server of their own."""
        started = [self.start(*flags, healthy=False) for flags in flag_sets]
        for served in started:
            wait_healthy(served)
        return started

    def close(self) -> None:
        _stop(self.procs)


class SharedServers:
    """``get(*flags)``: one healthy ``astrai serve`` per distinct flags, started on first use and
    then shared; ``close`` stops them all."""

    def __init__(self, tmp_path_factory: pytest.TempPathFactory) -> None:
        self.starter = ServerStarter(tmp_path_factory)
        self.served: dict[tuple[str, ...], Served] = {}

    def get(self, *flags: str) -> Served:
        served = self.served.get(flags)
        if served is None or served.proc.poll() is not None:
            served = self.served[flags] = self.starter.start(*flags)
        return served

    def close(self) -> None:
        """Stop every server (a later ``get`` starts its flags' server anew)."""
        self.starter.close()
        self.served.clear()
