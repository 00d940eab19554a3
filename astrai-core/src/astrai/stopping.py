"""Stop strings on decoded text, matched across token boundaries, with hold-back.

A stop string may be split over several tokens, so text cannot be emitted as
soon as it is decoded: the longest suffix of the pending text that is a prefix
of some stop string is held back until the next token decides it. Text from a
matched stop string on is never emitted, streaming or not.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from astrai.model import IncrementalDecoder


def find_stop(text: str, stops: Sequence[str]) -> tuple[int, str] | None:
    """The earliest occurrence of any stop string in ``text`` as ``(index, stop)``, or None.

    When two stop strings start at the same index the longer one wins (it is the
    one a reader would say matched).
    """
    best: tuple[int, str] | None = None
    for stop in stops:
        i = text.find(stop)
        if i >= 0 and (best is None or i < best[0] or (i == best[0] and len(stop) > len(best[1]))):
            best = (i, stop)
    return best


def held_suffix_len(text: str, stops: Sequence[str]) -> int:
    """Length of the longest suffix of ``text`` that is a proper prefix of some stop string.

    Cost is bounded by the stop strings' lengths, not by ``text``.
    """
    best = 0
    for stop in stops:
        for k in range(min(len(stop) - 1, len(text)), best, -1):
            if text.endswith(stop[:k]):
                best = k
                break
    return best


class StopChecker:
    """Turns one request's sampled token ids into text that is safe to emit.

    ``push`` is called once per sampled token (not for EOS): it decodes through
    the request's ``IncrementalDecoder`` (complete UTF-8 characters only), then
    returns ``(emit, matched)``: the text that may be sent now, and the stop
    string that matched (None if none did). After a match the request is over
    and nothing more may be pushed. ``flush`` returns the held-back text when the
    request ends for another reason (EOS, max_tokens).
    Work per token is bounded by the stop strings' lengths.
    """

    def __init__(self, decoder: IncrementalDecoder, stop: Sequence[str] = ()) -> None:
        self._decoder = decoder
        self._stops = tuple(s for s in stop if s)  # an empty stop string would match everywhere
        self._held = ""

    @property
    def held(self) -> str:
        """Decoded text not emitted yet because it may start a stop string."""
        return self._held

    def push(self, token_id: int) -> tuple[str, str | None]:
        text = self._held + self._decoder.push(token_id)
        if not self._stops:
            return text, None
        hit = find_stop(text, self._stops)
        if hit is not None:
            self._held = ""
            return text[: hit[0]], hit[1]
        k = held_suffix_len(text, self._stops)
        self._held = text[len(text) - k :] if k else ""
        return text[: len(text) - k], None

    def flush(self) -> tuple[str, str | None]:
        """End of the request for another reason (EOS, max_tokens): ``(emit, matched)``.

        Emits the held-back text plus what the decoder still holds, minus a trailing
        incomplete character (U+FFFD: its remaining bytes were never generated);
        ``matched`` is a stop string that this last text completes, if any.
        """
        text = self._held + self._decoder.flush().rstrip("\ufffd")
        self._held = ""
        hit = find_stop(text, self._stops) if self._stops else None
        return (text, None) if hit is None else (text[: hit[0]], hit[1])
