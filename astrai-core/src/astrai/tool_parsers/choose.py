"""Which tool-call parser serves a request: by name, or ``hermes``."""

from __future__ import annotations

import functools

from astrai.errors import PluginError
from astrai.plugins import installed_state, load_plugins
from astrai.tool_parsers.base import TOOL_PARSERS, ToolParser, check_tool_parser


@functools.lru_cache(maxsize=8)
def _loaded(_state: object) -> tuple[dict[str, type[ToolParser]], dict[str, PluginError]]:
    found = load_plugins(TOOL_PARSERS, check_tool_parser)
    return found.classes, {n: f.as_error() for n, f in found.failures.items()}


def choose_tool_parser(name: str | None) -> type[ToolParser]:
    """The parser named ``name`` (None: ``hermes``, which reads the bare JSON form too; core's own class
    when its entry point is not seen). PluginError for a name that is not installed (listing those
    that are) or that failed to load."""
    classes, failures = _loaded(installed_state())
    if name is None and "hermes" not in classes:
        from astrai.tool_parsers.hermes import HermesToolParser

        return HermesToolParser
    name = name or "hermes"
    if name in failures:
        raise failures[name]
    if name not in classes:
        raise PluginError(
            f"tool-call parser {name!r} not found; misspelled or not installed? "
            f"Installed: {', '.join(sorted(classes)) or 'none'}"
        )
    return classes[name]
