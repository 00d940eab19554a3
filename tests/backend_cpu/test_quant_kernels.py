"""``astrai_cpu::quant_linear`` / ``quant_linear_wide`` / ``quant_linear_amx`` / ``quant_weight_t`` /
``quant_dequant`` against astrai.model.quant's reference."""

from __future__ import annotations

import pytest
import torch

from astrai.model.quant import NATIVE, dequantize, pack, split_blocks
from astrai_backend_cpu.kernels import QuantLinearKernel
from tests.core.test_quant import random_blocks

pytestmark = pytest.mark.usefixtures("cpu_kernels")


@pytest.fixture(autouse=True)
def quant_build(cpu_kernels):
    """Skips unless the build has ``quant_linear`` (AVX512-BF16, or AVX2 with FMA: float32 rows only)."""
    if not torch.ops.astrai_cpu.has_quant_linear():
        pytest.skip("the quantized kernels need a build for AVX512-BF16 or AVX2 + FMA")


def _needs_bf16() -> None:
    if not torch.ops.astrai_cpu.has_quant_linear_bf16():
        pytest.skip("bf16 rows need the build for AVX512-BF16 (this one has the AVX2 float32 kernels)")


QTYPES = pytest.mark.parametrize("qtype", sorted(NATIVE))


def packed_weight(qtype: str, n: int, k: int, seed: int = 0):
    return pack(*split_blocks(random_blocks(qtype, n, k, seed), qtype), NATIVE[qtype])


@QTYPES
@pytest.mark.parametrize("rows", [1, 3, 4, 9, 64])  # every row-block width, and several blocks
def test_bf16_rows_match_the_dequantized_weight_in_float32(qtype, rows):
    _needs_bf16()
    n, k = 53, 512  # an odd tile count, a padded last tile
    packed, layout = packed_weight(qtype, n, k, seed=rows)
    gen = torch.Generator().manual_seed(rows)
    x = torch.randn(rows, k, generator=gen).bfloat16()
    bias = torch.randn(n, generator=gen).bfloat16()
    got = torch.ops.astrai_cpu.quant_linear(x, packed, layout.ints(), bias)
    w = dequantize(packed, layout).double()
    want = (x.double() @ w.t() + bias.double()).float()
    assert got.dtype == torch.bfloat16 and got.shape == (rows, n)
    # the float32 sums (in another order) are within 1e-5 of the exact product; one bf16 rounding
    scale = (x.double().abs() @ w.abs().t()).float() + bias.float().abs()
    assert ((got.float() - want).abs() <= want.abs() * 2**-8 + scale * 1e-5).all()


@QTYPES
@pytest.mark.parametrize("rows", [1, 2, 3, 5, 70])  # every row block (and tiles by 4, 2 and 1 on AVX2)
@pytest.mark.parametrize("n", [40, 100])  # 3 and 7 tiles, the last one padded
def test_float32_rows_are_the_float32_model(qtype, rows, n):
    k = 256
    packed, layout = packed_weight(qtype, n, k, seed=3)
    x = torch.randn(rows, k, generator=torch.Generator().manual_seed(rows))
    got = torch.ops.astrai_cpu.quant_linear(x, packed, layout.ints(), None)
    w = dequantize(packed, layout).double()
    want = x.double() @ w.t()
    assert got.dtype == torch.float32
    # float32 sums in another order: within 1e-6 of the sum of the products' magnitudes
    assert ((got.double() - want).abs() <= (x.double().abs() @ w.abs().t()) * 1e-6).all()


@QTYPES
@pytest.mark.parametrize("rows", [1, 9, 70])  # 70: past max_rows, still this kernel
def test_float_out_gives_bf16_rows_float32_sums_unrounded(qtype, rows):
    """An LM head's logits: the same float32 sums as the bf16 outputs, before their rounding."""
    _needs_bf16()
    n, k = 53, 512
    packed, layout = packed_weight(qtype, n, k, seed=rows)
    gen = torch.Generator().manual_seed(rows)
    x = torch.randn(rows, k, generator=gen).bfloat16()
    bias = torch.randn(n, generator=gen).bfloat16()
    got = torch.ops.astrai_cpu.quant_linear(x, packed, layout.ints(), bias, True)
    rounded = torch.ops.astrai_cpu.quant_linear(x, packed, layout.ints(), bias)
    assert got.dtype == torch.float32 and got.shape == (rows, n)
    assert torch.equal(got.bfloat16(), rounded)  # one rounding (to nearest even) of the very same sums
    w = dequantize(packed, layout).double()
    want = x.double() @ w.t() + bias.double()
    scale = x.double().abs() @ w.abs().t() + bias.double().abs()
    assert ((got.double() - want).abs() <= scale * 1e-5).all()
    assert (got.double() - want).abs().max() < (rounded.double() - want).abs().max()


