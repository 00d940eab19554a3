"""``astrai serve --data-parallel-size M``: M engine replicas behind the SGLang Model Gateway, supervised.

``serve_replicas(settings)`` (``cli.serve`` calls it when ``data_parallel_size`` > 1) runs in the
process that was started as ``astrai serve``:

1. starts M replicas (``python -m astrai_server.child replica``): each a whole ``astrai serve`` with
   the same settings, on 127.0.0.1 at ``data_parallel_base_port + i`` (unset: free ports picked now),
   and waits until every one answers ``GET /health`` 200;
2. starts the gateway (``smg``, PyPI; ``python -m astrai_server.child gateway``) on the requested
   host and port with its cache-aware policy (``gateway_args``): it routes a request to the replica
   that served the longest prefix of its text, unless the load is out of balance;
3. supervises them: a child that exits unexpectedly is logged and restarted on the same port after
   a back-off (1 s, doubling to 30 s; reset once it has run ``STABLE`` seconds); one that failed
   ``MAX_FAILURES`` times in a row, each within ``STABLE`` seconds of its start, is not restarted
   again (``serve_replicas`` exits with status 1 once no replica or no gateway is left). Meanwhile
   the gateway's health checks (every ``HEALTH_INTERVAL`` s) take a dead replica out of its
   routing and its ``GET /readiness`` counts the healthy ones; requests are retried on another;
4. on SIGTERM or SIGINT sends SIGTERM to the gateway and to every replica at once (each drains:
   ``astrai_server.drain``; the gateway finishes its requests in flight), waits for them and
   returns; a second signal kills them all and exits at once with status 128 + the signal.

The API key is enforced at the gateway (``--api-key``, the others as ``--tenant-api-key``), which
accepts only ``Authorization: Bearer`` and passes that header on unchanged, and again at every
replica (same keys). Replicas' ports and pids, and the gateway's metrics port, are logged.

Over 300 lines because the supervisor is one state machine: the children's start, readiness,
restarts and stop, and the translation of the settings into the gateway's arguments.
"""

from __future__ import annotations

import importlib.util
import json
import logging
import math
import os
import secrets
import signal
import socket
import ssl
import subprocess
import sys
import time
import urllib.error
import urllib.request
from dataclasses import dataclass
from types import FrameType

from astrai.errors import AstraiError
from astrai_server.config import ServerSettings
from astrai_server.drain import ABORT_GRACE
from astrai_server.edge import check_tls
from astrai_server.errors import ConfigError
from astrai_server.keys import api_keys

logger = logging.getLogger(__name__)

POLICY = "cache_aware"
HEALTH_INTERVAL = 2  # seconds between the gateway's health checks of each replica
BACKOFF_FIRST, BACKOFF_MAX = 1.0, 30.0  # seconds before a restart: doubling from the first to the max
STABLE = 60.0  # seconds a child must run for its failures to be forgotten
MAX_FAILURES = 5  # quick failures in a row after which a child is not restarted again
POLL = 0.2  # seconds between two looks at the children
READY_TIMEOUT = 60.0  # seconds the gateway may take to register every replica
STOP_MARGIN = 10.0  # seconds beyond the drain a child may take to exit before it is killed
LOG_LEVELS = {"debug": "debug", "info": "info", "warning": "warn", "error": "error"}
INSTALL = "pip install 'astrai-server[gateway]'"


class ReplicaError(AstraiError):
    """A replica or the gateway could not start (its own error is in the log above)."""


@dataclass
class Child:
    """A supervised process: a replica or the gateway."""

    name: str  # "replica 0", "gateway"
    role: str  # "replica" or "gateway": python -m astrai_server.child <role>
    payload: bytes  # its settings (replica) or arguments (gateway), sent on stdin
    url: str  # where it serves
    proc: subprocess.Popen | None = None
    started: float = 0.0
    ready: bool = False  # it answered its health check since it last started
    failures: int = 0  # quick failures in a row
    restart_at: float | None = None  # when to start it again after it exited
    given_up: bool = False

    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None


def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET) as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def _connect_host(host: str) -> str:
    """The address a client on this machine reaches a socket bound to ``host`` at."""
    return {"0.0.0.0": "127.0.0.1", "::": "::1", "": "127.0.0.1"}.get(host, host)


