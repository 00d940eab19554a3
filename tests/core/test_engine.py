"""InferenceEngine's public API: generate / stream / async / chat / submit / stats / config."""

from __future__ import annotations

import asyncio
from types import SimpleNamespace

import pytest
import torch

from astrai.engine import DEFAULT_KV_MEMORY_BYTES, EngineConfig, GenerateResult, InferenceEngine
from astrai.kvcache.sizing import kv_config
from astrai.kvcache.storage import KVStorage
from astrai.request import FinishReason
from astrai.sampling import SamplingParams

GREEDY = {"temperature": 0.0, "ignore_eos": True}
pytestmark = pytest.mark.usefixtures("one_torch_thread")
PROMPTS = ["hello there", "a", "the rain in spain stays mainly", "xyz"]


def test_generate_str_list_and_streams_agree(tiny_engine, tiny_model, tiny_tokenizer, reference):
    engine = tiny_engine()
    single = [engine.generate(p, max_tokens=8, **GREEDY) for p in PROMPTS]
    for p, text in zip(PROMPTS, single, strict=True):
        ref = reference(tiny_model, tiny_tokenizer.encode(p, add_special_tokens=True), 8)
        assert text == tiny_tokenizer.decode(ref).rstrip("\ufffd")
    assert engine.generate(PROMPTS, max_tokens=8, **GREEDY) == single
    stream = engine.generate(PROMPTS[2], stream=True, max_tokens=8, **GREEDY)
    assert not isinstance(stream, str)
    assert "".join(stream) == single[2]
    by_index = ["" for _ in PROMPTS]
    for i, piece in engine.generate(PROMPTS, stream=True, max_tokens=8, **GREEDY):
        by_index[i] += piece
    assert by_index == single


def test_generate_async_delivers_on_the_event_loop(tiny_engine):
    engine = tiny_engine()
    expected = engine.generate("hello", max_tokens=10, **GREEDY)

    async def collect():
        loop = asyncio.get_running_loop()

        def no_executor(*args):
            raise AssertionError("generate_async must not hop to a thread per token")

        loop.run_in_executor = no_executor
        return [p async for p in engine.generate_async("hello", max_tokens=10, **GREEDY)]

    pieces = asyncio.run(collect())
    assert len(pieces) > 1 and "".join(pieces) == expected


def test_breaking_out_of_streams_aborts_the_request(tiny_engine):
    engine = tiny_engine()
    stream = engine.generate("hello", stream=True, max_tokens=400, **GREEDY)
    next(stream)
    stream.close()

    async def first_piece():
        async for piece in engine.generate_async("hello", max_tokens=400, **GREEDY):
            return piece

    assert asyncio.run(first_piece())
    engine.shutdown()  # would fail the two requests with EngineNotReady if they were still running
    stats = engine.get_stats()
    assert (stats["total_tasks"], stats["active_tasks"], stats["kv_tokens_in_use"]) == (2, 0, 0)
    assert stats["total_tokens"] < 100


def test_chat_applies_the_chat_template(tiny_engine, tiny_tokenizer):
    engine = tiny_engine()
    messages = [{"role": "user", "content": "hi there"}]
    ids = tiny_tokenizer.apply_chat_template(messages)
    r = engine.submit(ids, SamplingParams(max_tokens=6, **GREEDY))
    r.wait_completion()
    assert engine.chat(messages, max_tokens=6, **GREEDY) == r.text
    assert "".join(engine.chat(messages, stream=True, max_tokens=6, **GREEDY)) == r.text


def test_submit_returns_a_complete_generate_result(tiny_engine, tiny_tokenizer):
    engine = tiny_engine()
    pieces: list[str] = []
    done: list[GenerateResult] = []
    r = engine.submit(
        [0, 50, 60, 70], SamplingParams(max_tokens=7, **GREEDY), on_piece=pieces.append, on_done=done.append
    )
    assert r.wait_completion()
    assert done == [r] and r.done and r.wait(timeout=0)
    assert (r.prompt_tokens, r.completion_tokens, len(r.output_ids)) == (4, 7, 7)
    assert (r.finish_reason, r.stop_sequence, r.error) == (FinishReason.LENGTH, None, None)
    assert r.finish_reason == "length"
    assert r.text == "".join(pieces) == tiny_tokenizer.decode(r.output_ids).rstrip("\ufffd")
    assert list(r.pieces()) == pieces


