"""A request body within bounds: read in chunks up to a limit, decoded off the event loop.

``read_body(request, limit)`` reads the body incrementally: a 413 as soon as the declared
``Content-Length`` or the bytes received pass ``limit`` (the rest is never read), ``ClientGone``
when the client hangs up before the body is complete. ``decode_json(raw)`` (run it on a worker
thread) refuses, with a 400, a body that is not UTF-8, nests arrays and objects deeper than
``MAX_DEPTH``, holds more than ``MAX_VALUES`` values, is not JSON, or holds a lone UTF-16 surrogate
(``"\\ud800"``: no text can be encoded from it, so it would fail the response instead); given the
engine's ``astrai_server.fit.TextBound``, a string too long for the context is refused before it is
parsed.
The heap a large body freed goes back to the operating system by ``astrai.malloc.trim_heap``
(the app calls it after such a body; ``astrai.malloc`` owns the allocator's settings).
"""

from __future__ import annotations

import codecs
import json
import re
from contextlib import aclosing
from typing import TYPE_CHECKING, Any

from starlette.requests import ClientDisconnect, Request

from astrai_server.errors import HTTPProblem

if TYPE_CHECKING:
    from astrai_server.fit import TextBound

#: Deepest nesting of arrays and objects accepted: real requests (a tool's JSON schema inside
#: ``tools``, a content part inside a message) stay well under it; validation, templating and
#: schema compilation recurse, and 64 levels keep them far from Python's recursion limit.
MAX_DEPTH = 64
#: Bodies above this size are decoded with Python hooks that let other threads (the event loop)
#: take the GIL while the C parser works, and are followed by ``astrai.malloc.trim_heap()``.
LARGE_BODY = 1 << 20
#: Most values (array elements, object members, arrays and objects) in one body: a JSON parser and
#: the garbage collector take time per value (a 32 MiB body of empty strings is 8 million), and a
#: prompt of token ids this long fits no context astrai serves.
MAX_VALUES = 1 << 20
_CHUNK = 1 << 20  # bytes per step: each C call on one takes a millisecond or two
_NOT_STRUCTURAL = bytes(b for b in range(256) if b not in b'"[]{},')
_NOT_CONTINUATION = bytes(
    b for b in range(256) if not 0x80 <= b < 0xC0
)  # UTF-8: one byte per character but these
_SURROGATE_ESCAPE = re.compile(rb"\\u[dD][89a-fA-F]")
_SURROGATE = re.compile("[\ud800-\udfff]")


class ClientGone(Exception):
    """The client closed the connection before its body was complete (nothing to answer)."""

    def __init__(self, received: int, declared: int | None) -> None:
        of = "" if declared is None else f" of {declared}"
        super().__init__(f"the client disconnected while sending its body ({received}{of} bytes received)")


def _too_large(limit: int, size: int | None = None) -> HTTPProblem:
    size_text = "larger than" if size is None else f"{size} bytes, more than"
    return HTTPProblem(413, f"request body is {size_text} the limit of {limit} bytes (--max-request-bytes)")


async def read_body(request: Request, limit: int) -> bytearray:
    """The whole body, at most ``limit`` bytes. Raises HTTPProblem 413 (declared or received size
    past ``limit``: nothing more is read), HTTPProblem 400 (a Content-Length that is not a number)
    or ClientGone. Gathered in one buffer as it arrives: no copy of the whole on the event loop."""
    header = request.headers.get("content-length")
    declared = None
    if header is not None:
        if not header.strip().isdigit():
            raise HTTPProblem(400, f"invalid Content-Length header: {header!r}")
        declared = int(header)
        if declared > limit:
            raise _too_large(limit, declared)
    body = bytearray()
    try:
        async with aclosing(request.stream()) as stream:
            async for chunk in stream:
                if len(body) + len(chunk) > limit:  # a chunked upload, or more than it declared
                    raise _too_large(limit)
                body += chunk
    except ClientDisconnect:
        raise ClientGone(len(body), declared) from None
    return body


