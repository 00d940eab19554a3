"""``decoder_layers`` on ``astrai_cpu.DecodeStack``: a decode step's layers in one C++ call.

It must give the layer-by-layer result bit for bit (logits and the K/V it writes), run
exactly when that path would run on the same kernels, and leave every other step to the
layers.
"""

from __future__ import annotations

import contextlib
import dataclasses

import pytest
import torch
from astrai_core_test_fixtures import tiny_config

from astrai.extension import attn_backend, fused
from astrai.kvcache import KVConfig, PagePool, assert_nothing_held, check_pool_invariants
from astrai.model import build_model
from astrai.model.cpu_linear import prepack_linears
from astrai.sampling import SamplingParams

pytestmark = [
    pytest.mark.usefixtures("cpu_kernels"),
    pytest.mark.skipif(
        not torch.cpu._is_avx512_bf16_supported(),
        reason="the decode stack runs on the AVX512-BF16 linear kernel; this CPU has no AVX512-BF16",
    ),
]


def bf16_model(layers=3, bias=False, fuse=True, seed=0, dtype=torch.bfloat16, **options):
    """A seeded random tiny Llama, projections fused and (bf16) linears packed as load_model leaves them;
    ``options``: more ``ModelConfig`` fields (a sliding window)."""
    cfg = dataclasses.replace(tiny_config(), num_hidden_layers=layers, attention_bias=bias, **options)
    model = build_model(cfg, dtype)
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            scale = 0.2 if "norm" in name else p.shape[-1] ** -0.5
            p.copy_((1.0 if "norm" in name else 0.0) + torch.randn(p.shape, generator=gen) * scale)
    if fuse:
        model.fuse_projections()
    if dtype == torch.bfloat16:
        prepack_linears(model)
    return model


@contextlib.contextmanager
def without_stack():
    """No ``decoder_layers`` kernel for the CPU inside the block: the model runs its layers."""
    from astrai.extension.backend.policy import get_registry

    in_force = get_registry().kernels.for_device("cpu")
    kernel = in_force.pop("decoder_layers")
    try:
        yield
    finally:
        in_force["decoder_layers"] = kernel


@pytest.fixture
def spy(in_force, monkeypatch):
    """Wraps the ``decoder_layers`` kernel the cpu backend lends; records whether each call ran the step."""
    with torch.no_grad():  # kernels are for inference: none is given while grad is enabled
        real = fused.kernel_for("decoder_layers", torch.empty(0))
    assert real is not None, "astrai-backend-cpu lends no decoder_layers"
    ran: list[bool] = []

    def kernel(*args):
        out = real(*args)
        ran.append(out is not None)
        return out

    monkeypatch.setitem(in_force, "decoder_layers", kernel)
    return ran


def new_pool(model, rows=16, paged=True, kinds=("auto", "auto")):
    cfg = model.config
    # contiguous: no pool size (one max_seq_len run of slots per row)
    kv = KVConfig(
        max_batch_size=rows,
        max_seq_len=256,
        page_size=16 if paged else 1,
        n_tokens=4096 if paged else None,
        kinds=kinds,
    )
    return PagePool(
        cfg.num_hidden_layers,
        cfg.num_attention_heads,
        cfg.num_key_value_heads,
        cfg.head_dim,
        kv,
        dtype=next(model.parameters()).dtype,
    )


def prefill(model, pool, prompts):
    """One ragged prefill forward for ``prompts``; returns their rows and each one's next token."""
    rows = [pool.task_alloc() for _ in prompts]
    for row, p in zip(rows, prompts, strict=True):
        assert pool.extend(row, len(p))
    lens = [len(p) for p in prompts]
    kv = pool.bind_tasks(rows, lens, lens)
    ids = torch.tensor([t for p in prompts for t in p])
    positions = torch.cat([torch.arange(n) for n in lens])
    logits = model(ids, positions, kv, torch.tensor(lens).cumsum(0) - 1)
    return rows, logits.argmax(-1).tolist()


def decode_step(model, pool, rows, tokens, lens):
    """One decode step (one token per row at position ``lens[i]``); returns the logits."""
    for row, n in zip(rows, lens, strict=True):
        assert pool.extend(row, n + 1)
    kv = pool.bind_tasks(rows, [1] * len(rows), [n + 1 for n in lens])
    return model(torch.tensor(tokens), torch.tensor(lens), kv, torch.arange(len(rows)))


