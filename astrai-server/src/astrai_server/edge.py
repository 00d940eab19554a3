"""The HTTP edge of ``astrai serve``: request ids, the access log, CORS, API keys, TLS, log formats.

``install(app, settings)`` (called by ``create_app``) puts ``EdgeMiddleware`` outside every route,
and Starlette's ``CORSMiddleware`` inside it when ``settings.allowed_origins`` lists origins.
``EdgeMiddleware`` is pure ASGI (a stream passes through it unbuffered); for every HTTP request it

- names the request: ``scope["state"]["request_id"]`` (``request.state.request_id``) is the
  client's ``X-Request-Id`` when that is 1 to 128 characters of ``[A-Za-z0-9._:-]``, else a new
  ``req-<16 hex>`` (the replacement is logged); an id already in flight gets ``-<8 hex>``
  appended (the live ids are ``app.state.request_ids``). ``current_request_id()`` returns it
  inside the request, and ``RequestIdFilter`` puts it on every log record made there;
- echoes ``x-request-id`` on every response it sends (errors, 401s, streams);
- counts ``app.state.in_flight``: requests not finished yet (a stream until its last byte is
  sent or its client left), GET /health and GET /metrics excepted;
- refuses a request with both ``Content-Length`` and ``Transfer-Encoding``: 400, the connection
  closed (``connections.refuse_ambiguous_framing``);
- writes one record on the ``astrai_server.access`` logger when the response is done: method,
  path, route, status, duration, request id, client, and the token counts an endpoint left in
  ``scope["state"]["usage"]``. A client that left before the response was complete (the app got
  ``http.disconnect``, or a send failed) makes it ``abandoned``, status 499 (nginx's), with the
  ``status_sent`` before (None: none); a body that stalled (``connections``) makes it a 408.

``install`` also reads the API keys (``app.state.keys``: ``astrai_server.keys``, where ``caller`` and
``authorized`` check a request's; ``authorized`` is re-exported here). ``uvicorn_options(settings)`` is the
keyword arguments for uvicorn: TLS (its files checked first), ``logs.log_config(settings)``, ``http``.
"""

from __future__ import annotations

import logging
import re
import secrets
import ssl
import time
from pathlib import Path
from typing import Any

from astrai_server.config import ServerSettings
from astrai_server.connections import ambiguous_framing, protocol_class, refuse_ambiguous_framing
from astrai_server.errors import ConfigError
from astrai_server.keys import authorized, key_ring
from astrai_server.logs import RequestIdFilter, _current, current_request_id, log_config

__all__ = [
    "EdgeMiddleware",
    "RequestIdFilter",
    "authorized",
    "current_request_id",
    "install",
    "uvicorn_options",
]

logger = logging.getLogger(__name__)
access_logger = logging.getLogger("astrai_server.access")

REQUEST_ID = re.compile(r"[A-Za-z0-9._:-]{1,128}")
HEADER = b"x-request-id"
UNCOUNTED = frozenset({("GET", "/health"), ("HEAD", "/health"), ("GET", "/metrics"), ("HEAD", "/metrics")})
ABANDONED = 499  # nginx's "client closed request": never sent, only logged
_CONTROL = re.compile(r"[\x00-\x1f\x7f]")


def install(app: Any, settings: ServerSettings) -> None:
    """The edge of ``app``: its API keys, the in-flight count and live ids, CORS, ``EdgeMiddleware``.
    Raises ConfigError for an unreadable ``api_key_file``."""
    app.state.keys = key_ring(settings)
    app.state.in_flight = 0
    app.state.request_ids = set()
    if settings.allowed_origins:
        from starlette.middleware.cors import CORSMiddleware

        app.add_middleware(
            CORSMiddleware,
            allow_origins=settings.allowed_origins,
            allow_methods=settings.allowed_methods,
            allow_headers=settings.allowed_headers,
            expose_headers=["x-request-id", "retry-after"],
        )
    app.add_middleware(EdgeMiddleware, state=app.state)  # added last: outside CORS, so preflights get an id