def decode_json(raw: bytes | bytearray, bound: TextBound | None = None) -> Any:
    """The JSON value of ``raw``; HTTPProblem 400 when it nests deeper than ``MAX_DEPTH``, holds
    more than ``MAX_VALUES`` values, is not UTF-8, is not JSON or holds a lone surrogate; with
    ``bound``, RequestRejected (the context-length 400) first when one string is so long that it
    alone cannot fit the context. CPU-bound: call it off the event loop. Every step works on
    ``_CHUNK`` bytes at a time, so that the event loop gets the GIL in between, except the final
    parse, whose longest single string ``bound`` keeps short (the parse itself is given Python
    hooks, which let the GIL go, for each number and object)."""
    pieces, longest, escapes = _reduce(raw)
    containers = sum(p.count(b"[") + p.count(b"{") for p in pieces)  # upper bounds: strings included
    if containers > MAX_DEPTH or containers + sum(p.count(b",") for p in pieces) > MAX_VALUES:
        depth, values = _count(b"".join(pieces))
        if depth > MAX_DEPTH:
            raise HTTPProblem(400, f"request body nests arrays and objects more than {MAX_DEPTH} levels deep")
        if values > MAX_VALUES:
            raise HTTPProblem(400, f"request body holds more than {MAX_VALUES} JSON values")
    del pieces
    if bound is not None:
        bound.check(longest, one_string=True)
    text = _utf8(raw)
    try:
        hooks = _YIELDING if len(raw) > LARGE_BODY else {}
        body = json.loads(text, parse_constant=_no_constant, **hooks)
    except ValueError as e:
        raise HTTPProblem(400, f"request body is not valid JSON: {e}") from None
    del text
    if escapes:  # only an escape can write a lone surrogate
        _refuse_surrogates(body)
    return body


def _utf8(raw: bytes | bytearray) -> str:
    """``raw`` decoded as strict UTF-8 (a BOM dropped) a chunk at a time; HTTPProblem 400 naming the
    first bad byte."""
    decoder = codecs.getincrementaldecoder("utf-8-sig")("strict")
    try:
        parts = [decoder.decode(raw[i : i + _CHUNK]) for i in range(0, len(raw), _CHUNK)]
        parts.append(decoder.decode(b"", final=True))
    except UnicodeDecodeError:
        try:  # once more in one piece, for the error's position in the whole body
            bytes(raw).decode("utf-8-sig")
        except UnicodeDecodeError as e:  # strict: also refuses encoded surrogates (ED A0 80)
            raise HTTPProblem(
                400,
                "request body is not valid JSON: "
                f"not UTF-8 at byte {e.start} ({e.object[e.start]:#04x}: {e.reason})",
            ) from None
        raise
    return "".join(parts)


def _reduce(raw: bytes | bytearray) -> tuple[list[bytes], int, bool]:
    """One pass over ``raw`` in steps of about ``_CHUNK`` bytes: the bytes that give JSON its structure
    (``"[]{},``, with the escapes that could end a string early, ``\\\\`` and ``\\"``, dropped),
    the fewest characters that the longest string must hold (counted over the steps that lie
    wholly inside one string), and whether an escape may write a surrogate."""
    pieces, inside, run, longest, escapes = [], False, 0, 0, False
    start, size = 0, len(raw)
    while start < size:
        end = min(start + _CHUNK, size)
        while end < size and raw[end - 1] == 0x5C:  # never split a run of backslashes
            end += 1
        piece = whole = raw[start:end]
        backslashes = piece.count(b"\\")
        if backslashes:
            escapes = escapes or _SURROGATE_ESCAPE.search(raw, start, min(end + 5, size)) is not None
            piece = piece.replace(b"\\\\", b"").replace(b'\\"', b"")
        reduced = piece.translate(None, _NOT_STRUCTURAL)
        quotes = reduced.count(b'"')
        if inside and not quotes:  # wholly inside one string: its characters, at the least
            characters = len(whole) - len(whole.translate(None, _NOT_CONTINUATION))
            # an escape writes 1 character in up to 6 bytes per backslash
            # (\\uD83D\\uDE00: 12 bytes, 2 backslashes)
            run += max(0, characters - 6 * backslashes)
        else:
            longest, run = max(longest, run), 0
        inside ^= bool(quotes % 2)
        pieces.append(bytes(reduced))
        start = end
    return pieces, max(longest, run), escapes


