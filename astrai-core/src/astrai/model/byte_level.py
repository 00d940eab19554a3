"""GPT-2's byte-level BPE alphabet: which byte each character of a byte-level token stands for."""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

__all__ = ["BYTE_OF_CHAR", "is_byte_level"]


def _bytes_to_unicode() -> dict[str, int]:
    """GPT-2's byte-level alphabet, inverted: the character each byte is written as -> the byte."""
    printable = [*range(ord("!"), ord("~") + 1), *range(0xA1, 0xAC + 1), *range(0xAE, 256)]
    chars, extra = {}, 0
    for b in range(256):
        if b in printable:
            chars[chr(b)] = b
        else:
            chars[chr(256 + extra)] = b
            extra += 1
    return chars


BYTE_OF_CHAR = _bytes_to_unicode()  # the character each byte is written as -> the byte


def is_byte_level(hf: PreTrainedTokenizerBase) -> bool:
    """Whether the backend tokenizer decodes with the byte-level (GPT-2) decoder."""
    backend = getattr(hf, "backend_tokenizer", None)
    decoder = getattr(backend, "decoder", None)
    return decoder is not None and "ByteLevel" in type(decoder).__name__ + repr(decoder)[:200]
