"""Fixtures of the flash backend tests: the flash-attn test double, a tiny bf16 model, engines."""

from __future__ import annotations

import pytest
import torch


@pytest.fixture(autouse=True)
def one_torch_thread():
    """One intra-op thread: these ops are tiny, and the machine's cores are shared."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture(autouse=True)
def fresh_registry(monkeypatch):
    """No ASTR_BACKEND from outside, and a backend registry discovered anew before and after."""
    from astrai.extension.backend.policy import reset_registry

    monkeypatch.delenv("ASTR_BACKEND", raising=False)
    reset_registry()
    yield
    reset_registry()


@pytest.fixture
def flash_double(monkeypatch):
    """The backend's kernels are the plain-PyTorch double (``flash_double.DOUBLE``, runs on CPU)."""
    from flash_double import DOUBLE

    from astrai_backend_flash import kernels

    monkeypatch.setattr(kernels, "stand_in", DOUBLE)
    return DOUBLE


class IdTokenizer:
    """Just what the engine needs of a tokenizer when prompts are token ids: EOS ids and decode."""

    eos_token_ids = [1]

    def decode(self, ids, skip_special_tokens=True):
        return "".join(chr(0x41 + i % 26) for i in ids if not (skip_special_tokens and i == 1))


def _tiny_half_model(architecture="llama", **options):
    """A seeded random 2-layer model in float16 (hidden 64, 4 q / 2 kv heads of 16, vocab 300);
    ``options``: more ``ModelConfig`` fields."""
    from astrai.model import ModelConfig, build_model

    config = ModelConfig(
        architecture=architecture,
        vocab_size=300,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        max_position_embeddings=1024,
        bos_token_id=0,
        eos_token_ids=[1],
        name="tiny-fp16",
        **options,
    )
    gen = torch.Generator().manual_seed(4321)
    model = build_model(config, torch.float16)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" not in name:
                p.copy_(torch.randn(p.shape, generator=gen) / p.shape[-1] ** 0.5)
            elif architecture.startswith("gemma"):  # Gemma's norms are (1 + weight)
                p.zero_()
        model.lm_head.weight.mul_(8.0)  # wide logit gaps: greedy tokens survive fp16 summation order
    return model


@pytest.fixture(scope="session")
def tiny_half_model():
    """A seeded random 2-layer Llama in float16 (hidden 64, 4 q / 2 kv heads of 16, vocab 300)."""
    return _tiny_half_model()


@pytest.fixture(scope="session")
def tiny_windowed_half_model():
    """The same sizes as Gemma 2: a layer in a sliding window of 100 positions, a global one, scores
    soft-capped (the prompts of ``test_engine_flash`` reach past the window)."""
    return _tiny_half_model(
        "gemma2",
        sliding_window=100,
        layer_types=["sliding_attention", "full_attention"],
        attn_logit_softcapping=5.0,
        final_logit_softcapping=30.0,
        hidden_act="gelu_pytorch_tanh",
    )


@pytest.fixture
def make_engine():
    """``make_engine(model, **EngineConfig fields)``; every engine is shut down after the test."""
    from astrai.engine import EngineConfig, InferenceEngine

    engines = []

    def make(model, **config):
        engine = InferenceEngine(model, IdTokenizer(), EngineConfig(**config))
        engines.append(engine)
        return engine

    yield make
    for engine in engines:
        engine.shutdown()
