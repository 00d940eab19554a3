"""A grammar compile worker process (``astrai.grammar.pool``): ``python -m astrai.grammar.worker IN OUT
MODULE:CLASS``, reading from file descriptor IN and writing to OUT.

It reads the backend's exported state, makes the backend from it (``GrammarBackend.restore``),
says ``("ready", rss)``, then answers each spec's fields it receives with ``("ok", serialized,
rss)``, ``("rejected", message, param)`` or ``("error", message, rss)``, until the engine's end of
the pipe closes (the engine stopped, or exited). ``rss`` is the worker's resident memory in
bytes, by which the pool decides to replace it (a large compile's memory then goes back to the
system with the process). The worker holds no state of any request: killing it mid-compile (a
time-out, a client that left, a drain) loses nothing but that compile.
"""

from __future__ import annotations

import os
import sys
from importlib import import_module
from multiprocessing.connection import Connection
from typing import Any

__all__ = ["main", "rss_bytes", "serve"]


def rss_bytes() -> int:
    """This process's resident set in bytes (0 where ``/proc`` is not there)."""
    try:
        with open("/proc/self/statm", encoding="ascii") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, IndexError):
        return 0


def main(argv: list[str]) -> int:
    """The worker's entry: ``argv`` is ``[IN, OUT, MODULE:CLASS]``."""
    inbox = Connection(int(argv[0]), writable=False)
    outbox = Connection(int(argv[1]), readable=False)
    try:
        state = inbox.recv()
    except (EOFError, OSError):  # the engine is gone before it sent anything
        return 0
    serve(inbox, outbox, argv[2], state)
    return 0


def serve(inbox: Any, outbox: Any, backend: str, state: Any) -> None:
    """Compile until ``inbox`` closes; ``backend`` is ``"module:Class"`` of a ``GrammarBackend``."""
    from astrai.errors import RequestRejected
    from astrai.grammar.base import GrammarSpec

    module, _, name = backend.partition(":")
    compiler = getattr(import_module(module), name).restore(state)
    outbox.send(("ready", rss_bytes()))
    while True:
        try:
            fields = inbox.recv()
        except (EOFError, OSError):  # the engine's process closed the pipe or exited
            return
        try:
            reply = ("ok", compiler.serialize(compiler.compile(GrammarSpec(*fields))), rss_bytes())
        except RequestRejected as e:
            reply = ("rejected", str(e), e.param)
        except Exception as e:  # noqa: BLE001  a library's failure is this request's, never the worker's
            reply = ("error", f"{type(e).__name__}: {e}", rss_bytes())
        try:
            outbox.send(reply)
        except OSError:  # the engine's process is gone
            return


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
