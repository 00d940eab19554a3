"""Stop strings on decoded text, matched across token boundaries, with hold-back.

A stop string may be split over several tokens, so text cannot be emitted as
soon as it is decoded: the longest suffix of the pending text that is a prefix
of some stop string is held back until the next token decides it. Text from a
matched stop string on is never emitted, streaming or not.

The matching runs on the scheduler thread once per token and request, so its cost must not grow
with the number of stop strings: ``StopAutomaton`` (Aho-Corasick) reads each decoded character
once, whatever the strings; building it costs their total length, once per request (on the
submitting thread, cached for requests that send the same strings).
"""

from __future__ import annotations

from collections import deque
from collections.abc import Sequence
from functools import lru_cache
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


class StopAutomaton:
    """The stop strings of a request as an Aho-Corasick automaton: immutable, shared by requests that
    send the same strings.

    A state is the longest suffix of the text read so far that is a prefix of some stop string
    (``depth`` characters of it): exactly the text a checker must hold back. ``longest[s]`` is the
    length of the longest stop string that ends at state ``s`` (0: none), ``ends[s]`` that string.
    """

    def __init__(self, stops: Sequence[str]) -> None:
        self.stops = tuple(
            dict.fromkeys(s for s in stops if s)
        )  # an empty stop string would match everywhere
        goto: list[dict[str, int]] = [{}]
        depth, ends = [0], [""]
        for stop in self.stops:
            state = 0
            for ch in stop:
                nxt = goto[state].get(ch)
                if nxt is None:
                    nxt = goto[state][ch] = len(goto)
                    goto.append({})
                    depth.append(depth[state] + 1)
                    ends.append("")
                state = nxt
            ends[state] = stop
        fail = [0] * len(goto)
        longest = [len(e) for e in ends]
        queue = deque(goto[0].values())
        while queue:  # breadth first: a state's failure link is shallower, so already final
            state = queue.popleft()
            if not ends[state]:
                longest[state], ends[state] = longest[fail[state]], ends[fail[state]]
            for ch, nxt in goto[state].items():
                f = fail[state]
                while f and ch not in goto[f]:
                    f = fail[f]
                fail[nxt] = goto[f].get(ch, 0) if goto[f].get(ch, 0) != nxt else 0
                queue.append(nxt)
        self.goto, self.fail, self.depth, self.longest, self.ends = goto, fail, depth, longest, ends

    def scan(self, state: int, text: str, offset: int = 0) -> tuple[int, tuple[int, str] | None]:
        """Read ``text`` from ``state``: the state after it, and the earliest match that ends in it as
        ``(index, stop)`` (the index counted from ``offset`` characters before ``text``; the longer
        stop on a tie), or None. Linear in ``len(text)``."""
        goto, fail, longest = self.goto, self.fail, self.longest
        best: tuple[int, str] | None = None
        for i, ch in enumerate(text):
            while state and ch not in goto[state]:
                state = fail[state]
            state = goto[state].get(ch, 0)
            n = longest[state]
            if n:  # a later end with an earlier (or equal: then longer) start wins
                start = offset + i + 1 - n
                if best is None or start <= best[0]:
                    best = (start, self.ends[state])
        return state, best


@lru_cache(maxsize=256)
def stop_automaton(stops: tuple[str, ...]) -> StopAutomaton:
    """The automaton of ``stops``, shared by the requests (the ``n`` choices of one) that send them."""
    return StopAutomaton(stops)


class StopChecker:
    """Turns one request's sampled token ids into text that is safe to emit.

    ``push`` is called once per sampled token (not for EOS): it decodes through
    the request's ``IncrementalDecoder`` (complete UTF-8 characters only), then
    returns ``(emit, matched)``: the text that may be sent now, and the stop
    string that matched (None if none did). After a match the request is over
    and nothing more may be pushed. ``flush`` returns the held-back text when the
    request ends for another reason (EOS, max_tokens).
    Work per token is linear in the text it decodes, whatever the number of stop strings
    (``StopAutomaton``); the same matches as ``find_stop`` over the held and new text.
    """

    def __init__(self, decoder: IncrementalDecoder, stop: Sequence[str] = ()) -> None:
        self._decoder = decoder
        self._automaton = stop_automaton(tuple(stop)) if stop else None
        self._state = 0
        self._held = ""
        self.decoded = ""  # the text the last pushed token decoded to, before any hold-back

    @property
    def held(self) -> str:
        """Decoded text not emitted yet because it may start a stop string."""
        return self._held

    def push(self, token_id: int) -> tuple[str, str | None]:
        piece = self.decoded = self._decoder.push(token_id)
        return self._read(piece)

    def flush(self) -> tuple[str, str | None]:
        """End of the request for another reason (EOS, max_tokens): ``(emit, matched)``.

        Emits the held-back text plus what the decoder still holds, minus a trailing
        incomplete character (U+FFFD: its remaining bytes were never generated);
        ``matched`` is a stop string that this last text completes, if any.
        """
        text, matched = self._read(self._decoder.flush().rstrip("\ufffd"))
        if matched is None:
            text, self._held = text + self._held, ""
        return text, matched

    def _read(self, piece: str) -> tuple[str, str | None]:
        held = self._held
        if self._automaton is None:
            return piece, None
        self._state, hit = self._automaton.scan(self._state, piece, len(held))
        text = held + piece
        if hit is not None:
            self._held = ""
            return text[: hit[0]], hit[1]
        k = self._automaton.depth[self._state]
        self._held = text[len(text) - k :] if k else ""
        return text[: len(text) - k], None
