"""Refusing a request whose text cannot fit the context before it is validated, templated or tokenized.

No token of a tokenizer stands for more than B bytes (``max_token_bytes``: the longest token,
special tokens' text included) and no character for fewer than one byte, so a prompt of C
characters is at least C / B tokens, and none of ``L * B`` characters or more fits a context of
L tokens (``TextBound``). ``text_weight`` counts the characters that one prompt of a decoded
request must hold; ``refuse_oversized`` refuses the request when they reach the bound, and
``astrai_server.body.decode_json`` refuses a single string that does before it is even parsed.
"""

from __future__ import annotations

import weakref
from dataclasses import dataclass
from typing import Any

from astrai.errors import RequestRejected


@dataclass(frozen=True)
class TextBound:
    """No prompt of ``limit * per_token`` characters or more fits a context of ``limit`` tokens when
    no token stands for more than ``per_token`` bytes (and no character for fewer than one)."""

    limit: int
    per_token: int

    @property
    def chars(self) -> int:
        return self.limit * self.per_token

    def check(self, chars: int, one_string: bool = False) -> None:
        """RequestRejected, the context-length 400, when a text of ``chars`` characters cannot fit."""
        if chars >= self.chars:
            text = (
                f"a string of at least {chars} characters" if one_string else f"a text of {chars} characters"
            )
            raise RequestRejected(
                f"the prompt is at least {-(-chars // self.per_token)} tokens "
                f"({text}, at most {self.per_token} characters per token), "
                f"but the context limit is {self.limit} tokens "
                "(prompt plus at least one generated token)"
            )


def text_bound(engine: Any) -> TextBound | None:
    """``engine``'s bound (``engine.context_limit``, ``max_token_bytes``); None when its tokenizer
    cannot say."""
    per_token = max_token_bytes(getattr(engine, "tokenizer", None))
    return None if per_token is None else TextBound(engine.context_limit, per_token)


def refuse_oversized(body: Any, bound: TextBound, size: int) -> None:
    """RequestRejected (400, the context-length refusal) for a decoded request body whose text
    weight (``text_weight``) cannot fit, found before it is validated, templated or tokenized.
    A body of ``size`` < ``bound.chars`` bytes is not walked: its weight is at most its size."""
    if size >= bound.chars:
        bound.check(text_weight(body))


def text_weight(value: Any) -> int:
    """The characters of a decoded JSON value that one prompt holds at least: a string's length
    (whitespace included); the sum over an object's values or an array's elements, where a
    number, boolean or null counts 1 (a token id is a token; anything else in an array is
    rendered with one character at least) and 0 as an object's value (a setting: ``temperature``,
    a ``logit_bias`` entry); but the longest element of an array of strings or of arrays, which
    are alternatives (the prompts of a completion, stop strings)."""
    if isinstance(value, str):
        return len(value)
    if isinstance(value, dict):
        return sum(text_weight(v) for v in value.values() if isinstance(v, (str, list, dict)))
    if not isinstance(value, list):
        return 1
    if value and (all(isinstance(v, str) for v in value) or all(isinstance(v, list) for v in value)):
        return max(map(text_weight, value))
    return sum(map(text_weight, value))


#: ``max_token_bytes`` per tokenizer, computed once (a tokenizer that cannot be a weak key is not cached).
_MAX_TOKEN_BYTES: weakref.WeakKeyDictionary[Any, int] = weakref.WeakKeyDictionary()


def max_token_bytes(tokenizer: Any) -> int | None:
    """The most bytes one token of ``tokenizer`` stands for (special tokens' text included): its
    ``max_token_bytes()``, else ``token_bytes`` over ``range(vocab_size)``; None when it has neither."""
    try:
        return _MAX_TOKEN_BYTES[tokenizer]
    except (KeyError, TypeError):
        pass
    bulk = getattr(tokenizer, "max_token_bytes", None)  # astrai's Tokenizer: the vocabulary in bulk
    token_bytes, vocab = getattr(tokenizer, "token_bytes", None), getattr(tokenizer, "vocab_size", None)
    if callable(bulk):
        found = bulk()
    elif token_bytes is None or not isinstance(vocab, int):
        return None
    else:
        found = max((len(token_bytes(i)) for i in range(vocab)), default=1) or 1
    try:
        _MAX_TOKEN_BYTES[tokenizer] = found
    except TypeError:
        pass
    return found
