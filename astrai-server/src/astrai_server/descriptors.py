"""The descriptors of ``astrai serve``: the open-file limit, the connection cap derived from it, and
accept() failures for want of descriptors logged once per interval.

- ``raise_descriptor_limit()`` (at start) raises the soft ``RLIMIT_NOFILE`` to the hard limit (each
  connection holds a descriptor) and logs both numbers in one INFO line.
- ``default_max_connections(soft)`` is the connection cap when ``--max-connections`` is unset: the
  soft limit less ``DESCRIPTOR_RESERVE``, at least half the soft limit (``connections`` enforces it).
- ``AcceptErrorLog.install(loop)`` makes the event loop's exception handler count accept() failing
  with EMFILE, ENFILE, ENOBUFS or ENOMEM: one WARNING line per ``LOG_INTERVAL`` with the count and
  the last error, no traceback; every other exception goes to the handler it replaced.
"""

from __future__ import annotations

import asyncio
import errno
import logging
from typing import Any

from astrai_server.logs import EveryInterval

logger = logging.getLogger(__name__)

#: Descriptors kept for the server itself when the connection cap is derived from the limit: the
#: listening socket, the event loop's, model and log files, tensor-parallel workers' pipes (an idle
#: server on the default model holds about ten).
DESCRIPTOR_RESERVE = 64
#: The derived cap when the soft limit is unlimited.
UNLIMITED_CONNECTIONS = 65536
#: Seconds between two lines that count accept() failures.
LOG_INTERVAL = 5.0
ACCEPT_ERRNOS = frozenset({errno.EMFILE, errno.ENFILE, errno.ENOBUFS, errno.ENOMEM})


def raise_descriptor_limit() -> tuple[int, int] | None:
    """Raise the soft ``RLIMIT_NOFILE`` to the hard limit and log both; ``(soft, hard)`` after, or
    None where the platform has no such limit. A refusal is a WARNING, not an error: the server
    then runs with the soft limit it was given."""
    try:
        import resource
    except ImportError:  # not a POSIX system
        return None
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    # Linux refuses RLIM_INFINITY: the most descriptors a process may have is /proc/sys/fs/nr_open
    target = _nr_open(hard) if hard == resource.RLIM_INFINITY else hard
    before = soft
    if soft != resource.RLIM_INFINITY and soft < target:
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (target, hard))
            soft = target
        except (ValueError, OSError) as e:
            logger.warning("descriptor limit: cannot raise the soft limit %d to %d: %s", soft, target, e)
    raised = f" (raised from {_text(before)})" if soft != before else ""
    logger.info("descriptor limit (RLIMIT_NOFILE): soft %s%s, hard %s", _text(soft), raised, _text(hard))
    return soft, hard


def soft_limit() -> int | None:
    """The soft ``RLIMIT_NOFILE`` now (None: unlimited, or no such limit on this platform)."""
    try:
        import resource
    except ImportError:
        return None
    soft = resource.getrlimit(resource.RLIMIT_NOFILE)[0]
    return None if soft == resource.RLIM_INFINITY else soft


def default_max_connections(soft: int | None) -> int:
    """The connection cap for a soft descriptor limit ``soft`` (None: unlimited)."""
    if soft is None:
        return UNLIMITED_CONNECTIONS
    return max(soft - DESCRIPTOR_RESERVE, soft // 2, 1)


def _nr_open(hard: int) -> int:
    try:
        with open("/proc/sys/fs/nr_open", encoding="ascii") as f:
            return int(f.read())
    except (OSError, ValueError):
        return hard


def _text(limit: int) -> str:
    import resource

    return "unlimited" if limit == resource.RLIM_INFINITY else str(limit)


class AcceptErrorLog:
    """The event loop's exception handler (see the module docstring).

    asyncio calls its handler for every failed accept(), with a traceback: its accept loop tries
    up to uvicorn's backlog (2048) times per wake-up, each failure scheduling another retry, so a
    server out of descriptors logged hundreds of thousands of tracebacks a minute."""

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self.previous = loop.get_exception_handler()
        self.failures = EveryInterval(
            logger,
            logging.WARNING,
            "accept() failures%s: %d (the last: %s); new connections wait in the listen queue until "
            "descriptors free up (see --max-connections)",
            LOG_INTERVAL,
        )

    @classmethod
    def install(cls, loop: asyncio.AbstractEventLoop) -> AcceptErrorLog:
        handler = cls(loop)
        loop.set_exception_handler(handler)
        return handler

    def __call__(self, loop: asyncio.AbstractEventLoop, context: dict[str, Any]) -> None:
        exc = context.get("exception")
        if isinstance(exc, OSError) and exc.errno in ACCEPT_ERRNOS:
            self.failures.count(loop, exc)
        elif self.previous is not None:
            self.previous(loop, context)
        else:
            loop.default_exception_handler(context)