def _url(scheme: str, host: str, port: int) -> str:
    return f"{scheme}://[{host}]:{port}" if ":" in host else f"{scheme}://{host}:{port}"


def replica_ports(settings: ServerSettings) -> list[int]:
    """The replicas' ports: ``data_parallel_base_port + i``, or free ones. ConfigError past 65535."""
    size, base = settings.data_parallel_size, settings.data_parallel_base_port
    if base is None:
        return [free_port() for _ in range(size)]
    if base + size - 1 > 65535:
        raise ConfigError(
            f"--data-parallel-base-port {base}: {size} replicas need ports up to {base + size - 1}, "
            "past 65535"
        )
    if any(p is not None and base <= p < base + size for p in (settings.port, settings.gateway_metrics_port)):
        raise ConfigError(
            f"--data-parallel-base-port {base}: "
            f"the replicas' ports {base}-{base + size - 1} hold the gateway's port"
        )
    return list(range(base, base + size))


def check_gateway_settings(settings: ServerSettings) -> None:
    """ConfigError for what the gateway cannot do as ``astrai serve`` does, or when smg is missing."""
    if importlib.util.find_spec("smg") is None:
        raise ConfigError(f"--data-parallel-size needs the SGLang Model Gateway (PyPI: smg): {INSTALL}")
    defaults = ServerSettings.model_fields
    for name in ("allowed_methods", "allowed_headers"):
        if getattr(settings, name) != defaults[name].default:
            raise ConfigError(
                f"--{name.replace('_', '-')} with --data-parallel-size: the gateway answers CORS itself, "
                "for --allowed-origins only (its own methods and headers)"
            )
    for name in ("ssl_keyfile_password", "ssl_ca_certs"):
        if getattr(settings, name) is not None:
            raise ConfigError(
                f"--{name.replace('_', '-')} with --data-parallel-size: "
                "the gateway's TLS takes a plain key and no client certificates"
            )
    if settings.ssl_cert_reqs != "none":
        raise ConfigError(
            "--ssl-cert-reqs with --data-parallel-size: the gateway verifies no client certificates"
        )
    check_tls(settings)  # a missing or bad certificate fails now


def replica_settings(settings: ServerSettings, port: int, keys: list[str], index: int = 0) -> ServerSettings:
    """One replica's settings: the same, but on 127.0.0.1:``port``, one replica, the keys read
    already, plain HTTP and no CORS (the gateway terminates TLS and answers CORS); a KV cache
    folder of its own, ``replica-<index>`` under ``--kv-cache-dir`` (replicas never share files)."""
    folder = settings.kv_cache_dir
    return ServerSettings.model_validate(
        {
            **settings.model_dump(),
            "kv_cache_dir": None if folder is None else os.path.join(folder, f"replica-{index}"),
            "host": "127.0.0.1",
            "port": port,
            "data_parallel_size": 1,
            "data_parallel_base_port": None,
            "gateway_metrics_port": None,
            "api_key": keys or None,
            "api_key_file": None,
            "ssl_certfile": None,
            "ssl_keyfile": None,
            "allowed_origins": [],
        }
    )


def gateway_args(
    settings: ServerSettings, port: int, urls: list[str], metrics_port: int, keys: list[str]
) -> list[str]:
    """The arguments of ``smg launch`` that serve ``settings`` in front of the replicas at ``urls``.

    The default backend (sglang) over HTTP is smg's generic OpenAI-compatible router, which passes
    chat, completions, responses and messages on; its health checks (every ``HEALTH_INTERVAL`` s,
    unhealthy after 2 failures, healthy again after 1 success) keep a dead replica out of the routing.
    """
    args = [
        "--host",
        settings.host,
        "--port",
        str(port),
        "--worker-urls",
        *urls,
        "--policy",
        POLICY,
        "--backend",
        "sglang",
        "--prometheus-host",
        "127.0.0.1",
        "--prometheus-port",
        str(metrics_port),
        "--health-check-interval-secs",
        str(HEALTH_INTERVAL),
        "--health-failure-threshold",
        "2",
        "--health-success-threshold",
        "1",
        "--worker-startup-check-interval",
        "1",
        "--max-payload-size",
        str(settings.max_request_bytes),
        "--shutdown-grace-period-secs",
        str(math.ceil(settings.shutdown_timeout + ABORT_GRACE)),
        "--log-level",
        LOG_LEVELS[settings.log_level],
    ]
    if settings.log_format == "json":
        args.append("--log-json")
    if keys:  # the first is also the gateway's own key towards the replicas (health checks, loads)
        args += ["--api-key", keys[0]]
        for i, key in enumerate(keys[1:], 1):
            args += ["--tenant-api-key", f"key{i}:{key}"]
    if settings.allowed_origins:
        args += ["--cors-allowed-origins", *settings.allowed_origins]
    if settings.ssl_certfile is not None:
        args += [
            "--tls-cert-path",
            settings.ssl_certfile,
            "--tls-key-path",
            settings.ssl_keyfile or settings.ssl_certfile,
        ]
    return args


