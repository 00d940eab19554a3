"""Shared fixtures of the core tests: a tiny random model, the real default model, pool checks.

astrai is imported inside fixtures, so a broken module fails only the tests that use it.
"""

from __future__ import annotations

import itertools

import pytest
import torch

BOS, EOS = 0, 1
BYTES = slice(97, 225)  # ids of the lone bytes 0x80..0xFF in CharTokenizer


class CharTokenizer:
    """A tokenizer for the tiny model: ids are byte strings, decode joins them as UTF-8.

    Ids 0/1 are <bos>/<eos> (special, skipped when decoding); then the 95 printable
    ASCII characters, the lone bytes 0x80..0xFF (so one character can be split
    over several tokens, as with byte-level BPE), newline, and common two-letter
    pieces up to ``VOCAB`` ids. Encoding is greedy longest match.
    """

    VOCAB = 300

    def __init__(self) -> None:
        pieces = [bytes([c]) for c in [*range(32, 127), *range(0x80, 0x100)]] + [b"\n"]
        pairs = ("".join(p).encode() for p in itertools.product("etaoinsrhl ", repeat=2))
        pieces += list(itertools.islice(pairs, self.VOCAB - 2 - len(pieces)))
        self.pieces: list[bytes] = [b"<bos>", b"<eos>", *pieces]
        self.ids = {p: i for i, p in enumerate(self.pieces) if i > EOS}
        self.eos_token_ids = [EOS]
        self.bos_token_id = BOS

    def encode(self, text: str, add_special_tokens: bool = False) -> list[int]:
        data, out, i = text.encode(), [BOS] if add_special_tokens else [], 0
        while i < len(data):
            n = 2 if data[i : i + 2] in self.ids else 1
            out.append(self.ids[data[i : i + n]])
            i += n
        return out

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        keep = (i for i in ids if not (skip_special_tokens and i in (BOS, EOS)))
        return b"".join(self.pieces[i] for i in keep).decode("utf-8", errors="replace")

    def apply_chat_template(self, messages, tools=None, add_generation_prompt=True) -> list[int]:
        text = "".join(f"{m['role']}: {m['content']}\n" for m in messages)
        return self.encode(text + ("assistant: " if add_generation_prompt else ""), add_special_tokens=True)


def tiny_config():
    from astrai.model import ModelConfig

    return ModelConfig(
        architecture="llama",
        vocab_size=CharTokenizer.VOCAB,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        max_position_embeddings=512,
        bos_token_id=BOS,
        eos_token_ids=[EOS],
        name="tiny",
    )


@pytest.fixture(scope="session")
def tiny_model():
    """A seeded random 2-layer Llama (hidden 64, 4 q / 2 kv heads of 16, vocab 300), float32."""
    from astrai.model import build_model

    gen = torch.Generator().manual_seed(1234)
    model = build_model(tiny_config(), torch.float32)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" not in name:
                p.copy_(torch.randn(p.shape, generator=gen) / p.shape[-1] ** 0.5)
        model.lm_head.weight.mul_(8.0)  # wide logit gaps: greedy is robust to summation order
        model.lm_head.weight[BYTES].mul_(0.05)  # lone bytes rarely win: greedy text stays readable
    return model


def reference_greedy(model, prompt_ids, n, presence_penalty=0.0, frequency_penalty=0.0):
    """Greedy tokens of one request, computed without the scheduler: a contiguous one-row
    pool, the whole prompt in one forward, then one token per forward. EOS is not special.
    Penalties follow OpenAI: ``logit -= frequency * count + presence * (count > 0)``."""
    from astrai.kvcache import KVConfig, PagePool

    cfg = model.config
    pool = PagePool(
        cfg.num_hidden_layers,
        cfg.num_attention_heads,
        cfg.num_key_value_heads,
        cfg.head_dim,
        KVConfig(max_batch_size=1, max_seq_len=len(prompt_ids) + n),
        dtype=next(model.parameters()).dtype,
    )
    row, out, ids, start = pool.task_alloc(), [], list(prompt_ids), 0
    counts = torch.zeros(cfg.vocab_size)
    for _ in range(n):
        end = start + len(ids)
        pool.extend(row, end)
        logits = model(
            torch.tensor(ids),
            torch.arange(start, end),
            pool.bind_tasks([row], [len(ids)], [end]),
            torch.tensor([len(ids) - 1]),
        )[0]
        logits = logits - frequency_penalty * counts - presence_penalty * (counts > 0).float()
        out.append(int(logits.argmax()))
        counts[out[-1]] += 1
        ids, start = [out[-1]], end
    pool.task_free(row)
    return out


