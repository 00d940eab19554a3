"""``astrai serve MODEL`` and ``--revision``: the model as the first argument, a Hub id's revision,
and the one line a Hub id that cannot load ends the server with."""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
from pathlib import Path

import pytest

from astrai_server.cli import add_serve_command, settings_from_args
from astrai_server.errors import ConfigError


def _parse(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="astrai")
    add_serve_command(parser.add_subparsers(dest="command", required=True))
    return parser.parse_args(["serve", *argv])


def test_the_model_may_be_the_first_argument() -> None:
    s = settings_from_args(_parse(["Qwen/Qwen3-0.6B", "--revision", "v1", "--port", "0"]))
    assert (s.model, s.revision, s.port) == ("Qwen/Qwen3-0.6B", "v1", 0)
    assert settings_from_args(_parse(["--model", "m.gguf", "m.gguf"])).model == "m.gguf"
    assert settings_from_args(_parse([])).revision is None


def test_two_different_models_are_refused() -> None:
    with pytest.raises(ConfigError, match="two models: 'a/b' and --model 'c/d'"):
        settings_from_args(_parse(["a/b", "--model", "c/d"]))


def test_the_revision_is_a_setting_of_the_yaml_file_too(tmp_path: Path) -> None:
    config = tmp_path / "serve.yaml"
    config.write_text("server:\n  model: org/name\n  revision: v2\n")
    s = settings_from_args(_parse(["--config", str(config)]))
    assert (s.model, s.revision) == ("org/name", "v2")


def test_a_hub_id_not_cached_offline_ends_serve_with_one_line(tmp_path: Path) -> None:
    env = {
        **os.environ,
        "HF_HUB_OFFLINE": "1",
        "HF_HUB_CACHE": str(tmp_path / "hub"),
        "PYTHONPATH": os.pathsep.join(sys.path),
    }
    done = subprocess.run(
        [sys.executable, "-m", "astrai_server", "org/absent", "--port", "0"],
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    errors = [line for line in done.stderr.splitlines() if line.startswith("astrai serve: error:")]
    assert done.returncode == 1, done.stderr
    assert errors == [
        f"astrai serve: error: org/absent is not in the Hugging Face cache ({tmp_path / 'hub'}) and "
        "HF_HUB_OFFLINE=1 forbids downloading it: run once without HF_HUB_OFFLINE to download it, "
        "or give a local path"
    ], done.stderr
