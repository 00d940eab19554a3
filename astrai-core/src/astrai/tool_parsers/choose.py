"""Which tool-call parser serves a request: by name, or the first whose ``matches`` the chat template, or
``hermes``."""

from __future__ import annotations

import functools

from astrai.errors import PluginError
from astrai.plugins import installed_state, load_plugins
from astrai.tool_parsers.base import TOOL_PARSERS, ToolParser, check_tool_parser


@functools.lru_cache(maxsize=8)
def _loaded(_state: object) -> tuple[dict[str, type[ToolParser]], dict[str, PluginError]]:
    found = load_plugins(TOOL_PARSERS, check_tool_parser)
    return found.classes, {n: f.as_error() for n, f in found.failures.items()}


def choose_tool_parser(name: str | None, chat_template: str = "") -> type[ToolParser]:
    """The parser named ``name``, or (None) the first installed one, by name, whose ``matches`` the
    template, else ``hermes`` (which reads the bare JSON form too; core's own class when its entry
    point is not seen). PluginError for a name that is not installed (listing those that are) or
    that failed to load."""
    classes, failures = _loaded(installed_state())
    if name is None:
        chosen = next((c for n, c in sorted(classes.items()) if c.matches(chat_template)), None)
        if chosen is None and "hermes" not in classes:
            from astrai.tool_parsers.hermes import HermesToolParser

            return HermesToolParser
        name = "hermes" if chosen is None else chosen.name
    if name in failures:
        raise failures[name]
    if name not in classes:
        raise PluginError(
            f"tool-call parser {name!r} not found; misspelled or not installed? "
            f"Installed: {', '.join(sorted(classes)) or 'none'}"
        )
    return classes[name]
