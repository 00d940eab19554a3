"""The connections of ``astrai serve``: a cap on open connections, and deadlines for a request's
head and body.

uvicorn bounds neither: a client that sends its request head one byte a second holds its connection,
and a descriptor, for ever, and a few thousand of them exhaust the descriptors. ``protocol_class``
returns the ``http=`` class for ``uvicorn.Config``: uvicorn's own HTTP protocol (httptools when it
is installed, else h11: what ``http="auto"`` picks) with ``GuardedProtocol`` mixed in, so that

- a connection is taken only while fewer than ``max_connections`` are open (uvicorn's
  ``server_state.connections``). At the limit, a new connection first takes the place of the open
  one that has waited longest for a request head, if that wait is over ``EVICTABLE_AFTER`` seconds:
  that one gets a 408 and is closed (a client sends a head in milliseconds; a slowloris holds its
  connections in exactly that state, so its connections cannot lock other clients out until the
  header timeout). Otherwise the new connection is answered at once, before it sends anything:
  ``503 {"detail": ...}`` with ``Connection: close`` and ``Retry-After: 1``. It is never counted,
  and its descriptor goes when the client hangs up, at most ``REFUSED_LINGER`` seconds later;
- a request head (request line and headers) must be complete within ``header_timeout`` seconds
  of the connection opening or, on a kept-alive connection, of the first byte of the next request
  (the idle time between requests is uvicorn's ``timeout_keep_alive``);
- a request body must make progress: not a byte for ``header_timeout`` seconds while the server
  reads it is a stall (as nginx's ``client_body_timeout``; time the server does not read is not
  counted). A slow body that keeps coming is not bounded here, only by ``max_connections``.

A connection past either deadline gets ``408 {"detail": ...}`` with ``Connection: close`` (unless
a response had started: then it is only closed) and is closed. For a stalled body,
``scope["state"]["timed_out"]`` is set first, so that the access log (``edge``) records a 408, not
a client that left. Refusals and timeouts are counted in one log line per interval at most
(``logs.EveryInterval``): a flood of them must not flood the log.

``ambiguous_framing(scope)``: whether a request carries both ``Content-Length`` and
``Transfer-Encoding``. h11 takes the chunked framing then, and keeps the connection: a proxy in
front that took the other framing could smuggle a second request in the body. httptools (llhttp)
refuses such a request itself; ``refuse_ambiguous_framing`` (an ASGI app: ``EdgeMiddleware`` runs
it instead of the app) answers 400 ``{"detail": ...}`` with ``Connection: close``, which makes
uvicorn close the connection, as RFC 9112 section 6.3 requires of a server that refuses it.

uvicorn's own ``limit_concurrency`` is not used: it counts the very connection that asks, reads its
request head first and answers each request with a plain-text 503, so a connection over it still
holds its slot; the check here refuses at accept and counts the same set.
"""

from __future__ import annotations

import asyncio
import json
import logging
from typing import TYPE_CHECKING, Any

from astrai_server.descriptors import DESCRIPTOR_RESERVE, default_max_connections, soft_limit
from astrai_server.logs import EveryInterval

if TYPE_CHECKING:
    from astrai_server.config import ServerSettings

logger = logging.getLogger(__name__)

#: Seconds a refused connection may stay open after its 503, waiting for its client to hang up.
REFUSED_LINGER = 1.0
#: Seconds a connection's request head may be incomplete before a new connection at the limit may
#: take its place.
EVICTABLE_AFTER = 1.0
#: Seconds between two lines that count refusals, or timeouts.
LOG_INTERVAL = 5.0
AMBIGUOUS = b'{"detail": "a request may not carry both Content-Length and Transfer-Encoding (RFC 9112, 6.3)"}'


