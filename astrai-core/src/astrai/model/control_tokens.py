"""Control-token strings inside chat content are plain text: a message cannot forge ``<|im_end|>``.

The chat template's own markers are the only control tokens of a templated prompt. Every
control-token string found in the conversation's strings (content, roles, names, tool-call
arguments, tool results, tool definitions, dict keys included) is wrapped in two markers that
carry a random nonce of the rendering, so the client cannot type them; the rendered text is
then split on the markers: what the template wrote is encoded as usual, each wrapped string as
plain text (the tokenizer's pipeline without its added tokens). A conversation with no such
string is encoded in one piece, exactly as before.
"""

from __future__ import annotations

import functools
import re
import secrets
from typing import Any

from astrai.errors import RequestRejected

__all__ = ["ContentMarks", "control_tokens"]


def control_tokens(hf: Any) -> tuple[str, ...]:
    """The added-token strings content may not produce as tokens, longest first.

    Every special added token, and the non-special ones the chat template's source spells
    (Qwen's ``<tool_call>``), whitespace-only ones excepted (templates write those as text).
    """
    template = str(getattr(hf, "chat_template", None) or "")
    found = {
        t.content
        for t in hf.added_tokens_decoder.values()
        if t.content and (t.special or (t.content in template and not t.content.isspace()))
    }
    return tuple(sorted(found, key=len, reverse=True))


@functools.lru_cache(maxsize=8)
def _alternatives(tokens: tuple[str, ...]) -> re.Pattern[str]:
    """A regex of any of ``tokens`` (longest first, so a token wins over the tokens it contains)."""
    return re.compile("|".join(map(re.escape, tokens)) or "(?!)")  # (?!) never matches


class ContentMarks:
    """The markers of one rendering: :meth:`wrap` marks control-token strings in the chat's
    inputs, :meth:`split` finds them again in the rendered text.

    Markers are lowercase ASCII letters and hex digits, so JSON escaping, ``trim`` or
    ``lower`` in a template leave them whole; a template that cuts a marked string apart
    (``content.split('</think>')``) leaves lone markers, which :meth:`split` drops.
    """

    def __init__(self, tokens: tuple[str, ...]) -> None:
        nonce = secrets.token_hex(8)
        self.open, self.close = f"astraiopen{nonce}", f"astraiclose{nonce}"
        self._tokens = _alternatives(tokens)
        self.count = 0  # control-token strings wrapped so far

    def _mark(self, match: re.Match[str]) -> str:
        self.count += 1
        return f"{self.open}{match.group(0)}{self.close}"

    def wrap(self, obj: Any) -> Any:
        """A copy of ``obj`` (strings, lists, tuples and dicts, keys included) with every
        control-token string wrapped in the markers; other values are kept as they are."""
        if isinstance(obj, str):
            return self._tokens.sub(self._mark, obj)
        if isinstance(obj, dict):
            return {self.wrap(k): self.wrap(v) for k, v in obj.items()}
        if isinstance(obj, (list, tuple)):
            return [self.wrap(v) for v in obj]
        return obj

    def split(self, text: str) -> list[str | None]:
        """``[template text, content token, template text, ...]``: the pieces of a rendering of
        wrapped inputs; a lone marker gives ``None`` in a content token's place."""
        markers = re.compile(f"{self.open}({self._tokens.pattern}){self.close}|{self.open}|{self.close}")
        return markers.split(text)

    def encode(self, tokenizer: Any, rendered: str) -> list[int]:
        """Ids of ``rendered`` (a rendering of wrapped inputs): template text through
        ``tokenizer.encode``, its control tokens included, content tokens through
        ``tokenizer.encode_plain``. Raises RequestRejected for a control-token string the
        vocabulary cannot spell as plain text (it would come back as the control token)."""
        pieces = self.split(rendered)
        ids = tokenizer.encode(pieces[0])
        newline = tokenizer.encode("\n")
        for i, piece in enumerate(pieces[1:], start=1):
            if not piece:
                continue
            plain = i % 2 == 1
            encode = tokenizer.encode_plain if plain else tokenizer.encode
            # Encoded after a newline that is then dropped: a SentencePiece tokenizer would
            # otherwise prefix the piece with the space it gives the start of a text.
            piece_ids = encode("\n" + piece)
            piece_ids = piece_ids[len(newline) :] if piece_ids[: len(newline)] == newline else encode(piece)
            if plain and tokenizer.hf.convert_tokens_to_ids(piece) in piece_ids:
                raise RequestRejected(
                    f"the content holds {piece!r}, which this tokenizer cannot encode as plain text"
                )
            ids += piece_ids
        return ids
