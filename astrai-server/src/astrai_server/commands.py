"""astrai-server's hook plugin: adds ``astrai serve`` to the ``astrai`` command.

Registered as entry point ``astrai_server`` in ``astrai.plugins``, so that astrai-core
never imports the server. ``PluginManager.discover()`` imports this module whenever an
engine is made: it imports nothing heavy, and ``astrai_server.cli`` (pydantic, the
settings) loads only when the ``astrai`` command builds its parser.
"""

from __future__ import annotations

from typing import Any

import astrai


@astrai.hookimpl
def astrai_register_commands(subparsers: Any, plugins: Any) -> None:
    from astrai_server.cli import add_serve_command

    add_serve_command(subparsers, plugins)
