"""GGUF-quantized weights kept quantized: astrai's tile layout, its reference, and the modules.

A GGUF block holds 32 or 256 weights as small integer codes with float scales (and, in some
formats, mins): weight = scale * code + min. ``split_blocks`` reads a tensor's blocks into
codes, scales and mins (numpy, vectorised, following gguf-py's dequantization so that the
values are gguf-py's to the bit); ``pack`` lays them out in tiles for the kernels:

- a tile is 16 output rows (the last one padded with zero rows); the packed tensor is the
  tiles one after the other, each its ``k / group`` group records in order;
- a group record covers ``group`` input columns (32; 16 for Q6_K, whose scales are per 16)
  of the tile's 16 rows: 16 scales (float16 where the file's are, else float32), 16 mins when
  the format has them, then the codes;
- 4-bit codes: ``group / 4`` chunks of 32 bytes; byte ``2j + e`` of chunk ``c`` holds row
  ``j``'s code for column ``4c + e`` in its low nibble and for column ``4c + 2 + e`` in its high
  nibble (signed formats store ``code & 15`` of a code in -8..7);
- 8-bit codes (int8): ``group / 2`` chunks of 32 bytes; byte ``2j + e`` of chunk ``c`` is row
  ``j``'s code for column ``2c + e``;
- 5- and 6-bit codes (``narrow_codes``: layouts with 8-bit activations only, whose kernel reads
  them): the code as unsigned (signed codes plus 16 or 32), its low four bits as the 4-bit codes
  are, then per chunk ``c`` of those (columns ``4c`` to ``4c + 3``) one 64-bit little-endian mask
  per high bit (bit 4, then bit 5 for 6-bit codes): its bit ``4j + e`` is that bit of row ``j``'s
  code for column ``4c + e`` (the byte that code takes in the kernel's operand);
- K-quant factors (``narrow_scales``, ``QuantSpec.k_scales``; 8-bit activations only): the scales
  (and mins) as the file holds them, a float16 times a small integer: each record's 16 scales
  (then 16 mins) as int8 factors, and before the records of each super-block of 256 columns a
  header of the 16 rows' float16 factors (scales', then mins'); the kernels' ``f16_scales`` integer
  is 2.

One 32-byte load expands to the operands of the AVX512-BF16 dot instruction for 16 outputs
(astrai-backend-cpu's ``csrc/quant.cpp``). What each GGUF type becomes (``NATIVE``): Q4_0,
Q4_1 and Q8_0 keep the file's own bits (4.5, 5 and 8.5 bits per weight); Q4_K keeps its
4-bit codes with its sub-block scales and mins multiplied out to float32 at load (6 bits per
weight, the file's 4.5); Q5_0, Q5_1, Q5_K and Q6_K widen their 5- and 6-bit codes to int8
(8.5 to 10 bits per weight, the file's 5.5 to 6.6). When the model switches to 8-bit activations
on a kernel that reads them, the codes go back to 5 and 6 bits (``narrow_codes``) and a K-quant's
scales and mins to the file's factors (``narrow_scales``): about the file's bits (Q4_K 4.625, Q5_0
5.5, Q5_1 6, Q5_K 5.625, Q6_K 6.5625). Other types (F32, F16, BF16, Q2_K, Q3_K) are dequantized at load as before.

``QuantizedLinear`` and ``QuantizedEmbedding`` hold the packed weights (one copy) and run on a
plugin's ``quant_linear`` kernel (``astrai.extension.fused``); ``dequantize`` is the
reference (torch), for the tests and for devices without the kernel.

Over 300 lines because the layout, its reader from every GGUF block format, its reference
and the modules that hold it document one another and change together.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import NamedTuple

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from astrai.extension.fused import kernel_for

TILE = 16
SUPER = 256  # a K-quant's super-block of columns


@dataclass(frozen=True)
class QuantSpec:
    """How a GGUF type is kept: code width, group size, mins, float16 scales, signed 4-bit codes."""

    bits: int
    group: int
    has_min: bool
    f16_scales: bool
    signed: bool = False
    #: a K-quant's scales (and mins) as two factors (``narrow_scales``): int8 in each record, float16
    #: in a header before each super-block of 256 columns
    k_scales: bool = False

    @property
    def bits_per_weight(self) -> float:
        if self.k_scales:
            return self.bits + (8 / self.group + 16 / SUPER) * (1 + self.has_min)
        scale = 16 if self.f16_scales else 32
        return self.bits + scale * (1 + self.has_min) / self.group


NATIVE: dict[str, QuantSpec] = {
    "Q4_0": QuantSpec(4, 32, False, True, signed=True),
    "Q4_1": QuantSpec(4, 32, True, True),
    "Q8_0": QuantSpec(8, 32, False, True),
    "Q4_K": QuantSpec(4, 32, True, False),
    "Q5_0": QuantSpec(8, 32, False, True),
    "Q5_1": QuantSpec(8, 32, True, True),
    "Q5_K": QuantSpec(8, 32, True, False),
    "Q6_K": QuantSpec(8, 16, False, False),
}


@dataclass(frozen=True)
class QuantLayout:
    """A packed weight's shape and format (``ints()``: the kernels' layout argument)."""

    n: int
    k: int
    spec: QuantSpec
    #: float32 rows quantized to int8 per group for the products (``use_int8_activations``)
    int8_rows: bool = False

    @property
    def tiles(self) -> int:
        return -(-self.n // TILE)

    @property
    def scale_bytes(self) -> int:
        s = self.spec
        return TILE * (1 if s.k_scales else 2 if s.f16_scales else 4)

    @property
    def record_bytes(self) -> int:
        s = self.spec
        return self.scale_bytes * (1 + s.has_min) + TILE * s.group * s.bits // 8

    @property
    def header_bytes(self) -> int:
        """``k_scales``: the float16 factors before each super-block's records."""
        return TILE * 2 * (1 + self.spec.has_min) if self.spec.k_scales else 0

    @property
    def nbytes(self) -> int:
        groups = self.k // self.spec.group
        return self.tiles * (
            groups * self.record_bytes + groups * self.spec.group // SUPER * self.header_bytes
        )

    def ints(self) -> list[int]:
        s = self.spec
        return [
            self.n,
            self.k,
            s.bits,
            s.group,
            int(s.has_min),
            2 if s.k_scales else int(s.f16_scales),
            int(s.signed),
            int(self.int8_rows),
        ]


