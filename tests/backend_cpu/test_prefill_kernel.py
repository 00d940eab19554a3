"""``astrai_cpu::prefill_attention``: causal attention of fresh prompts, against float64 and SDPA; in
sliding windows too.

The kernel is AVX512-BF16 code: each kernel test runs on the build (``avx512``, on CPUs with those
instructions) and on ``emulated``, the same source compiled for this machine with its intrinsics
emulated in C++ (``avx512_emu/``), which runs anywhere (slowly) and checks the kernel's logic, not
the compiler's code for the real instructions.
"""

from __future__ import annotations

import copy
import dataclasses

import pytest
import torch
import torch.nn.functional as F
from astrai_core_test_fixtures import tiny_config

from astrai.extension import attn_backend
from astrai.kvcache import KVConfig, PagePool, assert_nothing_held
from astrai.model import build_model
from astrai.model.cpu_linear import prepack_linears

pytestmark = pytest.mark.usefixtures("cpu_kernels")
no_avx512_bf16 = pytest.mark.skipif(
    not torch.cpu._is_avx512_bf16_supported(),
    reason="the prefill kernel is built for AVX512-BF16; this CPU has none (SDPA runs instead)",
)


@pytest.fixture(params=["avx512", "emulated"])
def kernel(request):
    """``kernel(q, k_buf, v_buf, table, chunks, scale, window=0)`` on the build's prefill_attention or
    on the emulated one; ``chunks``: (req_to_token row, first row of q, rows, prefix) per request."""
    if request.param == "avx512":
        if not torch.cpu._is_avx512_bf16_supported():
            pytest.skip("the prefill kernel is built for AVX512-BF16; this CPU has none (SDPA runs instead)")
        op = torch.ops.astrai_cpu.prefill_attention
    else:
        op = request.getfixturevalue("avx512_emulated").prefill_attention

    def call(q, k_buf, v_buf, table, chunks, scale, window=0):
        cols = [torch.tensor(c, dtype=torch.int64) for c in zip(*chunks, strict=True)]
        return op(q, k_buf, v_buf, table, *cols, scale, window)

    return call


def qkv_slices(n, hq, hkv, d, seed):
    """q, k, v as the model hands them over: strided row views of one fused projection output."""
    gen = torch.Generator().manual_seed(seed)
    fused = (torch.randn(n, (hq + 2 * hkv) * d, generator=gen) * 2).bfloat16()
    q = fused[:, : hq * d].view(n, hq, d)
    k = fused[:, hq * d : (hq + hkv) * d].view(n, hkv, d)
    v = fused[:, (hq + hkv) * d :].view(n, hkv, d)
    return q, k, v


def scattered_pool(keys: list[torch.Tensor], values: list[torch.Tensor], seed=0):
    """K/V buffers holding each request's positions in shuffled slots, and the req_to_token rows."""
    gen = torch.Generator().manual_seed(seed)
    total = sum(len(k) for k in keys)
    slots = torch.randperm(total + 13, generator=gen)[:total].int()  # some slots belong to nobody
    k_buf = torch.randn(total + 13, *keys[0].shape[1:], generator=gen).bfloat16()
    v_buf = torch.randn(total + 13, *keys[0].shape[1:], generator=gen).bfloat16()
    table = torch.full((len(keys), max(len(k) for k in keys) + 5), -1, dtype=torch.int32)
    at = 0
    for row, (k, v) in enumerate(zip(keys, values, strict=True)):
        mine = slots[at : at + len(k)]
        k_buf[mine.long()], v_buf[mine.long()] = k, v
        table[row, : len(k)] = mine
        at += len(k)
    return k_buf, v_buf, table


def attention(q, k, v, prefix, dtype, window=0):
    """Rows of q at positions prefix.. over keys/values 0.. (in a sliding window: the last ``window``
    positions up to their own): the float64 (or SDPA bf16) reference."""
    n, total = q.shape[0], k.shape[0]
    allowed = torch.arange(total)[None, :] <= (prefix + torch.arange(n))[:, None]
    if window:
        allowed &= torch.arange(total)[None, :] > (prefix + torch.arange(n))[:, None] - window
    return F.scaled_dot_product_attention(
        *(x.to(dtype).transpose(0, 1)[None] for x in (q, k, v)),
        attn_mask=allowed,
        scale=q.shape[-1] ** -0.5,
        enable_gqa=q.shape[1] != k.shape[1],
    )[0].transpose(0, 1)