@pytest.mark.parametrize("qtype", ["Q4_1", "Q8_0", "Q6_K"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_a_rows_result_does_not_depend_on_the_batch(qtype, dtype):
    if dtype == torch.bfloat16:
        _needs_bf16()
    packed, layout = packed_weight(qtype, 96, 512)
    x = torch.randn(13, 512, generator=torch.Generator().manual_seed(1)).to(dtype)
    batch = torch.ops.astrai_cpu.quant_linear(x, packed, layout.ints(), None)
    for i in (0, 4, 12):
        alone = torch.ops.astrai_cpu.quant_linear(x[i : i + 1], packed, layout.ints(), None)
        assert torch.equal(alone[0], batch[i])


@QTYPES
def test_weight_t_and_rows_are_the_reference_dequantization(qtype):
    packed, layout = packed_weight(qtype, 37, 256, seed=5)
    ref = dequantize(packed, layout)
    assert torch.equal(
        torch.ops.astrai_cpu.quant_weight_t(packed, layout.ints(), torch.float32), ref.t().contiguous()
    )
    assert torch.equal(
        torch.ops.astrai_cpu.quant_weight_t(packed, layout.ints(), torch.bfloat16), ref.t().bfloat16()
    )
    ids = torch.tensor([36, 0, 17, 17])
    assert torch.equal(
        torch.ops.astrai_cpu.quant_dequant(packed, layout.ints(), ids, torch.bfloat16), ref[ids].bfloat16()
    )


@QTYPES
@pytest.mark.parametrize("rows", [65, 200])
def test_wide_rows_are_the_dense_bf16_models_bit_for_bit(qtype, rows):
    """``quant_linear_wide`` (prefill): every row against the weight as the bf16 model holds it,
    on ``linear_packed``'s loops: equal to ``linear_packed`` on the dequantized bf16 weight."""
    _needs_bf16()
    n, k = 53, 512  # an odd tile count, a padded last tile
    packed, layout = packed_weight(qtype, n, k, seed=rows)
    gen = torch.Generator().manual_seed(rows)
    x = torch.randn(rows, k, generator=gen).bfloat16()
    bias = torch.randn(n, generator=gen).bfloat16()
    got = torch.ops.astrai_cpu.quant_linear_wide(x, packed, layout.ints(), bias)
    dense = torch.ops.astrai_cpu.linear_pack(dequantize(packed, layout).bfloat16())
    assert torch.equal(got, torch.ops.astrai_cpu.linear_packed(x, dense, n, bias))
    assert torch.equal(got[7:9], torch.ops.astrai_cpu.quant_linear_wide(x[7:9], packed, layout.ints(), bias))


def _needs_amx() -> None:
    if not torch.ops.astrai_cpu.has_quant_linear_amx():
        pytest.skip("quant_linear_amx needs a CPU with AMX (and the OS's leave to use its tiles)")


@QTYPES
@pytest.mark.parametrize(("rows", "n"), [(65, 53), (200, 16), (17, 40), (300, 100), (96, 32)])
def test_amx_rows_are_the_bf16_weights_products(qtype, rows, n):
    """``quant_linear_amx`` (prefill on an AMX CPU): the weight as the bf16 model holds it, float32
    sums in the tiles' order, one rounding; a row's result does not depend on the other rows.
    Tile counts 1-4 and 7 (groups of four and what is left), and partial 16-row blocks."""
    _needs_amx()
    k = 512
    packed, layout = packed_weight(qtype, n, k, seed=rows)
    gen = torch.Generator().manual_seed(rows)
    x = torch.randn(rows, k, generator=gen).bfloat16()
    bias = torch.randn(n, generator=gen).bfloat16()
    got = torch.ops.astrai_cpu.quant_linear_amx(x, packed, layout.ints(), bias)
    w = dequantize(packed, layout).bfloat16().double()
    want = x.double() @ w.t() + bias.double()
    scale = x.double().abs() @ w.abs().t() + bias.double().abs()
    assert got.dtype == torch.bfloat16 and got.shape == (rows, n)
    assert ((got.double() - want).abs() <= want.abs() * 2**-8 + scale * 1e-5).all()
    assert torch.equal(got[7:9], torch.ops.astrai_cpu.quant_linear_amx(x[7:9], packed, layout.ints(), bias))


def test_wide_takes_amx_up_to_its_rows_then_the_whole_weight_into_onednn():
    """QuantLinearKernel.wide: without AMX ``quant_linear_wide``; with it, ``quant_linear_amx`` up
    to ``amx_rows`` rows and the weight dequantized whole into oneDNN's GEMM past them."""
    _needs_bf16()
    n, k = 53, 512
    packed, layout = packed_weight("Q4_1", n, k, seed=5)
    x = torch.randn(80, k, generator=torch.Generator().manual_seed(5)).bfloat16()
    bias = torch.randn(n, generator=torch.Generator().manual_seed(6)).bfloat16()
    kernel = QuantLinearKernel()
    ops = torch.ops.astrai_cpu
    if not torch.cpu._is_amx_tile_supported():
        assert torch.equal(
            kernel.wide(x, packed, layout.ints(), bias), ops.quant_linear_wide(x, packed, layout.ints(), bias)
        )
        return
    _needs_amx()
    assert torch.equal(
        kernel.wide(x, packed, layout.ints(), bias), ops.quant_linear_amx(x, packed, layout.ints(), bias)
    )
    kernel.amx_rows = 79
    whole = torch.addmm(bias, x, ops.quant_weight_t(packed, layout.ints(), torch.bfloat16))
    assert torch.equal(kernel.wide(x, packed, layout.ints(), bias), whole)


def test_bad_inputs_are_refused():
    packed, layout = packed_weight("Q4_1", 32, 64)
    with pytest.raises(RuntimeError, match="tile layout"):
        torch.ops.astrai_cpu.quant_linear(torch.randn(1, 64), packed[:-1], layout.ints(), None)
    with pytest.raises(RuntimeError, match="rows \\[M, k\\]"):
        torch.ops.astrai_cpu.quant_linear(torch.randn(1, 32), packed, layout.ints(), None)
    with pytest.raises(RuntimeError, match="outside"):
        torch.ops.astrai_cpu.quant_dequant(packed, layout.ints(), torch.tensor([32]), torch.float32)
    if not torch.ops.astrai_cpu.has_quant_linear_bf16():
        with pytest.raises(RuntimeError, match="bf16 rows need a build for AVX512-BF16"):
            torch.ops.astrai_cpu.quant_linear(torch.randn(1, 64).bfloat16(), packed, layout.ints(), None)
        return
    with pytest.raises(RuntimeError, match="bf16 rows"):
        torch.ops.astrai_cpu.quant_linear_wide(torch.randn(70, 64), packed, layout.ints(), None)
    if torch.ops.astrai_cpu.has_quant_linear_amx():
        with pytest.raises(RuntimeError, match="bf16 rows"):
            torch.ops.astrai_cpu.quant_linear_amx(torch.randn(70, 64), packed, layout.ints(), None)


def test_an_lm_heads_large_logits_reuse_one_block_once_it_is_let_go():
    """``float_out`` outputs of 16 MiB and more (a step's logits: Gemma 3's are 32 MiB at 32 rows) come
    from one block kept between calls whenever nothing holds it any more, so a step does not fault
    its pages in afresh; a caller still holding the last logits, or a view of them, gets a new block
    and its values stay as they were."""
    import resource

    packed, layout = packed_weight("Q8_0", 65536, 64)
    x = torch.randn(70, 64, generator=torch.Generator().manual_seed(3))  # 70 x 65,536 floats: 17.5 MiB

    def head(rows):
        return torch.ops.astrai_cpu.quant_linear(rows, packed, layout.ints(), None, True)

    first = head(x)
    want, block = first.clone(), first.data_ptr()
    second = head(x[:64])  # the first still held
    assert second.data_ptr() != block and torch.equal(first, want)
    del first
    third = head(x)  # let go: the kept block again
    assert third.data_ptr() == block and torch.equal(third, want)
    held = third[:2]
    del third
    fourth = head(x)  # a view still holds it
    assert fourth.data_ptr() != block and torch.equal(held, want[:2]) and torch.equal(fourth, want)
    del held, fourth, second
    assert head(x[:1]).data_ptr() != block  # small outputs: the allocator's own blocks
    before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    again = head(x)
    assert (
        resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before < 100
    )  # 4,480 pages written, none faulted
    assert again.data_ptr() == block and torch.equal(again, want)
