"""Tool-call parsers: the calls a model wrote in its chat template's format, out of its answer."""

from __future__ import annotations

from astrai.tool_parsers.base import TOOL_PARSERS, ForcedCall, ToolParser, check_tool_parser
from astrai.tool_parsers.choose import choose_tool_parser

__all__ = ["TOOL_PARSERS", "ForcedCall", "ToolParser", "check_tool_parser", "choose_tool_parser"]