@pytest.mark.parametrize(
    ("hq", "hkv", "d"), [(9, 3, 64), (8, 2, 128), (4, 4, 64), (2, 1, 128), (4, 1, 256)]
)  # (4, 1, 256): Gemma 3 270M's heads
@pytest.mark.parametrize(
    ("n", "prefix"),
    [(1, 0), (7, 0), (8, 0), (9, 0), (31, 0), (33, 0), (257, 0), (2, 16), (40, 32), (9, 100), (100, 5)],
)
def test_matches_float64_as_closely_as_sdpa(kernel, n, prefix, hq, hkv, d):
    """One chunk of n rows after `prefix` cached positions, K/V scattered over the pool."""
    q, k, v = qkv_slices(prefix + n, hq, hkv, d, seed=n * hq + d + prefix)
    k_buf, v_buf, table = scattered_pool([k], [v])
    got = kernel(q[prefix:], k_buf, v_buf, table, [(0, 0, n, prefix)], d**-0.5)
    assert got.dtype == torch.bfloat16 and got.shape == (n, hq, d)
    want = attention(q[prefix:], k, v, prefix, torch.float64)
    err = (got.double() - want).abs().max().item()
    sdpa_err = (attention(q[prefix:], k, v, prefix, torch.bfloat16).double() - want).abs().max().item()
    # both round the probabilities and the output to bf16; the sums' order differs
    assert err <= 1.5 * sdpa_err + 2e-3, (err, sdpa_err)


@pytest.mark.parametrize(("hq", "hkv", "d"), [(9, 3, 64), (8, 2, 128), (4, 1, 256)])
@pytest.mark.parametrize(
    ("n", "prefix", "window"),
    [
        (40, 0, 1),
        (40, 0, 8),
        (100, 0, 33),
        (257, 0, 64),
        (9, 100, 20),
        (40, 32, 40),
        (100, 500, 100),
        (33, 64, 97),
    ],
)
def test_windowed_matches_float64_as_closely_as_sdpa(kernel, n, prefix, window, hq, hkv, d):
    """Sliding windows: of one position, inside a 32-key block, across blocks, starting in the cached
    prefix (only the keys from the first one row 0 sees are packed)."""
    q, k, v = qkv_slices(prefix + n, hq, hkv, d, seed=n + window + d + prefix)
    k_buf, v_buf, table = scattered_pool([k], [v])
    got = kernel(q[prefix:], k_buf, v_buf, table, [(0, 0, n, prefix)], d**-0.5, window)
    want = attention(q[prefix:], k, v, prefix, torch.float64, window)
    err = (got.double() - want).abs().max().item()
    sdpa_err = (
        (attention(q[prefix:], k, v, prefix, torch.bfloat16, window).double() - want).abs().max().item()
    )
    assert err <= 1.5 * sdpa_err + 2e-3, (err, sdpa_err)


def test_a_window_wider_than_every_request_is_no_window(kernel):
    shapes = [(0, 37), (64, 16), (200, 9)]  # (prefix, rows)
    qs, ks, vs = zip(*(qkv_slices(p + n, 9, 3, 64, seed=i) for i, (p, n) in enumerate(shapes)), strict=True)
    k_buf, v_buf, table = scattered_pool(list(ks), list(vs), seed=2)
    q = torch.cat([qq[p:] for qq, (p, _) in zip(qs, shapes, strict=True)])
    chunks = [(0, 0, 37, 0), (1, 37, 16, 64), (2, 53, 9, 200)]
    plain = kernel(q, k_buf, v_buf, table, chunks, 0.125)
    assert torch.equal(kernel(q, k_buf, v_buf, table, chunks, 0.125, window=209), plain)
    assert not torch.equal(kernel(q, k_buf, v_buf, table, chunks, 0.125, window=208), plain)


def test_a_ragged_step_is_each_chunk_alone(kernel):
    """Chunks of several requests (fresh and after a prefix) in one call: each is, bit for bit,
    its own call; rows of q that no chunk lists are left to the caller."""
    shapes = [(0, 37), (64, 16), (5, 1), (0, 130), (200, 9)]  # (prefix, rows)
    qs, ks, vs = zip(*(qkv_slices(p + n, 9, 3, 64, seed=i) for i, (p, n) in enumerate(shapes)), strict=True)
    k_buf, v_buf, table = scattered_pool(list(ks), list(vs), seed=1)
    q = torch.cat(
        [qq[p:] for qq, (p, _) in zip(qs, shapes, strict=True)] + [qs[0][:3]]
    )  # 3 rows nobody lists
    chunks, row = [], 0
    for i, (p, n) in enumerate(shapes):
        chunks.append((i, row, n, p))
        row += n
    for window in (0, 24):
        together = kernel(q, k_buf, v_buf, table, chunks, 0.125, window)
        for i, (r, q0, n, p) in enumerate(chunks):
            alone = kernel(q[q0 : q0 + n], k_buf, v_buf, table, [(r, 0, n, p)], 0.125, window)
            assert torch.equal(together[q0 : q0 + n], alone), (window, i)


