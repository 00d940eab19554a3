"""docs/configuration.md against the parsers, ServerSettings, load_settings and the sources."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import yaml
from cli_options import astrai_parsers, options
from cli_options import default_text as flag_default
from cli_options import type_text as flag_type
from docs_pages import ROOT, Block, all_blocks
from model_fields import default_text, range_text, type_text

from astrai_server.config import ServerSettings, env_name, load_settings, parse_bytes

NONE = "—"  # a cell with no flag or no YAML key
ENGINE_COMMANDS = ("astrai", "chat", "generate", "plugins")


def _one(kind: str) -> Block:
    blocks = all_blocks(kind)
    assert len(blocks) == 1, f"expected one <!-- {kind} --> block, found {[b.where for b in blocks]}"
    return blocks[0]


def test_serve_table_lists_every_flag_and_setting() -> None:
    block = _one("serve-options")
    rows = block.records()
    flags = options(astrai_parsers()["serve"])
    assert sorted(r["Flag"] for r in rows if r["Flag"] != NONE) == sorted(flags), f"{block.where}: flags"
    keys = [r["YAML key"] for r in rows if r["YAML key"] != NONE]
    assert sorted(keys) == sorted(ServerSettings.model_fields), f"{block.where}: YAML keys"
    for r in rows:
        where = f"{block.where}: {r['Flag']} {r['YAML key']}"
        assert r["Meaning"], where
        if r["YAML key"] == NONE:  # a flag of the command only (--config)
            action = flags[r["Flag"]]
            expected = (flag_type(action), flag_default(action), "")
            assert (r["Type"], r["Default"], r["Range"]) == expected, where
            continue
        field = ServerSettings.model_fields[r["YAML key"]]
        if r["Flag"] != NONE:
            assert flags[r["Flag"]].dest == r["YAML key"], where
        assert r["Type"] == type_text(field.annotation), where
        assert r["Default"] == default_text(field), where
        assert r["Range"] == range_text(field), where


def test_astrai_table_lists_every_option_of_the_engine_commands() -> None:
    block = _one("cli-options")
    parsers = astrai_parsers()
    actual = {(c, o): a for c in ENGINE_COMMANDS for o, a in options(parsers[c]).items()}
    documented = {(c, r["Option"]): r for r in block.records() for c in r["Commands"].split(", ")}
    assert sorted(documented) == sorted(actual), block.where
    for (command, option), action in actual.items():
        r = documented[command, option]
        where = f"{block.where}: {command} {option}"
        assert (r["Type"], r["Default"]) == (flag_type(action), flag_default(action)), where
        assert r["Meaning"], where


YAML_BLOCKS = all_blocks("serve-yaml")


@pytest.mark.parametrize("block", YAML_BLOCKS, ids=[f"{b.page}:{b.line}" for b in YAML_BLOCKS])
def test_yaml_example_loads_as_written(block: Block, tmp_path: Path) -> None:
    """``load_settings`` accepts the file; each key it sets has the value it shows."""
    path = tmp_path / "serve.yaml"
    path.write_text(block.text)
    plugin_keys = block.argument.split(",") if block.argument else []
    settings = load_settings({}, path, dict.fromkeys(plugin_keys))
    section = yaml.safe_load(block.text)["server"]
    for key, value in section.items():
        if key in plugin_keys:
            assert settings.plugin_options[key] == value, f"{block.where}: {key}"
        else:
            expected = parse_bytes(value) if key == "kv_memory" else value
            expected = [value] if key == "api_key" and isinstance(value, str) else expected  # one key
            assert getattr(settings, key) == expected, f"{block.where}: {key}"


_ENV_NAME = re.compile(r"""["'](ASTR(?:AI)?_[A-Z0-9_]+)["']""")
SETTINGS_VARIABLE = "ASTRAI_<SETTING>"  # one row for the variables of astrai serve's settings


def sources_variables() -> dict[str, set[str]]:
    """Every environment variable the sources spell out, with the modules that spell it."""
    named: dict[str, set[str]] = {}
    for source in ROOT.glob("astrai-*/src/**/*.py"):
        parts = source.relative_to(ROOT).with_suffix("").parts[2:]  # after "<distribution>/src"
        module = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
        for name in _ENV_NAME.findall(source.read_text(encoding="utf-8")):
            named.setdefault(name, set()).add(module)
    return named


def test_environment_table_lists_every_variable_the_sources_name() -> None:
    block = _one("env-vars")
    named = sources_variables()
    clashes = sorted(set(named) & {env_name(key) for key in ServerSettings.model_fields})
    assert not clashes, f"variables of settings that other code reads too: {clashes}"
    named[SETTINGS_VARIABLE] = {"astrai_server.config"}  # env_name(key) for every setting
    documented = {r["Variable"]: r for r in block.records()}
    assert sorted(documented) == sorted(named), block.where
    for name, r in documented.items():
        assert r["Read by"] in named[name], f"{block.where}: {name} is spelled in {sorted(named[name])}"
        assert r["Meaning"], f"{block.where}: {name}"
