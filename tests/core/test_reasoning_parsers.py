"""Reasoning parsers: fixed texts split as documented, and every split of a text into two or three
pieces streams to exactly the whole text's split (``astrai.reasoning_parsers`` seen through its
entry points)."""

from __future__ import annotations

import pytest

from astrai.errors import PluginError
from astrai.reasoning import REASONING_PARSERS, ReasoningParser, choose_reasoning_parser
from astrai.reasoning.deepseek_r1 import DeepSeekR1ReasoningParser
from astrai.reasoning.none import NoneReasoningParser
from astrai.reasoning.qwen3 import Qwen3ReasoningParser

QWEN3_PROMPT = "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"
CLOSED_PROMPT = QWEN3_PROMPT + "<think>\n\n</think>\n\n"  # Qwen3's template with enable_thinking false
OPEN_PROMPT = QWEN3_PROMPT + "<think>\n"  # a template that opens the block (DeepSeek-R1, Qwen3 thinking-only)

CASES = {
    # (parser, prompt tail, output): (reasoning, content)
    "qwen3": (
        Qwen3ReasoningParser,
        QWEN3_PROMPT,
        "<think>\nLet me see.\n</think>\n\nHello!",
        ("Let me see.", "Hello!"),
    ),
    "qwen3-empty-think": (Qwen3ReasoningParser, QWEN3_PROMPT, "<think>\n\n</think>\n\nHi", (None, "Hi")),
    "qwen3-no-think": (Qwen3ReasoningParser, CLOSED_PROMPT, "  Just an answer", (None, "  Just an answer")),
    "qwen3-truncated": (
        Qwen3ReasoningParser,
        QWEN3_PROMPT,
        "<think>\nstill thinking </thi",
        ("still thinking </thi", ""),
    ),
    "qwen3-open-prompt": (
        Qwen3ReasoningParser,
        OPEN_PROMPT,
        'a < b\n</think>\n\n{"x": 1}',
        ("a < b", '{"x": 1}'),
    ),
    "qwen3-late-tag": (
        Qwen3ReasoningParser,
        QWEN3_PROMPT,
        "Hi <think>no</think>",
        (None, "Hi <think>no</think>"),
    ),
    "qwen3-tool-call": (
        Qwen3ReasoningParser,
        QWEN3_PROMPT,
        '<think>call it</think><tool_call>\n{"name": "f", "arguments": {}}\n</tool_call>',
        ("call it", '<tool_call>\n{"name": "f", "arguments": {}}\n</tool_call>'),
    ),
    "deepseek_r1": (DeepSeekR1ReasoningParser, "", "Hmm, 2+2.\n</think>\n\n4", ("Hmm, 2+2.", "4")),
    "deepseek_r1-own-tag": (DeepSeekR1ReasoningParser, "", "<think>Hmm</think>4", ("Hmm", "4")),
    "deepseek_r1-unclosed": (DeepSeekR1ReasoningParser, "", "  <thi", ("<thi", "")),
    "none": (NoneReasoningParser, "", "<think>x</think>y", (None, "<think>x</think>y")),
}


def _streamed(parser: ReasoningParser, pieces: list[str]) -> tuple[str | None, str]:
    reasoning = content = ""
    for piece in pieces:
        r, c = parser.push(piece)
        reasoning, content = reasoning + r, content + c
    r, c = parser.finish()
    return (reasoning + r) or None, content + c


@pytest.mark.parametrize("case", list(CASES), ids=list(CASES))
def test_whole_text_split(case: str) -> None:
    cls, tail, text, expected = CASES[case]
    assert cls(tail).parse(text) == expected


@pytest.mark.parametrize("case", list(CASES), ids=list(CASES))
def test_every_split_streams_to_the_whole_text_split(case: str) -> None:
    cls, tail, text, expected = CASES[case]
    assert _streamed(cls(tail), list(text)) == expected  # one character at a time
    for i in range(len(text) + 1):
        assert _streamed(cls(tail), [text[:i], text[i:]]) == expected, i
        for j in range(i, len(text) + 1, 3):
            assert _streamed(cls(tail), [text[:i], text[i:j], text[j:]]) == expected, (i, j)


def test_thinking_tracks_the_block() -> None:
    parser = Qwen3ReasoningParser(QWEN3_PROMPT)
    assert not parser.thinking
    parser.push("<think>")
    assert parser.thinking
    parser.push("x</think>")
    assert not parser.thinking
    assert DeepSeekR1ReasoningParser("").thinking


def test_chosen_through_entry_points() -> None:
    assert choose_reasoning_parser(None, "{{ '<think>' }}") is Qwen3ReasoningParser
    assert choose_reasoning_parser(None, "{{ messages }}") is NoneReasoningParser
    assert choose_reasoning_parser("deepseek_r1", "") is DeepSeekR1ReasoningParser
    with pytest.raises(PluginError, match="'nope' not found.*Installed: deepseek_r1, none, qwen3"):
        choose_reasoning_parser("nope", "")
    assert REASONING_PARSERS == "astrai.reasoning_parsers"
