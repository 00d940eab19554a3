"""The body of a grammar compile worker process (``astrai.grammar.pool``).

``serve(conn, backend, state)`` runs in the worker: it makes the backend from its exported state
(``GrammarBackend.restore``), says ``("ready", rss)``, then answers each ``(kind, value)`` it
receives with ``("ok", serialized, rss)``, ``("rejected", message, param)`` or
``("error", message, rss)``, until the pipe closes. ``rss`` is the worker's resident memory in
bytes, by which the pool decides to replace it (a large compile's memory then goes back to the
system with the process). The worker holds no state of any request: killing it mid-compile (a
time-out, a client that left, a drain) loses nothing but that compile.
"""

from __future__ import annotations

import os
from importlib import import_module
from typing import Any

__all__ = ["rss_bytes", "serve"]


def rss_bytes() -> int:
    """This process's resident set in bytes (0 where ``/proc`` is not there)."""
    try:
        with open("/proc/self/statm", encoding="ascii") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, IndexError):
        return 0


def serve(conn: Any, backend: str, state: Any) -> None:
    """Compile until ``conn`` closes; ``backend`` is ``"module:Class"`` of a ``GrammarBackend``."""
    from astrai.errors import RequestRejected
    from astrai.grammar.base import GrammarSpec

    module, _, name = backend.partition(":")
    compiler = getattr(import_module(module), name).restore(state)
    conn.send(("ready", rss_bytes()))
    while True:
        try:
            kind, value = conn.recv()
        except (EOFError, OSError):  # the engine's process closed the pipe or exited
            return
        try:
            data = compiler.serialize(compiler.compile(GrammarSpec(kind, value)))
        except RequestRejected as e:
            conn.send(("rejected", str(e), e.param))
        except Exception as e:  # noqa: BLE001  a library's failure is this request's, never the worker's
            conn.send(("error", f"{type(e).__name__}: {e}", rss_bytes()))
        else:
            conn.send(("ok", data, rss_bytes()))
