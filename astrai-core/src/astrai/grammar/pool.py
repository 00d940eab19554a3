"""``CompilePool``: grammar compiles as bounded, cancellable work in worker processes.

A grammar library compiles in native code that cannot be interrupted: xgrammar took 270 s and
3.65 GiB for an enum of 100,000 strings, went on after its client left, and never gave the memory
back. So compiles run in worker processes (``python -m astrai.grammar.worker``: a fresh interpreter,
never a fork of the engine's threads, and never a re-run of the program's ``__main__``, which a
program that embeds the engine may not guard as multiprocessing's spawn needs): a compile past its
time-out, whose client left (``cancel``) or that a drain ends (``cancel_all``) is stopped by killing
its worker, and a replacement starts at once in the background (importing the backend takes a few
seconds). A worker whose resident set grew past ``recycle_bytes`` is replaced after its compile, so
its memory goes back too.

At most ``workers`` compiles run at once, and at most ``max_pending`` more wait for a worker; one
more is refused at once (``Overloaded``: a 429). The threads that call ``compile`` wait on a pipe,
never on the event loop or the scheduler thread.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import subprocess
import sys
import threading
import time
import weakref
from multiprocessing.connection import Connection
from typing import TYPE_CHECKING, Any

from astrai.errors import EngineNotReady, Overloaded, RequestRejected

if TYPE_CHECKING:
    from astrai.grammar.base import GrammarBackend, GrammarSpec

__all__ = ["Cancelled", "CompilePool"]

logger = logging.getLogger(__name__)

#: Seconds a new worker may take to import its backend and rebuild it from the exported state.
START_TIMEOUT = 120.0
_POLL = 0.05  # seconds between looks at a waiting compile's cancel event and deadline


class Cancelled(RequestRejected):
    """A compile was abandoned: its client left (nothing is answered) or the server drains."""


class _Worker:
    """One worker process and the engine's ends of its two pipes (its stdio stays the server's)."""

    def __init__(self, backend: str, state: Any) -> None:
        from_parent, to_child = os.pipe()  # (read end, write end)
        from_child, to_parent = os.pipe()
        env = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in sys.path if p)}
        command = [sys.executable, "-m", "astrai.grammar.worker", str(from_parent), str(to_parent), backend]
        try:  # a session of its own: a terminal's Ctrl-C reaches the server, which stops its workers
            self.proc = subprocess.Popen(
                command,
                pass_fds=(from_parent, to_parent),
                stdin=subprocess.DEVNULL,
                env=env,
                start_new_session=True,
            )  # fmt: skip  (the call reads better with its options together)
        finally:
            os.close(from_parent)
            os.close(to_parent)
        self.inbox = Connection(from_child, writable=False)
        self._outbox = Connection(to_child, readable=False)
        self.ready = False
        self.rss = 0
        # the exported state (megabytes) goes on a thread: the pipe takes it as the worker reads it,
        # once its imports are done, and nobody waits for that but the worker's first compile
        self._starting = threading.Thread(
            target=self._send_quietly, args=(state,), name="astrai-grammar-start", daemon=True
        )
        self._starting.start()

    def _send_quietly(self, message: Any) -> None:
        try:
            self._outbox.send(message)
        except OSError:  # killed before it read it
            pass

    def send(self, message: Any) -> None:
        self._outbox.send(message)

    def alive(self) -> bool:
        return self.proc.poll() is None

    def kill(self) -> None:
        self.proc.kill()
        self.proc.wait()
        # the start thread may still be writing the state: with no reader left its write fails
        # (EPIPE) and it ends; closing the pipe under it instead raised a TypeError in that thread
        self._starting.join(timeout=10)
        self.inbox.close()
        self._outbox.close()


class CompilePool:
    """Compiles for ``backend`` (its ``export()`` is not None) in up to ``workers`` processes."""

    def __init__(
        self,
        backend: GrammarBackend,
        workers: int = 1,
        timeout: float = 15.0,
        max_pending: int = 8,
        recycle_bytes: int = 1 << 30,
    ) -> None:
        if workers < 1 or max_pending < 0 or not timeout > 0:
            raise ValueError(
                f"need workers >= 1, max_pending >= 0, timeout > 0: {workers}, {max_pending}, {timeout}"
            )
        cls = type(backend)
        self._path = f"{cls.__module__}:{cls.__qualname__}"
        self._state = backend.export()
        self.workers, self.timeout = workers, timeout
        self.max_pending, self.recycle_bytes = max_pending, recycle_bytes
        self._lock = threading.Lock()
        self._idle: list[_Worker] = []  # started and waiting for a compile (at most ``workers``: the slots)
        self._slots = threading.Semaphore(workers)
        self._queued = 0  # compiles running or waiting for a worker
        self._epoch = 0  # bumped by cancel_all: compiles that began before it end
        self._closed = False
        # a pool dropped without close() (a cache nobody closed) still stops its idle workers
        weakref.finalize(self, _kill_all, self._idle)

    def compile(self, spec: GrammarSpec, cancel: threading.Event | None = None) -> bytes | str:
        """The serialized compiled grammar of ``spec`` (the backend's ``deserialize`` reads it).

        Raises RequestRejected (the backend's verdict, or a compile past ``timeout``: both a 400),
        Overloaded when ``workers + max_pending`` compiles are under way already, ``Cancelled`` once
        ``cancel`` is set, EngineNotReady after ``cancel_all`` or ``close``."""
        with self._lock:
            if self._closed:
                raise EngineNotReady("the grammar compile pool is closed")
            if self._queued >= self.workers + self.max_pending:
                raise Overloaded(
                    f"{self._queued} grammar compiles are under way or waiting; "
                    "retry later (--grammar-workers)"
                )
            self._queued += 1
            epoch = self._epoch
        try:
            while not self._slots.acquire(timeout=_POLL):
                self._check(cancel, epoch)
            try:
                return self._run(spec, cancel, epoch)
            finally:
                self._slots.release()
        finally:
            with self._lock:
                self._queued -= 1

    def _check(self, cancel: threading.Event | None, epoch: int) -> None:
        if cancel is not None and cancel.is_set():
            raise Cancelled("the grammar compile was abandoned: its client left", param="grammar")
        if self._epoch != epoch or self._closed:
            raise EngineNotReady("the server is shutting down: the grammar compile was stopped")

    def _take(self) -> _Worker:
        """An idle worker, or a new one (the caller holds a slot: never more than ``workers`` live)."""
        with self._lock:
            if self._idle:
                return self._idle.pop()
        return _Worker(self._path, self._state)

    def _give_back(self, worker: _Worker) -> None:
        with self._lock:
            if not self._closed:
                self._idle.append(worker)
                return
        worker.kill()

    def _run(self, spec: GrammarSpec, cancel: threading.Event | None, epoch: int) -> bytes | str:
        worker = self._take()
        keep: _Worker | None = None
        try:
            if not worker.ready:
                self._wait(worker, cancel, epoch, time.monotonic() + START_TIMEOUT, "start")
                worker.ready = True
            worker.send(dataclasses.astuple(spec))
            started = time.monotonic()
            reply = self._wait(worker, cancel, epoch, started + self.timeout, "compile")
            took = time.monotonic() - started
            if reply[0] == "rejected":
                keep = worker
                raise RequestRejected(reply[1], param=reply[2])
            worker.rss = reply[2]
            keep = worker if worker.rss < self.recycle_bytes else None
            if keep is None:
                logger.info("grammar worker grew to %.0f MiB: replaced", worker.rss / 2**20)
            if reply[0] == "error":
                raise RequestRejected(f"cannot compile the {spec.kind}: {reply[1]}", param="grammar")
            if took > 1.0:
                logger.info("compiled a %s of %d bytes in %.1f s", spec.kind, len(spec.value), took)
            return reply[1]
        finally:
            if keep is None:
                worker.kill()
                if worker.ready:  # it had started: its replacement starts now, in the background
                    keep = _Worker(self._path, self._state)
            if keep is not None:
                self._give_back(keep)

    def _wait(
        self, worker: _Worker, cancel: threading.Event | None, epoch: int, deadline: float, what: str
    ) -> Any:
        """The worker's next message; stops waiting (the caller kills the worker) on cancel, drain,
        deadline or the worker's death."""
        while not worker.inbox.poll(_POLL):
            self._check(cancel, epoch)
            if time.monotonic() > deadline:
                if what == "start":
                    raise EngineNotReady(f"a grammar compile worker did not start within {START_TIMEOUT:g} s")
                raise RequestRejected(
                    f"compiling the grammar took longer than {self.timeout:g} s and was stopped "
                    "(--grammar-compile-timeout); simplify the schema, pattern or choices",
                    param="grammar",
                )
            if not worker.alive():
                break
        try:
            return worker.inbox.recv()
        except (EOFError, OSError):
            code = worker.proc.poll()
            raise RequestRejected(
                f"the grammar compile worker died (exit code {code}) compiling this grammar", param="grammar"
            ) from None

    def cancel_all(self) -> None:
        """Stop every compile under way or waiting (EngineNotReady to their callers); later compiles run."""
        with self._lock:
            self._epoch += 1

    def close(self) -> None:
        """Stop every compile and worker; later compiles raise EngineNotReady. Idempotent."""
        with self._lock:
            self._closed = True
            self._epoch += 1
        _kill_all(self._idle)


def _kill_all(workers: list[_Worker]) -> None:
    """Kill every worker of ``workers`` (emptied)."""
    while workers:
        workers.pop().kill()
