"""Which reasoning parser serves a request: by name, or the first whose ``matches`` the chat template."""

from __future__ import annotations

import functools

from astrai.errors import PluginError
from astrai.plugins import installed_state, load_plugins
from astrai.reasoning.base import REASONING_PARSERS, ReasoningParser, check_reasoning_parser


@functools.lru_cache(maxsize=8)
def _loaded(_state: object) -> tuple[dict[str, type[ReasoningParser]], dict[str, PluginError]]:
    found = load_plugins(REASONING_PARSERS, check_reasoning_parser)
    return found.classes, {n: f.as_error() for n, f in found.failures.items()}


def choose_reasoning_parser(name: str | None, chat_template: str) -> type[ReasoningParser]:
    """The parser named ``name``, or (None) the first installed one, by name, whose ``matches`` the
    template; ``none`` when none does (core's own class when its entry point is not seen: stale
    metadata of a development install never fails a request). PluginError for a name that is not
    installed (listing those that are) or that failed to load (its failure)."""
    classes, failures = _loaded(installed_state())
    if name is None:
        chosen = next((c for n, c in sorted(classes.items()) if c.matches(chat_template)), None)
        if chosen is None and "none" not in classes:
            from astrai.reasoning.none import NoneReasoningParser

            return NoneReasoningParser
        name = "none" if chosen is None else chosen.name
    if name in failures:
        raise failures[name]
    if name not in classes:
        raise PluginError(
            f"reasoning parser {name!r} not found; misspelled or not installed? "
            f"Installed: {', '.join(sorted(classes)) or 'none'}"
        )
    return classes[name]