def release(pool, rows):
    for row in rows:
        pool.task_free(row)
    check_pool_invariants(pool)
    assert_nothing_held(pool)


def both_ways(model, pool, rows, tokens, lens, spy):
    """The step with the stack and, from the same pool contents, layer by layer: logits and K/V of each
    (an int8 pool's scales too)."""
    storage = pool.storage
    buffers = [
        t for t in (storage.k_buffer, storage.v_buffer, storage.k_scale, storage.v_scale) if t is not None
    ]
    before = [t.clone() for t in buffers]
    fused_logits = decode_step(model, pool, rows, tokens, lens)
    fused_kv = [t.clone() for t in buffers]
    assert spy[-1] is True, "the stack declined a step it should run"
    for t, b in zip(buffers, before, strict=True):
        t.copy_(b)
    with without_stack():
        layer_logits = decode_step(model, pool, rows, tokens, lens)
    return (fused_logits, *fused_kv), (layer_logits, *buffers)


@pytest.mark.parametrize("batch", [1, 3, 8, 12])
@pytest.mark.parametrize("bias", [False, True], ids=["no-bias", "qkv-bias"])
@pytest.mark.parametrize("paged", [True, False], ids=["paged", "contiguous"])
def test_bit_for_bit_the_layers_result(spy, batch, bias, paged):
    model = bf16_model(bias=bias)
    pool = new_pool(model, paged=paged)
    gen = torch.Generator().manual_seed(batch)
    prompts = [
        torch.randint(3, 250, (int(n),), generator=gen).tolist()
        for n in torch.randint(1, 150, (batch,), generator=gen)
    ]
    rows, tokens = prefill(model, pool, prompts)
    lens = [len(p) for p in prompts]
    for _ in range(3):  # a few steps, the last ones on K/V the stack itself wrote
        got, want = both_ways(model, pool, rows, tokens, lens, spy)
        for g, w in zip(got, want, strict=True):
            assert torch.equal(g, w)
        tokens, lens = got[0].argmax(-1).tolist(), [n + 1 for n in lens]
    release(pool, rows)


@pytest.mark.parametrize("kinds", [("int8", "int8"), ("int8", "auto"), ("auto", "int8")], ids="/".join)
def test_an_int8_pool_bit_for_bit_the_layers_result(spy, kinds):
    model = bf16_model()
    pool = new_pool(model, kinds=kinds)
    prompts = [list(range(3, 3 + n)) for n in (1, 40, 130)]
    rows, tokens = prefill(model, pool, prompts)
    lens = [len(p) for p in prompts]
    for _ in range(3):
        got, want = both_ways(model, pool, rows, tokens, lens, spy)
        assert len(got) == 4 if "auto" in kinds else len(got) == 5  # logits, K, V and the scales
        for g, w in zip(got, want, strict=True):
            assert torch.equal(g, w)
        tokens, lens = got[0].argmax(-1).tolist(), [n + 1 for n in lens]
    release(pool, rows)


WINDOWS = {
    # Mistral: every layer in one window
    "mistral-window-24": {"architecture": "mistral", "sliding_window": 24},
    # Ministral: windowed and global layers, a window of one position
    "ministral-window-1": {
        "architecture": "ministral",
        "sliding_window": 1,
        "layer_types": ["sliding_attention", "full_attention", "sliding_attention"],
    },
    "ministral-window-40": {
        "architecture": "ministral",
        "sliding_window": 40,
        "layer_types": ["full_attention", "sliding_attention", "sliding_attention"],
    },
}


@pytest.mark.parametrize("options", list(WINDOWS.values()), ids=list(WINDOWS))
def test_sliding_windows_bit_for_bit_the_layers_result(spy, options):
    """Windowed layers: paged_decode from each request's first position in the layer's window, as the
    cpu backend's decode rows (prompts of up to 150 tokens reach past it)."""
    model = bf16_model(**options)
    assert model.decoder_stack().windows == tuple(
        a.window for a in (lay.self_attn for lay in model.model.layers)
    )
    pool = new_pool(model)
    gen = torch.Generator().manual_seed(len(options))
    prompts = [torch.randint(3, 250, (int(n),), generator=gen).tolist() for n in (1, 23, 24, 25, 150)]
    rows, tokens = prefill(model, pool, prompts)
    lens = [len(p) for p in prompts]
    for _ in range(3):
        got, want = both_ways(model, pool, rows, tokens, lens, spy)
        for g, w in zip(got, want, strict=True):
            assert torch.equal(g, w)
        tokens, lens = got[0].argmax(-1).tolist(), [n + 1 for n in lens]
    release(pool, rows)


