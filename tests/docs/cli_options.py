"""How an argparse option is written in docs/configuration.md: its flags, type and default.

The configuration tests derive these cells from the real parsers of ``astrai`` and
``astrai serve`` and compare them with the documented rows.
"""

from __future__ import annotations

import argparse
import json

from astrai.cli import build_parser, parse_key_value
from astrai.hooks import PluginManager

_TYPES = {None: "string", int: "integer", float: "number", parse_key_value: "KEY=VALUE"}


def options(parser: argparse.ArgumentParser) -> dict[str, argparse.Action]:
    """``{option text: action}``: ``--port``, ``--paged / --no-paged``, ``-v / --verbose`` or a
    positional's name; without ``--help`` and sub-command selectors."""
    found = {}
    for action in parser._actions:
        if isinstance(action, (argparse._HelpAction, argparse._SubParsersAction)):
            continue
        found[" / ".join(action.option_strings) or action.dest] = action
    return found


def type_text(action: argparse.Action) -> str:
    """``flag`` (takes no value), the choices (``"float32" or ...``), or the value's type;
    ``, repeatable`` for an option that may be given several times."""
    if action.nargs == 0:
        return "flag"
    if action.choices:
        text = " or ".join(json.dumps(c) for c in action.choices)
    else:
        text = _TYPES[action.type]
    return text + ", repeatable" * isinstance(action, argparse._AppendAction)


def default_text(action: argparse.Action) -> str:
    """``required`` for a positional argument, else the default as JSON."""
    if not action.option_strings and action.required:
        return "required"
    return json.dumps(action.default)


def astrai_parsers() -> dict[str, argparse.ArgumentParser]:
    """The ``astrai`` parser as ``{"astrai": top level, "chat": ..., "serve": ...}``: with the hook
    plugin of astrai-server (which adds ``serve``), no other."""
    import astrai_server.commands

    parser = build_parser(PluginManager([astrai_server.commands]))
    (sub,) = [a for a in parser._actions if isinstance(a, argparse._SubParsersAction)]
    return {"astrai": parser, **sub.choices}
