"""Thread-level tuning for inference on the CPU: OpenMP teams.

**OpenMP teams of two threads.** The model runs on the scheduler thread. When
another long-lived thread (typically the main thread, loading the weights) has
also run parallel regions, libgomp keeps that thread's team of workers alive,
counts more OpenMP threads than CPUs, stops spinning between regions and parks
its workers on a futex, so every small op of the scheduler thread pays a
wake-up: a 576x1536 bf16 GEMV took 65 us on the first thread and 125-135 us on
the second, a small softmax 5 us and 60 us; a decode step of the default model
went from ~23 ms to ~45 ms. A thread that has exited leaves no team behind, so
``run_off_thread`` runs CPU-heavy set-up work (``load_model``) on a short-lived
thread and the caller's thread never owns a team. (``omp_set_dynamic`` would
also lift the slowdown, but oneDNN requires a fixed team size: its results are
wrong with dynamic teams.) A thread that did run parallel work and lives on (an
embedding program's main thread, a benchmark's, a test's) hands its team back
with ``release_openmp_team`` (libgomp's ``omp_pause_resource_all``, which frees
the calling thread's pool only); the scheduler calls it for the thread that
starts it and for each thread that submits to it. Measured on the default model:
a decode step at 11-12 ms went to 19-21 ms after one parallel op on the main
thread, and back to 11-14 ms after the release.

The C allocator's tuning, the other process-wide knob of CPU inference, is ``astrai.malloc``'s.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import functools
import logging
import sys
import threading
from collections.abc import Callable
from typing import Any, TypeVar

logger = logging.getLogger(__name__)

T = TypeVar("T")


@functools.cache
def _libgomp_pause() -> Callable[[int], int] | None:
    """libgomp's ``omp_pause_resource_all`` where this process runs libgomp (torch's CPU builds do);
    None elsewhere (another OpenMP runtime may pause every thread's team, not the caller's)."""
    if not sys.platform.startswith("linux"):
        return None
    try:
        with open("/proc/self/maps") as maps:
            paths = {line.split(None, 5)[-1].strip() for line in maps if "libgomp" in line}
    except OSError:
        return None
    for path in sorted(p for p in paths if p.startswith("/")):
        try:
            return ctypes.CDLL(path).omp_pause_resource_all
        except (OSError, AttributeError):
            continue
    return None


def release_openmp_team() -> bool:
    """Hand back the calling thread's OpenMP team (see the module docstring); True when libgomp
    took the request. Cheap when the thread holds none. Never call it inside a parallel region:
    a Python thread is not in one unless it is a torch worker's callback."""
    pause = _libgomp_pause()
    return pause is not None and pause(1) == 0  # omp_pause_soft


def run_off_thread(fn: Callable[..., T], *args: Any) -> T:
    """``fn(*args)`` on a short-lived thread; returns its result or raises its exception.

    Any OpenMP team the work creates dies with that thread (see the module docstring).
    """
    result: list[Any] = []

    def target() -> None:
        try:
            result.append((True, fn(*args)))
        except BaseException as exc:  # handed to the caller below
            result.append((False, exc))

    worker = threading.Thread(target=target, name="astrai-setup")
    worker.start()
    worker.join()
    ok, value = result[0]
    if not ok:
        raise value
    return value
