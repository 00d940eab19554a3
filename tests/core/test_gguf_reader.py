"""``open_gguf`` (astrai.model.gguf_reader) against gguf-py's own ``GGUFReader``: the same fields,
parts, indices and contents, array metadata read in a few passes rather than element by element."""

from __future__ import annotations

import re

import numpy as np
import pytest
from gguf import GGUFReader, GGUFWriter

from astrai.errors import ModelFormatError
from astrai.model.gguf_reader import open_gguf

TOKENS = ["<pad>", "", "a", "  ", "\u2581th\u00e9", "\U0001f600", *(f"t{i}" for i in range(500))]


def _write(path) -> None:
    writer = GGUFWriter(str(path), "llama")
    writer.add_uint32("test.scalar", 7)
    writer.add_string("test.text", "h\u00e9llo")
    writer.add_array("tokenizer.ggml.tokens", TOKENS)
    writer.add_array("tokenizer.ggml.scores", [float(-i) / 3 for i in range(len(TOKENS))])
    writer.add_array("tokenizer.ggml.token_type", [i % 5 for i in range(len(TOKENS))])
    writer.add_array("test.bools", [True, False, True])
    writer.add_array("test.nested", [[1, 2], [3]])
    writer.add_tensor("token_embd.weight", np.arange(12, dtype=np.float32).reshape(3, 4))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


def _same(ours: GGUFReader, theirs: GGUFReader) -> None:
    assert list(ours.fields) == list(theirs.fields)
    for name, mine in ours.fields.items():
        want = theirs.fields[name]
        assert (mine.offset, mine.data, mine.types) == (want.offset, want.data, want.types), name
        assert len(mine.parts) == len(want.parts), name
        for got, ref in zip(mine.parts, want.parts, strict=True):
            assert (got.dtype, got.shape, got.tobytes()) == (ref.dtype, ref.shape, ref.tobytes()), name
        assert mine.contents() == want.contents(), name
        if mine.data:
            assert mine.contents(len(mine.data) - 1) == want.contents(len(want.data) - 1), name
    assert ours.data_offset == theirs.data_offset
    assert [t.name for t in ours.tensors] == [t.name for t in theirs.tensors]
    assert all(np.array_equal(a.data, b.data) for a, b in zip(ours.tensors, theirs.tensors, strict=True))


def test_the_fields_are_gguf_pys(tmp_path) -> None:
    path = tmp_path / "meta.gguf"
    _write(path)
    ours = open_gguf(path)
    _same(ours, GGUFReader(path))
    assert ours.fields["tokenizer.ggml.tokens"].contents() == TOKENS
    assert {"test.bools", "test.nested", "tokenizer.ggml.scores"} <= set(ours.fields)


@pytest.mark.parametrize("cut", [0.3, 0.6], ids=["in-the-strings", "in-the-numbers"])
def test_an_array_cut_short_is_refused_naming_the_file(tmp_path, cut) -> None:
    full = tmp_path / "meta.gguf"
    _write(full)
    data = full.read_bytes()
    path = tmp_path / "cut.gguf"
    path.write_bytes(data[: int(len(data) * cut)])
    with pytest.raises(
        ModelFormatError, match=rf"^{re.escape(str(path))}: truncated: the file has \d+ bytes"
    ):
        open_gguf(path)


@pytest.mark.slow  # gguf-py takes seconds over the default model's 49,152-token vocabulary
def test_the_default_models_fields_are_gguf_pys(default_model_path) -> None:
    _same(open_gguf(default_model_path), GGUFReader(default_model_path))
