"""``ThinkReasoningParser``: reasoning inside ``<think>...</think>`` at the start of the output.

The reasoning is the text between the tags, without the whitespace around it; the content is what
follows ``</think>``, without its leading whitespace. An output that does not start with
``<think>`` is all content, unless the parser starts inside the block (``starts_open``): then
everything before ``</think>`` is reasoning. An output that ends before ``</think>`` (``max_tokens``)
leaves its reasoning as reasoning and no content. Shared by ``qwen3`` and ``deepseek_r1``.
"""

from __future__ import annotations

from astrai.reasoning.base import ReasoningParser
from astrai.thinking import ThinkingFormat

OPEN, CLOSE = "<think>", "</think>"
_START, _REASONING, _AFTER, _CONTENT = range(4)


def _tag_prefix(text: str, tag: str) -> int:
    """The length of the longest end of ``text`` that is a proper prefix of ``tag``."""
    return next((k for k in range(min(len(tag) - 1, len(text)), 0, -1) if tag.startswith(text[-k:])), 0)


class ThinkReasoningParser(ReasoningParser):
    """``<think>`` reasoning; ``starts_open`` (the prompt opened the block) decides the untagged case."""

    end_of_thinking = "\n" + CLOSE + "\n\n"  # as Qwen3 and DeepSeek-R1 write it

    def __init__(self, prompt_tail: str = "") -> None:
        super().__init__(prompt_tail)
        self.open = self.starts_open(prompt_tail)
        self.state = _START
        self.buf = ""  # text pushed but not released
        self.started = False  # some reasoning went out (leading whitespace is dropped before)

    def starts_open(self, prompt_tail: str) -> bool:
        """Whether the prompt leaves the think block open: its last ``<think>`` is not closed."""
        at = prompt_tail.rfind(OPEN)
        return at >= 0 and prompt_tail.find(CLOSE, at) < 0

    def thinking_format(self) -> ThinkingFormat | None:
        if self.prompt_tail.rstrip().endswith(CLOSE):  # the template closed the block: thinking is off
            return None
        return ThinkingFormat(OPEN, CLOSE, self.end_of_thinking, inside=self.open)

    @property
    def thinking(self) -> bool:
        return self.state == _REASONING or (self.state == _START and self.open)

    def push(self, piece: str) -> tuple[str, str]:
        self.buf += piece
        reasoning = content = ""
        if self.state == _START:
            head = self.buf.lstrip()
            if head.startswith(OPEN):
                self.buf, self.state = head[len(OPEN) :], _REASONING
            elif OPEN.startswith(head):  # may still become the tag
                return "", ""
            else:
                self.state = _REASONING if self.open else _CONTENT
        if self.state == _REASONING:
            if not self.started:
                self.buf = self.buf.lstrip()
            end = self.buf.find(CLOSE)
            if end >= 0:
                reasoning, self.buf, self.state = (
                    self.buf[:end].rstrip(),
                    self.buf[end + len(CLOSE) :],
                    _AFTER,
                )
            else:  # hold a possible start of the tag, and the whitespace before it (it may end the reasoning)
                keep = _tag_prefix(self.buf, CLOSE)
                head = self.buf[: len(self.buf) - keep]
                cut = len(head.rstrip())
                reasoning, self.buf = self.buf[:cut], self.buf[cut:]
            self.started = self.started or bool(reasoning)
        if self.state == _AFTER:
            self.buf = self.buf.lstrip()
            if self.buf:
                self.state = _CONTENT
        if self.state == _CONTENT:
            content, self.buf = self.buf, ""
        return reasoning, content

    def finish(self) -> tuple[str, str]:
        held, self.buf = self.buf, ""
        if self.state == _START:
            return (held.strip(), "") if self.open else ("", held)
        if self.state == _REASONING:
            return held.rstrip(), ""
        return "", held if self.state == _CONTENT else ""