def protocol_class(settings: ServerSettings) -> type[asyncio.Protocol]:
    """uvicorn's HTTP protocol class with ``GuardedProtocol`` mixed in, for ``settings``; logs the
    bounds. ``max_connections`` unset: derived from the soft descriptor limit now
    (``descriptors.default_max_connections``), so ``raise_descriptor_limit`` comes first."""
    from uvicorn.protocols.http.auto import AutoHTTPProtocol  # httptools if installed, else h11

    soft = soft_limit()
    derived = default_max_connections(soft)
    limit = settings.max_connections or derived
    if soft is not None and limit > derived:
        over = "is more than the descriptor limit allows (soft %d, less %d reserved): accept() will fail"
        logger.warning("--max-connections %d " + over, limit, soft, DESCRIPTOR_RESERVE)
    timeout = settings.header_timeout
    message = "connections: at most %d open (--max-connections), request heads within %g s (--header-timeout)"
    logger.info(message, limit, timeout)

    def every(level: int, message: str) -> EveryInterval:
        return EveryInterval(logger, level, message, LOG_INTERVAL)

    attributes = {
        "header_timeout": timeout,
        "max_connections": limit,
        "refusals": every(logging.WARNING, f"connections refused%s: %d, {limit} open (--max-connections)"),
        "head_timeouts": every(logging.INFO, f"connections closed%s: %d, no request head in {timeout:g} s"),
        "body_timeouts": every(logging.INFO, f"connections closed%s: %d, a body stalled for {timeout:g} s"),
        "evictions": every(logging.WARNING, "connections closed%s: %d, their heads incomplete, for new ones"),
        "heads": {},
    }
    return type(f"Guarded{AutoHTTPProtocol.__name__}", (GuardedProtocol, AutoHTTPProtocol), attributes)


def _response(status: int, reason: str, detail: str, *headers: str) -> bytes:
    """A whole HTTP/1.1 response that closes the connection, written without uvicorn's parser."""
    body = json.dumps({"detail": detail}).encode()
    head = [f"HTTP/1.1 {status} {reason}", "content-type: application/json", f"content-length: {len(body)}"]
    return ("\r\n".join([*head, "connection: close", *headers]) + "\r\n\r\n").encode("ascii") + body


