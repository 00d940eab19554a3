"""GGUF blocks kept quantized (astrai.model.quant): the values are gguf-py's, the tile layout round-trips."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType
from gguf.quants import dequantize as gguf_dequantize

from astrai.model.quant import (
    NATIVE,
    TILE,
    QuantizedLinear,
    QuantLayout,
    dequantize,
    narrow_bits,
    narrow_codes,
    narrow_scales,
    pack,
    split_blocks,
)

# bytes per block, block size, and the offsets of the float16 fields (kept finite below)
BLOCKS = {
    "Q4_0": (18, 32, [0]),
    "Q4_1": (20, 32, [0, 2]),
    "Q5_0": (22, 32, [0]),
    "Q5_1": (24, 32, [0, 2]),
    "Q8_0": (34, 32, [0]),
    "Q4_K": (144, 256, [0, 2]),
    "Q5_K": (176, 256, [0, 2]),
    "Q6_K": (210, 256, [208]),
}


def random_blocks(qtype: str, rows: int, k: int, seed: int = 0) -> np.ndarray:
    """Random GGUF blocks of ``qtype`` for a ``[rows, k]`` tensor (every code and sub-scale bit
    pattern possible; the float16 scales finite and of either sign)."""
    size, block, halves = BLOCKS[qtype]
    rng = np.random.default_rng(seed)
    raw = rng.integers(0, 256, size=(rows * k // block, size), dtype=np.uint8)
    for off in halves:
        raw[:, off : off + 2] = (
            rng.uniform(-0.05, 0.05, size=len(raw)).astype(np.float16).view(np.uint8).reshape(-1, 2)
        )
    return raw.reshape(rows, -1)


@pytest.mark.parametrize("qtype", sorted(NATIVE))
def test_split_blocks_gives_gguf_py_values_to_the_bit(qtype):
    rows, k = 5, 512
    raw = random_blocks(qtype, rows, k)
    codes, scales, mins = split_blocks(raw, qtype)
    spec = NATIVE[qtype]
    assert codes.shape == (rows, k) and scales.shape == (rows, k // spec.group)
    assert (mins is not None) == spec.has_min
    # scale * code, rounded, then + min: gguf-py's order of operations
    values = np.repeat(scales, spec.group, axis=1) * codes.astype(np.float32)
    if mins is not None:
        values = values + np.repeat(mins, spec.group, axis=1)
    expected = gguf_dequantize(raw, GGMLQuantizationType[qtype]).reshape(rows, k)
    np.testing.assert_array_equal(values, expected)


@pytest.mark.parametrize("qtype", sorted(NATIVE))
@pytest.mark.parametrize("rows", [16, 37])  # whole tiles, and a last tile padded with zero rows
def test_pack_and_the_reference_dequantize_round_trip(qtype, rows):
    k = 256
    raw = random_blocks(qtype, rows, k, seed=rows)
    packed, layout = pack(*split_blocks(raw, qtype), NATIVE[qtype])
    assert packed.dtype == torch.uint8 and packed.numel() == layout.nbytes
    assert layout.ints() == [
        rows,
        k,
        NATIVE[qtype].bits,
        NATIVE[qtype].group,
        int(NATIVE[qtype].has_min),
        int(NATIVE[qtype].f16_scales),
        int(NATIVE[qtype].signed),
        0,  # int8_rows: float32 activations unless switched (astrai.model.activations)
    ]
    expected = gguf_dequantize(raw, GGMLQuantizationType[qtype]).reshape(rows, k)
    np.testing.assert_array_equal(dequantize(packed, layout).numpy(), expected)


def test_file_sized_formats_keep_the_files_bits_per_weight():
    # Q4_0, Q4_1 and Q8_0 hold exactly the file's bytes (codes plus float16 scales)
    for qtype, bpw in (("Q4_0", 4.5), ("Q4_1", 5.0), ("Q8_0", 8.5)):
        size, block, _ = BLOCKS[qtype]
        assert NATIVE[qtype].bits_per_weight == bpw == size * 8 / block
        layout = QuantLayout(64, 1024, NATIVE[qtype])
        assert layout.nbytes == 64 * 1024 // block * size


# the 5- and 6-bit formats the loader widens to int8 codes, and what narrow_codes makes of them:
# (bits, signed, bits per weight: codes plus the layout's float16 or float32 scales and mins)
NARROWED = {"Q5_0": (5, True, 5.5), "Q5_1": (5, False, 6.0), "Q5_K": (5, False, 7.0), "Q6_K": (6, True, 8.0)}


@pytest.mark.parametrize("qtype", sorted(NATIVE))
@pytest.mark.parametrize("rows", [16, 37])
def test_narrow_codes_keep_every_weight_in_fewer_bits(qtype, rows):
    """An int8 layout of 5- or 6-bit codes narrowed: the same weights to the bit (the reference
    reads both), 2 to 3 bits a weight fewer; 4-bit layouts and Q8_0's codes are left as they are."""
    raw = random_blocks(qtype, rows, 256, seed=rows)
    packed, layout = pack(*split_blocks(raw, qtype), NATIVE[qtype])
    if qtype not in NARROWED:
        assert narrow_bits(packed, layout) is None
        return
    bits, signed, bpw = NARROWED[qtype]
    assert narrow_bits(packed, layout) == bits
    narrowed, lay = narrow_codes(packed, layout, bits)
    assert (lay.spec.bits, lay.spec.signed, lay.spec.bits_per_weight) == (bits, signed, bpw)
    assert (lay.n, lay.k, lay.spec.group, lay.spec.has_min) == (
        rows,
        256,
        layout.spec.group,
        layout.spec.has_min,
    )
    assert narrowed.numel() == lay.nbytes == lay.tiles * TILE * 256 * bpw / 8 < packed.numel()
    assert torch.equal(dequantize(narrowed, lay), dequantize(packed, layout))


