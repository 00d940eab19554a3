"""transformers' import of a GGUF file with each file's metadata parsed once.

transformers reads a GGUF's metadata with gguf's ``GGUFReader`` once for the config and again
for the weights (and a tokenizer import once more), and the reader walks every element of the
tokenizer's arrays in Python: for Gemma 3's 262,144-token vocabulary that is most of a minute of
one test on CI's machines. Inside ``reading_once()`` every ``GGUFReader(path)`` of an unchanged
file returns the reader made first: a read-only memory map of the same bytes, so transformers
sees exactly what it would read itself, in a third of the time.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from pathlib import Path


@contextlib.contextmanager
def reading_once() -> Iterator[None]:
    """``gguf.GGUFReader`` made once per file (path, size and modification time) for the block."""
    import gguf

    real = gguf.GGUFReader
    readers: dict[tuple, object] = {}

    def reader(path, *args, **kwargs):
        stat = Path(path).stat()
        key = (str(Path(path).resolve()), stat.st_size, stat.st_mtime_ns, args, tuple(sorted(kwargs.items())))
        if key not in readers:
            readers[key] = real(path, *args, **kwargs)
        return readers[key]

    gguf.GGUFReader = reader
    try:
        yield
    finally:
        gguf.GGUFReader = real