def test_a_row_never_sees_later_keys(kernel):
    """Causal and block-exact: the first m rows of a prompt are, bit for bit, the m-row prompt's."""
    q, k, v = qkv_slices(70, 9, 3, 64, seed=1)
    k_buf, v_buf, table = scattered_pool([k], [v])
    whole = kernel(q, k_buf, v_buf, table, [(0, 0, 70, 0)], 0.125)
    for m in (1, 8, 13, 32, 33, 64):
        assert torch.equal(kernel(q[:m], k_buf, v_buf, table, [(0, 0, m, 0)], 0.125), whole[:m])


def test_refuses_what_it_does_not_compute(kernel):
    q, k, v = qkv_slices(4, 4, 2, 64, seed=0)
    k_buf, v_buf, table = scattered_pool([k], [v])
    with pytest.raises(RuntimeError, match="bf16 only"):
        kernel(q.float(), k_buf.float(), v_buf.float(), table, [(0, 0, 4, 0)], 0.125)
    q32, k32, v32 = qkv_slices(4, 4, 2, 32, seed=0)
    with pytest.raises(RuntimeError, match="head dim 64, 128 or 256"):
        kernel(q32, *scattered_pool([k32], [v32]), [(0, 0, 4, 0)], 0.125)
    with pytest.raises(RuntimeError, match="multiple of Hkv"):
        kernel(q[:, :3], k_buf, v_buf, table, [(0, 0, 4, 0)], 0.125)
    with pytest.raises(RuntimeError, match="window must be in"):
        kernel(q, k_buf, v_buf, table, [(0, 0, 4, 0)], 0.125, window=-1)
    with pytest.raises(RuntimeError, match="outside q or req_to_token"):
        kernel(q, k_buf, v_buf, table, [(0, 2, 4, 0)], 0.125)
    table[0, 1] = 10_000
    with pytest.raises(RuntimeError, match="slot outside the pool"):
        kernel(q, k_buf, v_buf, table, [(0, 0, 4, 0)], 0.125)


@no_avx512_bf16
def test_model_prefill_on_the_kernels_is_as_close_to_float32_as_torch_native():
    """A bf16 model with head dim 64: a ragged step of fresh prompts, then one of chunks after them
    (and a decode row). Its logits under ``cpu`` (the kernels) are as close to the same weights'
    float32 logits as torch_native's bf16 logits (SDPA and its gather path) are."""
    cfg = dataclasses.replace(
        tiny_config(),
        hidden_size=256,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=64,
        intermediate_size=512,
    )
    f32 = build_model(cfg, torch.float32)
    gen = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for name, p in f32.named_parameters():
            w = (
                1.0 + 0.2 * torch.randn(p.shape, generator=gen)
                if "norm" in name
                else torch.randn(p.shape, generator=gen) * p.shape[-1] ** -0.5
            )
            p.copy_(w.bfloat16().float())  # values that bf16 holds exactly
    f32.fuse_projections()
    bf16 = copy.deepcopy(f32)
    for p in bf16.parameters():
        p.data = p.data.bfloat16()
    prepack_linears(bf16)
    first, then = [3, 40, 129, 17], [20, 1, 33, 64]  # step 1 fresh, step 2 chunks after them (one decode row)
    prompts = [torch.randint(3, 250, (a + b,), generator=gen) for a, b in zip(first, then, strict=True)]
    steps = [(first, [0] * 4), (then, first)]  # (rows per request, positions before them)
    logits = {}
    for name, model, backend in (
        ("cpu", bf16, "cpu"),
        ("torch_native", bf16, "torch_native"),
        ("f32", f32, "torch_native"),
    ):
        dtype = next(model.parameters()).dtype
        pool = PagePool(
            cfg.num_hidden_layers,
            cfg.num_attention_heads,
            cfg.num_key_value_heads,
            cfg.head_dim,
            KVConfig(max_batch_size=4, max_seq_len=256, page_size=16, n_tokens=1024),
            dtype=dtype,
        )
        rows = [pool.task_alloc() for _ in prompts]
        for n_new, before in steps:
            ends = [b + n for b, n in zip(before, n_new, strict=True)]
            for row, end in zip(rows, ends, strict=True):
                assert pool.extend(row, end)
            ids = torch.cat([p[b:e] for p, b, e in zip(prompts, before, ends, strict=True)])
            positions = torch.cat([torch.arange(b, e) for b, e in zip(before, ends, strict=True)])
            kv = pool.bind_tasks(rows, n_new, ends)
            with attn_backend(backend):
                out = model(ids, positions, kv, torch.tensor(n_new).cumsum(0) - 1)
            if name == "cpu":
                assert kv.plan["cpu"].chunks is not None, "the prefill kernel did not take the step"
            logits.setdefault(name, []).append(out)
        for row in rows:
            pool.task_free(row)
        assert_nothing_held(pool)
    for step, want in enumerate(logits["f32"]):
        err = (logits["cpu"][step] - want).abs().max().item()
        native_err = (logits["torch_native"][step] - want).abs().max().item()
        assert err <= 1.5 * native_err + 1e-2, (step, err, native_err)
