"""``astrai_cpu::lora_apply`` (the CPU backend's ``lora`` kernel) against ``lora_reference`` and a
row-by-row formula: rows of several adapters and of none in one call, runs long enough for its
tiled path (4 rows a read of the weights) and single rows, parts of different ranks, float32 and bf16 rows, adapters kept in float32, float16 or bf16."""

from __future__ import annotations

import pytest
import torch
from torch import nn


def _module(slots: int = 3):
    from astrai.lora import LoraLinear, LoraSet

    torch.manual_seed(0)
    lora = LoraSet(slots)
    mod = LoraLinear(nn.Linear(64, 96, bias=False), lora)
    parts0 = [  # two parts, ranks 4 and 8 (zero-padded to 8), a gap of columns left alone
        (0, 32, torch.randn(4, 64), torch.randn(32, 4)),
        (48, 96, torch.randn(8, 64), torch.randn(48, 8)),
    ]
    parts1 = [(0, 96, torch.randn(16, 64), torch.randn(96, 16))]
    mod.set_slot(0, parts0)
    mod.set_slot(1, parts1)  # slot 2: no update in this module
    return lora, mod, {0: parts0, 1: parts1, 2: []}


def _by_rows(y: torch.Tensor, x: torch.Tensor, slots: list[int], parts: dict) -> torch.Tensor:
    out = y.float().clone()
    for t, s in enumerate(slots):
        for o0, o1, a, b in parts.get(s, []) if s >= 0 else []:
            out[t, o0:o1] += b @ (a @ x[t].float())
    return out


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_lora_apply_equals_the_reference_and_leaves_base_rows_alone(cpu_kernels, dtype):
    from astrai.lora import lora_reference

    lora, mod, parts = _module()
    slots = [0] * 20 + [1, -1, 0, 2, 1, -1] + [1] * 17 + [-1] * 3
    lora.bind(slots, [1] * len(slots))
    x = torch.randn(len(slots), 64).to(dtype)
    y = torch.randn(len(slots), 96).to(dtype)
    kernel_out = y.clone()
    torch.ops.astrai_cpu.lora_apply(kernel_out, x, lora.rows, mod.a, mod.b, mod.spans)
    reference = lora_reference(y.clone(), x, mod)
    formula = _by_rows(y, x, slots, parts)
    tol = 1e-4 if dtype == torch.float32 else 5e-2
    torch.testing.assert_close(kernel_out.float(), formula, atol=tol * 10, rtol=tol)
    torch.testing.assert_close(reference.float(), formula, atol=tol * 10, rtol=tol)
    untouched = [t for t, s in enumerate(slots) if s in (-1, 2)]
    assert torch.equal(kernel_out[untouched], y[untouched])  # no adapter, or none in this module
    zeros = [t for t, s in enumerate(slots) if s == 0]
    assert torch.equal(kernel_out[zeros, 32:48], y[zeros, 32:48])  # the columns slot 0's parts leave