class GuardedProtocol:
    """Mixed in before uvicorn's ``H11Protocol`` or ``HttpToolsProtocol`` by ``protocol_class``,
    which sets the bounds; relies only on what both classes have (annotated below). uvicorn makes
    ``cycle`` when a request head is complete; it has ``more_body`` (the request's),
    ``response_started``, ``response_complete`` and ``scope``."""

    header_timeout: float
    max_connections: int
    refusals: EveryInterval  # the four counters are the server's, shared by its connections
    head_timeouts: EveryInterval
    body_timeouts: EveryInterval
    evictions: EveryInterval
    heads: dict[GuardedProtocol, float]  # the server's connections awaiting a head, oldest first
    # uvicorn's
    connections: set[Any]
    transport: Any
    flow: Any
    loop: asyncio.AbstractEventLoop
    cycle: Any

    _refused = False
    _timer: asyncio.TimerHandle | None = None
    _phase: str | None = None  # "head" or "body": what the timer guards
    _of: Any = None  # the cycle whose body, or after whose response the head, is guarded (None: the first)
    _progress = 0.0  # loop time the guarded body last grew

    def connection_made(self, transport: Any) -> None:
        if len(self.connections) >= self.max_connections and not self._evict_one():
            self._refuse(transport)
            return
        super().connection_made(transport)  # type: ignore[misc]
        self._start("head", None)

    def _refuse(self, transport: Any) -> None:
        self._refused = True
        detail = f"too many connections: the server holds its limit of {self.max_connections}; retry later"
        transport.write(_response(503, "Service Unavailable", detail, "retry-after: 1"))
        # Half-close and read on until the client hangs up: closing with its request unread would
        # reset the connection, which may discard the 503 before the client reads it.
        if transport.can_write_eof():
            transport.write_eof()
            self._timer = self.loop.call_later(REFUSED_LINGER, transport.close)
        else:  # TLS has no half-close
            transport.close()
        self.refusals.count(self.loop)

    def _evict_one(self) -> bool:
        """Close the connection that has waited longest for a head, if over ``EVICTABLE_AFTER`` s."""
        now = self.loop.time()
        while self.heads:
            oldest, since = next(iter(self.heads.items()))
            if since > now - EVICTABLE_AFTER:
                return False
            oldest._stop()
            if oldest.transport.is_closing():
                continue  # closed already: it leaves the connections at the next turn of the loop
            detail = f"request head not complete after {now - since:.1f} s; closed to take a new connection"
            oldest.transport.write(_response(408, "Request Timeout", detail))
            oldest.transport.close()
            self.evictions.count(self.loop)
            return True
        return False

    def connection_lost(self, exc: Exception | None) -> None:
        self._stop()
        if not self._refused:
            super().connection_lost(exc)  # type: ignore[misc]

    def data_received(self, data: bytes) -> None:
        if self._refused:
            return  # dropped until the client hangs up
        super().data_received(data)  # type: ignore[misc]
        self._watch(received=True)

    def eof_received(self) -> bool | None:
        return None if self._refused else super().eof_received()  # type: ignore[misc]

    def on_response_complete(self) -> None:
        super().on_response_complete()  # type: ignore[misc]
        self._watch(received=False)

    def _watch(self, received: bool) -> None:
        """After uvicorn handled input or completed a response: which deadline runs now."""
        cycle = self.cycle
        if self.transport.is_closing():
            self._stop()
        elif cycle is None:
            pass  # the first head: its deadline runs from connection_made, whatever arrives
        elif cycle.more_body:  # the body is still coming (also after an early answer, such as a 413)
            if (self._phase, self._of) != ("body", cycle):
                self._start("body", cycle)
            self._progress = self.loop.time()
        elif not cycle.response_complete:
            self._stop()  # the app is answering: no deadline of ours
        elif received and (self._phase, self._of) != ("head", cycle):
            self._start("head", cycle)  # the first bytes of the next request's head
        elif not received:
            self._stop()  # between requests: uvicorn's keep-alive timer

    def _start(self, phase: str, cycle: Any) -> None:
        self._stop()
        self._phase, self._of = phase, cycle
        self._progress = self.loop.time()
        self._timer = self.loop.call_at(self._progress + self.header_timeout, self._expired)
        if phase == "head":
            self.heads[self] = self._progress  # newest last: the dict keeps the oldest first

    def _stop(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
        self._timer, self._phase, self._of = None, None, None
        self.heads.pop(self, None)

    def _expired(self) -> None:
        self._timer = None
        transport, loop, cycle = self.transport, self.loop, self.cycle
        if transport.is_closing() or transport.get_protocol() is not self:  # closed, or now a WebSocket's
            return
        if self._phase == "body":
            if self.flow.read_paused:
                self._progress = loop.time()  # the server is not reading: no stall of the client's
            if loop.time() < self._progress + self.header_timeout:
                self._timer = loop.call_at(self._progress + self.header_timeout, self._expired)
                return
            self.body_timeouts.count(loop)
            if not cycle.response_started:
                cycle.scope.setdefault("state", {})["timed_out"] = True
                detail = f"request body stalled: no byte for {self.header_timeout:g} s"
                transport.write(_response(408, "Request Timeout", detail))
        else:
            self.head_timeouts.count(loop)
            detail = f"request head not complete within {self.header_timeout:g} s"
            transport.write(_response(408, "Request Timeout", detail))
        self._stop()
        transport.close()


def ambiguous_framing(scope: dict[str, Any]) -> bool:
    """Whether the request of ``scope`` has both a ``Content-Length`` and a ``Transfer-Encoding`` header."""
    names = {name.lower() for name, _ in scope.get("headers", ())}
    return b"content-length" in names and b"transfer-encoding" in names


async def refuse_ambiguous_framing(scope: dict[str, Any], receive: Any, send: Any) -> None:
    """400 with ``Connection: close``: where the body ends is unknown, so the connection cannot be reused."""
    headers = [(b"content-type", b"application/json"), (b"content-length", b"%d" % len(AMBIGUOUS))]
    headers.append((b"connection", b"close"))
    await send({"type": "http.response.start", "status": 400, "headers": headers})
    await send({"type": "http.response.body", "body": AMBIGUOUS})