class EdgeMiddleware:
    """Request ids, the in-flight count and the access log (see the module docstring)."""

    def __init__(self, app: Any, state: Any) -> None:
        self.app, self.state = app, state

    async def __call__(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        started = time.perf_counter()
        rid = self._claim(scope)
        scope.setdefault("state", {})["request_id"] = rid
        counted = (scope["method"], scope["path"]) not in UNCOUNTED
        echo = (HEADER, rid.encode("ascii"))
        status: int | None = None
        sent: int | None = None  # the status that went out while the client was there
        finished = abandoned = False  # the last body message was sent; the client left before that

        async def receive_watched() -> dict[str, Any]:
            nonlocal abandoned
            message = await receive()
            abandoned |= message["type"] == "http.disconnect" and not finished
            return message

        async def send_with_id(message: dict[str, Any]) -> None:
            nonlocal status, sent, finished, abandoned
            if message["type"] == "http.response.start":
                status = message["status"]
                sent = None if abandoned else status
                headers = [(k, v) for k, v in message.get("headers", ()) if k.lower() != HEADER]
                message = {**message, "headers": [*headers, echo]}
            elif message["type"] == "http.response.body" and not message.get("more_body", False):
                finished = True  # before the send: the server may signal the disconnect that follows first
            try:
                await send(message)
            except OSError:
                abandoned = True
                raise

        app = refuse_ambiguous_framing if ambiguous_framing(scope) else self.app
        token = _current.set(rid)
        if counted:
            self.state.in_flight += 1
        try:
            await app(scope, receive_watched, send_with_id)
        except Exception:
            if status is None:  # Starlette's own answer, with the id (it then finds the response started)
                await send_with_id(
                    {
                        "type": "http.response.start",
                        "status": 500,
                        "headers": [(b"content-type", b"text/plain; charset=utf-8")],
                    }
                )
                await send({"type": "http.response.body", "body": b"Internal Server Error"})
            raise
        finally:
            if counted:
                self.state.in_flight -= 1
            self.state.request_ids.discard(rid)
            timed_out = scope["state"].get("timed_out", False)  # the 408 of connections: no client left
            abandoned &= not timed_out
            status, sent = (408, 408) if timed_out else (ABANDONED, sent) if abandoned else (status, status)
            _log_access(scope, rid, status, time.perf_counter() - started, abandoned, sent)
            _current.reset(token)

    def _claim(self, scope: dict[str, Any]) -> str:
        """This request's id (see the module docstring), added to the live ids."""
        live: set[str] = self.state.request_ids
        given = next((v.decode("latin-1") for k, v in scope.get("headers", ()) if k.lower() == HEADER), None)
        if given is None or not REQUEST_ID.fullmatch(given):
            rid = _new_id(live)
            if given is not None:
                shown = repr(given[:64]) + ("..." if len(given) > 64 else "")
                logger.info(
                    "x-request-id %s is not 1 to 128 characters of A-Z a-z 0-9 . _ : -; the request is %s",
                    shown,
                    rid,
                    extra={"request_id": rid},
                )
        else:
            rid = given
            while rid in live:
                rid = f"{given}-{secrets.token_hex(4)}"
            if rid != given:
                logger.info(
                    "x-request-id %s is in flight already; this request is %s",
                    given,
                    rid,
                    extra={"request_id": rid},
                )
        live.add(rid)
        return rid


def _new_id(live: set[str]) -> str:
    while (rid := f"req-{secrets.token_hex(8)}") in live:
        pass
    return rid


def _log_access(
    scope: dict[str, Any], rid: str, status: int | None, duration: float, abandoned: bool, sent: int | None
) -> None:
    path = _CONTROL.sub(lambda m: f"\\x{ord(m.group()):02x}", scope["path"])
    route = getattr(scope.get("route"), "path", None)
    client = scope.get("client")
    fields: dict[str, Any] = {
        "request_id": rid,
        "method": scope["method"],
        "path": path,
        "route": route,
        "status": status,
        "duration": round(duration, 6),
        "client": f"{client[0]}:{client[1]}" if client else None,
        "abandoned": abandoned,
        "status_sent": sent,
    }
    usage = scope.get("state", {}).get("usage")
    tokens = ""
    if isinstance(usage, dict):
        for name in ("prompt_tokens", "completion_tokens"):
            if name in usage:
                fields[name] = usage[name]
                tokens += f" {name}={usage[name]}"
    if abandoned:
        tokens += f" abandoned status_sent={'-' if sent is None else sent}"
    access_logger.info(
        "%s %s %s %.3fs request_id=%s client=%s%s",
        fields["method"],
        path,
        "-" if status is None else status,
        duration,
        rid,
        fields["client"] or "-",
        tokens,
        extra=fields,
    )


# ---------------------------------------------------------------- uvicorn and TLS

CERT_REQS = {"none": ssl.CERT_NONE, "optional": ssl.CERT_OPTIONAL, "required": ssl.CERT_REQUIRED}


def uvicorn_options(settings: ServerSettings) -> dict[str, Any]:
    """``uvicorn.Config`` keyword arguments beyond host, port and log level: logging (``log_config``,
    no access log of uvicorn's: ``EdgeMiddleware`` writes it), the HTTP protocol class that bounds
    connections (``connections.protocol_class``) and TLS. Raises ConfigError for TLS settings that
    cannot work (see ``check_tls``)."""
    options: dict[str, Any] = {"log_config": log_config(settings), "access_log": False}
    options["http"] = protocol_class(settings)
    if check_tls(settings):
        options.update(
            ssl_certfile=settings.ssl_certfile,
            ssl_keyfile=settings.ssl_keyfile,
            ssl_keyfile_password=settings.ssl_keyfile_password,
            ssl_ca_certs=settings.ssl_ca_certs,
            ssl_cert_reqs=CERT_REQS[settings.ssl_cert_reqs],
        )
    return options


def check_tls(settings: ServerSettings) -> bool:
    """Whether TLS is on (``ssl_certfile`` set), once its files load as uvicorn will load them.
    ConfigError for a missing or bad file, a key without a certificate, an encrypted key without
    its password, client certificates without the CA that verifies them."""
    s = settings
    if s.ssl_certfile is None:
        for name in ("ssl_keyfile", "ssl_keyfile_password", "ssl_ca_certs"):
            if getattr(s, name) is not None:
                raise ConfigError(f"{_flag(name)} needs --ssl-certfile (the certificate TLS serves)")
        if s.ssl_cert_reqs != "none":
            raise ConfigError("--ssl-cert-reqs needs --ssl-certfile (the certificate TLS serves)")
        return False
    if s.ssl_cert_reqs != "none" and s.ssl_ca_certs is None:
        raise ConfigError(
            f"--ssl-cert-reqs {s.ssl_cert_reqs} needs --ssl-ca-certs "
            "(the CA certificates that verify clients)"
        )
    for name in ("ssl_certfile", "ssl_keyfile", "ssl_ca_certs"):
        path = getattr(s, name)
        if path is not None and not Path(path).is_file():
            raise ConfigError(f"{_flag(name)} {path}: no such file")

    def no_password() -> str:
        raise ConfigError(
            f"--ssl-keyfile {s.ssl_keyfile or s.ssl_certfile}: the key is encrypted; "
            "give --ssl-keyfile-password"
        )

    context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    try:
        context.load_cert_chain(s.ssl_certfile, s.ssl_keyfile, password=s.ssl_keyfile_password or no_password)
    except (ssl.SSLError, OSError) as e:
        key = f" and --ssl-keyfile {s.ssl_keyfile}" if s.ssl_keyfile else ""
        raise ConfigError(
            f"--ssl-certfile {s.ssl_certfile}{key}: not a PEM certificate chain and its private key ({e})"
        ) from None
    if s.ssl_ca_certs is not None:
        try:
            context.load_verify_locations(s.ssl_ca_certs)
        except (ssl.SSLError, OSError) as e:
            raise ConfigError(f"--ssl-ca-certs {s.ssl_ca_certs}: not PEM CA certificates ({e})") from None
    return True


def _flag(name: str) -> str:
    return "--" + name.replace("_", "-")