@pytest.mark.parametrize("store", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("width", [96, 1030])  # 1030: a lone row's work split over the threads
def test_adapters_kept_in_16_bits_give_their_widened_values_update_exactly(cpu_kernels, store, width):
    """``lora_dtype`` float16 / bfloat16: the kernel widens the stored weights exactly and sums as it
    does in float32, so its result is bit for bit the float32 kernel's on the widened weights, for
    runs in tiles, single rows, and a lone row split over the threads (over 16,384 weights)."""
    from astrai.lora import LoraLinear, LoraSet

    torch.manual_seed(1)
    parts = [
        (0, 40, torch.randn(8, 64), torch.randn(40, 8)),
        (48, width, torch.randn(16, 64), torch.randn(width - 48, 16)),
    ]
    mods = {}
    for dtype in (store, torch.float32):
        lora = LoraSet(2, dtype)
        mods[dtype] = LoraLinear(nn.Linear(64, width, bias=False), lora)
        mods[dtype].set_slot(
            1, [(o0, o1, a.to(store).float(), b.to(store).float()) for o0, o1, a, b in parts]
        )
    assert mods[store].a[1].dtype == store and torch.equal(mods[store].a[1].float(), mods[torch.float32].a[1])
    for slots in ([1] * 18 + [-1, 1], [1]):
        x, y = torch.randn(len(slots), 64), torch.randn(len(slots), width)
        outs = []
        for mod in mods.values():
            mod.lora.bind(slots, [1] * len(slots))
            out = y.clone()
            torch.ops.astrai_cpu.lora_apply(out, x, mod.lora.rows, mod.a, mod.b, mod.spans)
            outs.append(out)
        assert torch.equal(outs[0], outs[1])
        stored = {1: [(o0, o1, a.to(store).float(), b.to(store).float()) for o0, o1, a, b in parts]}
        torch.testing.assert_close(outs[0], _by_rows(y, x, slots, stored), atol=1e-3, rtol=1e-4)


def test_a_rows_result_does_not_depend_on_its_batch(cpu_kernels):
    """Single rows and the same rows in a run of their adapter: the same update to float32's
    rounding (tiles and row loops sum in different orders)."""
    lora, mod, _ = _module()
    x = torch.randn(24, 64)
    y = torch.randn(24, 96)
    alone = y.clone()
    lora.bind([1] * 24, [1] * 24)
    torch.ops.astrai_cpu.lora_apply(alone, x, lora.rows, mod.a, mod.b, mod.spans)
    mixed = y.clone()
    lora.bind([1, -1] * 12, [1] * 24)
    torch.ops.astrai_cpu.lora_apply(mixed, x, lora.rows, mod.a, mod.b, mod.spans)
    torch.testing.assert_close(mixed[::2], alone[::2], atol=1e-4, rtol=1e-5)


def test_the_kernel_refuses_what_does_not_fit(cpu_kernels):
    lora, mod, _ = _module()
    lora.bind([0, 1], [1, 1])
    with pytest.raises(RuntimeError, match="weights are not what the module's input takes"):
        torch.ops.astrai_cpu.lora_apply(
            torch.zeros(2, 96), torch.zeros(2, 32), lora.rows, mod.a, mod.b, mod.spans
        )
    with pytest.raises(RuntimeError, match="rows int32"):
        torch.ops.astrai_cpu.lora_apply(
            torch.zeros(2, 96), torch.zeros(2, 64), lora.rows.long(), mod.a, mod.b, mod.spans
        )


@pytest.mark.parametrize("store", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("qtype", ["Q4_1", "Q8_0"])
def test_quantized_linear_with_its_updates_in_one_region_is_lora_apply_after_it(cpu_kernels, store, qtype):
    """``quant_linear_lora`` (the whole-step kernel's way for up to 15 rows: the base product and
    the rows' updates in one parallel region) gives ``quant_linear`` then ``lora_apply``, to the
    bit: a lone row, several rows of several adapters, of none and of a slot without an update
    here, on one thread and two, in the model's dtypes; 16 rows go to lora_apply's tiles."""
    from astrai.lora import LoraLinear, LoraSet
    from astrai.model.quant import NATIVE, pack, split_blocks
    from tests.core.test_quant import random_blocks

    if not torch.ops.astrai_cpu.has_quant_linear():
        pytest.skip("the quantized kernels need a build for AVX512-BF16 or AVX2 + FMA")
    n, k = 1030, 256  # parts that end inside a tile and inside a thread's columns
    packed, layout = pack(*split_blocks(random_blocks(qtype, n, k, 0), qtype), NATIVE[qtype])
    torch.manual_seed(0)
    mod = LoraLinear(nn.Linear(k, n, bias=False), LoraSet(3, store))
    mod.set_slot(
        0,
        [
            (0, 40, torch.randn(8, k), torch.randn(40, 8)),
            (48, n, torch.randn(16, k), torch.randn(n - 48, 16)),
        ],
    )
    mod.set_slot(1, [(0, n, torch.randn(3, k), torch.randn(n, 3))])  # rank 3: A's last rows one by one
    dtypes = [torch.float32] + ([torch.bfloat16] if torch.ops.astrai_cpu.has_quant_linear_bf16() else [])
    threads = torch.get_num_threads()
    try:
        for count in sorted({1, 2, threads}):
            torch.set_num_threads(count)
            for slots in ([0], [1], [2], [-1, 0], [0, 1, -1, 2, 1, 0, 0, 1], [0] * 15, [1] * 16):
                for dtype in dtypes:
                    x, bias = torch.randn(len(slots), k).to(dtype), torch.randn(n).to(dtype)
                    rows = torch.tensor(slots, dtype=torch.int32)
                    want = torch.ops.astrai_cpu.quant_linear(x, packed, layout.ints(), bias)
                    torch.ops.astrai_cpu.lora_apply(want, x, rows, mod.a, mod.b, mod.spans)
                    got = torch.ops.astrai_cpu.quant_linear_lora(
                        x, packed, layout.ints(), bias, rows, mod.a, mod.b, mod.spans
                    )
                    assert torch.equal(got, want), (count, slots, dtype)
    finally:
        torch.set_num_threads(threads)


def test_a_slot_is_kept_in_the_kernel_blocks_and_plain_views_give_it_back(cpu_kernels):
    """``set_slot``'s blocks: A's rows in groups of 4 with 16 columns of each side by side, B in
    blocks of 16 output columns, each part from a block, rank and widths padded with zeros;
    ``plain_a``/``plain_b`` undo them. Widths that are no multiple of 16 (input 70, parts of 20 and
    30 columns) and rank 3 give the kernel's update the formula's, for single rows and a run in tiles."""
    from astrai.lora import LoraLinear, LoraSet, plain_a, plain_b

    torch.manual_seed(2)
    parts = [
        (0, 20, torch.randn(3, 70), torch.randn(20, 3)),
        (25, 55, torch.randn(2, 70), torch.randn(30, 2)),
    ]
    mod = LoraLinear(nn.Linear(70, 55, bias=False), LoraSet(2))
    mod.set_slot(1, parts)
    a, b = mod.a[1], mod.b[1]
    assert a.shape == (2, 5, 4, 16) and b.shape == (
        2 + 2,
        4,
        16,
    )  # rank 3 -> 4; 20 -> 32 and 30 -> 32 columns
    assert mod.spans[1].tolist() == [[0, 20, 0], [25, 55, 32]]
    for g, k, i, lane in [(0, 0, 0, 0), (0, 3, 2, 5), (1, 4, 1, 5), (1, 2, 1, 9)]:
        row, col = 4 * g + i, 16 * k + lane
        part, r = divmod(row, 4)
        assert a[g, k, i, lane] == (parts[part][2][r, col] if r < parts[part][2].shape[0] else 0.0)
    assert torch.equal(a[:, 4, :, 6:], torch.zeros(2, 4, 10))  # columns past the input's 70
    assert b[1, 2, 3] == parts[0][3][16 + 3, 2] and b[2, 1, 15] == parts[1][3][15, 1]
    assert torch.equal(b[1, :, 4:], torch.zeros(4, 12)) and torch.equal(b[:, 3], torch.zeros(4, 16))
    dense_a, dense_b = plain_a(a, 70), plain_b(b)
    assert torch.equal(dense_a[:3], parts[0][2]) and torch.equal(dense_a[4:6], parts[1][2])
    assert torch.equal(dense_b[:3, :20], parts[0][3].t()) and torch.equal(dense_b[:2, 32:62], parts[1][3].t())
    for slots in ([1, -1, 1], [1] * 17 + [-1]):
        mod.lora.bind(slots, [1] * len(slots))
        x, y = torch.randn(len(slots), 70), torch.randn(len(slots), 55)
        out = y.clone()
        torch.ops.astrai_cpu.lora_apply(out, x, mod.lora.rows, mod.a, mod.b, mod.spans)
        want = _by_rows(y, x, slots, {1: parts})
        torch.testing.assert_close(out, want, atol=1e-4, rtol=1e-5)
        assert torch.equal(out[:, 20:25], y[:, 20:25])  # the columns between the parts
