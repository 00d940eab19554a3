"""Logging of ``astrai serve``: ``--log-format text|json``, and the request id on every record.

``log_config(settings)`` is the ``logging.config.dictConfig`` that ``astrai serve`` applies, and
hands to uvicorn (``edge.uvicorn_options``): one stderr handler in the chosen format, uvicorn's
loggers passing their records to it. ``RequestIdFilter`` (on that handler) sets
``record.request_id`` from ``current_request_id()``, the id ``edge.EdgeMiddleware`` gives the
HTTP request being served in this context (None outside a request and on other threads).
``JsonFormatter`` writes one JSON object a line. ``EveryInterval`` logs how often something
happened, one line per interval at most, for events a client can cause by the thousand.
"""

from __future__ import annotations

import asyncio
import json
import logging
from contextvars import ContextVar
from datetime import datetime, timezone
from typing import Any

#: What an ``astrai_server.access`` record carries besides its message (``edge._log_access``).
#: ``abandoned`` (the client left before its response was complete: ``status`` is then 499) and
#: ``status_sent`` (the status that reached the connection, None when none did) are on every access record.
ACCESS_FIELDS = (
    "method",
    "path",
    "route",
    "status",
    "duration",
    "client",
    "prompt_tokens",
    "completion_tokens",
)
ACCESS_FIELDS += ("abandoned", "status_sent")
TEXT_FORMAT = "%(levelname)s %(name)s: %(message)s"

_current: ContextVar[str | None] = ContextVar("astrai_request_id", default=None)


def current_request_id() -> str | None:
    """The id of the HTTP request being served in this context (None outside one, or on another thread)."""
    return _current.get()


class RequestIdFilter(logging.Filter):
    """Sets ``record.request_id``: the current request's id (None outside a request), unless set already."""

    def filter(self, record: logging.LogRecord) -> bool:
        if getattr(record, "request_id", None) is None:
            record.request_id = _current.get()
        return True


class JsonFormatter(logging.Formatter):
    """One JSON object a line: time (ISO 8601, UTC), level, logger, message, request_id, the access
    fields a record carries, ``exc_info`` (the traceback as a string) when there is one."""

    def format(self, record: logging.LogRecord) -> str:
        out: dict[str, Any] = {
            "time": datetime.fromtimestamp(record.created, timezone.utc).isoformat(timespec="milliseconds"),
            "level": record.levelname,
            "logger": record.name,
            "message": record.getMessage(),
            "request_id": getattr(record, "request_id", None) or _current.get(),
        }
        out.update({name: getattr(record, name) for name in ACCESS_FIELDS if hasattr(record, name)})
        if record.exc_info:
            out["exc_info"] = self.formatException(record.exc_info)
        if record.stack_info:
            out["stack_info"] = self.formatStack(record.stack_info)
        return json.dumps(out, default=str)  # ASCII: no character of a message can break the line


def log_config(settings: Any) -> dict[str, Any]:
    """``dictConfig`` of ``astrai serve``: one stderr handler in ``settings.log_format`` with the request
    id filter, at ``settings.log_level``; uvicorn's loggers hand their records to it."""
    formatter = {"()": JsonFormatter} if settings.log_format == "json" else {"format": TEXT_FORMAT}
    return {
        "version": 1,
        "disable_existing_loggers": False,
        "filters": {"request_id": {"()": RequestIdFilter}},
        "formatters": {"astrai": formatter},
        "handlers": {
            "astrai": {
                "class": "logging.StreamHandler",
                "stream": "ext://sys.stderr",
                "formatter": "astrai",
                "filters": ["request_id"],
            }
        },
        "root": {"level": settings.log_level.upper(), "handlers": ["astrai"]},
        "loggers": {
            name: {"handlers": [], "propagate": True}
            for name in ("uvicorn", "uvicorn.error", "uvicorn.access")
        },
    }


class EveryInterval:
    """Counts events of one kind and logs the count at most once per ``interval`` seconds (of the
    event loop's clock): the first event at once, the ones after it when the interval since the last
    line is over. ``message`` takes the window (`` in the last 5 s``, empty on the first line), the
    count, then the arguments of the latest ``count``."""

    def __init__(self, logger: logging.Logger, level: int, message: str, interval: float = 5.0) -> None:
        self.logger, self.level, self.message, self.interval = logger, level, message, interval
        self.pending = 0
        self.args: tuple[Any, ...] = ()
        self._last: float | None = None  # loop time of the last line
        self._flush: asyncio.TimerHandle | None = None

    def count(self, loop: asyncio.AbstractEventLoop, *args: Any) -> None:
        """One more event (on the loop's thread); ``args`` are the latest event's."""
        self.pending += 1
        self.args = args
        if self._flush is not None:
            return  # a line is due already
        due = loop.time() if self._last is None else self._last + self.interval
        if due <= loop.time():
            self.flush(loop)
        else:
            self._flush = loop.call_at(due, self.flush, loop)

    def flush(self, loop: asyncio.AbstractEventLoop) -> None:
        """Log the events counted since the last line, if any."""
        self._flush = None
        if self.pending:
            seconds = 0.0 if self._last is None else loop.time() - self._last
            window = "" if self._last is None else f" in the last {seconds:.{0 if seconds >= 1 else 1}f} s"
            self.logger.log(self.level, self.message, window, self.pending, *self.args)
            self.pending, self._last = 0, loop.time()
