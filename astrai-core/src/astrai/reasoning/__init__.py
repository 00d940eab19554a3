"""Reasoning parsers: a thinking model's output split into its reasoning and its answer."""

from __future__ import annotations

from astrai.reasoning.base import (
    REASONING_PARSERS,
    ReasoningParser,
    check_reasoning_parser,
)
from astrai.reasoning.choose import choose_reasoning_parser

__all__ = ["REASONING_PARSERS", "ReasoningParser", "check_reasoning_parser", "choose_reasoning_parser"]