def test_stats_count_tasks_tokens_and_kv(tiny_engine):
    engine = tiny_engine(n_tokens=512, page_size=4)
    engine.generate(PROMPTS, max_tokens=5, **GREEDY)
    engine.shutdown()  # the loop has published its last step
    stats = engine.get_stats()
    assert {k: stats[k] for k in ("total_tasks", "total_tokens", "active_tasks", "waiting_queue")} == {
        "total_tasks": 4,
        "total_tokens": 20,
        "active_tasks": 0,
        "waiting_queue": 0,
    }
    assert (stats["kv_tokens_total"], stats["kv_tokens_in_use"], stats["preemptions"]) == (512, 0, 0)
    assert stats["kv_tokens_cached"] > 0 and stats["prefix_hit_tokens"] == 0
    assert not engine.is_healthy() and engine.scheduler.reason == "shut down"


def test_a_returned_request_is_never_counted_active_or_waiting(tiny_engine):
    """Once ``generate`` (text, a stream, a list, async) returns, ``get_stats`` shows no request in
    flight: the stats are published before a request's end is delivered (a race let one in four runs
    of this loop see a finished request as active)."""
    engine = tiny_engine()

    def idle() -> bool:
        stats = engine.get_stats()
        return stats["active_tasks"] == 0 and stats["waiting_queue"] == 0

    async def one_async(prompt: str) -> None:
        async for _ in engine.generate_async(prompt, max_tokens=2, **GREEDY):
            pass

    for i in range(40):
        prompt = PROMPTS[i % len(PROMPTS)]
        engine.generate(prompt, max_tokens=1 + i % 3, **GREEDY)
        assert idle(), (i, "generate", engine.get_stats())
        list(engine.generate(prompt, stream=True, max_tokens=2, **GREEDY))
        assert idle(), (i, "stream", engine.get_stats())
        list(engine.generate(PROMPTS, stream=True, max_tokens=2, **GREEDY))
        assert idle(), (i, "streamed list", engine.get_stats())
        asyncio.run(one_async(prompt))
        assert idle(), (i, "generate_async", engine.get_stats())


