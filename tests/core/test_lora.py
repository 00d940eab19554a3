"""LoRA adapters on the default model's quantized GGUF weights, against transformers + peft.

One engine serves three PEFT adapters (ranks 8, 16 with rsLoRA, 4 with a per-module alpha; all
seven projections, or a few) and the base model, in one batch; peft on transformers' float32 import
of the same GGUF is the oracle. The pool's invariants are checked after every test.
"""

from __future__ import annotations

import json
import shutil
from concurrent import futures

import pytest
import torch
from lora_adapters import SPECS, write_gguf_lora

pytest.importorskip("peft")

N = 32  # tokens compared per request
LOGPROB_TOL = 2e-3  # float32, quantized weights: summation order only

PROMPTS = [
    "The old lighthouse keeper climbed the stairs every evening and looked out over the grey sea, "
    "counting the ships that passed",
    "List three facts about the planet Mars:",
]


@pytest.fixture(scope="module")
def oracle(lora_oracle):
    return lora_oracle


@pytest.fixture(scope="module")
def engine(default_model_path, oracle):
    from astrai.engine import EngineConfig, InferenceEngine

    config = EngineConfig(
        enable_lora=True, max_loras=4, max_lora_rank=32, max_seq_len=256, n_tokens=320, max_batch_size=8
    )
    eng = InferenceEngine.from_model(str(default_model_path), torch.float32, config=config, weights="gguf")
    for name, folder in oracle.folders.items():
        eng.loras.load(name, folder)
    yield eng
    eng.shutdown()


@pytest.fixture(autouse=True)
def _pool_checked(request):
    """After each test of the shared engine: its pool's invariants, checked between two steps."""
    yield
    if "engine" in request.fixturenames:
        eng = request.getfixturevalue("engine")
        checked = futures.Future()
        eng.scheduler.call_soon(lambda: checked.set_result(_check(eng.pool)))
        assert checked.result(60) is None


def _check(pool) -> BaseException | None:
    from astrai.kvcache import assert_nothing_held, check_pool_invariants

    try:
        check_pool_invariants(pool)
        assert_nothing_held(pool)
    except AssertionError as exc:
        return exc
    return None


@pytest.fixture(scope="module")
def expected(engine, oracle):
    """(adapter, prompt index) -> peft's greedy tokens and log-probs."""
    out = {}
    for name in [*SPECS, None]:
        for i, text in enumerate(PROMPTS):
            tokens, logprobs, margin = oracle.greedy(name, engine.tokenizer.encode(text), N)
            assert margin > 1e-3, f"{name} on prompt {i}: near-tied logits make a poor comparison"
            out[name, i] = tokens, logprobs
    return out


def submit(engine, i: int, lora: str | None, n: int = N, **sampling):
    ids = engine.tokenizer.encode(PROMPTS[i])
    params = engine._params(
        {"max_tokens": n, "temperature": 0, "ignore_eos": True, "logprobs": 0, **sampling}
    )
    return engine.submit(ids, params, lora=lora)


def check(result, expected_tokens, expected_logprobs) -> None:
    assert result.wait_completion(120)
    assert result.error is None
    assert result.output_ids == expected_tokens
    got = [e.logprob for e in result.logprobs]
    assert got == pytest.approx(expected_logprobs, abs=LOGPROB_TOL)


def test_each_adapter_alone_equals_peft(engine, expected):
    for name in [*SPECS, None]:
        for i in range(len(PROMPTS)):
            check(submit(engine, i, name), *expected[name, i])
    assert expected["a1", 0][0] != expected[None, 0][0]  # the adapters change what the model says
    assert expected["a2", 0][0] != expected[None, 0][0]
    assert expected["a3", 0][0] != expected[None, 0][0]


def test_one_batch_mixing_three_adapters_and_the_base(engine, expected):
    """All eight requests at once (rows of every adapter and the base in the same steps); the
    same prompt under each adapter never shares another's cached pages."""
    before = engine.get_stats()
    results = {(name, i): submit(engine, i, name) for i in range(len(PROMPTS)) for name in [*SPECS, None]}
    for key, result in results.items():
        check(result, *expected[key])
    after = engine.get_stats()
    assert after["preemptions"] > before["preemptions"]  # the pool (320 tokens) cannot hold all eight


