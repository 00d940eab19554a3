"""The C allocator of the process (glibc's malloc): its one owner, for an embedding program and a server.

**Page faults from malloc.** A decode step allocates and frees the same large temporaries
(gathered K/V, activations, logits) in every layer. glibc's malloc serves blocks above its mmap
threshold with fresh ``mmap`` calls and trims the heap top back to the kernel after each free, so
every step pays page faults for memory it just returned; inside a virtual machine those faults
are expensive (measured here: 1.9 M minor faults and 9.6 s of system time for the offline
benchmark, 4x fewer faults and a third of the system time once tuned). Keeping freed memory in the
heap is what tcmalloc/jemalloc do by default, and what vLLM's CPU guide gets by preloading one of
them; ``mallopt`` reaches the same effect without a preload.

**The decision.** One setting per process, ``tune_malloc()``: blocks under ``MMAP_THRESHOLD`` come
from the heap, freed heap stays (up to ``TRIM_THRESHOLD`` at its top, grown by ``TOP_PAD`` at a
time). An engine on the CPU applies it when it starts (an embedding program's process included);
``astrai serve`` applies it at start whatever the device, before anything large is allocated, so a
server's process has the same allocator before and after its model loads. Memory that a server
frees in bulk and will not reuse soon (a large request body, a model loader's transient copies,
the weights that int8 activations narrow to the file's bits: ``astrai.model.activations``)
goes back to the system by ``trim_heap()``, which releases free heap whatever these thresholds
say; a block at or above ``MMAP_THRESHOLD`` (a body of 32 MiB) is unmapped when it is freed, so
one that a step allocates each time would be faulted in each time: the CPU plugin keeps an LM
head's logits (32 MiB for Gemma 3 at 32 rows) in a block of its own between steps instead
(``csrc/logits_out.cpp``; disabling ``mmap`` outright kept ~250 MB more resident for Gemma after
32-row steps).
Nothing else in astrai calls ``mallopt`` or ``malloc_trim``.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import functools
import logging
import sys
import threading
from typing import Any

__all__ = ["MMAP_THRESHOLD", "TOP_PAD", "TRIM_THRESHOLD", "trim_heap", "tune_malloc"]

logger = logging.getLogger(__name__)

_M_TRIM_THRESHOLD, _M_TOP_PAD, _M_MMAP_THRESHOLD = -1, -2, -3  # glibc's mallopt options
#: Blocks of this size or more are mapped on their own and unmapped when freed (glibc's ceiling for
#: the threshold on 64-bit, DEFAULT_MMAP_THRESHOLD_MAX; a fixed value also stops glibc raising it).
MMAP_THRESHOLD = 32 << 20
#: Free heap at the top is given back only beyond this (the step temporaries stay mapped).
TRIM_THRESHOLD = 1 << 30
#: The heap grows by this much more than asked, so that a step's temporaries rarely grow it.
TOP_PAD = 64 << 20


@functools.cache
def _libc() -> Any:
    if not sys.platform.startswith("linux"):
        return None
    try:
        return ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
    except OSError:
        return None


@functools.cache
def tune_malloc() -> bool:
    """Apply the process's allocator setting (the module doc); True when applied (once per process).

    A no-op returning False off Linux/glibc. Safe to call from any thread.
    """
    mallopt = getattr(_libc(), "mallopt", None)
    if mallopt is None:  # not Linux, or musl or another libc without mallopt
        return False
    options = (
        (_M_MMAP_THRESHOLD, MMAP_THRESHOLD),
        (_M_TRIM_THRESHOLD, TRIM_THRESHOLD),
        (_M_TOP_PAD, TOP_PAD),
    )
    applied = all(mallopt(option, value) == 1 for option, value in options)
    logger.debug("malloc tuning %s", "applied" if applied else "refused")
    return applied


_TRIMMING = threading.Lock()


def trim_heap() -> None:
    """Return the heap that the C allocator holds free to the operating system (glibc's ``malloc_trim``;
    nothing elsewhere). It releases the GIL while it runs; one at a time (a second call while one
    runs returns at once: the running one frees what both would)."""
    trim = getattr(_libc(), "malloc_trim", None)
    if trim is None or not _TRIMMING.acquire(blocking=False):
        return
    try:
        trim(0)
    finally:
        _TRIMMING.release()