def _count(text: bytes) -> tuple[int, int]:
    """``(depth, values)`` of reduced JSON (``_reduce``); stops once either passes its bound."""
    import numpy as np

    step = np.zeros(256, np.int32)
    step[[ord("["), ord("{")]], step[[ord("]"), ord("}")]] = 1, -1
    view = np.frombuffer(text, np.uint8)
    depth = peak = quotes = values = 0
    for start in range(0, len(view), _CHUNK):
        chunk = view[start : start + _CHUNK]
        seen = np.cumsum(chunk == ord('"'), dtype=np.int64) + quotes  # quotes up to each byte
        outside = seen % 2 == 0  # a closing quote counts as outside: it is no bracket or comma
        moves = np.where(outside, step[chunk], 0)
        levels = np.cumsum(moves, dtype=np.int64) + depth
        values += int(np.count_nonzero(moves > 0)) + int(np.count_nonzero(outside & (chunk == ord(","))))
        peak, depth, quotes = max(peak, int(levels.max())), int(levels[-1]), int(seen[-1])
        if peak > MAX_DEPTH or values > MAX_VALUES:
            break
    return peak, values


def structure(raw: bytes | bytearray) -> tuple[int, int]:
    """``(depth, values)`` of the JSON text ``raw``, brackets and commas inside strings not counted:
    how deep arrays and objects nest, and how many values it holds (commas plus arrays and
    objects, within one of the count for valid JSON); exact up to the bounds (``MAX_DEPTH``,
    ``MAX_VALUES``), past which the scan stops. For invalid JSON, numbers ``json.loads`` refuses anyway."""
    return _count(b"".join(_reduce(raw)[0]))


def _pairs(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    return dict(pairs)


def _int(text: str) -> int:
    return int(text)


def _float(text: str) -> float:
    return float(text)


#: ``json.loads`` hooks written in Python: each call lets a thread waiting for the GIL have it,
#: so a large body's parse never holds the event loop for long (the C parser alone would).
def _no_constant(name: str) -> Any:
    """``NaN``, ``Infinity``, ``-Infinity``: not JSON (RFC 8259), and no answer could echo them."""
    raise ValueError(f"{name} is not a JSON number")


_YIELDING: dict[str, Any] = {"object_pairs_hook": _pairs, "parse_int": _int, "parse_float": _float}


def _refuse_surrogates(body: Any) -> None:
    """HTTPProblem 400 naming the first string (a value or a key) that holds a lone surrogate."""
    stack: list[tuple[str, Any]] = [("", body)]
    while stack:
        path, value = stack.pop()
        if isinstance(value, str):
            _check_text(value, path)
        elif isinstance(value, dict):
            for key, item in value.items():
                _check_text(key, path, key=True)
                stack.append((f"{path}.{key}" if path else key, item))
        elif isinstance(value, list):
            stack.extend((f"{path}.{i}" if path else str(i), item) for i, item in enumerate(value))


def _check_text(text: str, path: str, key: bool = False) -> None:
    found = None if text.isascii() else _SURROGATE.search(text)
    if found is None:
        return
    char = f"\\u{ord(found.group()):04x}"
    if key:
        name = text.encode("utf-8", "backslashreplace").decode()
        where = f"{path}.{name}" if path else name
        raise HTTPProblem(
            400, f"invalid key {where}: a lone surrogate ({char}) is not text", param=path or None
        )
    raise HTTPProblem(400, f"{path or 'body'}: a lone surrogate ({char}) is not text", param=path or None)


def dispose(value: Any) -> None:
    """Empty a decoded JSON value's arrays and objects one element at a time (CPU-bound: call it off
    the event loop): dropping a large one at once frees it all in one C call, which holds the GIL
    for as long as it takes. Only for a value nothing else shares (a request model may)."""
    stack = [value]
    while stack:
        item = stack.pop()
        if isinstance(item, list):
            while item:
                stack.append(item.pop())
        elif isinstance(item, dict):
            while item:
                stack.append(item.popitem()[1])
