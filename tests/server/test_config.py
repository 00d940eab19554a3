"""``astrai serve`` configuration: defaults, YAML ``server:`` section, CLI flags (which win), errors naming
keys."""

from __future__ import annotations

import argparse
import os
from pathlib import Path
from typing import Any

import pytest

from astrai.engine import EngineConfig
from astrai.hooks import PluginManager
from astrai_server.cli import add_serve_command, serve_main, settings_from_args
from astrai_server.config import ServerSettings, load_settings, parse_bytes
from astrai_server.errors import ConfigError


def _parse(argv: list[str]) -> argparse.Namespace:
    """Through a parser shaped like astrai-core's ``astrai`` command: ``astrai serve ...``."""
    parser = argparse.ArgumentParser(prog="astrai")
    add_serve_command(parser.add_subparsers(dest="command", required=True))
    return parser.parse_args(["serve", *argv])


def _yaml(tmp_path: Path, text: str) -> str:
    path = tmp_path / "serve.yaml"
    path.write_text(text)
    return str(path)


def test_defaults_are_loopback_default_model_and_paged_prefix_cached_kv() -> None:
    s = settings_from_args(_parse([]))
    assert (s.host, s.port, s.model, s.paged, s.prefix_caching, s.api_key) == (
        "127.0.0.1",
        8000,
        None,
        True,
        True,
        None,
    )
    cfg = s.engine_config()
    assert isinstance(cfg, EngineConfig) and (cfg.paged, cfg.prefix_caching, cfg.page_size) == (
        True,
        True,
        16,
    )


def test_cli_flags_override_the_yaml_section(tmp_path: Path) -> None:
    path = _yaml(
        tmp_path,
        "server:\n  host: 0.0.0.0\n  port: 8001\n  max_batch_size: 4\n  kv_memory: 64MiB\n  dtype: bfloat16\n"
        "runtime:\n  gpus: all\n",
    )
    args = _parse(
        ["--config", path, "--port", "9000", "--no-prefix-caching", "--protocols", "openai", "--api-key", "k"]
    )
    assert args.run.__name__ == "run_serve"
    s = settings_from_args(args)
    assert (s.host, s.port, s.max_batch_size, s.dtype) == ("0.0.0.0", 9000, 4, "bfloat16")  # port: CLI wins
    assert (s.kv_memory, s.prefix_caching, s.protocols, s.api_key) == (64 * 2**20, False, ["openai"], ["k"])
    cfg = s.engine_config()
    assert (cfg.max_batch_size, cfg.kv_memory_bytes, cfg.prefix_caching) == (4, 64 * 2**20, False)


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("server:\n  prot: 1\n", "unknown key 'server.prot'"),
        ("server:\n  port: many\n", "'server.port'"),
        ("serverz:\n  port: 1\n", "unknown section 'serverz'"),
        ("server: [1, 2]\n", "'server' must be a mapping"),
        ("server:\n  kv_memory: lots\n", "'server.kv_memory'"),
        ("server: {port: 1\n", "cannot read config"),
    ],
    ids=["unknown-key", "bad-type", "unknown-section", "not-mapping", "bad-size", "bad-yaml"],
)
def test_bad_yaml_is_an_error_that_names_the_key(tmp_path: Path, text: str, message: str) -> None:
    path = _yaml(tmp_path, text)
    with pytest.raises(ConfigError, match=message) as info:
        load_settings({}, path)
    assert path in str(info.value)


