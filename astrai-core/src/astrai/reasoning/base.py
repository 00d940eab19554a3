"""``ReasoningParser``: the contract of the ``astrai.reasoning_parsers`` entry-point group.

A thinking model writes its reasoning before its answer (Qwen3 and DeepSeek-R1 inside
``<think>...</think>``). A reasoning parser splits the generated text into the two, incrementally
(a stream's deltas) and on the whole text; protocols then show the reasoning apart
(OpenAI's ``reasoning_content``), and tool-call parsing applies to the answer only.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import ClassVar

from astrai.plugins import check_class
from astrai.thinking import ThinkingFormat

__all__ = ["REASONING_PARSERS", "ReasoningParser", "check_reasoning_parser"]

REASONING_PARSERS = "astrai.reasoning_parsers"


class ReasoningParser(ABC):
    """Splits one choice's generated text into ``(reasoning, content)``; one instance per choice.

    ``prompt_tail`` is the end of the rendered prompt (its last few tokens, decoded): a template may
    open the thinking block itself (DeepSeek-R1's, Qwen3's thinking-only ones), or close it
    (Qwen3's with ``enable_thinking`` false), and the parser starts inside or outside it accordingly.

    ``push`` and ``finish`` together must give, for any split of a text into pieces, the
    same concatenated reasoning and content as ``parse`` of the whole text: text that may still
    turn into a tag (a trailing ``</thi``) is held back until the next piece, or ``finish``.
    Methods never raise for any model output; pure text, no I/O.
    """

    name: ClassVar[str]  # entry-point name, e.g. "qwen3"
    # the text that ends a thinking: what the engine writes when a thinking used its budget
    # (``SamplingParams.thinking_budget``); None: this parser's models do not think
    end_of_thinking: ClassVar[str | None] = None

    def __init__(self, prompt_tail: str = "") -> None:
        self.prompt_tail = prompt_tail

    @classmethod
    def matches(cls, chat_template: str) -> bool:
        """Whether this parser is the automatic choice for a model with ``chat_template`` (default: never)."""
        return False

    def thinking_format(self) -> ThinkingFormat | None:
        """How this choice's thinking is written (its tags, ``end_of_thinking``, whether the prompt
        opened it), for the engine to end it at a budget and for a grammar to leave it free; None
        (the default) when the output does not think: a parser without ``end_of_thinking``, or a
        prompt whose template closed the block (thinking turned off)."""
        return None

    @property
    @abstractmethod
    def thinking(self) -> bool:
        """True while the text pushed so far ends inside the reasoning (its tokens count as reasoning)."""

    @abstractmethod
    def push(self, piece: str) -> tuple[str, str]:
        """``(reasoning, content)`` of ``piece`` that can be released now (either may be "")."""

    @abstractmethod
    def finish(self) -> tuple[str, str]:
        """``(reasoning, content)`` still held back once the output has ended."""

    def parse(self, text: str) -> tuple[str | None, str]:
        """The whole output's ``(reasoning, content)``; reasoning None when there was none."""
        r1, c1 = self.push(text)
        r2, c2 = self.finish()
        return (r1 + r2) or None, c1 + c2


def check_reasoning_parser(name: str, plugin: object, origin: str) -> type[ReasoningParser]:
    """Validate an ``astrai.reasoning_parsers`` plugin: a ``ReasoningParser`` named ``name``. Raises PluginError."""
    return check_class(ReasoningParser, name, plugin, origin)
