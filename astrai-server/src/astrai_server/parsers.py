"""Which reasoning and tool-call parsers a server's requests get (``--reasoning-parser``,
``--tool-call-parser``), and the pair of them chosen for an engine's chat template."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from astrai.reasoning import choose_reasoning_parser
from astrai.tool_parsers import choose_tool_parser

if TYPE_CHECKING:
    from astrai.reasoning import ReasoningParser
    from astrai.tool_parsers import ToolParser


@dataclass(frozen=True)
class Chosen:
    """The parser classes of one engine: one instance of each per choice."""

    reasoning: type[ReasoningParser] | None  # None: the protocol keeps the text as generated
    tool: type[ToolParser]


@dataclass(frozen=True)
class Parsers:
    """The parsers named on the command line; None: chosen from the chat template (reasoning: the
    first installed parser whose ``matches`` it, else ``none``; tool calls: the same, else
    ``hermes``)."""

    reasoning: str | None = None
    tool: str | None = None

    def for_engine(self, engine: Any) -> Chosen:
        """The parsers for ``engine``'s chat template. PluginError for a name not installed."""
        template = getattr(getattr(engine, "tokenizer", None), "chat_template", None) or ""
        return Chosen(
            choose_reasoning_parser(self.reasoning, template), choose_tool_parser(self.tool, template)
        )
