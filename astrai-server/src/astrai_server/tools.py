"""Tool calls enforced by grammar, in the format of the request's tool-call parser (each
``astrai.tool_parsers`` plugin knows its own: ``ToolParser.auto_grammar`` and ``forced_call``).

A request that must call a tool gets the opening of a call appended to its prompt, a grammar that
makes the rest a valid call of one of its tools, and stops at the call's end (``open_tool_call``):
the answer always parses. One that may call one (``auto``) gets the parser's structural tag: free
text, and any call it opens is a valid one.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from astrai.errors import RequestRejected
from astrai.grammar import GrammarSpec
from astrai.protocol import Prepared
from astrai.tool_parsers import ForcedCall, ToolParser, choose_tool_parser
from astrai.tool_parsers.hermes import (
    CLOSE,
    OPEN,
    HermesToolParser,
    call_head,
    call_schema,
    parse_hermes_calls,
)

#: Today's names of the ``hermes`` parser's pieces, kept for the code and tests that use them.
ToolCallStreamFilter = HermesToolParser
parse_tool_calls = parse_hermes_calls

__all__ = ["CLOSE", "OPEN", "ToolCallStreamFilter", "call_opening", "call_schema", "calls_tag"]
__all__ += ["enforced", "open_tool_call", "parse_tool_calls"]


def enforced(parser: type[ToolParser], chat_template: str) -> bool:
    """Whether ``parser``'s format is enforced for a model with ``chat_template``: when the template
    teaches that format (``matches``), or ignores tools (``chat_prompt_ids`` then describes them).
    A template that teaches a format the parser does not know gets nothing enforced."""
    return "tools" not in chat_template or parser.matches(chat_template)


def call_opening(tokenizer: Any, name: str | None) -> str:
    """The start of a ``<tool_call>`` to append to a prompt whose answer must be one ("" if the
    template teaches another format): ``<tool_call>`` and a newline, then ``{"name": <name>,
    "arguments": `` when the tool is known."""
    template = getattr(tokenizer, "chat_template", None) or ""
    if not enforced(HermesToolParser, template):
        return ""
    return call_head(name) if name else OPEN + "\n"


def calls_tag(tools: list[dict[str, Any]]) -> dict[str, Any]:
    """The ``hermes`` structural tag of ``tool_choice`` auto."""
    return HermesToolParser.auto_grammar(tools)


def open_tool_call(p: Prepared, tokenizer: Any, parser: type[ToolParser] | None = None) -> ForcedCall | None:
    """A request that must call a tool: end its prompt with the opening of a call in ``parser``'s
    format (None: the one chosen from the chat template), constrain what follows to a call of one of
    ``p.tools`` with arguments valid against its ``parameters``, and stop at the call's end. A
    request that may call one (``auto``, no other constraint) gets the parser's structural tag
    instead. Returns how the call was forced (None when not required, for several prompts, or when
    nothing is enforced for this template and parser). Modifies ``p.prompt_ids`` and ``p.params``."""
    if not p.tools or p.prompts is not None:
        return _unenforced(p, "")
    template = getattr(tokenizer, "chat_template", None) or ""
    parser = parser or choose_tool_parser(None, template)
    if not enforced(parser, template):
        return _unenforced(p, f"this model's chat template does not teach the {parser.name} call format")
    if not p.tool_call_required:
        if p.params.grammar is not None:
            return _unenforced(p, "a response format already constrains the answer")
        tag = parser.auto_grammar(p.tools, template)  # free text, but a call the model opens is valid
        if tag is None:
            return _unenforced(p, f"the {parser.name} tool-call parser enforces no call format")
        p.params = dataclasses.replace(p.params, grammar=GrammarSpec.of("structural_tag", tag))
        return None
    forced = parser.forced_call(p.tools, template)
    if forced is None:
        return _unenforced(p, f"the {parser.name} tool-call parser enforces no call format")
    if p.params.grammar is not None:
        raise RequestRejected(
            "a required tool call and a response format cannot both constrain the answer", param="tool_choice"
        )
    if forced.opening:
        p.prompt_ids = [*p.prompt_ids, *tokenizer.encode(forced.opening, add_special_tokens=False)]
    p.params = dataclasses.replace(p.params, stop=[*p.params.stop, *forced.stop], grammar=forced.grammar)
    return forced


def _unenforced(p: Prepared, why: str) -> None:
    """None, for calls that no grammar enforces; RequestRejected naming ``p.strict_tools`` when the
    client asked for strict calls (``why``: what stands in the way)."""
    if p.strict_tools is not None and p.tools:
        raise RequestRejected(
            f"{p.strict_tools}: true needs the calls constrained by grammar, which this request cannot "
            f"have ({why})",
            param=p.strict_tools,
        )
    return None
