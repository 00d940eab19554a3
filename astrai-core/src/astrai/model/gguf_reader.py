"""``open_gguf``: gguf-py's ``GGUFReader`` over a memory map, fast on large metadata arrays.

gguf-py reads a metadata array one element at a time, each element its own small ndarray made
through several numpy calls: Gemma 3's tokenizer (262,144 tokens, their scores and their types)
took it about 5 s to parse. ``_MappedReader`` reads a numeric array with one slice and walks a
string array's length prefixes with ``struct``, then hands gguf-py the very parts it would have
made (a one-element array per number; a length and a byte view per string), so that
``ReaderField.contents`` and every other use of the reader see what gguf-py gives.
"""

from __future__ import annotations

import struct
from pathlib import Path
from typing import Any

import numpy as np
from gguf import GGUFReader, GGUFValueType

from astrai.errors import ModelFormatError, ModelNotFound

__all__ = ["open_gguf"]

_LENGTH = struct.Struct("=Q")  # a string's length prefix, in the host's order (byte_order "I")


class _Truncated(ValueError):
    """gguf-py asked for bytes past the end of the file (its slices would come back short)."""

    def __init__(self, end: int) -> None:
        super().__init__(f"data runs to byte {end}")
        self.end = end


class _MappedReader(GGUFReader):
    """A GGUFReader whose buffer is a plain ndarray view of the file's memory map.

    gguf-py slices ``reader.data`` once per metadata element (100k+ for a
    tokenizer); on a plain ndarray that is about 3x faster than on np.memmap.
    The view still maps the file: nothing is read until a tensor is used.
    Every slice is checked against the file's end, so that a truncated file
    is named as such rather than failing a reshape deep inside gguf-py.
    """

    @property
    def data(self) -> np.ndarray:
        return self._buf

    @data.setter
    def data(self, value: np.ndarray) -> None:
        self._buf = value.view(np.ndarray)

    def _get(self, offset: int, dtype: Any, count: int = 1, override_order: Any = None) -> np.ndarray:
        end = int(offset) + np.dtype(dtype).itemsize * int(count)
        if end > len(self._buf):
            raise _Truncated(end)
        return super()._get(offset, dtype, count, override_order)

    def _get_field_parts(
        self, orig_offs: int, raw_type: int
    ) -> tuple[int, list[np.ndarray], list[int], list]:
        """gguf-py's parts of one field; arrays of numbers or strings in a few passes instead of
        several numpy calls per element (the same parts, indices and types as gguf-py's)."""
        if raw_type != GGUFValueType.ARRAY or self.byte_order != "I":
            return super()._get_field_parts(orig_offs, raw_type)
        raw_itype = self._get(orig_offs, np.uint32)
        length = self._get(orig_offs + 4, np.uint64)
        itype, count, offs = GGUFValueType(int(raw_itype[0])), int(length[0]), orig_offs + 12
        types = [GGUFValueType.ARRAY] + [itype] * (count > 0)  # gguf-py: the item type from the first item
        scalar = self.gguf_scalar_to_np.get(itype)
        if scalar is not None:
            values = self._get(offs, scalar, count)
            parts = [raw_itype, length, *values.reshape(count, 1)]
            return 12 + int(values.nbytes), parts, list(range(2, 2 + count)), types
        if itype != GGUFValueType.STRING:  # arrays of arrays: gguf-py's own way
            return super()._get_field_parts(orig_offs, raw_type)
        buf, size, u64 = self._buf, len(self._buf), np.dtype(np.uint64)
        view, unpack = memoryview(buf), _LENGTH.unpack_from
        parts = [raw_itype, length]
        for _ in range(count):
            if offs + 8 > size:
                raise _Truncated(offs + 8)
            (n,) = unpack(view, offs)
            if offs + 8 + n > size:
                raise _Truncated(offs + 8 + n)
            parts += (buf[offs : offs + 8].view(u64), buf[offs + 8 : offs + 8 + n])
            offs += 8 + n
        return offs - orig_offs, parts, list(range(3, 3 + 2 * count, 2)), types


def open_gguf(path: str | Path) -> GGUFReader:
    """Parse a GGUF file's header; raises ModelNotFound when it is missing or not GGUF, and
    ModelFormatError when it is cut short (its header or tensor data past the end of the file)."""
    try:
        return _MappedReader(path)
    except _Truncated as e:
        size = Path(path).stat().st_size
        raise ModelFormatError(
            f"{path}: truncated: the file has {size} bytes, but its tensor table or data runs to byte "
            f"{e.end} (an incomplete download or copy?)"
        ) from None
    except (OSError, ValueError, KeyError, IndexError) as e:
        raise ModelNotFound(f"{path}: not a readable GGUF file ({e})") from e
