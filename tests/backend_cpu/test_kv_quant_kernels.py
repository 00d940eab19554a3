"""The CPU backend on an int8 KV cache: ``astrai_cpu::store_kv`` writes the reference's bytes,
``paged_decode`` reads int8 K and/or V, and the backend's steps match the float64 reference."""

from __future__ import annotations

import pytest
import torch
from test_kv_quant import MIXED, check_int8_step

from astrai.kvcache.quant import dequantize, quantize
from astrai_backend_cpu import paged_decode
from astrai_backend_cpu.backend import CpuBackend

pytestmark = pytest.mark.usefixtures("cpu_kernels")
KINDS = [("int8", "int8"), ("int8", "auto"), ("auto", "int8")]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16], ids=["f32", "bf16", "f16"])
def test_store_kv_writes_the_bytes_of_the_reference(dtype):
    gen = torch.Generator().manual_seed(0)
    x = (torch.randn(37, 3, 64, generator=gen) * 5).to(dtype)
    x[4, 1] = 0  # a head of zeros: scale 0
    x[5, 2, 7] = 1e-30  # a head whose largest value is tiny
    loc = torch.randperm(100, generator=gen)[:37]
    buf, scale = torch.full((100, 3, 64), 9, dtype=torch.int8), torch.full((100, 3), -1.0)
    torch.ops.astrai_cpu.store_kv(x, loc, buf, scale)
    q8, s = quantize(x)
    assert torch.equal(buf[loc], q8) and torch.equal(scale[loc], s)
    untouched = torch.ones(100, dtype=torch.bool)
    untouched[loc] = False
    assert buf[untouched].eq(9).all() and scale[untouched].eq(-1).all()
    plain = torch.zeros(100, 3, 64, dtype=dtype)
    torch.ops.astrai_cpu.store_kv(x, loc, plain, None)
    assert torch.equal(plain[loc], x)


def test_store_kv_and_paged_decode_refuse_what_they_cannot_read():
    x, loc = torch.randn(2, 3, 64), torch.tensor([0, 1])
    with pytest.raises(RuntimeError, match="float32 scales"):
        torch.ops.astrai_cpu.store_kv(x, loc, torch.zeros(4, 3, 64, dtype=torch.int8), None)
    with pytest.raises(RuntimeError, match="outside the pool"):
        torch.ops.astrai_cpu.store_kv(x, torch.tensor([0, 4]), torch.zeros(4, 3, 64), None)
    q8, s = quantize(torch.randn(4, 3, 64))
    table, one = torch.zeros(1, 4, dtype=torch.int32), torch.tensor([0])
    with pytest.raises(RuntimeError, match="int8 k_buffer needs float32 scales"):
        paged_decode(torch.randn(1, 6, 64), q8, q8, table, one, torch.tensor([2]), 0.1, None, None, s)
    with pytest.raises(RuntimeError, match="v_buffer must be int8 with its scales, or in q's dtype"):
        paged_decode(
            torch.randn(1, 6, 64),
            q8,
            torch.randn(4, 3, 64).bfloat16(),
            table,
            one,
            torch.tensor([2]),
            0.1,
            None,
            s,
        )


@pytest.mark.parametrize("kinds", KINDS, ids="/".join)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["f32", "bf16"])
def test_paged_decode_reads_int8_rows_times_their_scale(kinds, dtype):
    gen = torch.Generator().manual_seed(7)
    size, lens = 700, [1, 127, 128, 129, 300, 600]
    kf, vf = (torch.randn(size, 2, 64, generator=gen).to(dtype) for _ in range(2))
    table = torch.randperm(size, generator=gen).to(torch.int32).repeat(len(lens), 1)
    q = torch.randn(len(lens), 6, 64, generator=gen).to(dtype)
    rows, seq = torch.arange(len(lens)), torch.tensor(lens)
    bufs, scales, dense = [], [], []
    for x, kind in zip((kf, vf), kinds, strict=True):
        if kind == "int8":
            q8, s = quantize(x)
            bufs.append(q8), scales.append(s), dense.append(dequantize(q8, s, torch.float32).to(dtype))
        else:
            bufs.append(x), scales.append(None), dense.append(x)
    starts = torch.tensor([0, 0, 5, 100, 0, 550])
    for first in (None, starts):
        got = paged_decode(q, *bufs, table, rows, seq, 0.125, first, *scales)
        if dtype == torch.float32:  # the same float32 values: only the order of sums may differ
            want = paged_decode(q, *dense, table, rows, seq, 0.125, first)
            torch.testing.assert_close(got, want, atol=1e-6, rtol=1e-5)
        else:  # bf16 rounds the dequantized rows: compare at bf16's precision
            want = paged_decode(q.float(), *(d.float() for d in dense), table, rows, seq, 0.125, first)
            torch.testing.assert_close(got.float(), want, atol=2e-2, rtol=2e-2)


@pytest.mark.parametrize("kinds", KINDS, ids="/".join)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["f32", "bf16"])
def test_the_cpu_backend_serves_an_int8_pool(kinds, dtype):
    kv = check_int8_step(CpuBackend(), *MIXED, kinds, seed=3, dtype=dtype)
    assert kv.plan["cpu"].rows.numel() == 5  # the decode rows went to paged_decode
    kv = check_int8_step(CpuBackend(), [1] * 5, [0, 3, 127, 300, 40], kinds, seed=4, dtype=dtype)
    assert kv.plan["cpu"].tok_rows is None  # a pure decode step: every row on the kernel
    check_int8_step(CpuBackend(), *MIXED, kinds, seed=5, dtype=dtype, window=16)
    check_int8_step(CpuBackend(), [1, 1, 1], [40, 3, 90], kinds, seed=6, dtype=dtype, window=16)


@pytest.mark.parametrize("kinds", KINDS, ids="/".join)
@pytest.mark.parametrize("window", [0, 16])
def test_the_prefill_kernel_reads_an_int8_pool_as_its_bf16_values(avx512_emulated, kinds, window):
    """The AVX512-BF16 prefill kernel (emulated here: ``avx512_emulated``) on an int8 pool gives, bit for
    bit, its result on the bf16 pool holding the same values rounded (torch_native's reading)."""
    gen = torch.Generator().manual_seed(11)
    size, hkv, hq, d = 200, 2, 6, 64
    table = torch.randperm(size, generator=gen).to(torch.int32).view(2, 100)
    q = (torch.randn(60, hq, d, generator=gen) * 2).bfloat16()
    pools, scales, dense = [], [], []
    for kind in kinds:
        x = (torch.randn(size, hkv, d, generator=gen) * 3).bfloat16()
        if kind == "int8":
            q8, s = quantize(x)
            pools.append(q8), scales.append(s), dense.append(dequantize(q8, s, torch.bfloat16))
        else:
            pools.append(x), scales.append(None), dense.append(x)
    # a fresh prompt of 23 rows, and 37 rows after a cached prefix of 50 positions
    cols = [torch.tensor(c) for c in ([0, 1], [0, 23], [23, 37], [0, 50])]
    op = avx512_emulated.prefill_attention
    got = op(q, *pools, table, *cols, 0.125, window, *scales)
    want = op(q, *dense, table, *cols, 0.125, window)
    assert torch.equal(got, want)
