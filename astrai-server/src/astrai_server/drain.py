"""Graceful drain: ``DrainingServer``, the uvicorn server of ``astrai serve``.

uvicorn alone closes its listening socket on SIGTERM, so a load balancer's health probe gets
"connection refused" rather than an answer, and requests still streaming are cut when its
grace period ends. Here the first SIGTERM or SIGINT instead:

1. sets ``app.state.draining``: generation routes answer 503 in their protocol's shape and
   ``/health`` answers 503 ``{"status": "draining"}``, while the socket stays open; grammar
   compiles under way are stopped (their requests get 503: a compile may take many seconds and
   was not going to be served anyway);
2. waits up to ``shutdown_timeout`` seconds for the requests in flight (``app.state.in_flight``,
   kept by ``astrai_server.edge``) to finish;
3. aborts those still running (``engine.abort_all()``): each ends with finish reason
   ``abort`` and its stream with the protocol's normal end (OpenAI's ``[DONE]``);
4. lets uvicorn shut down; ``astrai serve`` then stops the engine and exits 0.

A second signal exits at once, with status 128 + the signal's number.
"""

from __future__ import annotations

import asyncio
import logging
import os
import signal
from types import FrameType
from typing import Any

import uvicorn

from astrai_server.descriptors import AcceptErrorLog

logger = logging.getLogger(__name__)

#: Seconds aborted requests get to send their last events before uvicorn closes the connections.
ABORT_GRACE = 10.0


class DrainingServer(uvicorn.Server):
    """``uvicorn.Server`` whose first exit signal drains ``app`` (see the module doc)."""

    def __init__(self, config: uvicorn.Config, app: Any, shutdown_timeout: float) -> None:
        super().__init__(config)
        self.app, self.shutdown_timeout = app, shutdown_timeout
        self._loop: asyncio.AbstractEventLoop | None = None
        self._drain: asyncio.Task | None = None

    async def serve(self, sockets: Any = None) -> None:
        self._loop = asyncio.get_running_loop()
        AcceptErrorLog.install(self._loop)  # accept() out of descriptors: a line per interval, no tracebacks
        await super().serve(sockets)

    def handle_exit(self, sig: int, frame: FrameType | None) -> None:
        """The signal handler (main thread, between two steps of the event loop)."""
        if self._drain is not None or self._loop is None:
            logger.warning("second %s: exiting now", signal.Signals(sig).name)
            os._exit(128 + sig)
        self.app.state.draining = True  # from now on: 503 for new requests and for /health
        engine = self.app.state.engine
        if engine is not None:
            engine.grammars.cancel_all()  # compiles under way end now (their workers are killed)
        # not recorded as uvicorn's captured signal: it would raise it again once the server is down
        self._drain = self._loop.create_task(self.drain(signal.Signals(sig).name))

    async def drain(self, why: str = "drain") -> None:
        """Wait for the requests in flight, abort them past the timeout, then stop uvicorn."""
        loop, app = asyncio.get_running_loop(), self.app
        logger.info(
            "%s: draining: new requests get 503; %d in flight have %g s to finish",
            why,
            _in_flight(app),
            self.shutdown_timeout,
        )
        await _until_idle(app, loop.time() + self.shutdown_timeout)
        if _in_flight(app):
            engine = app.state.engine
            aborted = engine.abort_all() if engine is not None else 0
            logger.warning("shutdown timeout (%g s): aborting %d requests", self.shutdown_timeout, aborted)
            await _until_idle(app, loop.time() + ABORT_GRACE)
        logger.info("drained: shutting down")
        self.should_exit = True


def _in_flight(app: Any) -> int:
    return getattr(app.state, "in_flight", 0)


async def _until_idle(app: Any, deadline: float) -> None:
    loop = asyncio.get_running_loop()
    while _in_flight(app) and loop.time() < deadline:
        await asyncio.sleep(0.05)
