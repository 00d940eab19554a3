"""``none``: for models that do not think; everything is content."""

from __future__ import annotations

from astrai.reasoning.base import ReasoningParser


class NoneReasoningParser(ReasoningParser):
    """The identity: no reasoning, every piece released as content at once."""

    name = "none"

    @property
    def thinking(self) -> bool:
        return False

    def push(self, piece: str) -> tuple[str, str]:
        return "", piece

    def finish(self) -> tuple[str, str]:
        return "", ""
