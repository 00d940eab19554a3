"""``qwen3``: Qwen3's ``<think>...</think>``; chosen automatically for a template that mentions ``<think>``."""

from __future__ import annotations

from astrai.reasoning.think import OPEN, ThinkReasoningParser


class Qwen3ReasoningParser(ThinkReasoningParser):
    """Reasoning when the output opens ``<think>``, or when the prompt left it open (thinking-only
    templates); an output without it (``enable_thinking`` false) is all content."""

    name = "qwen3"

    @classmethod
    def matches(cls, chat_template: str) -> bool:
        return OPEN in chat_template
