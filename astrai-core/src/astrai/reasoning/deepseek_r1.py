"""``deepseek_r1``: DeepSeek-R1's template opens ``<think>`` in the prompt; everything before ``</think>``
is reasoning (a leading ``<think>`` the model writes itself is dropped)."""

from __future__ import annotations

from astrai.reasoning.think import ThinkReasoningParser


class DeepSeekR1ReasoningParser(ThinkReasoningParser):
    """Starts inside the reasoning whatever the prompt ends with."""

    name = "deepseek_r1"

    def starts_open(self, prompt_tail: str) -> bool:
        return True