@pytest.fixture(scope="session")
def reference():
    return reference_greedy


@pytest.fixture(scope="session")
def tiny_tokenizer():
    return CharTokenizer()


@pytest.fixture(scope="session")
def checkpoints(tmp_path_factory):
    """family -> (safetensors folder, the transformers model in float32) of every family
    (``families.FAMILIES``), built once."""
    from families import build_checkpoints

    return build_checkpoints(tmp_path_factory)


@pytest.fixture(scope="session")
def family_gguf(checkpoints, tmp_path_factory):
    """``family_gguf(family, qtype=None)`` -> (GGUF file, transformers model of what it holds): the
    family's checkpoint written as llama.cpp's converter writes it (``gguf_families``), its 2-D tensors
    quantized to ``qtype`` (a ``GGMLQuantizationType`` name; None: F32), once per session."""
    from gguf import GGMLQuantizationType
    from gguf_families import reference, write_gguf

    written: dict[tuple[str, str | None], tuple] = {}

    def get(family: str, qtype: str | None = None) -> tuple:
        if (family, qtype) not in written:
            folder, hf = checkpoints[family]
            path = tmp_path_factory.mktemp("gguf") / f"{family}-{qtype or 'F32'}.gguf"
            held = write_gguf(folder, path, None if qtype is None else GGMLQuantizationType[qtype])
            written[family, qtype] = (path, reference(hf, held))
        return written[family, qtype]

    return get


@pytest.fixture
def one_torch_thread():
    """Run the test with one intra-op thread, then restore the setting.

    The tiny model's ops are far too small to gain from intra-op threads, and on a
    shared 2-core machine their spin-waiting made these tests 10-30x slower.
    """
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture
def pool_guard():
    """Collects pools; after the test checks each: invariants hold and no request holds KV."""
    from astrai.kvcache import assert_nothing_held, check_pool_invariants

    pools: list = []
    yield pools.append
    for pool in pools:
        check_pool_invariants(pool)
        assert_nothing_held(pool)


@pytest.fixture
def make_engine(pool_guard):
    """Factory ``make_engine(model, tokenizer, **EngineConfig fields)``.

    At teardown every engine is shut down (which joins its thread) and its pool is
    checked by ``pool_guard``.
    """
    from astrai.engine import EngineConfig, InferenceEngine

    engines: list = []

    def make(model, tokenizer, **config):
        engine = InferenceEngine(model, tokenizer, EngineConfig(**config))
        engines.append(engine)
        pool_guard(engine.pool)
        return engine

    yield make
    for engine in engines:
        engine.shutdown()


@pytest.fixture
def tiny_engine(make_engine, tiny_model, tiny_tokenizer):
    """``tiny_engine(**EngineConfig fields)``: an engine on the tiny model (paged, page 4 by default)."""

    def make(**config):
        config = {"max_batch_size": 8, "page_size": 4, "n_tokens": 1024, **config}
        return make_engine(tiny_model, tiny_tokenizer, **config)

    return make


@pytest.fixture
def kernel_registry(monkeypatch):
    """``kernel_registry(*lent)``: the process registry for the test, every backend of it loaded
    (as an engine's start loads them): torch_native and, for each ``{device type: {op: kernel}}``
    of ``lent``, a torch_native that lends those kernels (the first the most preferred).
    ``kernel_registry()``: no kernels at all. Returns the registry."""
    from astrai.extension.backend import policy
    from astrai.extension.backend.torch_native import TorchNativeBackend

    def make(*lent):
        classes = [TorchNativeBackend]
        for i, by_device in enumerate(lent):

            def kernels(self, device_type, by_device=by_device):
                return by_device.get(device_type, {})

            attrs = {"name": f"lender{i}", "priority": 90 + i, "kernels": kernels}
            classes.append(type(f"Lender{i}", (TorchNativeBackend,), attrs))
        registry = policy.BackendRegistry(classes)
        monkeypatch.setattr(policy, "_registry", registry)
        registry.load()
        return registry

    return make
