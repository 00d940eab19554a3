"""The one place where errors become HTTP status codes; builders shape the bodies.

``status_for`` maps astrai's error classes (never message text) to a status.
``HTTPProblem`` carries the errors the server itself detects (malformed JSON,
schema validation, authentication) to the same place.
"""

from __future__ import annotations

from astrai.errors import (
    AdapterBusy,
    AdapterError,
    AstraiError,
    BackendUnavailable,
    CapacityExceeded,
    EngineNotReady,
    ModelNotFound,
    Overloaded,
    PluginError,
    RequestRejected,
)

#: Most specific first: the first class that matches decides.
STATUS_BY_ERROR: tuple[tuple[type[BaseException], int], ...] = (
    (RequestRejected, 400),  # can never be served: too long, bad parameters, template refuses it
    (ModelNotFound, 404),
    (AdapterError, 400),  # a LoRA adapter that cannot be loaded or named so
    (AdapterBusy, 409),  # every adapter slot has requests in flight
    (Overloaded, 429),  # shed under load, nothing kept: retry after Retry-After (Anthropic: 529)
    (EngineNotReady, 503),  # not loaded yet, shut down, or the scheduler died
    (CapacityExceeded, 503),  # no room now; the client may retry
    (BackendUnavailable, 500),
    (PluginError, 500),
    (AstraiError, 500),
)


class ConfigError(AstraiError):
    """``astrai serve`` configuration is invalid: unknown YAML key, bad value, unreadable file."""


class ModelLoadFailed(AstraiError):
    """The model did not load at start (``on_load_failure: exit``): ``astrai serve`` exits 1 with the
    message, one line naming the file and the problem. Never an HTTP error: no request sees it."""


class HTTPProblem(Exception):
    """An error the server detects itself, with its status; ``param`` names the offending field."""

    def __init__(self, status: int, message: str, param: str | None = None) -> None:
        super().__init__(message)
        self.status, self.message, self.param = status, message, param


def status_for(exc: BaseException) -> int:
    """HTTP status for ``exc``: 500 for anything that is not an expected astrai error."""
    if isinstance(exc, HTTPProblem):
        return exc.status
    for cls, status in STATUS_BY_ERROR:
        if isinstance(exc, cls):
            return status
    return 500


#: ``Retry-After`` (seconds) of a request shed under load (``Overloaded``).
RETRY_AFTER_SECONDS = 1


def public_message(exc: BaseException) -> str:
    """What a client may read: astrai errors are raised on purpose and say what went wrong;
    anything else (a bug, a failed step) stays generic and goes to the server log."""
    if isinstance(exc, HTTPProblem):
        return exc.message
    if isinstance(exc, EngineNotReady) and not str(exc):
        return "Engine not initialized"
    if isinstance(exc, AstraiError):
        return str(exc)
    return "internal server error (see the server log)"
