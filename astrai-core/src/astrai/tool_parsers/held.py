"""``HeldToolParser``: the streaming half shared by the formats whose calls begin at a marker
(``<tool_call>``, ``[TOOL_CALLS]``) or make up the whole answer (a leading ``{`` or ``[``).

Text goes out as it comes up to a marker (or up to a trailing prefix of one, which the next piece
may complete); from the marker on, or from the start when the answer opens with a leading
character, everything is held until ``finish``, which parses the whole answer.
"""

from __future__ import annotations

from typing import Any, ClassVar

from astrai.protocol import ToolCall
from astrai.tool_parsers.base import ToolParser

__all__ = ["HeldToolParser"]


class HeldToolParser(ToolParser):
    """Subclasses set ``markers`` (strings that open a call anywhere) and ``leading`` (first
    characters, after whitespace, of an answer that is wholly calls), and implement ``parse``."""

    markers: ClassVar[tuple[str, ...]] = ()
    leading: ClassVar[tuple[str, ...]] = ()

    def __init__(self, names: set[str], opening: str = "", tools: list[dict[str, Any]] | None = None) -> None:
        super().__init__(names, opening, tools)
        self.sent = ""  # text already released
        self.held = opening  # text not released yet
        self.capturing = bool(opening)  # a call (marker or leading character) has begun

    def push(self, piece: str) -> str:
        self.held += piece
        if self.capturing:
            return ""
        if self.leading and not self.sent and self.held.lstrip()[:1] in self.leading:
            self.capturing = True
            return ""
        found = [i for i in (self.held.find(m) for m in self.markers) if i >= 0]
        if found:
            self.capturing = True
            out, self.held = self.held[: min(found)], self.held[min(found) :]
        else:
            keep = max((_partial(self.held, m) for m in self.markers), default=0)
            if self.leading and not self.sent and not self.held.strip():
                keep = len(self.held)  # leading whitespace: an answer of calls may still follow
            out, self.held = self.held[: len(self.held) - keep], self.held[len(self.held) - keep :]
        self.sent += out
        return out

    def finish(self) -> tuple[str, list[ToolCall]]:
        _, calls = self.parse(self.sent + self.held)
        held, self.held = self.held, ""
        return ("", calls) if calls else (held, [])


def _partial(text: str, marker: str) -> int:
    """The length of the longest end of ``text`` that begins ``marker`` (0: none)."""
    longest = min(len(marker) - 1, len(text))
    return next((k for k in range(longest, 0, -1) if marker.startswith(text[-k:])), 0)
