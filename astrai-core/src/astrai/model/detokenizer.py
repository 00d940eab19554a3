"""The incremental detokenizer: a token stream's text, piece by piece, never splitting a character."""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from astrai.model.tokenizer import Tokenizer


class IncrementalDecoder:
    """Turn a stream of token ids into text pieces, each made of complete characters.

    Decodes a sliding window (tokens since the last emission, plus the tokens
    before them back to the emission before) and emits the difference, as vLLM's
    detokenizer does: decoding the prefix along with the new tokens keeps
    context-dependent spacing (SentencePiece's leading "▁") right. A window whose
    text ends in U+FFFD is held: a character's bytes are split across tokens.
    ``"".join(pushes) + flush() == tokenizer.decode(all_ids, skip_special_tokens)``.
    """

    def __init__(self, tokenizer: Tokenizer, skip_special_tokens: bool = True):
        self._tokenizer = tokenizer
        self._skip = skip_special_tokens
        self._ids: list[int] = []  # tokens from the window's prefix start
        self._read = 0  # _ids[:_read] were emitted; _ids[_read:] are pending

    def _decode(self, ids: list[int]) -> str:
        return self._tokenizer.decode(ids, skip_special_tokens=self._skip)

    def push(self, token_id: int) -> str:
        """Add one token; return the text it completes ("" while a character is split)."""
        self._ids.append(int(token_id))
        prefix = self._decode(self._ids[: self._read])
        text = self._decode(self._ids)
        if len(text) <= len(prefix) or text.endswith("\ufffd"):
            return ""
        # The emitted tokens become the next window's prefix; older ones are dropped.
        del self._ids[: self._read]
        self._read = len(self._ids)
        return text[len(prefix) :]

    def flush(self) -> str:
        """Return the held text (possibly ending in U+FFFD) and reset."""
        rest = self._decode(self._ids)[len(self._decode(self._ids[: self._read])) :]
        self._ids, self._read = [], 0
        return rest
