"""Subcommands from hook plugins (``astrai_register_commands``): how astrai-server adds ``astrai serve``."""

from __future__ import annotations

import argparse
import logging
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

import astrai
from astrai.cli import build_parser, main
from astrai.hooks import PluginManager


class Greeter:
    """Adds ``astrai greet NAME``."""

    def __init__(self) -> None:
        self.greeted: list[str] = []

    @astrai.hookimpl
    def astrai_register_commands(self, subparsers: Any, plugins: Any) -> None:
        p = subparsers.add_parser("greet", help="say hello")
        p.add_argument("name")
        p.set_defaults(run=self.run, plugins=plugins)

    def run(self, args: argparse.Namespace) -> int:
        self.greeted.append(args.name)
        return 7


class Raising:
    @astrai.hookimpl
    def astrai_register_commands(self, subparsers: Any) -> None:
        raise RuntimeError("cannot register")


class HalfRegistered:
    @astrai.hookimpl
    def astrai_register_commands(self, subparsers: Any) -> None:
        subparsers.add_parser("half")
        raise RuntimeError("failed after add_parser")


def test_a_hook_plugin_adds_a_subcommand_that_main_runs() -> None:
    greeter = Greeter()
    pm = PluginManager([greeter])
    args = build_parser(pm).parse_args(["greet", "Ada"])
    assert (args.command, args.name, args.plugins) == ("greet", "Ada", pm)
    assert main(["greet", "Grace"], pm) == 7 and greeter.greeted == ["Grace"]
    assert build_parser(pm).parse_args(["plugins"]).run.__name__ == "_print_plugins"  # core's, as before


def test_a_raising_registration_is_logged_and_the_parser_still_works(
    caplog: pytest.LogCaptureFixture,
) -> None:
    greeter = Greeter()
    with caplog.at_level(logging.ERROR, logger="astrai.plugins"):
        parser = build_parser(PluginManager([Raising(), greeter, HalfRegistered()]))
    failed = [r.getMessage() for r in caplog.records]
    assert any("astrai_register_commands" in m and "Raising" in m for m in failed), failed
    assert any("HalfRegistered" in m for m in failed), failed
    assert parser.parse_args(["greet", "Ada"]).name == "Ada"  # the other plugin's command is there
    assert parser.parse_args(["plugins"]).command == "plugins"
    with pytest.raises(SystemExit) as info:  # a command its plugin left half-made is an error, not a crash
        main(["half"], PluginManager([HalfRegistered()]))
    assert info.value.code == 2


def _python(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, *args], capture_output=True, text=True, timeout=120)


def test_serve_comes_from_the_installed_entry_point() -> None:
    script = Path(sys.executable).with_name("astrai")  # the console script users run
    done = subprocess.run([str(script), "serve", "--help"], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert "--attention-backend" in done.stdout and "--request-log PATH" in done.stdout
    done = _python("-m", "astrai_server", "--help")  # serve_main, without the astrai command
    assert done.returncode == 0 and "--attention-backend" in done.stdout, done.stderr


def test_core_never_imports_the_server_and_the_hook_plugin_imports_cheaply() -> None:
    code = (
        "import sys\n"
        "from astrai.cli import build_parser\n"
        "from astrai.hooks import PluginManager\n"
        "choices = build_parser(PluginManager())._subparsers._group_actions[0].choices\n"
        "assert 'serve' not in choices and not any(m.startswith('astrai_server') for m in sys.modules), "
        "choices\n"
        "before = set(sys.modules)\n"
        "import astrai_server.commands\n"
        "new = {m.split('.')[0] for m in set(sys.modules) - before}\n"
        "assert new == {'astrai_server'}, new  # no fastapi, uvicorn, pydantic or torch\n"
    )
    done = _python("-c", code)
    assert done.returncode == 0, done.stderr
