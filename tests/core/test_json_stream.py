"""``JsonStream``: JSON objects written in any spelling re-written, as they come, into the canonical
text ``json.dumps(..., ensure_ascii=False)`` gives them whole, every prefix of it on the way; what is
not a JSON object fails."""

from __future__ import annotations

import json
import random

import pytest

from astrai.tool_parsers.json_stream import JsonStream

SCALARS = [
    0,
    -1,
    1.5,
    1e20,
    12345678901234567890123,
    True,
    False,
    None,
    "",
    'a"b\\c\n/',
    "é😀\u0001\t",
    -0.0,
    2.5e-8,
]


def _value(rng: random.Random, depth: int = 0):
    r = rng.random()
    if depth > 3 or r < 0.3:
        return rng.choice(SCALARS)
    if r < 0.65:
        return {
            f"k{i}" + rng.choice(["", "é", '"', "😀"]): _value(rng, depth + 1)
            for i in range(rng.randint(0, 4))
        }
    return [_value(rng, depth + 1) for _ in range(rng.randint(0, 4))]


def _spell(rng: random.Random, v) -> str:
    """``v`` as some model might write it: any whitespace, \\u escapes or not, another float spelling."""
    ws = lambda: rng.choice(["", " ", "\n  ", "\t"])  # noqa: E731
    if isinstance(v, dict):
        items = ("," + ws()).join(_spell(rng, k) + ws() + ":" + ws() + _spell(rng, x) for k, x in v.items())
        return "{" + ws() + items + ws() + "}"
    if isinstance(v, list):
        return "[" + ws() + ("," + ws()).join(_spell(rng, x) for x in v) + ws() + "]"
    if isinstance(v, str):
        return json.dumps(v, ensure_ascii=rng.random() < 0.5)
    if isinstance(v, float) and rng.random() < 0.5:
        return repr(v).replace("e+", "E")
    return json.dumps(v)


def test_any_spelling_streams_to_the_canonical_text() -> None:
    rng = random.Random(0)
    for _ in range(400):
        value = {"a": _value(rng), **{f"b{i}": _value(rng) for i in range(rng.randint(0, 2))}}
        written, tail = _spell(rng, value), rng.choice(["", "\n</tool_call>", "}"])
        want = json.dumps(json.loads(written), ensure_ascii=False)
        raw, stream, got, at = written + tail, JsonStream(), "", 0
        while at < len(raw) and not stream.done:
            took, out = stream.feed(raw[at : at + rng.randint(1, 7)])
            got += out
            assert want.startswith(got), (raw, got)
            at += took
        assert stream.done and not stream.failed and got == want
        assert raw[at:] == tail  # it stops taking where the object ends


@pytest.mark.parametrize(
    "text",
    [
        '{"a":1,}',
        '{"a" 1}',
        '{"a":tru}',
        '{"a":1,"a":2}',
        "[1]",
        '"x"',
        '{"a":"\x01"}',
        '{"a":1e999}',
        '{"a":[1,]}',
    ],
)
def test_what_is_not_an_object_fails(text: str) -> None:
    stream = JsonStream()
    stream.feed(text)
    assert stream.failed and not stream.done