def test_declines_what_the_layers_must_run(spy, in_force):
    model = bf16_model()
    pool = new_pool(model)
    gen = torch.Generator().manual_seed(5)
    prompts = [torch.randint(3, 250, (20 + i,), generator=gen).tolist() for i in range(9)]
    rows, tokens = prefill(model, pool, prompts)
    assert spy == [False], "a prefill step is the layers'"
    lens = [len(p) for p in prompts]
    linear = in_force["linear"]
    linear.max_rows, before = 8, linear.max_rows
    try:
        decode_step(model, pool, rows, tokens, lens)  # 9 rows: more than the linear kernel takes
    finally:
        linear.max_rows = before
    assert spy[-1] is False
    lens = [n + 1 for n in lens]
    with attn_backend("torch_native"):  # attention chosen elsewhere: the layers run it there
        decode_step(model, pool, rows[:2], tokens[:2], lens[:2])
    assert spy[-1] is False
    decode_step(model, pool, rows[:2], tokens[:2], [n + 1 for n in lens[:2]])
    assert spy[-1] is True
    release(pool, rows)


def verify_step(model, pool, rows, tokens, lens, drafts):
    """A speculative verify step: row i brings its decode token and ``drafts[i]`` drafts after it
    (``drafts[i]`` 0: a plain decode row); returns the logits at every position, in order."""
    q_lens = [1 + len(d) for d in drafts]
    for row, n, q in zip(rows, lens, q_lens, strict=True):
        assert pool.extend(row, n + q)
    kv = pool.bind_tasks(rows, q_lens, [n + q for n, q in zip(lens, q_lens, strict=True)])
    kv.drafts_host = tuple(len(d) for d in drafts)
    ids = torch.tensor([t for tok, d in zip(tokens, drafts, strict=True) for t in [tok, *d]])
    positions = torch.cat([torch.arange(n, n + q) for n, q in zip(lens, q_lens, strict=True)])
    return model(ids, positions, kv, torch.arange(sum(q_lens)))


def test_verify_steps_run_on_it_bit_for_bit(spy):
    """Decode rows with drafts after them (tokens attending up to their own positions) run on the
    stack, with the layers' logits and K/V; a step that also prefills is the layers'."""
    model = bf16_model()
    pool = new_pool(model)
    gen = torch.Generator().manual_seed(11)
    prompts = [torch.randint(3, 250, (int(n),), generator=gen).tolist() for n in (17, 40, 63)]
    rows, tokens = prefill(model, pool, prompts)
    lens = [len(p) for p in prompts]
    drafts = [[7, 8, 9, 10], [], [11, 12]]
    k0, v0 = pool.k_buffer.clone(), pool.v_buffer.clone()
    got = verify_step(model, pool, rows, tokens, lens, drafts), pool.k_buffer.clone(), pool.v_buffer.clone()
    assert spy[-1] is True, "the stack declined a verify step"
    pool.k_buffer.copy_(k0)
    pool.v_buffer.copy_(v0)
    with without_stack():
        want = verify_step(model, pool, rows, tokens, lens, drafts), pool.k_buffer, pool.v_buffer
    for g, w in zip(got, want, strict=True):
        assert torch.equal(g, w)
    new = pool.task_alloc()  # a fresh prompt beside a verify row: the layers run that step
    n0 = lens[0] + 1 + len(drafts[0])
    assert pool.extend(rows[0], n0 + 3) and pool.extend(new, 30)
    kv = pool.bind_tasks([rows[0], new], [3, 30], [n0 + 3, 30])
    kv.drafts_host = (2, 0)
    ids = torch.tensor([tokens[0], 1, 2] + [5] * 30)
    model(ids, torch.cat([torch.arange(n0, n0 + 3), torch.arange(30)]), kv, torch.tensor([0, 1, 2, 32]))
    assert spy[-1] is False
    rows2 = [new]
    release(pool, rows + rows2)


