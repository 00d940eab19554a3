"""transformers' import of a GGUF file with each file's metadata parsed once.

transformers reads a GGUF's metadata with gguf's ``GGUFReader`` once for the config and again
for the weights (and a tokenizer import once more), and the reader walks every element of the
tokenizer's arrays in Python: for Gemma 3's 262,144-token vocabulary that is most of a minute of
one test on CI's machines. Inside ``reading_once()`` every ``GGUFReader(path)`` of an unchanged
file returns the reader made first: a read-only memory map of the same bytes, so transformers
sees exactly what it would read itself, in a third of the time. And the reader made slices a
plain array over its map where gguf slices the ``np.memmap`` itself (``_get``, called twice a
string: an ``np.memmap`` slice costs several times a plain one): the same bytes, the same values.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from pathlib import Path


@contextlib.contextmanager
def reading_once() -> Iterator[None]:
    """``gguf.GGUFReader`` made once per file (path, size and modification time) for the block."""
    import gguf
    import numpy as np

    real = gguf.GGUFReader
    readers: dict[tuple, object] = {}

    class Reader(real):
        def _get(self, offset, dtype, count=1, override_order=None):
            plain = self.__dict__.get("_plain")
            if plain is None:  # (the constructor sets self.data before its first _get)
                plain = self._plain = self.data.view(np.ndarray)
            count = int(count)
            arr = plain[offset : offset + np.dtype(dtype).itemsize * count].view(dtype)[:count]
            return arr.view(
                arr.dtype.newbyteorder(self.byte_order if override_order is None else override_order)
            )

    def reader(path, *args, **kwargs):
        stat = Path(path).stat()
        key = (str(Path(path).resolve()), stat.st_size, stat.st_mtime_ns, args, tuple(sorted(kwargs.items())))
        if key not in readers:
            readers[key] = Reader(path, *args, **kwargs)
        return readers[key]

    gguf.GGUFReader = reader
    try:
        yield
    finally:
        gguf.GGUFReader = real
