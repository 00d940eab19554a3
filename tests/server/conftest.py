"""Fixtures of the server tests: a REAL uvicorn server on a loopback port with the default model
(float32, loaded once per session), a second app sharing that engine behind an API key, and a
scripted fake engine for the unit layer (builders, handler, app without a model).
"""

from __future__ import annotations

import contextlib
import gc
import socket
import threading
import time
import uuid
import warnings
from collections.abc import Iterator
from dataclasses import dataclass, field
from types import SimpleNamespace
from typing import Any

import pytest

from astrai.errors import RequestRejected

API_KEY = "test-key-123"


@contextlib.contextmanager
def serve_app(app: Any) -> Iterator[str]:
    """Run ``app`` with uvicorn in a background thread on a free loopback port; yields its base URL."""
    import uvicorn

    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.bind(("127.0.0.1", 0))
    server = uvicorn.Server(uvicorn.Config(app, log_level="warning", timeout_graceful_shutdown=2))
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    deadline = time.monotonic() + 30
    while not server.started:
        if not thread.is_alive() or time.monotonic() > deadline:
            raise RuntimeError("uvicorn did not start")
        time.sleep(0.02)
    try:
        yield f"http://127.0.0.1:{sock.getsockname()[1]}"
    finally:
        server.should_exit = True
        thread.join(10)
        sock.close()
        # connections uvicorn's loop still held at shutdown are collected here, inside the
        # harness, rather than at a random later test (where filterwarnings=error fails it)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", ResourceWarning)
            gc.collect()


@pytest.fixture(scope="session")
def engine() -> Iterator[Any]:
    """The real engine on the default model in float32 (deterministic greedy output)."""
    import torch

    from astrai.engine import EngineConfig, InferenceEngine

    eng = InferenceEngine.from_model(None, dtype=torch.float32, config=EngineConfig(max_seq_len=1024))
    yield eng
    eng.shutdown()


@pytest.fixture(scope="session")
def base_url(engine: Any) -> Iterator[str]:
    """A real server (every installed protocol, from the entry points) on ``engine``."""
    from astrai_server import ServerSettings, create_app

    with serve_app(create_app(ServerSettings(), engine)) as url:
        yield url


@pytest.fixture(scope="session")
def api_key() -> str:
    return API_KEY


@pytest.fixture(scope="session")
def keyed_url(engine: Any, api_key: str) -> Iterator[str]:
    """A second real server on the same engine that requires ``api_key``."""
    from astrai_server import ServerSettings, create_app

    with serve_app(create_app(ServerSettings(api_key=api_key), engine)) as url:
        yield url


@pytest.fixture
def openai_client(base_url: str) -> Any:
    import openai

    return openai.OpenAI(base_url=base_url + "/v1", api_key="unused", max_retries=0, timeout=120)


@pytest.fixture
def anthropic_client(base_url: str) -> Any:
    import anthropic

    return anthropic.Anthropic(base_url=base_url, api_key="unused", max_retries=0, timeout=120)


# ---------------------------------------------------------------- the fake engine (unit layer)
@dataclass
class Script:
    """What the fake engine does with the next submitted request."""

    pieces: list[str] = field(default_factory=lambda: ["Hello", " world"])
    finish: str = "stop"
    stop_sequence: str | None = None
    error: BaseException | None = None
    delay: float = 0.0  # seconds between pieces
    tokens_per_piece: int = 1


class FakeResult:
    def __init__(self, rid: str) -> None:
        self.request_id, self.done, self.error = rid, False, None
        self.pieces: list[str] = []
        self.finish_reason: str | None = None
        self.stop_sequence: str | None = None
        self.completion_tokens = 0
        self.aborted = threading.Event()

    @property
    def text(self) -> str:
        return "".join(self.pieces)


class FakeTokenizer:
    """One token per whitespace-separated word of ``role: content`` lines; records its last call."""

    def __init__(self, chat_template: str = "{{ messages }}") -> None:
        self.chat_template = chat_template
        self.calls: list[tuple[list[dict], Any]] = []

    def render(self, messages: list[dict]) -> str:
        return "\n".join(f"{m['role']}: {m['content']}" for m in messages)

    def apply_chat_template(
        self, messages: list[dict], tools: Any = None, add_generation_prompt: bool = True
    ) -> list[int]:
        self.calls.append((messages, tools))
        return self.encode(self.render(messages) + "\nassistant:")

    def encode(self, text: str, add_special_tokens: bool = False) -> list[int]:
        return [len(w) for w in text.split()]


class FakeEngine:
    """Duck-types what the server uses of InferenceEngine; pieces come from a thread, like the scheduler's."""

    def __init__(self, scripts: list[Script] | None = None, ctx: int = 64) -> None:
        self.tokenizer = FakeTokenizer()
        self.context_limit = ctx  # InferenceEngine.context_limit: prompt plus generated tokens
        self.model = SimpleNamespace(config=SimpleNamespace(vocab_size=100))
        self.scripts = list(scripts or [])
        self.submitted: list[tuple[list[int], Any]] = []
        self.results: list[FakeResult] = []
        self.healthy = True
        self.compiled: list[Any] = []  # grammars the server compiled before submitting (the real cache's API)
        self.grammars = SimpleNamespace(compile_async=self._compile, check=lambda spec: None)

    async def _compile(self, spec: Any) -> Any:
        self.compiled.append(spec)
        return spec

    def submit(
        self,
        prompt_ids: list[int],
        params: Any,
        on_piece: Any = None,
        on_done: Any = None,
        request_id: str | None = None,
        priority: int = 0,
        cache_namespace: str | None = None,
        sibling: int = 0,
        grammar: Any = None,
    ) -> FakeResult:
        vocab = self.model.config.vocab_size  # the model-dependent check the engine makes at submit
        if any(t >= vocab for t in params.logit_bias):
            raise RequestRejected(f"logit_bias token ids must be < vocab size {vocab}")
        script = self.scripts.pop(0) if self.scripts else Script()
        result = FakeResult(request_id or uuid.uuid4().hex)
        self.submitted.append((list(prompt_ids), params))
        self.results.append(result)
        threading.Thread(target=self._run, args=(script, result, on_piece, on_done), daemon=True).start()
        return result

    def _run(self, script: Script, r: FakeResult, on_piece: Any, on_done: Any) -> None:
        r.finish_reason = script.finish
        for piece in script.pieces:
            if r.aborted.wait(script.delay):
                r.finish_reason = "abort"
                break
            r.pieces.append(piece)
            r.completion_tokens += script.tokens_per_piece
            on_piece(piece)
        r.stop_sequence, r.error, r.done = script.stop_sequence, script.error, True
        on_done(r)

    def abort(self, request_id: str) -> None:
        for r in self.results:
            if r.request_id == request_id:
                r.aborted.set()

    def is_healthy(self) -> bool:
        return self.healthy

    def get_stats(self) -> dict:
        return {"total_tasks": len(self.results), "total_tokens": 0, "active_tasks": 0, "waiting_queue": 0}


@pytest.fixture
def fake_engine() -> FakeEngine:
    return FakeEngine()


@pytest.fixture(scope="session")
def serving() -> Any:
    """``serve_app``, for a fixture of a wider scope than ``fakes``' (one server for a module)."""
    return serve_app


@pytest.fixture
def fakes() -> SimpleNamespace:
    """The fake classes, for tests that script their own engine."""
    return SimpleNamespace(Script=Script, FakeEngine=FakeEngine, serve_app=serve_app)