def test_a_narrowed_codes_high_bits_are_where_the_layout_says():
    """One code of 16 (bit 4 set) at row 5, column 4 * 3 + 2 of group 1: the low nibbles are all
    zero and chunk 3's mask of group 1's record has bit 4 * 5 + 2 set, nothing else."""
    codes = np.zeros((16, 64), np.int8)
    codes[5, 32 + 4 * 3 + 2] = 16
    scales, mins = np.ones((16, 2), np.float32), np.zeros((16, 2), np.float32)
    packed, layout = pack(codes, scales, mins, NATIVE["Q5_1"])
    narrowed, lay = narrow_codes(packed, layout, narrow_bits(packed, layout))
    record = narrowed.view(2, lay.record_bytes)[1]  # group 1 of the one tile
    head = 2 * TILE * 2  # float16 scales and mins
    assert not record[head : head + 256].any()  # eight chunks of 32 bytes of low nibbles
    masks = record[head + 256 :].view(8, 8)  # a 64-bit mask per chunk
    assert int(masks[3].view(torch.int64)) == 1 << (4 * 5 + 2) and masks.count_nonzero() == 1
    assert torch.equal(dequantize(narrowed, lay), torch.from_numpy(codes).float())


# the K-quants' scales and mins as the file's factors (narrow_scales, after narrow_codes): bits a
# weight (the file's: 4.5, 5.5, 6.5625)
K_SCALED = {"Q4_K": 4.625, "Q5_K": 5.625, "Q6_K": 6.5625}


@pytest.mark.parametrize("qtype", sorted(NATIVE))
def test_narrow_scales_give_k_quants_the_files_factors_back(qtype):
    """A K-quant's float32 scales (and mins) are float16 times small integers: held as those factors
    (int8 in the records, float16 in a header per 256 columns) they give the same float32 values,
    the same weights to the bit, in about the file's bits; other formats are left as they are."""
    raw = random_blocks(qtype, 37, 512, seed=5)
    packed, layout = pack(*split_blocks(raw, qtype), NATIVE[qtype])
    bits = narrow_bits(packed, layout)
    if bits is not None:
        packed, layout = narrow_codes(packed, layout, bits)
    narrowed = narrow_scales(packed, layout)
    if qtype not in K_SCALED:
        assert narrowed is None
        return
    data, lay = narrowed
    assert lay.spec.k_scales and lay.ints()[5] == 2  # the kernels' f16_scales integer: 2
    assert lay.spec.bits_per_weight == K_SCALED[qtype]
    assert data.numel() == lay.nbytes == lay.tiles * TILE * 512 * K_SCALED[qtype] / 8
    assert torch.equal(dequantize(data, lay), dequantize(packed, layout))


def test_k_scales_sit_where_the_layout_says():
    """One tile of 256 columns of Q4_K-like groups: row 3's scales 0.5 * (1..8) and mins -0.25 * 7:
    the header holds each row's float16 factors (scales', then mins'), each record one int8 factor
    a row for each, and nothing that is not a product of the two is taken."""
    codes = np.zeros((16, 256), np.int8)
    scales = np.zeros((16, 8), np.float32)
    mins = np.zeros((16, 8), np.float32)
    scales[3] = 0.5 * np.arange(1, 9)
    mins[3] = -0.25 * 7
    packed, layout = pack(codes, scales, mins, NATIVE["Q4_K"])
    data, lay = narrow_scales(packed, layout)
    header = data[: lay.header_bytes].view(torch.float16).view(2, TILE).float()
    d, dmin = header[0, 3].item(), header[1, 3].item()
    records = data[lay.header_bytes :].view(8, lay.record_bytes)
    q = records[:, : 2 * TILE].view(torch.int8).view(8, 2, TILE)[:, :, 3].float()
    assert torch.equal(d * q[:, 0], torch.from_numpy(scales[3])) and torch.equal(
        dmin * q[:, 1], torch.from_numpy(mins[3])
    )
    assert header[:, :3].count_nonzero() == 0 and records[:, 2 * TILE :].count_nonzero() == 0
    scales[3, 5] = 0.1234567  # no float16 times an int8
    assert narrow_scales(*pack(codes, scales, mins, NATIVE["Q4_K"])) is None


def test_concat_merges_whole_tile_segments_of_one_format_and_keeps_others_apart():
    k = 64
    parts = []
    for qtype, rows in (("Q4_1", 32), ("Q4_1", 16), ("Q6_K", 16)):
        raw = random_blocks(qtype, rows, 256 if qtype == "Q6_K" else k, seed=rows)
        codes, scales, mins = split_blocks(raw, qtype)
        if qtype == "Q6_K":  # a Q6_K tensor of the same k: its first 64 columns
            codes, scales = codes[:, :k].copy(), scales[:, : k // 16].copy()
        parts.append(QuantizedLinear([pack(codes, scales, mins, NATIVE[qtype])]))
    fused = QuantizedLinear.concat(parts)
    assert [lay.n for lay in fused.layouts] == [48, 16] and fused.out_features == 64
    x = torch.randn(3, k, generator=torch.Generator().manual_seed(0))
    with torch.no_grad():  # the reference path: no kernel is installed for these CPU tensors under grad
        w = torch.cat([dequantize(p, lay) for part in parts for p, lay in part.segments]).double()
        ref, scale = x.double() @ w.t(), x.double().abs() @ w.abs().t()
        # float32 sums in another order than the float64 reference: within a few ulps of the sum of |terms|
        assert ((fused(x).double() - ref).abs() <= 1e-6 * scale + 1e-6).all()
