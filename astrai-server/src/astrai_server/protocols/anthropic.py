"""Anthropic Messages (``POST /v1/messages``), as the official ``anthropic`` SDK expects it.

Registered as entry point ``anthropic`` in ``astrai.protocols``. Parameters,
defaults and ranges are the fields of ``MessagesRequest``, as documented in
docs/http-api.md, ``tools`` / ``tool_choice`` included. A final assistant message
is a prefill: generation continues it. Streams follow Anthropic's event sequence
(``message_start`` with the real ``input_tokens``, ..., ``message_stop``) and end
with ``data: [DONE]``.
"""

from __future__ import annotations

import json
import logging
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from astrai.errors import RequestRejected
from astrai.protocol import (
    ChatResult,
    Prepared,
    ResponseBuilder,
    chat_prompt_ids,
    new_id,
    plugin_sampling,
    sse,
    value_or_default,
)
from astrai.sampling import SamplingParams

logger = logging.getLogger(__name__)

STOP_REASON = {"stop": "end_turn", "stop_sequence": "stop_sequence", "length": "max_tokens", "tool_calls": "tool_use", "abort": "end_turn"}
ERROR_TYPE = {401: "authentication_error", 403: "permission_error", 404: "not_found_error", 413: "request_too_large", 429: "rate_limit_error", 503: "overloaded_error", 529: "overloaded_error"}  # fmt: skip


class TextBlock(BaseModel):
    type: Literal["text"]
    text: str


class ToolUseBlock(BaseModel):
    type: Literal["tool_use"]
    id: str
    name: str
    input: dict[str, Any] = Field(default_factory=dict)


class ToolResultBlock(BaseModel):
    type: Literal["tool_result"]
    tool_use_id: str
    content: str | list[TextBlock] | None = None
    is_error: bool = False

    def text(self) -> str:
        return self.content if isinstance(self.content, str) else "".join(b.text for b in self.content or [])


Block = Annotated[TextBlock | ToolUseBlock | ToolResultBlock, Field(discriminator="type")]


class AnthropicMessage(BaseModel):
    role: Literal["user", "assistant"]
    content: str | list[Block]


class ToolDef(BaseModel):
    name: str = Field(min_length=1, max_length=64)
    description: str | None = None
    input_schema: dict[str, Any] = Field(default_factory=lambda: {"type": "object"})


class ToolChoice(BaseModel):
    type: Literal["auto", "any", "tool", "none"] = "auto"
    name: str | None = None


class MessagesRequest(BaseModel):
    """The request body of ``POST /v1/messages``; undeclared fields are kept for sampling plugins."""

    model_config = ConfigDict(extra="allow")

    model: str = "astrai"
    messages: list[AnthropicMessage] = Field(min_length=1)
    system: str | list[TextBlock] | None = None
    max_tokens: int = Field(1024, gt=0)
    temperature: float | None = Field(1.0, ge=0.0, le=2.0)
    top_p: float | None = Field(1.0, ge=0.0, le=1.0)
    top_k: int | None = Field(50, ge=0)
    stream: bool | None = False
    stop_sequences: list[str] | None = None
    metadata: dict[str, Any] | None = None
    tools: list[ToolDef] | None = None
    tool_choice: ToolChoice | None = None

    def sampling_params(self) -> SamplingParams:
        """The engine's parameters for this request: null is the field's default (for ``top_k``: off).

        Empty stop sequences are dropped; undeclared fields go to ``extra`` (sampling
        plugins). Raises RequestRejected for a value the engine refuses although the
        schema takes it (``top_p`` 0).
        """
        return SamplingParams(
            max_tokens=self.max_tokens,
            temperature=value_or_default(self, "temperature"),
            top_p=value_or_default(self, "top_p"),
            top_k=self.top_k or 0,
            stop=[s for s in self.stop_sequences or [] if s],
            extra=plugin_sampling(self),
        )


def _template_messages(req: MessagesRequest) -> list[dict[str, Any]]:
    """Messages in the Hugging Face chat-template convention: tool_use -> tool_calls, tool_result -> role tool."""
    out: list[dict[str, Any]] = []
    if req.system:
        system = req.system if isinstance(req.system, str) else "".join(b.text for b in req.system)
        out.append({"role": "system", "content": system})
    for m in req.messages:
        if isinstance(m.content, str):
            out.append({"role": m.role, "content": m.content})
            continue
        text = "".join(b.text for b in m.content if isinstance(b, TextBlock))
        calls = [
            {"id": b.id, "type": "function", "function": {"name": b.name, "arguments": b.input}}
            for b in m.content
            if isinstance(b, ToolUseBlock)
        ]
        for b in m.content:
            if isinstance(b, ToolResultBlock):
                out.append({"role": "tool", "content": b.text(), "tool_call_id": b.tool_use_id})
        if text or calls or not any(isinstance(b, ToolResultBlock) for b in m.content):
            out.append({"role": m.role, "content": text, **({"tool_calls": calls} if calls else {})})
    return out


