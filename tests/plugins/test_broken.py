"""A broken plugin distribution is reported with its name and never crashes astrai, unless selected by
name."""

from __future__ import annotations

import pytest

from astrai.errors import ModelNotFound, PluginError
from astrai.hooks import PluginManager
from astrai.model.architecture import get_architecture
from astrai.protocol import load_protocols
from astrai.sampling import SamplingParams, SamplingPipeline

DIST = "astrai-broken-plugin 0.1.0"


def test_failures_are_kept_with_their_distribution() -> None:
    failure = load_protocols().failures["broken"]
    assert failure.distribution == DIST and isinstance(failure.error, ImportError)
    assert DIST in failure.describe() and "needs libbroken" in failure.describe()
    assert set(load_protocols().classes) >= {"openai", "anthropic", "ollama"}  # the others still load
    hooks = PluginManager.discover()
    assert "unknown hook 'astrai_request_finsihed'" in str(hooks.failures["broken_hooks"].error)
    assert hooks.has_impls("astrai_request_finished")  # astrai-request-log still registered


def test_selecting_a_broken_sampling_plugin_raises_its_error() -> None:
    pipe = SamplingPipeline.discover()  # loads despite it
    assert "typical_p" in pipe.extra and "not_a_strategy" not in pipe.extra
    for params in (SamplingParams(strategy="not_a_strategy"), SamplingParams(extra={"not_a_strategy": 1})):
        with pytest.raises(PluginError, match=DIST):
            pipe.prepare(params)
    with pytest.raises(PluginError, match=DIST):
        SamplingPipeline.discover(defaults={"not_a_strategy": 1})


def test_selecting_a_broken_architecture_raises_its_error() -> None:
    assert get_architecture("qwen2").attention_bias
    with pytest.raises(PluginError, match=f"{DIST}.*not an astrai.model.architecture.Architecture"):
        get_architecture("broken_arch")
    with pytest.raises(
        ModelNotFound,
        match="'gpt2' is not supported; misspelled or not installed\\? Installed: gemma2, gemma3, gemma3_text, llama, ministral, mistral, mixtral, phi3, qwen2, qwen2_moe, qwen3, qwen3_moe$",
    ):
        get_architecture("gpt2")


def test_selecting_a_broken_protocol_raises_its_error() -> None:
    from astrai_server import ServerSettings, create_app

    with pytest.raises(PluginError, match=f"{DIST}.*needs libbroken"):
        create_app(ServerSettings(protocols=["broken"]), None)
    app = create_app(ServerSettings(), None)  # all that loads: broken skipped
    paths = {route.path for route in app.routes}
    assert {"/v1/chat/completions", "/v1/messages", "/api/chat", "/api/tags", "/request-log"} <= paths