class QuantWeight(NamedTuple):
    """A weight kept quantized by the GGUF loader: the tile layout, its layout, the file's type."""

    packed: torch.Tensor
    layout: QuantLayout
    qtype: str

    def dense(self, dtype: torch.dtype) -> torch.Tensor:
        return dequantize(self.packed, self.layout).to(dtype)


# ----------------------------------------------------------------- reading GGUF blocks
def _nibbles(qs: np.ndarray, half: int) -> np.ndarray:
    """``[..., half]`` bytes -> ``[..., 2 * half]``: the low nibbles, then the high ones (ggml's order)."""
    return np.concatenate([qs & 0x0F, qs >> 4], axis=-1)


def _f16(b: np.ndarray) -> np.ndarray:
    return np.ascontiguousarray(b).view(np.float16).astype(np.float32)


def _k_scale_min(scales: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Q4_K/Q5_K's 12 bytes of 6-bit sub-block scales and mins -> two ``[nb, 8]`` uint8 arrays."""
    s = scales.reshape(-1, 3, 4)
    d, m, md = s[:, 0], s[:, 1], s[:, 2]
    sc = np.concatenate([d & 0x3F, (md & 0x0F) | ((d >> 2) & 0x30)], axis=-1)
    mn = np.concatenate([m & 0x3F, (md >> 4) | ((m >> 2) & 0x30)], axis=-1)
    return sc, mn


def split_blocks(raw: np.ndarray, qtype: str) -> tuple[np.ndarray, np.ndarray, np.ndarray | None]:
    """A tensor's GGUF blocks (uint8, ``[rows, bytes]``) -> codes ``[rows, k]`` int8, scales and
    mins ``[rows, k / group]`` float32 (mins ``None`` when the format has none)."""
    rows = raw.shape[0]
    b = np.ascontiguousarray(raw, dtype=np.uint8).reshape(rows, -1)
    if qtype in ("Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0"):
        size = {"Q4_0": 18, "Q4_1": 20, "Q5_0": 22, "Q5_1": 24, "Q8_0": 34}[qtype]
        blk = b.reshape(-1, size)
        d = _f16(blk[:, 0:2])
        m = _f16(blk[:, 2:4]) if qtype in ("Q4_1", "Q5_1") else None
        off = 4 if m is not None else 2
        if qtype == "Q8_0":
            codes = blk[:, 2:].view(np.int8)
        else:
            if qtype in ("Q5_0", "Q5_1"):
                qh = np.ascontiguousarray(blk[:, off : off + 4]).view(np.uint32)
                high = ((qh >> np.arange(32, dtype=np.uint32)) & 1).astype(np.uint8)
                off += 4
            codes = _nibbles(blk[:, off : off + 16], 16)
            if qtype in ("Q5_0", "Q5_1"):
                codes = codes | (high << 4)
            codes = codes.astype(np.int8)
            if qtype == "Q4_0":
                codes = codes - np.int8(8)
            elif qtype == "Q5_0":
                codes = codes - np.int8(16)
        scales, mins = d[:, :1], None if m is None else m[:, :1]
    elif qtype in ("Q4_K", "Q5_K"):
        size = 144 if qtype == "Q4_K" else 176
        blk = b.reshape(-1, size)
        d, dmin = _f16(blk[:, 0:2]), _f16(blk[:, 2:4])
        sc, mn = _k_scale_min(blk[:, 4:16])
        scales = d * sc.astype(np.float32)  # gguf-py's products, float32
        mins = -(dmin * mn.astype(np.float32))
        if qtype == "Q4_K":
            qs = blk[:, 16:].reshape(-1, 4, 32)
            codes = np.concatenate([qs & 0x0F, qs >> 4], axis=-1).reshape(-1, 256)
        else:
            qh, qs = blk[:, 16:48], blk[:, 48:].reshape(-1, 4, 32)
            low = np.concatenate([qs & 0x0F, qs >> 4], axis=-1).reshape(-1, 8, 32)
            high = (qh.reshape(-1, 1, 32) >> np.arange(8, dtype=np.uint8).reshape(1, 8, 1)) & 1
            codes = (low | (high << 4)).reshape(-1, 256)
        codes = codes.astype(np.int8)
    elif qtype == "Q6_K":
        blk = b.reshape(-1, 210)
        ql, qh = blk[:, :128].reshape(-1, 2, 64), blk[:, 128:192].reshape(-1, 2, 32)
        sc = blk[:, 192:208].view(np.int8).astype(np.float32)
        d = _f16(blk[:, 208:210])
        scales, mins = d * sc, None
        low = np.concatenate([ql & 0x0F, ql >> 4], axis=-1).reshape(-1, 2, 4, 32)
        high = (qh.reshape(-1, 2, 1, 32) >> np.array([0, 2, 4, 6], dtype=np.uint8).reshape(1, 1, 4, 1)) & 3
        codes = ((low | (high << 4)).astype(np.int8) - np.int8(32)).reshape(-1, 256)
    else:
        raise ValueError(f"no quantized layout for GGUF type {qtype}")
    codes = codes.reshape(rows, -1)
    groups = codes.shape[1] // NATIVE[qtype].group
    scales = np.ascontiguousarray(scales, np.float32).reshape(rows, groups)
    if mins is not None:
        mins = np.ascontiguousarray(mins, np.float32).reshape(rows, groups)
    return codes, scales, mins


def pack(
    codes: np.ndarray, scales: np.ndarray, mins: np.ndarray | None, spec: QuantSpec
) -> tuple[torch.Tensor, QuantLayout]:
    """Codes ``[n, k]`` int8 and scales/mins ``[n, k / group]`` -> the tile layout (uint8) and its layout."""
    n, k = codes.shape
    g, tiles = spec.group, -(-n // TILE)
    pad = tiles * TILE - n

    def rows(a: np.ndarray) -> np.ndarray:
        return np.pad(a, ((0, pad), (0, 0))) if pad else a

    c = rows(codes).reshape(tiles, TILE, k // g, g)
    if spec.bits == 4:
        c = (c.astype(np.uint8) & 0x0F).reshape(tiles, TILE, k // g, g // 4, 2, 2)  # column 4c + 2h + e
        byte = c[..., 0, :] | (c[..., 1, :] << 4)  # [t, j, g, c, e]
        code_bytes = byte.transpose(0, 2, 3, 1, 4).reshape(tiles, k // g, -1)
    else:
        c = c.reshape(tiles, TILE, k // g, g // 2, 2)  # column 2c + e
        code_bytes = c.transpose(0, 2, 3, 1, 4).reshape(tiles, k // g, -1).view(np.uint8)
    dtype = np.float16 if spec.f16_scales else np.float32

    def per_tile(a: np.ndarray) -> np.ndarray:
        # float16 scales come from float16 fields: the conversion back is exact
        return rows(a).astype(dtype).reshape(tiles, TILE, k // g).transpose(0, 2, 1).copy().view(np.uint8)

    parts = (
        [per_tile(scales)] + ([per_tile(mins)] if spec.has_min else []) + [np.ascontiguousarray(code_bytes)]
    )
    packed = np.concatenate(parts, axis=-1).reshape(-1)
    layout = QuantLayout(n, k, spec)
    assert packed.size == layout.nbytes
    return torch.from_numpy(packed), layout


def dequantize(packed: torch.Tensor, layout: QuantLayout) -> torch.Tensor:
    """The reference: the weight ``[n, k]`` in float32 (scale * code, rounded, + min), in torch."""
    codes, scales, mins = unpack(packed, layout)
    w = codes.float() * scales.repeat_interleave(layout.spec.group, dim=1)
    if mins is not None:
        w = w + mins.repeat_interleave(layout.spec.group, dim=1)
    return w


def unpack(
    packed: torch.Tensor, layout: QuantLayout
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """A packed weight's integer codes ``[n, k]`` (int16, signed formats' as signed), its scales and
    mins ``[n, k // group]`` (float32; mins ``None`` where the format has none)."""
    s, n, k = layout.spec, layout.n, layout.k
    groups, ssz = k // s.group, 2 if s.f16_scales else 4
    if s.k_scales:
        return _unpack_k_scales(packed, layout)
    rec = packed.view(layout.tiles, groups, layout.record_bytes)
    sdt = torch.float16 if s.f16_scales else torch.float32
    scales = rec[..., : TILE * ssz].contiguous().view(sdt).float()  # [t, g, 16]
    off = TILE * ssz
    mins = None
    if s.has_min:
        mins = rec[..., off : off + TILE * ssz].contiguous().view(sdt).float()
        off += TILE * ssz
    raw = rec[..., off:].contiguous()
    if s.bits in (5, 6):
        return _unpack_narrow(raw, layout, scales, mins)
    if s.bits == 4:
        b = raw.view(layout.tiles, groups, s.group // 4, TILE, 2)  # [t, g, c, j, e]
        lo, hi = (b & 0x0F).to(torch.int16), (b >> 4).to(torch.int16)
        if s.signed:
            lo, hi = torch.where(lo >= 8, lo - 16, lo), torch.where(hi >= 8, hi - 16, hi)
        codes = torch.stack([lo, hi], dim=3)  # [t, g, c, h, j, e]: column 4c + 2h + e
        codes = codes.permute(0, 4, 1, 2, 3, 5).reshape(layout.tiles * TILE, k)
    else:
        b = raw.view(torch.int8).view(layout.tiles, groups, s.group // 2, TILE, 2)  # [t, g, c, j, e]
        codes = b.permute(0, 3, 1, 2, 4).reshape(layout.tiles * TILE, k).to(torch.int16)
    if mins is not None:
        mins = mins.permute(0, 2, 1).reshape(-1, groups)[:n]
    return codes[:n], scales.permute(0, 2, 1).reshape(-1, groups)[:n], mins


def _unpack_narrow(raw: torch.Tensor, layout: QuantLayout, scales: torch.Tensor, mins: torch.Tensor | None):
    """``unpack`` of 5- and 6-bit codes: the low nibbles, then each chunk's masks of the high bits."""
    s, n, k = layout.spec, layout.n, layout.k
    groups, chunks = k // s.group, s.group // 4
    low = raw[..., : chunks * 32].reshape(layout.tiles, groups, chunks, TILE, 2)  # [t, g, c, j, e]
    codes = torch.stack([low & 0x0F, low >> 4], dim=4).to(torch.int16)  # [t, g, c, j, h, e]: 4c + 2h + e
    masks = raw[..., chunks * 32 :].reshape(layout.tiles, groups, chunks, s.bits - 4, 8)
    shifts = torch.arange(8, dtype=torch.uint8)
    for b in range(s.bits - 4):  # bit 4j + 2h + e of the chunk's mask
        bits = (masks[..., b, :, None] >> shifts) & 1  # [t, g, c, 8 bytes, 8 bits]: bit 8i + l
        codes += bits.reshape(layout.tiles, groups, chunks, TILE, 2, 2).to(torch.int16) << (4 + b)
    if s.signed:
        codes -= 1 << (s.bits - 1)
    codes = codes.permute(0, 3, 1, 2, 4, 5).reshape(layout.tiles * TILE, k)
    if mins is not None:
        mins = mins.permute(0, 2, 1).reshape(-1, groups)[:n]
    return codes[:n], scales.permute(0, 2, 1).reshape(-1, groups)[:n], mins


def _unpack_k_scales(packed: torch.Tensor, layout: QuantLayout):
    """``unpack`` of ``k_scales`` layouts: the records' codes as ``unpack`` reads them, the scales
    and mins the float32 products of their two factors (exact)."""
    s, tiles = layout.spec, layout.tiles
    per, supers = SUPER // s.group, layout.k // SUPER
    blocks = packed.view(tiles, supers, layout.header_bytes + per * layout.record_bytes)
    header = blocks[..., : layout.header_bytes].contiguous().view(torch.float16).float()
    header = header.view(tiles, supers, 1 + s.has_min, 1, TILE)  # [t, super, scales|mins, 1, row]
    rec = blocks[..., layout.header_bytes :].reshape(tiles, supers, per, layout.record_bytes)
    factors = rec[..., : TILE * (1 + s.has_min)].contiguous().view(torch.int8).float()
    factors = factors.view(tiles, supers, per, 1 + s.has_min, TILE).transpose(2, 3)
    values = (
        (header * factors).permute(0, 1, 3, 2, 4).reshape(tiles, supers * per, -1)
    )  # [t, g, (1 + min) * 16]
    plain = replace(s, k_scales=False, f16_scales=False)
    flat = QuantLayout(layout.n, layout.k, plain)
    records = torch.cat(
        [
            values.contiguous().view(torch.uint8),
            rec[..., TILE * (1 + s.has_min) :].reshape(tiles, supers * per, -1),
        ],
        -1,
    )
    return unpack(records.reshape(-1).contiguous(), flat)


def _factor(values: np.ndarray) -> tuple[np.ndarray, np.ndarray] | None:
    """Rows of ``values`` ``[N, m]`` (float32) as ``d * q`` exactly: float16 ``d [N]`` times int8
    ``q [N, m]`` (what a K-quant's scales are); None where some row has no such factors."""
    big = np.abs(values).max(-1)
    d = np.zeros(len(values), np.float16)
    q = np.zeros(values.shape, np.int8)
    todo = np.flatnonzero(big > 0)
    # the largest value's factor: the formats' usual ones first (6-bit scales, Q6_K's int8), then any
    for c in [63, -63, 127, 128, -127, -128, *range(1, 129), *range(-1, -129, -1)]:
        if todo.size == 0:
            return d, q
        dc = (big[todo] / np.float32(c)).astype(np.float16)
        df, v = dc.astype(np.float32), values[todo]
        with np.errstate(divide="ignore", invalid="ignore", over="ignore"):
            qc = np.rint(v / df[:, None])
            ok = (df != 0) & np.isfinite(df) & ((qc >= -128) & (qc <= 127)).all(-1)
            ok[ok] = (qc[ok] * df[ok, None] == v[ok]).all(-1)  # (exact: a float16 times an int8)
        d[todo[ok]], q[todo[ok]] = dc[ok], qc[ok].astype(np.int8)
        todo = todo[~ok]
    return (d, q) if todo.size == 0 else None


def narrow_scales(packed: torch.Tensor, layout: QuantLayout) -> tuple[torch.Tensor, QuantLayout] | None:
    """A K-quant layout's float32 scales (and mins) back to the file's two factors (``k_scales``):
    int8 ones in the records, float16 ones in a header per super-block of 256 columns; the same
    float32 values (their products are exact), 1.4 bits a weight fewer (Q4_K 6 -> 4.625 bits, Q5_K
    in 5-bit codes 7 -> 5.625, Q6_K in 6-bit codes 8 -> 6.5625: the file's sizes). None for other
    layouts, or where some super-block's values are no such products."""
    s = layout.spec
    if s.f16_scales or s.k_scales or layout.k % SUPER or SUPER % s.group:
        return None
    tiles, per, supers = layout.tiles, SUPER // s.group, layout.k // SUPER
    parts = 1 + s.has_min
    rec = packed.view(tiles, supers, per, layout.record_bytes).numpy()
    values = rec[..., : TILE * 4 * parts].copy().view(np.float32).reshape(tiles, supers, per, parts, TILE)
    values = values.transpose(0, 1, 3, 4, 2)  # [t, super, scales|mins, row, group]
    factored = _factor(np.ascontiguousarray(values).reshape(-1, per))
    if factored is None:
        return None
    d, q = (
        factored[0].reshape(tiles, supers, parts, TILE),
        factored[1].reshape(tiles, supers, parts, TILE, per),
    )
    header = d.reshape(tiles, supers, parts * TILE).view(np.uint8)
    factors = q.transpose(0, 1, 4, 2, 3).reshape(tiles, supers, per, parts * TILE).view(np.uint8)
    records = np.concatenate([factors, rec[..., TILE * 4 * parts :]], axis=-1).reshape(tiles, supers, -1)
    out = replace(layout, spec=replace(s, k_scales=True))
    narrowed = np.concatenate([header, records], axis=-1).reshape(-1)
    assert narrowed.size == out.nbytes
    return torch.from_numpy(narrowed), out


def narrow_bits(packed: torch.Tensor, layout: QuantLayout) -> int | None:
    """The 5 or 6 bits that every code of an 8-bit layout fits (``narrow_codes``), or None: 5 for
    groups of 32 (codes -16..15, or 0..31 with mins: Q5_0, Q5_1, Q5_K), 6 for groups of 16 (-32..31:
    Q6_K); None for other layouts and codes (Q8_0's)."""
    s = layout.spec
    if s.bits != 8:
        return None
    rec = packed.view(layout.tiles, layout.k // s.group, layout.record_bytes)
    head = TILE * (2 if s.f16_scales else 4) * (1 + s.has_min)
    lo, hi = (int(v) for v in torch.aminmax(rec[..., head:].view(torch.int8)))
    if s.group == 32 and ((0 <= lo and hi <= 31) if s.has_min else (-16 <= lo and hi <= 15)):
        return 5
    if s.group == 16 and not s.has_min and -32 <= lo and hi <= 31:
        return 6
    return None


def narrow_codes(packed: torch.Tensor, layout: QuantLayout, bits: int) -> tuple[torch.Tensor, QuantLayout]:
    """An 8-bit layout's codes in ``bits`` (5 or 6, ``narrow_bits``): the same codes, scales and
    mins (so the same products, to the bit), 2.5 or 2 bits a weight fewer to read. Straight from
    the records, without the ``[n, k]`` codes."""
    s = layout.spec
    groups, chunks = layout.k // s.group, s.group // 4
    head = TILE * (2 if s.f16_scales else 4) * (1 + s.has_min)
    rec = packed.view(layout.tiles, groups, layout.record_bytes).numpy()
    signed = not s.has_min
    codes = rec[..., head:].view(np.int8).reshape(layout.tiles, groups, chunks, 2, TILE, 2)  # 4c + 2h + e
    u = (codes.astype(np.int16) + ((1 << (bits - 1)) if signed else 0)).astype(np.uint8)
    low = (u[:, :, :, 0] & 0x0F) | ((u[:, :, :, 1] & 0x0F) << 4)  # [t, g, c, j, e]
    high = u.transpose(0, 1, 2, 4, 3, 5)  # [t, g, c, j, h, e]: bit 4j + 2h + e
    masks = [np.packbits((high >> b) & 1, axis=None, bitorder="little") for b in range(4, bits)]
    masks = np.stack([m.reshape(layout.tiles, groups, chunks, 8) for m in masks], axis=3)
    parts = [rec[..., :head], low.reshape(layout.tiles, groups, -1), masks.reshape(layout.tiles, groups, -1)]
    spec = replace(s, bits=bits, signed=signed)
    out = replace(layout, spec=spec)
    narrowed = np.concatenate(parts, axis=-1).reshape(-1)
    assert narrowed.size == out.nbytes
    return torch.from_numpy(narrowed), out


# ----------------------------------------------------------------- the modules
class QuantizedLinear(nn.Module):
    """An ``nn.Linear`` (no grad) whose weight stays in the tile layout: ``segments`` of rows, each
    ``(packed, layout)`` (a fused projection whose parts differ in type keeps one per part).

    ``float_out`` (an LM head): float32 outputs, every row on ``quant_linear`` (bf16 rows: the
    float32 sums are not rounded to bf16, where two logits a few hundredths apart would tie).
    Otherwise rows up to the kernel's ``max_rows`` (decode) run on ``quant_linear``; more rows
    (prefill) run on the kernel's ``wide`` where it has one (astrai-backend-cpu's float32 rows: the
    weight dequantized to float32 into torch's sgemm; bf16 rows without AMX:
    tiles of the weight dequantized in turn, as the bf16 model holds them, each used by every
    row while it is in the cache), else dequantize the whole weight to the input's dtype
    (``quant_weight_t``) and take oneDNN's GEMM. Without a kernel for the input's device, the
    reference ``dequantize`` (also for a dtype the kernel does not list in its ``dtypes``).
    """

    def __init__(
        self, segments: list[tuple[torch.Tensor, QuantLayout]], bias: torch.Tensor | None = None
    ) -> None:
        super().__init__()
        self.in_features = segments[0][1].k
        self.out_features = sum(lay.n for _, lay in segments)
        self.layouts = [lay for _, lay in segments]
        for i, (packed, _) in enumerate(segments):
            self.register_buffer(f"packed{i}", packed, persistent=False)
        self.bias = None if bias is None else nn.Parameter(bias, requires_grad=False)
        self.float_out = False

    @property
    def segments(self) -> list[tuple[torch.Tensor, QuantLayout]]:
        return [(getattr(self, f"packed{i}"), lay) for i, lay in enumerate(self.layouts)]

    @classmethod
    def concat(cls, parts: list[QuantizedLinear]) -> QuantizedLinear:
        """Row-wise concatenation (a fused projection); adjacent segments of one format whose rows
        fill whole tiles merge into one."""
        merged: list[tuple[torch.Tensor, QuantLayout]] = []
        for part in parts:
            for packed, lay in part.segments:
                if (
                    merged
                    and merged[-1][1].spec == lay.spec
                    and merged[-1][1].k == lay.k
                    and merged[-1][1].int8_rows == lay.int8_rows
                    and merged[-1][1].n % TILE == 0
                ):
                    prev, prev_lay = merged[-1]
                    merged[-1] = (torch.cat([prev, packed]), replace(prev_lay, n=prev_lay.n + lay.n))
                else:
                    merged.append((packed, lay))
        biases = [p.bias for p in parts]
        present = [b for b in biases if b is not None]
        bias = None
        if present:
            bias = torch.cat(
                [
                    b.detach() if b is not None else torch.zeros(p.out_features, dtype=present[0].dtype)
                    for p, b in zip(parts, biases, strict=True)
                ]
            )
        return cls(merged, bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        rows = x if x.dim() == 2 else x.reshape(-1, x.shape[-1])
        kernel = kernel_for("quant_linear", rows)
        if kernel is not None and rows.dtype not in getattr(kernel, "dtypes", (rows.dtype,)):
            kernel = None  # a kernel for other dtypes (float32 only on AVX2): the reference
        outs, n0 = [], 0
        for packed, lay in self.segments:
            bias = None if self.bias is None else self.bias[n0 : n0 + lay.n].to(rows.dtype)
            n0 += lay.n
            if kernel is not None and self.float_out:
                outs.append(kernel(rows, packed, lay.ints(), bias, float_out=True))
                continue
            # int8 rows (astrai.model.activations) stay on the kernel at any width: a row's
            # quantized product must not change with the rows beside it
            if kernel is not None and (rows.shape[0] <= kernel.max_rows or lay.int8_rows):
                outs.append(kernel(rows, packed, lay.ints(), bias))  # the bias added before the one rounding
                continue
            wide = getattr(kernel, "wide", None) if kernel is not None else None
            if wide is not None:  # many rows: tile after tile dequantized (as the bf16 model holds it)
                outs.append(wide(rows, packed, lay.ints(), bias))
                continue
            # many rows: the whole weight dequantized once (as the bf16 model holds it), oneDNN's GEMM
            wt = (
                kernel.weight_t(packed, lay.ints(), rows.dtype)
                if kernel is not None
                else dequantize(packed, lay).to(rows.dtype).t()
            )
            outs.append(torch.matmul(rows, wt) if bias is None else torch.addmm(bias, rows, wt))
        y = outs[0] if len(outs) == 1 else torch.cat(outs, dim=1)
        return y if x.dim() == 2 else y.view(*x.shape[:-1], self.out_features)

    def extra_repr(self) -> str:
        kinds = ", ".join(f"{lay.n}x{lay.k} {lay.spec.bits}-bit" for lay in self.layouts)
        return f"in_features={self.in_features}, out_features={self.out_features}, {kinds}"


class QuantizedEmbedding(nn.Module):
    """An ``nn.Embedding`` on a quantized table (the tile layout): rows dequantized on lookup."""

    def __init__(self, packed: torch.Tensor, layout: QuantLayout, dtype: torch.dtype) -> None:
        super().__init__()
        self.register_buffer("packed", packed, persistent=False)
        self.layout, self.dtype = layout, dtype
        self.num_embeddings, self.embedding_dim = layout.n, layout.k

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        kernel = kernel_for("quant_linear", self.packed)
        flat = ids.reshape(-1)
        if kernel is not None:
            rows = kernel.rows(self.packed, self.layout.ints(), flat, self.dtype)
        else:
            rows = F.embedding(flat, dequantize(self.packed, self.layout)).to(self.dtype)
        return rows.view(*ids.shape, self.embedding_dim)

    def as_linear(self) -> QuantizedLinear:
        """The tied LM head on the same packed table (no copy)."""
        return QuantizedLinear([(self.packed, self.layout)])


# ----------------------------------------------------------------- into a model
_FUSED_GROUPS = (("q_proj", "k_proj", "v_proj"), ("gate_proj", "up_proj"))


def install_quantized(model: nn.Module, state: dict, dtype: torch.dtype) -> dict[str, torch.Tensor]:
    """Put ``state``'s ``QuantWeight``s into ``model`` as quantized modules; returns the dense rest.

    A projection that is fused with others (q/k/v, gate/up) stays quantized only if they all
    are; otherwise its weight is dequantized to ``dtype`` with theirs. A tied LM head shares
    the quantized embedding table; a quantized LM head gives float32 logits (``float_out``).
    """
    quant = {name: w for name, w in state.items() if isinstance(w, QuantWeight)}
    dense = {name: w for name, w in state.items() if not isinstance(w, QuantWeight)}
    for name in list(quant):
        prefix, _, proj = name.removesuffix(".weight").rpartition(".")
        group = next((g for g in _FUSED_GROUPS if proj in g), (proj,))
        if any(f"{prefix}.{p}.weight" not in quant for p in group):
            dense[name] = quant.pop(name).dense(dtype)
    for name, w in quant.items():
        path = name.removesuffix(".weight")
        parent_name, _, attr = path.rpartition(".")
        parent = model.get_submodule(parent_name)
        old = getattr(parent, attr)
        if isinstance(old, nn.Embedding):
            setattr(parent, attr, QuantizedEmbedding(w.packed, w.layout, dtype))
        else:
            bias = None if old.bias is None else torch.zeros(w.layout.n, dtype=dtype)
            setattr(parent, attr, QuantizedLinear([(w.packed, w.layout)], bias))
    embed = model.get_submodule("model.embed_tokens")
    if getattr(model.config, "tie_word_embeddings", False):
        if isinstance(embed, QuantizedEmbedding):
            model.lm_head = embed.as_linear()
        dense.pop("lm_head.weight", None)
    if isinstance(model.lm_head, QuantizedLinear):  # logits in float32, as the kernel sums them
        model.lm_head.float_out = True
    return dense