def _select_tools(req: MessagesRequest) -> list[dict[str, Any]]:
    choice = req.tool_choice or ToolChoice()
    if not req.tools and choice.type in ("any", "tool"):
        raise RequestRejected(f"tool_choice {choice.type!r} requires tools")
    if not req.tools or choice.type == "none":
        return []
    tools = [
        {"type": "function", "function": {"name": t.name, "description": t.description or "", "parameters": t.input_schema}}
        for t in req.tools
    ]
    if choice.type == "tool":
        tools = [t for t in tools if t["function"]["name"] == choice.name]
        if not tools:
            raise RequestRejected(f"tool_choice names tool {choice.name!r}, which is not in tools")
    return tools


class AnthropicResponseBuilder(ResponseBuilder):
    """Anthropic Messages over JSON and SSE (named events)."""

    name = "anthropic"
    route = "/v1/messages"
    request_model = MessagesRequest

    def prepare(self, request: MessagesRequest, engine: Any) -> Prepared:
        tools = _select_tools(request)
        messages = _template_messages(request)
        tok = engine.tokenizer
        prefill = ""
        if messages[-1]["role"] == "assistant" and "tool_calls" not in messages[-1]:
            prefill = messages.pop()["content"].rstrip()  # Anthropic rejects trailing whitespace; we trim it
        required = bool(tools) and request.tool_choice is not None and request.tool_choice.type in ("any", "tool")
        if required and prefill:
            raise RequestRejected(f"tool_choice {request.tool_choice.type!r} cannot continue a prefilled assistant turn")
        prompt_ids = chat_prompt_ids(tok, messages, tools)
        if prefill:
            prompt_ids += tok.encode(prefill, add_special_tokens=False)
        return Prepared(
            request=request, prompt_ids=prompt_ids, params=request.sampling_params(), stream=bool(request.stream),
            tools=tools, tool_call_required=required, max_tokens_explicit="max_tokens" in request.model_fields_set,
            response_id=new_id("msg_"), model=request.model,
        )  # fmt: skip

    def format_stream_start(self, prepared: Prepared) -> list[str]:
        message = {
            "id": prepared.response_id, "type": "message", "role": "assistant", "model": prepared.model,
            "content": [], "stop_reason": None, "stop_sequence": None,
            "usage": {"input_tokens": len(prepared.prompt_ids), "output_tokens": 0},
        }  # fmt: skip
        block = {"type": "content_block_start", "index": 0, "content_block": {"type": "text", "text": ""}}
        return [sse({"type": "message_start", "message": message}, "message_start"), sse(block, "content_block_start")]

    def format_chunk(self, prepared: Prepared, index: int, text: str) -> list[str]:
        delta = {"type": "content_block_delta", "index": 0, "delta": {"type": "text_delta", "text": text}}
        return [sse(delta, "content_block_delta")]

    def format_stream_end(self, prepared: Prepared, result: ChatResult) -> list[str]:
        choice = result.choices[0]
        frames = [sse({"type": "content_block_stop", "index": 0}, "content_block_stop")]
        for k, call in enumerate(choice.tool_calls, start=1):
            start = {"type": "tool_use", "id": _tool_id(call.id), "name": call.name, "input": {}}
            delta = {"type": "input_json_delta", "partial_json": call.arguments}
            frames += [
                sse({"type": "content_block_start", "index": k, "content_block": start}, "content_block_start"),
                sse({"type": "content_block_delta", "index": k, "delta": delta}, "content_block_delta"),
                sse({"type": "content_block_stop", "index": k}, "content_block_stop"),
            ]
        delta = {"stop_reason": STOP_REASON[choice.finish_reason], "stop_sequence": choice.stop_sequence}
        usage = {"input_tokens": result.prompt_tokens, "output_tokens": result.completion_tokens}
        frames += [
            sse({"type": "message_delta", "delta": delta, "usage": usage}, "message_delta"),
            sse({"type": "message_stop"}, "message_stop"),
            sse("[DONE]"),
        ]
        return frames

    def format_response(self, prepared: Prepared, result: ChatResult) -> dict[str, Any]:
        choice = result.choices[0]
        content: list[dict[str, Any]] = []
        if choice.text or not choice.tool_calls:
            content.append({"type": "text", "text": choice.text})
        content += [
            {"type": "tool_use", "id": _tool_id(t.id), "name": t.name, "input": json.loads(t.arguments)}
            for t in choice.tool_calls
        ]
        return {
            "id": prepared.response_id, "type": "message", "role": "assistant", "model": prepared.model,
            "content": content, "stop_reason": STOP_REASON[choice.finish_reason],
            "stop_sequence": choice.stop_sequence,
            "usage": {"input_tokens": result.prompt_tokens, "output_tokens": result.completion_tokens},
        }  # fmt: skip

    def format_error(self, status: int, message: str, param: str | None = None) -> dict[str, Any]:
        kind = ERROR_TYPE.get(status, "api_error" if status >= 500 else "invalid_request_error")
        return {"type": "error", "error": {"type": kind, "message": message}}


def _tool_id(call_id: str) -> str:
    return "toolu_" + call_id.removeprefix("call_")