@pytest.mark.parametrize("kind", ["float32", "unfused projections", "patched layer"])
def test_declines_models_it_does_not_replicate(spy, kind):
    if kind == "float32":
        model = bf16_model(dtype=torch.float32)
    elif kind == "unfused projections":
        model = bf16_model(fuse=False)
    else:
        model = bf16_model()
        model.model.layers[1].__class__ = type("Patched", (type(model.model.layers[1]),), {})
    pool = new_pool(model)
    rows, tokens = prefill(model, pool, [[5, 6, 7]])
    decode_step(model, pool, rows, tokens, [3])
    assert spy[-1] is False
    release(pool, rows)


def test_engine_runs_decode_steps_on_it_and_matches_the_layers(spy, make_engine, tiny_tokenizer):
    model = bf16_model(layers=2, seed=7)
    prompts = [[5 + i] * (3 + 11 * i) for i in range(6)]
    params = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
    outputs = []
    for stack in (True, False):
        engine = make_engine(model, tiny_tokenizer, max_batch_size=8, page_size=4, n_tokens=2048)
        with contextlib.nullcontext() if stack else without_stack():
            results = [engine.submit(p, params) for p in prompts]
            assert all(r.wait_completion(60) for r in results)
        engine.shutdown()
        outputs.append([r.output_ids for r in results])
    assert outputs[0] == outputs[1]
    assert spy.count(True) >= 11, "the engine's decode steps did not run on the stack"


def test_default_model_in_bf16(spy, default_model_path):
    """SmolLM2's shapes (head dim 64: the attention kernel's specialised path, 30 layers, GQA 3)."""
    from astrai.model import load_model

    model, tokenizer = load_model(str(default_model_path), dtype=torch.bfloat16)
    pool = new_pool(model)
    prompts = [
        tokenizer.apply_chat_template([{"role": "user", "content": q}])
        for q in ("What is the capital of France?", "Name a prime number.", "Say hello.")
    ]
    rows, tokens = prefill(model, pool, prompts)
    lens = [len(p) for p in prompts]
    for _ in range(4):
        got, want = both_ways(model, pool, rows, tokens, lens, spy)
        for g, w in zip(got, want, strict=True):
            assert torch.equal(g, w)
        tokens, lens = got[0].argmax(-1).tolist(), [n + 1 for n in lens]
    release(pool, rows)


def test_bf16_greedy_text_does_not_depend_on_the_batch(make_engine, default_model_path):
    """Every kernel on the bf16 path computes a row's result without the other rows (the GEMMs, the
    prefill chunks, decode attention), so a prompt's greedy text is the same alone and inside a
    mixed batch, with prefill chunks cut at different places (max_prefill_tokens 16)."""
    from test_engine import REAL_PROMPTS  # tests/core

    from astrai.model import load_model

    model, tokenizer = load_model(str(default_model_path), dtype=torch.bfloat16)
    engine = make_engine(
        model, tokenizer, max_batch_size=8, max_seq_len=256, n_tokens=4096, max_prefill_tokens=16
    )
    batch = engine.generate(REAL_PROMPTS, max_tokens=24, temperature=0.0)
    alone = [engine.generate(p, max_tokens=24, temperature=0.0) for p in REAL_PROMPTS]
    assert alone == batch
    assert len(set(batch)) == len(batch) and all(batch)


def test_the_engine_packs_and_builds_the_stack_before_the_first_request(make_engine, tiny_tokenizer):
    from astrai.model.cpu_linear import PackedLinear

    model = bf16_model(layers=2, seed=3)
    linears = [m for m in model.modules() if isinstance(m, PackedLinear)]
    assert linears and all(m._small is None for m in linears)
    make_engine(model, tiny_tokenizer, max_batch_size=2, page_size=4, n_tokens=256)
    assert all(m._small is not None for m in linears)  # the warm-up's prefill and decode packed them
    assert all(m._onednn is None for m in linears)  # and no input went to oneDNN
    with torch.no_grad():
        stacks = fused.kernel_for("decoder_layers", torch.empty(0))._stacks
    assert stacks[model][0] is not None
