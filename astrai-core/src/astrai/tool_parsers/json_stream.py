"""``JsonStream``: a JSON object as the model writes it, re-written as it comes in the canonical text
``json.dumps(value, ensure_ascii=False)`` gives the whole of it.

A call's arguments stream to the client as deltas of one string, and the string the call ends with
is the canonical encoding of the decoded arguments (whatever whitespace or number spelling the model
used). Each character fed either extends that text at once (punctuation, a string's characters,
keys) or waits for what completes it (a number or literal until the character after it, an escape
until its last hex digit, a high surrogate until its low half), so the text out so far is always a
prefix of the final encoding.

Anything that is not JSON, a top-level value that is not an object, a key given twice (``json.loads``
keeps the first position but the last value: not a prefix any more), or a number that decodes to
infinity ends the stream as ``failed``: the caller keeps what went out and treats the rest as text.
"""

from __future__ import annotations

import json

__all__ = ["JsonStream"]

_WS = " \t\n\r"
_SCALAR = set("+-.0123456789eEtrufalsn")
_ESCAPES = {'"': '"', "\\": "\\", "/": "/", "b": "\b", "f": "\f", "n": "\n", "r": "\r", "t": "\t"}


def _canon(ch: str) -> str:
    """One decoded character as ``json.dumps(..., ensure_ascii=False)`` writes it inside a string."""
    return json.dumps(ch, ensure_ascii=False)[1:-1]


class JsonStream:
    """Feed the text of one JSON object (``feed``); ``done`` once it closed, ``failed`` on anything
    else. ``feed`` returns how much of the text it took (all of it, unless the object closed before
    its end) and the canonical text that it adds."""

    def __init__(self) -> None:
        # a stack of open containers: [kind, state, keys seen (objects)]; state is one of
        # "first" (just opened), "key", "colon", "value", "next" (after a value: "," or the close)
        self.stack: list[list] = []
        self.started = False
        self.done = False
        self.failed = False
        self.string: str | None = None  # None: not in a string; else "key" or "value"
        self.key = ""  # the key being read
        self.escape: str | None = None  # an escape being read, after its backslash
        self.high: str | None = None  # a high surrogate waiting for its low half
        self.scalar = ""  # a number or literal being read

    def feed(self, text: str) -> tuple[int, str]:
        out: list[str] = []
        for i, ch in enumerate(text):
            if self.done or self.failed:
                return i, "".join(out)
            self._char(ch, out)
        return len(text), "".join(out)

    # -- one character ---------------------------------------------------------------------------

    def _fail(self) -> None:
        self.failed = True

    def _char(self, ch: str, out: list[str]) -> None:
        if self.string is not None:
            self._in_string(ch, out)
            return
        if self.scalar:
            if ch in _SCALAR:
                self.scalar += ch
                return
            if not self._end_scalar(out):
                return
        if ch in _WS:
            return
        if not self.started:
            if ch != "{":
                self._fail()
                return
            self.started = True
            self.stack.append(["object", "first", set()])
            out.append("{")
            return
        kind, state = self.stack[-1][0], self.stack[-1][1]
        if kind == "object" and state in ("first", "key"):
            if ch == '"':
                self.string, self.key = "key", ""
                out.append(", " if state == "key" else "")
                out.append('"')
            elif ch == "}" and state == "first":
                self._close(out, "}")
            else:
                self._fail()
        elif state == "colon":
            if ch == ":":
                self.stack[-1][1] = "value"
                out.append(": ")
            else:
                self._fail()
        elif state in ("value", "first"):  # an object's value, or an array's first (or next) item
            if kind == "array" and state == "first" and ch == "]":
                self._close(out, "]")
            else:
                self._value(ch, out)
        elif state == "next":
            if ch == ",":
                self.stack[-1][1] = "key" if kind == "object" else "item"
            elif ch == ("}" if kind == "object" else "]"):
                self._close(out, ch)
            else:
                self._fail()
        elif state == "item":  # an array's next item, after its comma
            out.append(", ")
            self.stack[-1][1] = "value"
            self._value(ch, out)

    def _value(self, ch: str, out: list[str]) -> None:
        self.stack[-1][1] = "next"
        if ch == "{":
            self.stack.append(["object", "first", set()])
            out.append("{")
        elif ch == "[":
            self.stack.append(["array", "first", None])
            out.append("[")
        elif ch == '"':
            self.string = "value"
            out.append('"')
        elif ch in _SCALAR:
            self.scalar = ch
        else:
            self._fail()

    def _close(self, out: list[str], ch: str) -> None:
        self.stack.pop()
        out.append(ch)
        if not self.stack:
            self.done = True

    def _end_scalar(self, out: list[str]) -> bool:
        token, self.scalar = self.scalar, ""
        try:
            value = json.loads(token)
        except ValueError:
            self._fail()
            return False
        if isinstance(value, float) and value in (float("inf"), float("-inf")):
            self._fail()
            return False
        out.append(json.dumps(value))
        return True

    def _in_string(self, ch: str, out: list[str]) -> None:
        if self.escape is not None:
            self.escape += ch
            if self.escape[0] == "u":
                if len(self.escape) < 5:
                    return
                try:
                    code = int(self.escape[1:], 16)
                except ValueError:
                    self._fail()
                    return
                self.escape = None
                self._decoded(chr(code), out)
                return
            decoded = _ESCAPES.get(self.escape)
            self.escape = None
            if decoded is None:
                self._fail()
                return
            self._decoded(decoded, out)
            return
        if ch == "\\":
            self.escape = ""
            return
        if ch == '"':
            self._flush_high(out)
            self._end_string(out)
            return
        if ord(ch) < 0x20:  # a raw control character: not JSON
            self._fail()
            return
        self._decoded(ch, out)

    def _decoded(self, ch: str, out: list[str]) -> None:
        if self.high is not None:
            high, self.high = self.high, None
            if 0xDC00 <= ord(ch) <= 0xDFFF:  # the pair's low half: one character
                pair = (high + ch).encode("utf-16", "surrogatepass").decode("utf-16")
                self._emit(pair, out)
                return
            self._emit(high, out)
        if 0xD800 <= ord(ch) <= 0xDBFF:
            self.high = ch
            return
        self._emit(ch, out)

    def _flush_high(self, out: list[str]) -> None:
        if self.high is not None:
            high, self.high = self.high, None
            self._emit(high, out)

    def _emit(self, ch: str, out: list[str]) -> None:
        if self.string == "key":
            self.key += ch
        out.append(_canon(ch))

    def _end_string(self, out: list[str]) -> None:
        out.append('"')
        if self.string == "key":
            keys = self.stack[-1][2]
            if self.key in keys:  # json.loads keeps the last value at the first place
                self._fail()
                return
            keys.add(self.key)
            self.stack[-1][1] = "colon"
        self.string = None