def test_prefix_cache_is_per_adapter(engine, oracle, expected, tmp_path):
    """An adapter loaded now finds nothing cached, though every other adapter and the base cached
    this prompt already; its second request reuses its own pages."""
    shutil.copytree(oracle.folders["a1"], tmp_path / "copy")
    fresh = engine.loras.load("fresh", tmp_path / "copy")
    try:
        first = submit(engine, 0, "fresh")
        check(first, *expected["a1", 0])
        assert first.cached_tokens == 0
        second = submit(engine, 0, "fresh")
        check(second, *expected["a1", 0])
        assert second.cached_tokens >= 16
    finally:
        engine.loras.unload("fresh")
    # its pages go with it (dropped on the scheduler thread, before the call queued after it)
    dropped = futures.Future()
    engine.scheduler.call_soon(lambda: dropped.set_result(engine.pool.radix.root_of(fresh.namespace(None))))
    assert dropped.result(30) is None


def test_load_and_unload_under_load_leave_other_streams_unchanged(engine, oracle, expected, tmp_path):
    shutil.copytree(oracle.folders["a2"], tmp_path / "a2copy")
    running = [submit(engine, 0, "a1"), submit(engine, 1, None), submit(engine, 1, "a3")]
    engine.loras.load("late", tmp_path / "a2copy")  # a slot no running row uses
    late = submit(engine, 1, "late")
    engine.loras.unload("late")  # refused to new requests now; the one in flight finishes on it
    from astrai.errors import ModelNotFound

    with pytest.raises(ModelNotFound, match="late"):
        submit(engine, 0, "late")
    check(running[0], *expected["a1", 0])
    check(running[1], *expected[None, 1])
    check(running[2], *expected["a3", 1])
    check(late, *expected["a2", 1])
    assert [a.name for a in engine.loras.adapters] == list(SPECS)


def test_a_gguf_lora_equals_its_peft_twin(engine, oracle, expected, tmp_path):
    config = engine.model.config
    path = write_gguf_lora(
        oracle.folders["a1"], tmp_path / "a1.gguf", config.num_attention_heads, config.num_key_value_heads
    )
    engine.loras.load("a1-gguf", path)
    try:
        for i in range(len(PROMPTS)):
            check(submit(engine, i, "a1-gguf"), *expected["a1", i])
    finally:
        engine.loras.unload("a1-gguf")


def _write(folder, config: dict, tensors: dict) -> None:
    from safetensors.torch import save_file

    folder.mkdir(parents=True, exist_ok=True)
    (folder / "adapter_config.json").write_text(json.dumps(config))
    save_file(tensors, folder / "adapter_model.safetensors")


def test_bad_adapters_are_refused_and_nothing_is_kept(engine, oracle, tmp_path):
    from lora_adapters import lora_weights

    from astrai.errors import AdapterError

    config, tensors = lora_weights(oracle.folders["a1"])
    wide = dict(tensors)
    for key in [k for k in wide if "layers.3.self_attn.q_proj.lora_A" in k]:
        wide[key] = torch.zeros(8, 100)  # an adapter for a model of another width
    _write(tmp_path / "wide", config, wide)
    odd = {k.replace("layers.0.self_attn.q_proj", "layers.0.self_attn.x_proj"): v for k, v in tensors.items()}
    _write(tmp_path / "odd", config, odd)
    big = {
        k: torch.zeros(48, v.shape[1]) if ".lora_A" in k else torch.zeros(v.shape[0], 48)
        for k, v in tensors.items()
    }
    _write(tmp_path / "big", {**config, "r": 48}, big)
    _write(tmp_path / "dora", {**config, "use_dora": True}, tensors)
    (tmp_path / "plain").mkdir()
    cases = {
        str(tmp_path / "missing"): "does not exist",
        str(tmp_path / "plain"): "no adapter_config.json",
        str(tmp_path / "wide"): "another base model",
        str(tmp_path / "odd"): "x_proj",
        str(tmp_path / "big"): "rank 48, over --max-lora-rank 32",
        str(tmp_path / "dora"): "DoRA",
    }
    before = [(a.name, a.slot) for a in engine.loras.adapters]
    for path, message in cases.items():
        with pytest.raises(AdapterError, match=message):
            engine.loras.load("bad", path)
    with pytest.raises(AdapterError, match="loaded already"):
        engine.loras.load("a1", oracle.folders["a2"])
    assert [(a.name, a.slot) for a in engine.loras.adapters] == before
    assert engine.loras._free == [3]  # every slot a failed load took is free again