def test_engine_config_maps_onto_kv_config(tiny_model):
    mc = tiny_model.config
    per_token = KVStorage.bytes_per_token(
        mc.num_hidden_layers, mc.num_key_value_heads, mc.head_dim, torch.float32
    )
    kv = kv_config(EngineConfig(), mc, torch.float32)
    expected = min(EngineConfig().max_batch_size * 512, DEFAULT_KV_MEMORY_BYTES // per_token)
    assert (kv.paged, kv.page_size, kv.max_seq_len, kv.n_tokens, kv.prefix_caching) == (
        True,
        16,
        512,
        expected,
        True,
    )
    kv = kv_config(
        EngineConfig(max_seq_len=4096, kv_memory_bytes=1 << 20, max_batch_size=3), mc, torch.float32
    )
    assert (kv.max_seq_len, kv.memory_budget_bytes, kv.n_tokens, kv.max_batch_size) == (512, 1 << 20, None, 3)
    kv = kv_config(EngineConfig(paged=False, max_seq_len=64), mc, torch.float32)
    assert (kv.paged, kv.max_seq_len, kv.page_size) == (False, 64, 1)


def test_from_model_loads_through_load_model(monkeypatch, tiny_model, tiny_tokenizer, pool_guard):
    import astrai.model

    calls = []
    checkpoint = SimpleNamespace(config=tiny_model.config)  # what open_checkpoint reads from the header

    def fake_load(name_or_path, dtype, device, weights, max_seq_len, reserve):
        calls.append((name_or_path, dtype, device, weights, max_seq_len, list(reserve.values())))
        return tiny_model, tiny_tokenizer

    monkeypatch.setattr(astrai.model, "open_checkpoint", lambda name: checkpoint if name == "tiny" else None)
    monkeypatch.setattr(astrai.model, "load_model", fake_load)
    config = EngineConfig(n_tokens=256, max_seq_len=100)
    with InferenceEngine.from_model("tiny", dtype=torch.float32, config=config) as engine:
        pool_guard(engine.pool)
        assert engine.generate("hi", max_tokens=3) is not None
    # built for the context served, the pool's bytes counted in the memory check before loading
    pool = kv_config(config, tiny_model.config, torch.float32).nbytes(2, 2, 16, torch.float32)
    assert calls == [(checkpoint, torch.float32, "cpu", "dense", 100, [pool])]
    assert pool == 256 * 2 * 2 * 2 * 16 * 4 + 64 * 100 * 4  # K and V of every slot, and req_to_token
    assert not engine.is_healthy()


# ---------------------------------------------------------------- the real default model
REAL_PROMPTS = [
    "The capital of France is",
    "Once upon a time, in a small village by the sea, there lived an old fisherman who",
    "1, 2, 3, 4,",
    "Python is a programming language that",
    "The three primary colors are",
    "Q: What is the boiling point of water in Celsius?\nA:",
    "def fibonacci(n):",
    "Roses are red,",
]


@pytest.mark.slow
def test_real_model_greedy_alone_equals_inside_a_mixed_batch(make_engine, real_model):
    model, tokenizer = real_model
    engine = make_engine(model, tokenizer, max_batch_size=8, max_seq_len=256, n_tokens=2048)
    batch = engine.generate(REAL_PROMPTS, max_tokens=10, temperature=0.0)
    for i in (1, 2):  # the longest and the shortest prompt
        assert engine.generate(REAL_PROMPTS[i], max_tokens=10, temperature=0.0) == batch[i]
    assert len(set(batch)) == len(batch) and all(batch)


@pytest.mark.slow
def test_real_model_streams_multibyte_text_whole(make_engine, real_model):
    model, tokenizer = real_model
    engine = make_engine(model, tokenizer, max_batch_size=2, max_seq_len=256, n_tokens=1024)
    ids = tokenizer.apply_chat_template([{"role": "user", "content": "Translate 'thank you' to Japanese."}])
    pieces: list[str] = []
    r = engine.submit(ids, SamplingParams(max_tokens=12, temperature=0.0), on_piece=pieces.append)
    r.wait_completion()
    # the greedy answer is Japanese, with characters split over several byte tokens
    assert any("\ufffd" in tokenizer.decode([t]) for t in r.output_ids)
    assert any(ord(c) > 0x3000 for c in r.text)
    assert not any("\ufffd" in p for p in pieces)
    assert "".join(pieces) == r.text == tokenizer.decode(r.output_ids).rstrip("\ufffd")
    streamed = engine.chat(
        [{"role": "user", "content": "Translate 'thank you' to Japanese."}],
        stream=True,
        max_tokens=12,
        temperature=0.0,
    )
    assert "".join(streamed) == r.text


def test_attn_backend_context_reaches_the_scheduler_thread(tiny_engine):
    """The spec's ``with attn_backend(...): engine.generate(...)``: the selection made in the
    caller's thread governs that request's steps on the scheduler thread, strictly."""
    from astrai.errors import BackendUnavailable
    from astrai.extension import attn_backend

    engine = tiny_engine()
    params = SamplingParams(max_tokens=3, **GREEDY)
    with attn_backend("flash"):  # not installed here: strict selection must fail, not fall back
        failed = engine.submit([0, 50, 60], params)
    assert failed.wait_completion()
    assert failed.finish_reason == FinishReason.ERROR
    assert isinstance(failed.error, BackendUnavailable) and "flash" in str(failed.error)
    with attn_backend("torch_native"):
        ok = engine.submit([0, 50, 60], params)
    assert ok.wait_completion() and ok.finish_reason == FinishReason.LENGTH and len(ok.output_ids) == 3


def test_the_engine_runs_a_warm_up_forward_before_it_returns(make_engine, tiny_model, tiny_tokenizer, caplog):
    """Packed weights and per-model kernels are made before the first request (on the scheduler
    thread, on a scratch pool: the engine's pool and counters stay untouched); a model that fails
    there still gives an engine, whose requests then report the failure."""
    import threading

    calls: list[tuple[str, tuple[int, ...]]] = []

    class Watched(torch.nn.Module):
        def __init__(self, fail: bool) -> None:
            super().__init__()
            self.inner, self.config, self.fail = tiny_model, tiny_model.config, fail

        def forward(self, input_ids, positions, kv_cache, logits_indices):
            calls.append((threading.current_thread().name, kv_cache.q_lens_host))
            if self.fail:
                raise RuntimeError("broken model")
            return self.inner(input_ids, positions, kv_cache, logits_indices)

    engine = make_engine(Watched(fail=False), tiny_tokenizer)
    assert calls == [("astrai-scheduler", (2,)), ("astrai-scheduler", (1,))]  # a prefill, then a decode
    assert engine.get_stats()["total_tasks"] == 0 and engine.get_stats()["kv_tokens_in_use"] == 0
    with caplog.at_level("WARNING", logger="astrai.scheduler"):
        broken = make_engine(Watched(fail=True), tiny_tokenizer)
    assert "warm-up forward failed" in caplog.text
    result = broken.submit([5, 6, 7], SamplingParams(max_tokens=2, **GREEDY))
    assert result.wait_completion(30) and isinstance(result.error, RuntimeError)
