"""``build_lock``: one kernel builder per build directory, and a lock that dies with its holder.

``torch.utils.cpp_extension.load`` guards a build directory with a ``lock`` file
(``torch.utils.file_baton.FileBaton``): created when a build starts, removed when it ends, and
polled by every other process until it disappears, without asking whether its creator still
lives. A process killed during its build (an OOM kill, a SIGKILL at a rollout) leaves the file,
and every later load on that directory waits for it forever: on a cache volume shared by
replicas, one kill during the first build stops them all.

``build_lock(directory)`` wraps such a load in an exclusive ``fcntl.flock`` on a file of ours,
``astrai-build.lock``. The kernel drops a flock when its holder's last descriptor closes, so
also when the holder dies; whoever holds it is the only builder astrai runs on that directory,
and a torch ``lock`` file found then was left by a builder that is gone: it is removed.
A taker that finds the lock held logs one INFO line and waits as long as the holder lives.

Contract: every astrai process that builds into a directory takes this lock first (the CPU
and CUDA backends' JIT builds do). Builders that do not (another program calling torch's
``load`` on the same directory) are not protected. flock works across the containers of one
host and on NFSv4 (Linux maps it onto byte-range locks there).
"""

from __future__ import annotations

import contextlib
import fcntl
import logging
import os
import socket
from collections.abc import Iterator
from pathlib import Path

__all__ = ["LOCK_NAME", "TORCH_LOCK_NAME", "build_lock"]

logger = logging.getLogger(__name__)

#: Our lock file in the build directory; its content names the holder (pid and host), for the logs.
LOCK_NAME = "astrai-build.lock"
#: The file torch's FileBaton creates in the build directory while it builds.
TORCH_LOCK_NAME = "lock"


def _holder(fd: int) -> str:
    """Who holds the lock, as its holder wrote it ("pid 12 on host-a"), or "another process"."""
    try:
        text = os.pread(fd, 200, 0).decode(errors="replace").strip()
    except OSError:
        text = ""
    return f"another process ({text})" if text else "another process"


@contextlib.contextmanager
def build_lock(directory: str | Path) -> Iterator[None]:
    """Hold the build lock of ``directory`` (created if missing) for the ``with`` block.

    Blocks while another live process holds it (one INFO line says so); a torch ``lock`` file
    found once the lock is ours is removed (its builder is dead). Raises OSError when the
    directory or the lock file cannot be created (a read-only cache, say).
    """
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    # O_CLOEXEC (Python's default): compiler processes the build starts do not inherit the lock
    fd = os.open(directory / LOCK_NAME, os.O_RDWR | os.O_CREAT, 0o666)
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            logger.info("waiting for the kernel build in %s by %s", directory, _holder(fd))
            fcntl.flock(fd, fcntl.LOCK_EX)  # returns when the holder releases the lock or dies
        os.ftruncate(fd, 0)
        os.pwrite(fd, f"pid {os.getpid()} on {socket.gethostname()}".encode(), 0)
        stale = directory / TORCH_LOCK_NAME
        if stale.exists():
            logger.warning(
                "removing %s: a kernel build that did not finish left it (its process is gone)", stale
            )
            stale.unlink(missing_ok=True)
        yield
    finally:
        os.close(fd)  # releases the lock
