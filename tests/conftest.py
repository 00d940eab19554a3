"""Session-wide fixtures: the real default model and the HF transformers oracle, loaded once.

Where the default model is missing, tests that need it skip locally but fail under CI
(CI=true): the README's test command installs it, so its absence there is a broken setup.

The README's command runs the suite on two pytest-xdist workers, one test file each at a time.
OpenMP's threads then wait passively (``OMP_WAIT_POLICY``, read once as torch loads libgomp, here
before anything imports torch; the servers the tests start inherit it): spinning at a barrier, one
worker's threads took the cores the other's needed, and its kernel tests ran twice as long.
"""

from __future__ import annotations

import logging
import os
import sys

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
assert "torch" not in sys.modules, "torch was loaded before tests/conftest.py could set OMP_WAIT_POLICY"

import pytest  # noqa: E402
import torch  # noqa: E402


def _missing(reason: str):
    if os.environ.get("CI"):
        pytest.fail(f"{reason} (CI installs it: see the README's test command)")
    pytest.skip(reason)


@pytest.fixture(autouse=True)
def _root_log_handlers_of_a_test_removed():
    """``astrai serve``'s ``dictConfig``, run in process by some tests, gives the root logger a
    handler on that test's captured stderr, which pytest closes after the test: an engine thread of
    a later test logging through it printed ``--- Logging error ---`` tracebacks (22 in a CI log).
    Plain stream handlers that a test adds to the root logger go after it, and its level back."""
    root = logging.getLogger()
    before, level = set(root.handlers), root.level
    yield
    for handler in root.handlers[:]:
        if handler not in before and type(handler) is logging.StreamHandler:
            root.removeHandler(handler)
    root.setLevel(level)


@pytest.fixture(scope="session")
def default_model_path():
    """Path of the default model's GGUF file."""
    from astrai.errors import ModelNotFound
    from astrai.model.resolve import resolve_model

    try:
        return resolve_model(None)[1]
    except ModelNotFound as e:
        _missing(f"default model not installed: {e}")


@pytest.fixture(scope="session")
def real_model(default_model_path):
    """The default model (SmolLM2-135M GGUF) in float32 with its tokenizer, loaded once per session."""
    from astrai.model import load_model

    return load_model(str(default_model_path), dtype=torch.float32)


@pytest.fixture(scope="session")
def hf_oracle(default_model_path):
    """HF transformers' own import of the same GGUF, float32, eval mode: the independent reference."""
    transformers = pytest.importorskip("transformers")
    from hf_gguf import reading_once

    with reading_once():
        model = transformers.AutoModelForCausalLM.from_pretrained(
            str(default_model_path.parent),
            gguf_file=default_model_path.name,
            dtype=torch.float32,
            local_files_only=True,
        )
    return model.eval()


@pytest.fixture(scope="module")
def _server_starter(tmp_path_factory, default_model_path):
    """The module's ``serving.ServerStarter``; every server it started is stopped when the module ends."""
    from serving import ServerStarter

    starter = ServerStarter(tmp_path_factory)
    yield starter
    starter.close()


@pytest.fixture(scope="module")
def start_server(_server_starter):
    """``start(*flags, healthy=True, env=None, scheme="http") -> Served``: real ``astrai serve``
    subprocesses (tests/serving.py), all stopped when the test module ends."""
    return _server_starter.start


@pytest.fixture(scope="module")
def start_servers(_server_starter):
    """``start_servers(flags, ...) -> [Served, ...]``: one healthy private server per tuple of flags,
    started side by side, so that their start-ups overlap; stopped when the test module ends."""
    return _server_starter.start_many


@pytest.fixture(scope="session")
def lora_oracle(hf_oracle, tmp_path_factory):
    """Three random PEFT adapters of the default model on disk, and peft as their oracle
    (``tests/lora_adapters.py``), made once per session."""
    pytest.importorskip("peft")
    from lora_adapters import make_adapters

    return make_adapters(hf_oracle, tmp_path_factory.mktemp("lora-adapters"))
