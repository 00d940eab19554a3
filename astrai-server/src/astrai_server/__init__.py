"""The astrai HTTP server: OpenAI and Anthropic APIs (and any installed protocol) over FastAPI + uvicorn.

``create_app(settings, engine)`` builds the app; ``astrai serve`` (or
``python -m astrai_server``) runs it. Protocols are ``astrai.protocol.ResponseBuilder``
subclasses registered in the ``astrai.protocols`` entry-point group.
"""

from __future__ import annotations

from astrai_server.app import create_app
from astrai_server.config import ServerSettings, load_settings

__all__ = ["ServerSettings", "create_app", "load_settings"]