def test_bad_flag_value_names_the_flag_and_serve_exits_2(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(ConfigError, match="--max-batch-size"):
        load_settings({"max_batch_size": 0})
    assert serve_main(["--config", _yaml(tmp_path, "server:\n  nope: 1\n")]) == 2
    assert "unknown key 'server.nope'" in capsys.readouterr().err


def test_help_lists_every_setting(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as info:
        serve_main(["--help"])
    assert info.value.code == 0
    out = capsys.readouterr().out
    # plugin_options has no flag of its own: each hook plugin's option is a flag (and a YAML key)
    missing = [
        k
        for k in ServerSettings.model_fields
        if "--" + k.replace("_", "-") not in out and k != "plugin_options"
    ]
    assert missing == []


def test_sampling_defaults_and_plugin_options_from_yaml_and_flags(tmp_path: Path) -> None:
    path = _yaml(tmp_path, "server:\n  sampling: {min_p: 0.2}\n  trace_file: /tmp/a\n")
    plugin = {"trace_file": None, "trace_level": 1}  # what a hook plugin declared (dest -> default)
    s = load_settings({"trace_level": 3}, path, plugin)
    assert s.sampling == {"min_p": 0.2} and s.plugin_options == {"trace_file": "/tmp/a", "trace_level": 3}
    cfg = s.engine_config()
    assert (cfg.sampling, cfg.plugin_options) == ({"min_p": 0.2}, {"trace_file": "/tmp/a", "trace_level": 3})
    with pytest.raises(ConfigError, match="unknown key 'server.trace_file' .*known keys: .*plugin_options"):
        load_settings({}, path)  # without the plugin installed its key is unknown
    path = _yaml(tmp_path, "server:\n  sampling: {min_p: 0.2, top_a: 1}\n")
    args = _parse(["--config", path, "--sampling", "min_p=0.05", "--sampling", "mode=fast"])
    assert settings_from_args(args).sampling == {
        "min_p": 0.05,
        "mode": "fast",
    }  # the flags replace the YAML's
    with pytest.raises(SystemExit):
        _parse(["--sampling", "min_p"])  # not KEY=VALUE


def test_attention_backend_goes_to_the_engine_config_never_the_environment(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    from astrai_server import cli, drain, loader

    assert ServerSettings().engine_config().attention_backend is None
    s = settings_from_args(_parse(["--attention-backend", "torch_native"]))
    assert (
        s.engine_config().attention_backend == "torch_native"
    )  # strict for every request, over ASTR_BACKEND
    monkeypatch.delenv("ASTR_BACKEND", raising=False)
    built: list[Any] = []
    monkeypatch.setattr(drain.DrainingServer, "run", lambda self, sockets=None: None)

    def start(self: loader.EngineLoader, server: Any) -> None:
        built.append(self.settings.engine_config())

    monkeypatch.setattr(loader.EngineLoader, "start", start)
    environ = dict(os.environ)
    cli.serve(s, PluginManager())
    assert dict(os.environ) == environ
    assert [c.attention_backend for c in built] == ["torch_native"]


def test_on_load_failure_is_exit_unless_asked_to_stay_up_unhealthy() -> None:
    assert settings_from_args(_parse([])).on_load_failure == "exit"
    assert settings_from_args(_parse(["--on-load-failure", "unhealthy"])).on_load_failure == "unhealthy"
    assert load_settings({}, environ={"ASTRAI_ON_LOAD_FAILURE": "unhealthy"}).on_load_failure == "unhealthy"
    with pytest.raises(ConfigError, match="ASTRAI_ON_LOAD_FAILURE"):
        load_settings({}, environ={"ASTRAI_ON_LOAD_FAILURE": "retry"})
    with pytest.raises(SystemExit):
        _parse(["--on-load-failure", "retry"])


def test_parse_bytes() -> None:
    assert [parse_bytes(v) for v in (1024, "512MiB", "2 GB", "1.5KiB")] == [
        1024,
        512 * 2**20,
        2 * 10**9,
        1536,
    ]
    with pytest.raises(ValueError):
        parse_bytes("12 parsecs")


@pytest.mark.parametrize(
    ("flag", "installed"),
    [("--reasoning-parser", "deepseek_r1, none, qwen3"), ("--tool-call-parser", "hermes, llama3_json")],
)
def test_unknown_parser_exits_2_listing_the_installed(
    flag: str, installed: str, capsys: pytest.CaptureFixture[str]
) -> None:
    assert serve_main([flag, "nope"]) == 2  # before any model loads
    err = capsys.readouterr().err
    assert "'nope' not found; misspelled or not installed?" in err and f"Installed: {installed}" in err


def test_parser_flags_reach_the_settings() -> None:
    settings = settings_from_args(
        _parse(["--reasoning-parser", "deepseek_r1", "--tool-call-parser", "llama3_json"])
    )
    assert (settings.reasoning_parser, settings.tool_call_parser) == ("deepseek_r1", "llama3_json")
    assert (ServerSettings().reasoning_parser, ServerSettings().tool_call_parser) == (None, None)
