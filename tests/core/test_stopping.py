"""Stop strings across token boundaries, hold-back, and UTF-8 holding (no model needed)."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from astrai.model import IncrementalDecoder
from astrai.stopping import StopChecker, find_stop, held_suffix_len


def checker(tokenizer, stop):
    return StopChecker(IncrementalDecoder(tokenizer), stop)


def feed(chk, ids):
    """Push ids until a stop matches; returns (emitted pieces, matched, held text after each push)."""
    pieces, helds = [], []
    for i in ids:
        piece, matched = chk.push(i)
        pieces.append(piece)
        helds.append(chk.held)
        if matched is not None:
            return pieces, matched, helds
    return pieces, None, helds


def test_find_stop_takes_the_earliest_start_and_the_longer_on_a_tie():
    assert find_stop("xxabcab", ["ab", "ca"]) == (2, "ab")
    assert find_stop("xxabcab", ["bc", "abc"]) == (2, "abc")
    assert find_stop("hello", ["z"]) is None


@pytest.mark.parametrize(
    ("text", "stops", "held"),
    [("hello wo", ["world"], 2), ("hello w", ["world", "o wx"], 3), ("abc", ["d"], 0), ("aaa", ["aab"], 2)],
)
def test_held_suffix_is_the_longest_stop_prefix(text, stops, held):
    assert held_suffix_len(text, stops) == held


def test_stop_string_split_over_tokens_is_never_emitted(tiny_tokenizer):
    ids = tiny_tokenizer.encode("the stop here")
    # "the stop here" -> th|e |st|o|p| h|er|e: "stop" spans three tokens
    assert [tiny_tokenizer.decode([i]) for i in ids][2:5] == ["st", "o", "p"]
    pieces, matched, helds = feed(checker(tiny_tokenizer, ["stop"]), ids)
    assert matched == "stop"
    assert "".join(pieces) == "the "
    assert helds[2:4] == ["st", "sto"]  # held while it could still become "stop"


def test_held_text_that_turns_out_not_to_stop_is_released(tiny_tokenizer):
    ids = tiny_tokenizer.encode("the stoat")
    chk = checker(tiny_tokenizer, ["stop"])
    pieces, matched, _ = feed(chk, ids)
    assert matched is None
    assert "".join(pieces) + chk.flush()[0] == "the stoat"


@settings(max_examples=60, deadline=None)
@given(text=st.text("abc d", max_size=30), stop=st.text("abc d", min_size=1, max_size=4))
def test_emitted_text_is_the_text_before_the_first_stop(tiny_tokenizer, text, stop):
    ids = tiny_tokenizer.encode(text)
    chk = checker(tiny_tokenizer, [stop])
    pieces, matched, helds = feed(chk, ids)
    cut = text.find(stop)
    emitted = "".join(pieces)
    if cut >= 0:
        assert (emitted, matched) == (text[:cut], stop)
    else:
        assert matched is None
        assert emitted + chk.flush()[0] == text
    for held in helds:  # only a proper prefix of the stop string is ever held
        assert len(held) < len(stop) and stop.startswith(held)


def test_multibyte_characters_are_held_until_complete(tiny_tokenizer):
    ids = tiny_tokenizer.encode("a\u00e9\U0001f600b")  # é = 2 bytes, 😀 = 4 bytes, one token per byte
    assert len(ids) == 1 + 2 + 4 + 1
    chk = checker(tiny_tokenizer, [])
    pieces = [chk.push(i)[0] for i in ids]
    assert pieces == ["a", "", "\u00e9", "", "", "", "\U0001f600", "b"]


def test_flush_drops_an_incomplete_trailing_character(tiny_tokenizer):
    ids = tiny_tokenizer.encode("ok\U0001f600")[:-2]  # the emoji's last two bytes never come
    chk = checker(tiny_tokenizer, [])
    assert "".join(chk.push(i)[0] for i in ids) == "ok"
    assert chk.flush() == ("", None)


def test_stop_string_of_multibyte_characters(tiny_tokenizer):
    ids = tiny_tokenizer.encode("x\u4e2d\u6587y")
    pieces, matched, _ = feed(checker(tiny_tokenizer, ["\u6587"]), ids)
    assert (matched, "".join(pieces)) == ("\u6587", "x\u4e2d")


class _Pieces:
    """An ``IncrementalDecoder`` stand-in that returns the given pieces, one per push."""

    def __init__(self, pieces: list[str]) -> None:
        self.pieces = iter(pieces)

    def push(self, token_id: int) -> str:
        return next(self.pieces)

    def flush(self) -> str:
        return ""


def _reference(pieces: list[str], stops: list[str]) -> tuple[list[str], str | None, list[str]]:
    """What the checker emits per piece, by ``find_stop`` and ``held_suffix_len`` over the held and new
    text (the definition the automaton must reproduce)."""
    out, helds, held = [], [], ""
    for piece in pieces:
        text = held + piece
        hit = find_stop(text, stops)
        if hit is not None:
            out.append(text[: hit[0]])
            helds.append("")
            return out, hit[1], helds
        k = held_suffix_len(text, stops)
        held = text[len(text) - k :] if k else ""
        out.append(text[: len(text) - k])
        helds.append(held)
    return out, None, helds


@settings(max_examples=300, deadline=None)
@given(
    pieces=st.lists(st.text("abcd", max_size=5), max_size=12),
    stops=st.lists(st.text("abcd", min_size=1, max_size=5), min_size=1, max_size=6),
)
def test_the_automaton_matches_what_find_stop_defines(pieces, stops):
    """Several stop strings sharing prefixes and suffixes (``ab``, ``abc``, ``bc``, ...), pieces of any
    length: the same emitted text, held text and match as the per-string definition."""
    chk = StopChecker(_Pieces(pieces), stops)
    got, matched, helds = [], None, []
    for i in range(len(pieces)):
        piece, matched = chk.push(i)
        got.append(piece)
        helds.append(chk.held)
        if matched is not None:
            break
    assert (got, matched, helds) == _reference(pieces, stops)


def test_many_stop_strings_cost_what_the_text_costs():
    """10,000 stop strings: each character read walks the automaton once (failure links amortised), so
    a token's work does not grow with the strings' number; the states are their shared prefixes."""
    stops = [f"stop-{i:05d}" for i in range(10_000)]
    automaton = StopChecker(_Pieces([]), stops)._automaton
    assert len(automaton.goto) == 1 + len("stop-") + sum(10**k for k in range(5))  # a trie of 0xxxx
    state, hit = automaton.scan(0, "xx stop-0999 and stop-04321 yy")
    assert hit == (17, "stop-04321") and automaton.depth[state] == 0
