"""A real engine on a tiny random model, and the app over it, for the docs tests.

The tiny engine answers the HTTP examples that do not depend on what the model says
(errors, /stats, /v1/models), so the documentation's transcripts come from the real
server code without loading the default model.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import torch

BOS, EOS = 0, 1
API_KEY = "secret"


class ByteTokenizer:
    """One token per UTF-8 byte (id = byte + 2); ids 0/1 are <bos>/<eos>.

    The chat template writes ``<|role|>\\ncontent\\n`` per message, then ``<|assistant|>\\n``.
    """

    vocab_size = 258
    eos_token_ids = [EOS]
    bos_token_id = BOS
    chat_template = "byte template (no tools)"

    def encode(self, text: str, add_special_tokens: bool = False) -> list[int]:
        return [BOS] * add_special_tokens + [b + 2 for b in text.encode()]

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        return bytes(i - 2 for i in ids if i > EOS).decode("utf-8", errors="replace")

    def apply_chat_template(
        self, messages: list[dict], tools: Any = None, add_generation_prompt: bool = True
    ) -> list[int]:
        text = "".join(f"<|{m['role']}|>\n{m['content']}\n" for m in messages)
        return self.encode(text + "<|assistant|>\n" * add_generation_prompt, add_special_tokens=True)


def make_tiny_engine() -> Any:
    """An engine on a seeded random 1-layer Llama: context 64, paged pool of 256 slots in pages of 4.

    No hook plugins: the docs describe astrai itself, whatever else is installed.
    """
    from astrai.engine import EngineConfig, InferenceEngine
    from astrai.hooks import PluginManager
    from astrai.model import ModelConfig, build_model

    config = ModelConfig(
        architecture="llama",
        vocab_size=ByteTokenizer.vocab_size,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=1,
        num_attention_heads=2,
        num_key_value_heads=1,
        head_dim=16,
        max_position_embeddings=64,
        bos_token_id=BOS,
        eos_token_ids=[EOS],
        name="tiny",
    )
    model = build_model(config, torch.float32)
    gen = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(torch.randn(p.shape, generator=gen) / p.shape[-1] ** 0.5)
    config = EngineConfig(max_batch_size=2, page_size=4, n_tokens=256)
    return InferenceEngine(model, ByteTokenizer(), config, plugins=PluginManager())


def shut_down(engine: Any) -> None:
    """Stop ``engine`` and check its pool: invariants hold, no request holds KV."""
    from astrai.kvcache import assert_nothing_held, check_pool_invariants

    engine.shutdown()
    check_pool_invariants(engine.pool)
    assert_nothing_held(engine.pool)


@contextlib.contextmanager
def serve(engine: Any, api_key: str | None = API_KEY) -> Iterator[Any]:
    """A FastAPI TestClient on ``create_app`` over ``engine`` (built-in protocols, no hook
    plugins), sending ``api_key`` as ``x-api-key`` when the server requires one (an operator's key:
    /stats answers it)."""
    from fastapi.testclient import TestClient

    from astrai.hooks import PluginManager
    from astrai_server import ServerSettings, create_app
    from astrai_server.protocols.anthropic import AnthropicResponseBuilder
    from astrai_server.protocols.openai import OpenAIResponseBuilder

    builders = [OpenAIResponseBuilder(), AnthropicResponseBuilder()]
    with TestClient(
        create_app(ServerSettings(admin_api_key=api_key), engine, builders, plugins=PluginManager())
    ) as c:
        if api_key:
            c.headers["x-api-key"] = api_key
        yield c