def _get(url: str, timeout: float = 2.0) -> tuple[int, bytes]:
    """Status and body of ``GET url`` (0 when nothing answers); TLS certificates are not checked."""
    context = ssl._create_unverified_context() if url.startswith("https:") else None
    try:
        with urllib.request.urlopen(url, timeout=timeout, context=context) as r:
            return r.status, r.read()
    except urllib.error.HTTPError as e:
        return e.code, e.read()
    except (OSError, ValueError):
        return 0, b""


class Supervisor:
    """The children of one ``astrai serve --data-parallel-size``: see the module doc."""

    def __init__(self, settings: ServerSettings) -> None:
        check_gateway_settings(settings)
        if settings.signing_key is None:  # one key for every replica: a signature verifies on any of them
            settings = settings.model_copy(update={"signing_key": secrets.token_urlsafe(32)})
        self.settings = settings
        keys = [k.decode("utf-8") for k in api_keys(settings) or ()]
        scheme = "https" if settings.ssl_certfile else "http"
        port = settings.port or free_port(_connect_host(settings.host))
        self.metrics_port = settings.gateway_metrics_port or free_port()
        self.replicas = []
        for i, p in enumerate(replica_ports(settings)):
            payload = replica_settings(settings, p, keys, i).model_dump_json().encode()
            self.replicas.append(Child(f"replica {i}", "replica", payload, _url("http", "127.0.0.1", p)))
        args = gateway_args(settings, port, [r.url for r in self.replicas], self.metrics_port, keys)
        self.gateway = Child(
            "gateway", "gateway", json.dumps(args).encode(), _url(scheme, _connect_host(settings.host), port)
        )
        self.public_url = _url(scheme, settings.host, port)
        self.stopping: str | None = None  # the signal that asked for the stop

    @property
    def children(self) -> list[Child]:
        return [*self.replicas, self.gateway]

    # ------------------------------------------------------------ processes

    def start(self, child: Child) -> None:
        cmd = [sys.executable, "-m", "astrai_server.child", child.role, str(os.getpid())]
        child.proc = subprocess.Popen(cmd, stdin=subprocess.PIPE, start_new_session=True)
        assert child.proc.stdin is not None
        child.proc.stdin.write(child.payload)
        child.proc.stdin.close()
        child.started, child.ready, child.restart_at = time.monotonic(), False, None
        if child.role == "replica":
            logger.info(
                "%s started: pid %d, %s (its /metrics: %s/metrics)",
                child.name,
                child.proc.pid,
                child.url,
                child.url,
            )
        else:
            logger.info(
                "gateway started: pid %d, %s (policy %s; its own metrics: http://127.0.0.1:%d/metrics; "
                "every replica's, labelled worker_addr: %s/engine_metrics)",
                child.proc.pid,
                self.public_url,
                POLICY,
                self.metrics_port,
                self.public_url,
            )

    def healthy(self, child: Child) -> bool:
        if child.role == "replica":
            return _get(child.url + "/health")[0] == 200
        status, body = _get(child.url + "/readiness")
        try:
            return status == 200 and json.loads(body).get("healthy_workers") == len(self.replicas)
        except ValueError:
            return False

    def exited(self, child: Child, now: float) -> None:
        """``child`` has exited without being asked: schedule its restart, or give up on it."""
        assert child.proc is not None
        code = child.proc.returncode
        child.failures = 1 if now - child.started >= STABLE else child.failures + 1
        if child.failures >= MAX_FAILURES:
            child.given_up = True
            logger.error(
                "%s (pid %d) exited with status %s, its %d failure in a row: not restarted again",
                child.name,
                child.proc.pid,
                code,
                child.failures,
            )
            return
        delay = min(BACKOFF_FIRST * 2 ** (child.failures - 1), BACKOFF_MAX)
        child.restart_at = now + delay
        logger.error(
            "%s (pid %d) exited with status %s: restarting it in %g s",
            child.name,
            child.proc.pid,
            code,
            delay,
        )

    # ------------------------------------------------------------ signals

    def on_signal(self, sig: int, frame: FrameType | None) -> None:
        name = signal.Signals(sig).name
        if self.stopping is not None:
            logger.warning("second %s: killing the replicas and the gateway now", name)
            for child in self.children:
                if child.alive():
                    child.proc.kill()  # type: ignore[union-attr]
            os._exit(128 + sig)
        self.stopping = name

    # ------------------------------------------------------------ phases

    def wait_ready(self, children: list[Child], deadline: float | None = None) -> bool:
        """Until every one of ``children`` is healthy (True), a stop is asked for or the deadline
        passes (False). ReplicaError when one exits first."""
        waiting = list(children)
        while waiting and self.stopping is None:
            for child in list(waiting):
                if not child.alive():
                    raise ReplicaError(
                        f"{child.name} exited with status {child.proc.returncode} "
                        "before it was ready (its error is above)"
                    )  # type: ignore[union-attr]
                if self.healthy(child):
                    child.ready = True
                    waiting.remove(child)
            if deadline is not None and time.monotonic() > deadline:
                return False
            time.sleep(POLL)
        return not waiting

    def supervise(self) -> None:
        """Restart what exits, until a stop is asked for; SystemExit(1) once a whole role is gone."""
        next_check = 0.0
        while self.stopping is None:
            now = time.monotonic()
            for child in self.children:
                if child.given_up:
                    continue
                if child.restart_at is not None:
                    if now >= child.restart_at:
                        self.start(child)
                elif not child.alive():
                    self.exited(child, now)
            if self.gateway.given_up or all(r.given_up for r in self.replicas):
                logger.error(
                    "%s: stopping",
                    "the gateway cannot run" if self.gateway.given_up else "no replica can run",
                )
                raise SystemExit(1)  # run() stops the rest
            if now >= next_check:  # a restarted child that answers again
                next_check = now + 1.0
                for child in self.children:
                    if (
                        child.alive()
                        and not child.ready
                        and now - child.started > 1.0
                        and self.healthy(child)
                    ):
                        child.ready = True
                        logger.info("%s is ready again", child.name)
            time.sleep(POLL)

    def stop(self) -> None:
        """SIGTERM to every child at once (each drains), then wait; SIGKILL what is left at the deadline."""
        for child in self.children:
            if child.alive():
                child.proc.send_signal(signal.SIGTERM)  # type: ignore[union-attr]
        deadline = time.monotonic() + self.settings.shutdown_timeout + ABORT_GRACE + STOP_MARGIN
        for child in self.children:
            if child.proc is None:
                continue
            try:
                child.proc.wait(max(0.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                logger.warning("%s (pid %d) did not stop in time: killing it", child.name, child.proc.pid)
                child.proc.kill()
                child.proc.wait()

    def run(self) -> None:
        handlers = {sig: signal.signal(sig, self.on_signal) for sig in (signal.SIGTERM, signal.SIGINT)}
        try:
            logger.info(
                "starting %d replicas and the SGLang Model Gateway on %s", len(self.replicas), self.public_url
            )
            for child in self.replicas:
                self.start(child)
            if self.wait_ready(self.replicas):
                self.start(self.gateway)
                if self.wait_ready([self.gateway], time.monotonic() + READY_TIMEOUT):
                    logger.info(
                        "ready: the gateway on %s routes to %d replicas", self.public_url, len(self.replicas)
                    )
                elif self.stopping is None:
                    logger.warning("the gateway has not registered every replica after %g s", READY_TIMEOUT)
                self.supervise()
            logger.info("%s: stopping the gateway and the replicas", self.stopping)
        finally:
            self.stop()
            for sig, handler in handlers.items():
                signal.signal(sig, handler)
        logger.info("stopped")


def serve_replicas(settings: ServerSettings) -> None:
    """Run the replicas and the gateway until a signal stops them (see the module doc).

    ConfigError for settings the gateway cannot serve; ReplicaError when a child cannot start;
    SystemExit(1) when every replica, or the gateway, keeps failing."""
    Supervisor(settings).run()
