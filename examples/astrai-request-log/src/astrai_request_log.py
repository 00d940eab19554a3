"""astrai-request-log: one JSON line per finished request, with timings (an astrai hook plugin).

Registered as the module ``astrai_request_log`` in the ``astrai.plugins`` group. A line::

    {"event": "request_finished", "model": "SmolLM2-135M-Instruct", "request_id": "...",
     "prompt_tokens": 38, "completion_tokens": 7, "cached_tokens": 32, "finish_reason": "stop",
     "error": null, "submitted_at": 1767225600.0, "queue_time": 0.0004,
     "time_to_first_token": 0.051, "total_time": 0.12}

(times in seconds; ``submitted_at`` is Unix time). Lines go to the file named by
``--request-log`` (appended, one per line), else to the ``astrai.request_log`` logger.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import threading
import weakref
from collections import deque
from typing import Any

import astrai

logger = logging.getLogger("astrai.request_log")
RECENT = 100
"""Records ``GET /request-log`` keeps per engine."""


class RequestLog:
    """Where one engine's lines go: a file (``path``) or the logger; keeps the last ``RECENT``."""

    def __init__(self, path: str | None) -> None:
        self.file = (
            open(path, "a", encoding="utf-8") if path else None  # noqa: SIM115 - closed at engine stop
        )
        self.recent: deque[dict[str, Any]] = deque(maxlen=RECENT)
        self.lock = threading.Lock()

    def write(self, record: dict[str, Any]) -> None:
        line = json.dumps(record, separators=(",", ":"))
        with self.lock:
            self.recent.append(record)
            if self.file is None:
                logger.info("%s", line)
            else:
                self.file.write(line + "\n")
                self.file.flush()

    def close(self) -> None:
        with self.lock:
            if self.file is not None:
                self.file.close()


# One log per running engine; an engine that is collected takes its entry with it.
_logs: weakref.WeakKeyDictionary[Any, RequestLog] = weakref.WeakKeyDictionary()


@astrai.hookimpl
def astrai_add_options(parser: Any) -> None:
    parser.add_argument(
        "--request-log",
        dest="request_log",
        metavar="PATH",
        default=None,
        help="append one JSON line per finished request to PATH (else: the astrai.request_log logger)",
    )


@astrai.hookimpl
def astrai_engine_started(engine: Any) -> None:
    _logs[engine] = RequestLog(engine.config.plugin_options.get("request_log"))


@astrai.hookimpl
def astrai_request_finished(engine: Any, request: Any) -> None:
    log = _logs.get(engine)
    if log is not None:
        log.write(
            {"event": "request_finished", "model": engine.model.config.name, **dataclasses.asdict(request)}
        )


@astrai.hookimpl
def astrai_engine_stopped(engine: Any) -> None:
    log = _logs.pop(engine, None)
    if log is not None:
        log.close()


@astrai.hookimpl
def astrai_server_app(app: Any, settings: Any) -> None:
    from starlette.responses import JSONResponse  # only astrai-server calls this hook: it has starlette

    from astrai_server.edge import authorized  # the server's own check: any of its API keys

    async def recent(request: Any) -> Any:
        if not authorized(request):
            return JSONResponse({"detail": "invalid or missing API key"}, status_code=401)
        log = _logs.get(request.app.state.engine) if request.app.state.engine is not None else None
        if log is None:
            return JSONResponse({"requests": []})
        with log.lock:
            return JSONResponse({"requests": list(log.recent)})

    app.add_route("/request-log", recent, methods=["GET"])  # a plain Starlette endpoint(request)
