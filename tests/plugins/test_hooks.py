"""Hook plugins from in-memory objects: validation when they load, isolation when they fail, call order."""

from __future__ import annotations

import logging
import threading
from types import SimpleNamespace
from typing import Any

import pytest

import astrai
from astrai.errors import PluginError
from astrai.hooks import PluginManager


class Recorder:
    """Records every engine hook with the thread it ran on."""

    def __init__(self) -> None:
        self.calls: list[tuple[str, Any, str]] = []

    @astrai.hookimpl
    def astrai_engine_started(self, engine: Any) -> None:
        self.calls.append(("started", engine, threading.current_thread().name))

    @astrai.hookimpl
    def astrai_request_finished(self, engine: Any, request: Any) -> None:
        self.calls.append(("finished", request, threading.current_thread().name))

    @astrai.hookimpl
    def astrai_engine_stopped(self, engine: Any) -> None:
        self.calls.append(("stopped", engine, threading.current_thread().name))


class Raiser:
    def astrai_request_finished(self, request: Any) -> None:  # no marker and a subset of the arguments
        raise RuntimeError("plugin bug")


def test_validation_when_a_plugin_loads() -> None:
    misspelt = SimpleNamespace(astrai_request_finsihed=lambda request: None)
    with pytest.raises(PluginError, match="unknown hook 'astrai_request_finsihed'"):
        PluginManager([misspelt])
    wrong_args = SimpleNamespace(astrai_engine_started=lambda engine, nonsense: None)
    with pytest.raises(PluginError, match="nonsense"):
        PluginManager([wrong_args])
    pm = PluginManager([Raiser()])  # an unmarked astrai_* method is still an implementation
    assert pm.has_impls("astrai_request_finished") and not pm.has_impls("astrai_engine_started")


def test_a_failing_implementation_is_logged_and_the_others_still_run(
    caplog: pytest.LogCaptureFixture,
) -> None:
    recorder = Recorder()
    pm = PluginManager([recorder, Raiser()])
    with caplog.at_level(logging.ERROR, logger="astrai.plugins"):
        pm.notify("astrai_request_finished", engine=None, request="r1")
    assert [c[:2] for c in recorder.calls] == [("finished", "r1")]
    assert "hook astrai_request_finished of plugin" in caplog.text and "plugin bug" in caplog.text


@pytest.mark.slow
def test_engine_hooks_order_thread_and_isolation(real_model: tuple, caplog: pytest.LogCaptureFixture) -> None:
    from astrai.engine import EngineConfig, InferenceEngine

    recorder = Recorder()
    model, tokenizer = real_model
    with caplog.at_level(logging.ERROR, logger="astrai.plugins"):
        engine = InferenceEngine(
            model, tokenizer, EngineConfig(max_seq_len=256), plugins=PluginManager([recorder, Raiser()])
        )
        assert [c[0] for c in recorder.calls] == ["started"] and recorder.calls[0][1] is engine
        texts = engine.generate(["The sky is", "Two plus two is"], max_tokens=4, temperature=0)
        engine.shutdown()
        engine.shutdown()  # idempotent: stopped is called once
    assert len(texts) == 2 and all(texts)
    names = [c[0] for c in recorder.calls]
    assert names == ["started", "finished", "finished", "stopped"]
    finished = [c for c in recorder.calls if c[0] == "finished"]
    assert {c[2] for c in finished} == {"astrai-hooks"}  # never the scheduler's thread
    assert sorted(c[1].prompt_tokens for c in finished) == sorted(
        len(tokenizer.encode(p, add_special_tokens=True)) for p in ["The sky is", "Two plus two is"]
    )
    assert all(c[1].completion_tokens == 4 and c[1].finish_reason == "length" for c in finished)
    assert caplog.text.count("RuntimeError: plugin bug") == 2  # logged per call, never raised into the engine
    assert "hook astrai_request_finished of plugin 'Raiser-" in caplog.text
