"""The astrai HTTP server: OpenAI and Anthropic APIs (and any installed protocol) over FastAPI + uvicorn.

``create_app(settings, engine)`` builds the app; ``astrai serve`` (or
``python -m astrai_server``) runs it. Protocols are ``astrai.protocol.ResponseBuilder``
subclasses registered in the ``astrai.protocols`` entry-point group.

The names below load on first use: importing a submodule (the hook plugin
``astrai_server.commands``, which every engine's plugin discovery imports) must not
import FastAPI.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from astrai_server.app import create_app
    from astrai_server.config import ServerSettings, load_settings

__all__ = ["ServerSettings", "create_app", "load_settings"]
_HOMES = {
    "create_app": "astrai_server.app",
    "ServerSettings": "astrai_server.config",
    "load_settings": "astrai_server.config",
}


def __getattr__(name: str) -> Any:
    if name in _HOMES:
        return getattr(importlib.import_module(_HOMES[name]), name)
    raise AttributeError(f"module 'astrai_server' has no attribute {name!r}")