def test_past_max_loras_the_idle_adapter_goes_and_busy_ones_refuse(engine, oracle, expected, tmp_path):
    from astrai.errors import AdapterBusy, ModelNotFound

    for name in ("x1", "x2"):
        shutil.copytree(oracle.folders["a3"], tmp_path / name)
    engine.loras.load("x1", tmp_path / "x1")  # the fourth slot
    check(submit(engine, 0, "a2"), *expected["a2", 0])  # a1 is now the least recently used
    engine.loras.load("x2", tmp_path / "x2")  # evicts a1 (idle)
    assert [a.name for a in engine.loras.adapters] == ["a2", "a3", "x1", "x2"]
    with pytest.raises(ModelNotFound):
        submit(engine, 0, "a1")
    busy = [submit(engine, 0, name, n=200) for name in ("a2", "a3", "x1", "x2")]
    try:
        with pytest.raises(AdapterBusy, match="all 4 adapter slots"):
            engine.loras.load("a1", oracle.folders["a1"])
    finally:
        for r in busy:
            engine.abort(r.request_id)
        for r in busy:
            assert r.wait_completion(60)
    engine.loras.unload("x1")
    engine.loras.unload("x2")
    engine.loras.load("a1", oracle.folders["a1"])
    check(submit(engine, 0, "a1"), *expected["a1", 0])


def test_speculation_per_adapter(default_model_path, oracle, expected):
    """n-gram drafts verified on each adapter's own weights: the tokens of peft's greedy decoding."""
    from astrai.engine import EngineConfig, InferenceEngine

    config = EngineConfig(enable_lora=True, max_loras=2, max_seq_len=256, speculative="ngram")
    eng = InferenceEngine.from_model(str(default_model_path), torch.float32, config=config, weights="gguf")
    try:
        eng.loras.load("a2", oracle.folders["a2"])
        eng.loras.load("a3", oracle.folders["a3"])
        for key in [("a2", 0), ("a2", 1), ("a3", 0)]:
            accepted = eng.get_stats()["spec_accepted_tokens"]
            r = submit(eng, key[1], key[0], logprobs=None)  # (a request asking log-probs never drafts)
            assert r.wait_completion(120) and r.output_ids == expected[key][0]
            assert eng.get_stats()["spec_accepted_tokens"] > accepted  # drafts were confirmed on the adapter
        keys = [("a2", 0), ("a3", 1), (None, 0), ("a2", 1)]
        mixed = [submit(eng, i, name, logprobs=None) for name, i in keys]
        for r, key in zip(mixed, keys, strict=True):
            assert r.wait_completion(120) and r.output_ids == expected[key][0]
    finally:
        eng.shutdown()


def test_lora_is_refused_where_not_enabled(real_model):
    from astrai.engine import EngineConfig, InferenceEngine
    from astrai.errors import RequestRejected

    model, tokenizer = real_model
    eng = InferenceEngine(model, tokenizer, EngineConfig(max_seq_len=64))
    try:
        with pytest.raises(RequestRejected, match="not enabled"):
            eng.submit([1, 2, 3], eng._params({"max_tokens": 2}), lora="a1")
        assert eng.loras is None and not hasattr(model, "lora")
    finally:
        eng.shutdown()


def test_lora_is_refused_under_tensor_parallelism(tiny_model, tiny_tokenizer):
    import copy

    from astrai.engine import EngineConfig, InferenceEngine

    model = copy.deepcopy(tiny_model)
    model.tensor_parallel_size = 2  # as astrai.distributed's rank-0 model says
    with pytest.raises(ValueError, match="not supported under tensor parallelism"):
        InferenceEngine(model, tiny_tokenizer, EngineConfig(enable_lora=True, max_seq_len=64))
    assert not hasattr(model, "lora")
