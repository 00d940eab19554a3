"""LoRA adapters on the default model's quantized GGUF weights, against transformers + peft.

One engine serves three PEFT adapters (ranks 8, 16 with rsLoRA, 4 with a per-module alpha; all
seven projections, or a few) and the base model, in one batch; peft on transformers' float32 import
of the same GGUF is the oracle. The pool's invariants are checked after every test.
"""

from __future__ import annotations

import json
import shutil
import threading
from concurrent import futures

import pytest
import torch
from lora_adapters import PROMPT, SPECS, N, write_gguf_lora

pytest.importorskip("peft")

LOGPROB_TOL = 2e-3  # float32, quantized weights: summation order only


@pytest.fixture(scope="module")
def oracle(lora_oracle):
    return lora_oracle


@pytest.fixture(scope="module")
def engine(default_model_path, oracle):
    from astrai.engine import EngineConfig, InferenceEngine

    config = EngineConfig(
        enable_lora=True,
        max_loras=4,
        max_lora_rank=32,
        max_seq_len=256,
        n_tokens=192,  # less than four requests take: preemptions
        max_batch_size=8,
        speculative="ngram",  # (a request that asks log-probs never drafts: the others' tests)
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
    """Adapter (None: the base) -> peft's greedy tokens after PROMPT and their log-probs."""
    out = {}
    for name in [*SPECS, None]:
        tokens, logprobs, margin = oracle.greedy(name, engine.tokenizer.encode(PROMPT), N)
        assert margin > 1e-3, f"{name}: near-tied logits make a poor comparison"
        out[name] = tokens, logprobs
    return out


def submit(engine, lora: str | None, n: int = N, **sampling):
    ids = engine.tokenizer.encode(PROMPT)  # 25 tokens: the prefill's update in tiles
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
        check(submit(engine, name), *expected[name])
    for name in SPECS:
        assert expected[name][0] != expected[None][0]  # each adapter changes what the model says


def test_lora_dtype_auto_keeps_adapters_in_float16_on_quantized_weights(engine, tiny_model):
    """``lora_dtype`` auto: float16 on the GGUF blocks kept quantized, float32 on a dense model; a
    name picks its dtype; anything else is refused."""
    from astrai.config import EngineConfig
    from astrai.lora import LoraLinear, lora_dtype

    wrappers = [mod for _, _, mod in engine.model.lora.swaps]
    assert wrappers and all(isinstance(m, LoraLinear) for m in wrappers)
    held = {m.a[s].dtype for m in wrappers for s in range(4) if m.a[s].numel()}
    assert engine.model.lora.dtype == torch.float16 and held == {torch.float16}
    assert lora_dtype("auto", tiny_model) == torch.float32
    assert lora_dtype("bfloat16", engine.model) == torch.bfloat16
    with pytest.raises(ValueError, match="lora_dtype must be one of auto, float32, float16, bfloat16"):
        EngineConfig(lora_dtype="int8")


def test_a_slots_blocks_sit_in_one_buffer_in_the_models_order(engine):
    """Each loaded slot's ``a`` and ``b`` of every projection are views of one buffer
    (``astrai.hugepages``), laid out in the order a row's step reads them: the model's."""
    wrappers = list({id(mod): mod for mod, _, _ in engine.model.lora.targets.values()}.values())
    slots = {s for m in wrappers for s in range(engine.model.lora.slots) if m.a[s].numel()}
    assert len(slots) >= 2
    buffers = set()
    for slot in slots:
        blocks = [w[slot] for m in wrappers for w in (m.a, m.b) if w[slot].numel()]
        assert len(blocks) >= 2  # (an a and a b at least)
        assert len({t.untyped_storage().data_ptr() for t in blocks}) == 1
        starts = [t.data_ptr() for t in blocks]
        assert starts == sorted(starts)
        buffers.add(blocks[0].untyped_storage().data_ptr())
    assert len(buffers) == len(slots)  # a buffer per slot


def test_one_batch_mixing_three_adapters_and_the_base(engine, expected):
    """Four requests at once, rows of every adapter and the base in the same steps, preempting each
    other (the pool holds 192 tokens); the same prompt under each never shares another's pages."""
    before = engine.get_stats()
    results = {name: submit(engine, name) for name in [*SPECS, None]}
    for name, result in results.items():
        check(result, *expected[name])
    assert engine.get_stats()["preemptions"] > before["preemptions"]


def test_adapter_rows_decode_on_the_whole_step_kernel_to_the_bit(
    default_model_path, oracle, expected, tmp_path
):
    """A decode step with adapter rows runs on the cpu backend's whole-step kernel, each projection's
    updates added in it (in the projection's own parallel region on quantized weights): a batch of
    three adapters and the base, and one adapter's row alone, give the tokens and log-probs of the
    layers run one by one with their LoRA wrappers, to the bit (and peft's). The kernel keeps the
    slots' weights between steps: an adapter loaded after those steps, into a slot they saw empty,
    runs on its own weights there."""
    from stack_spy import counted, cpu_kernels, without_stack

    from astrai.engine import EngineConfig, InferenceEngine

    kernels = cpu_kernels()
    config = EngineConfig(
        enable_lora=True, max_loras=4, max_lora_rank=32, max_seq_len=256, prefix_caching=False
    )
    with InferenceEngine.from_model(
        str(default_model_path), torch.float32, config=config, weights="gguf"
    ) as eng:
        for name, folder in oracle.folders.items():
            eng.loras.load(name, folder)

        def batch(names: list | None = None) -> dict:
            held, go = threading.Event(), threading.Event()  # queued while the scheduler waits: the
            eng.scheduler.call_soon(lambda: (held.set(), go.wait(30)))  # same steps in both runs
            assert held.wait(30)
            results = {name: submit(eng, name) for name in names or [*SPECS, None]}
            go.set()
            for result in results.values():
                assert result.wait_completion(120) and result.error is None
            return {name: (r.output_ids, [e.logprob for e in r.logprobs]) for name, r in results.items()}

        ran: list[bool] = []
        with counted(kernels, ran):
            stacked = batch()
            alone = batch(["a2"])  # a lone row
        assert ran.count(True) >= 2 * (N - 1), "the decode steps with adapter rows did not run on the stack"
        with without_stack(kernels):
            layered = batch()
            assert alone == batch(["a2"])
        assert stacked == layered
        for name, (tokens, logprobs) in [*stacked.items(), *alone.items()]:
            assert tokens == expected[name][0]
            assert logprobs == pytest.approx(expected[name][1], abs=LOGPROB_TOL)
        shutil.copytree(oracle.folders["a1"], tmp_path / "a1copy")
        late = eng.loras.load("late", tmp_path / "a1copy")
        assert late.slot not in {a.slot for a in eng.loras.adapters if a.name != "late"}
        ran.clear()
        with counted(kernels, ran):
            tokens, logprobs = batch(["late"])["late"]
        assert ran.count(True) >= N - 1
        assert tokens == expected["a1"][0]
        assert logprobs == pytest.approx(expected["a1"][1], abs=LOGPROB_TOL)


def test_prefix_cache_is_per_adapter(engine, oracle, expected, tmp_path):
    """An adapter loaded now finds nothing cached, though every other adapter and the base cached
    this prompt already; its second request reuses its own pages."""
    shutil.copytree(oracle.folders["a1"], tmp_path / "copy")
    fresh = engine.loras.load("fresh", tmp_path / "copy")
    try:
        first = submit(engine, "fresh")
        check(first, *expected["a1"])
        assert first.cached_tokens == 0
        second = submit(engine, "fresh")
        check(second, *expected["a1"])
        assert second.cached_tokens >= 16
    finally:
        engine.loras.unload("fresh")
    # its pages go with it (dropped on the scheduler thread, before the call queued after it)
    dropped = futures.Future()
    engine.scheduler.call_soon(lambda: dropped.set_result(engine.pool.radix.root_of(fresh.namespace(None))))
    assert dropped.result(30) is None


def test_load_and_unload_under_load_leave_other_streams_unchanged(engine, oracle, expected, tmp_path):
    from astrai.errors import ModelNotFound

    shutil.copytree(oracle.folders["a2"], tmp_path / "a2copy")
    running = {name: submit(engine, name) for name in ("a1", None, "a3")}
    engine.loras.load("late", tmp_path / "a2copy")  # a slot no running row uses
    late = submit(engine, "late")
    engine.loras.unload("late")  # refused to new requests now; the one in flight finishes on it
    with pytest.raises(ModelNotFound, match="late"):
        submit(engine, "late")
    for name, result in running.items():
        check(result, *expected[name])
    check(late, *expected["a2"])
    assert [a.name for a in engine.loras.adapters] == list(SPECS)


def test_speculation_per_adapter(engine, expected):
    """n-gram drafts verified on each adapter's own weights: the tokens of peft's greedy decoding,
    alone and in one batch (a request that asks log-probs never drafts: these ask none)."""
    for name in ("a2", "a3"):
        accepted = engine.get_stats()["spec_accepted_tokens"]
        r = submit(engine, name, logprobs=None)
        assert r.wait_completion(120) and r.output_ids == expected[name][0]
        assert engine.get_stats()["spec_accepted_tokens"] > accepted  # drafts confirmed on the adapter
    mixed = {name: submit(engine, name, logprobs=None) for name in ("a2", "a3", None)}
    for name, r in mixed.items():
        assert r.wait_completion(120) and r.output_ids == expected[name][0]


def test_a_gguf_lora_equals_its_peft_twin(engine, oracle, expected, tmp_path):
    config = engine.model.config
    path = write_gguf_lora(
        oracle.folders["a1"], tmp_path / "a1.gguf", config.num_attention_heads, config.num_key_value_heads
    )
    engine.loras.load("a1-gguf", path)
    try:
        check(submit(engine, "a1-gguf"), *expected["a1"])
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
    check(submit(engine, "a2"), *expected["a2"])  # a1 is now the least recently used
    engine.loras.load("x2", tmp_path / "x2")  # evicts a1 (idle)
    assert [a.name for a in engine.loras.adapters] == ["a2", "a3", "x1", "x2"]
    with pytest.raises(ModelNotFound):
        submit(engine, "a1")
    busy = [submit(engine, name, n=150) for name in ("a2", "a3", "x1", "x2")]
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
    check(submit(engine, "a1"), *expected["a1"])


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
