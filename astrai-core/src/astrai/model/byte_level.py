"""GPT-2's byte-level BPE alphabet: which byte each character of a byte-level token stands for;
the bytes a token stands for, read from its piece or decoded."""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

__all__ = ["BYTE_OF_CHAR", "is_byte_level", "max_piece_bytes", "piece_bytes"]


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


def piece_bytes(token: str | None, byte_level: bool) -> bytes | None:
    """The bytes a vocabulary piece stands for, read from the piece itself: a byte-level piece's
    characters mapped back (``byte_level``: the tokenizer is byte-level and the token is not an
    added one), or a SentencePiece byte fallback (``<0x0A>``); b"" for no piece (an unknown id);
    None when only decoding the token says (a SentencePiece word, an added token)."""
    if token is None:
        return b""
    if byte_level:
        try:
            return bytes(BYTE_OF_CHAR[c] for c in token)
        except KeyError:  # not a byte-level piece after all
            pass
    if token.startswith("<0x") and token.endswith(">") and len(token) == 6:  # SentencePiece byte fallback
        return bytes([int(token[3:5], 16)])
    return None


def max_piece_bytes(hf: PreTrainedTokenizerBase, byte_level: Callable[[int], bool]) -> int:
    """The most bytes one token of ``hf`` stands for (at least 1), as ``piece_bytes`` reads them or,
    where it cannot, as decoding the token alone gives them (special tokens kept, no clean-up):
    every piece converted in one call and the rest decoded in one batch (0.8 s for Gemma 3's
    262,144 tokens). ``byte_level(id)``: whether that token's piece is byte-level."""
    ids = list(range(len(hf)))
    pieces = [piece_bytes(t, byte_level(i)) for i, t in enumerate(hf.convert_ids_to_tokens(ids))]
    rest = [[i] for i, piece in enumerate(pieces) if piece is None]
    backend = getattr(hf, "backend_tokenizer", None)  # what hf.decode runs, less its per-call cost
    if backend is not None:
        texts = backend.decode_batch(rest, skip_special_tokens=False)
    else:
        texts = [hf.decode(i, skip_special_tokens=False, clean_up_tokenization_spaces=False) for i in rest]
    sizes = [len(p) for p in pieces if p is not None] + [len(t.encode("utf-8")) for t in texts]
    return max(sizes, default=1) or 1
