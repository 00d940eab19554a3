"""Anthropic Messages (``POST /v1/messages``, ``/v1/messages/count_tokens``), as Anthropic's SDK expects.

Registered as entry point ``anthropic`` in ``astrai.protocols``. Parameters, defaults and ranges
are the fields of ``MessagesRequest``; its base ``MessagesInput`` holds what shapes the prompt,
which is all that ``count_tokens`` takes (both share ``_prompt``, so the count is the
``usage.input_tokens`` of the same input). ``min_p``, ``repetition_penalty``, ``min_tokens``,
``stop_token_ids`` and ``ignore_eos`` are the vLLM extensions. Every field the SDK can send is
implemented, accepted as metadata (``IGNORED``) or refused with a 400 naming it (``REFUSED``):
a top-level one in ``prepare`` or, undeclared, by the handler; a nested one by the schema, as
pydantic's ``extra_forbidden``, which the server answers with a 400 naming its location. A final
assistant message is a prefill: generation continues it. Streams follow Anthropic's event
sequence (``message_start`` with the real ``input_tokens``, ..., ``message_stop``) and end with
``data: [DONE]``.

Thinking (``thinking``: ``enabled`` with ``budget_tokens``, or ``adaptive``): a thinking model's
reasoning comes as a ``thinking`` block before the text, streamed as ``thinking_delta`` events and a
``signature_delta`` before its ``content_block_stop``; the signature (``astrai_server.signing``)
lets the block come back in a later turn, where it is verified and given to the template as the
assistant turn's ``reasoning_content``. Without ``thinking`` (or ``disabled``), as on Anthropic's
API, the model is asked not to think (``enable_thinking: false`` for a template that has the
switch) and whatever it thinks anyway is dropped.

Over 300 lines because the protocol is one file: a model for every object the SDK can send, the
tables of what is refused or ignored, the prompt both routes share and the response frames.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from typing import Annotated, Any, Literal

from pydantic import BaseModel, BeforeValidator, ConfigDict, Field, model_validator
from pydantic_core import PydanticCustomError

from astrai.errors import RequestRejected
from astrai.protocol import (
    CacheSalt,
    ChatResult,
    Choice,
    Prepared,
    ResponseBuilder,
    ToolCall,
    chat_prompt_ids,
    new_id,
    plugin_sampling,
    sent_fields,
    sse,
    value_or_default,
)
from astrai.sampling import SamplingParams
from astrai_server.parsers import Parsers
from astrai_server.request_parts import Strict, null_is_not_sent, select_tools
from astrai_server.signing import sign, verify
from astrai_server.structured import anthropic_format
from astrai_server.tools import open_tool_call

STOP_REASON = {
    "stop": "end_turn",
    "stop_sequence": "stop_sequence",
    "length": "max_tokens",
    "tool_calls": "tool_use",
    "abort": "end_turn",
}
ERROR_TYPE = {
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    413: "request_too_large",
    429: "rate_limit_error",
    503: "overloaded_error",
    529: "overloaded_error",
}

#: What astrai refuses of Anthropic's request (a 400 naming the field). The top-level fields that
#: no value of is served are not declared (the handler refuses them; JSON null means "not sent").
#: docs/http-api.md shows this table.
REFUSED = {
    "container": "code-execution containers are not supported",
    "context_management": "context editing is not supported",
    "diagnostics": "prompt-cache diagnostics are not supported",
    "mcp_servers": "MCP servers are not supported",
    "output_config": "effort is not supported (format is: structured output); {} is accepted",
    "thinking": 'display "omitted": astrai signs the thinking it shows, it cannot sign hidden thinking',
    "messages[].role": '"system" is not supported; the system prompt goes in system',
    "messages[].content[].type": (
        "blocks other than text, tool_use, tool_result and thinking (image, document, redacted_thinking: "
        "astrai never writes encrypted thinking, so it cannot read one)"
    ),
    "messages[].content[].citations": "citations are not supported; null or [] is accepted",
    "messages[].content[].caller": 'callers other than {"type": "direct"} (no programmatic tool calling)',
    "messages[].content[].toolset_name": "MCP toolsets are not supported",
    "tools[].type": 'server tools (web search, code execution, ...) are not supported; "custom" is accepted',
    "tools[].strict": (
        "true: calls are constrained where the chat template teaches the tool-call parser's format "
        "(or ignores tools), which strict cannot promise for every template"
    ),
    "tools[].defer_loading": "true: there is no tool search",
    "tools[].allowed_callers": 'anything but ["direct"] (no programmatic tool calling)',
    "tools[].input_examples": "examples are not shown to the model; null or [] is accepted",
}

#: Fields accepted and ignored: metadata that changes nothing a client can observe.
IGNORED = {
    "cache_control": (
        "Prompt-caching marks (top level, on blocks and tools): the prefix cache reuses any shared prefix."
    ),
    "inference_geo": "Where inference runs: where astrai is deployed.",
    "metadata": "An end-user id (user_id) for abuse detection.",
    "service_tier": "A capacity tier; astrai has one.",
    "speed": "A throughput mode; astrai has one.",
    "user_profile_id": "The party a request acts for; astrai has no accounts.",
    "workspace_id": "The workspace of a key; astrai has none.",
    "messages[].content[].is_error": "The model sees the tool result's content only.",
    "tools[].eager_input_streaming": "A tool's input streams in input_json_delta pieces as the model writes it either way.",
}


def _unless(ok: Callable[[Any], bool], key: str) -> BeforeValidator:
    """Refuse a nested field's non-null value unless ``ok(value)``: ``extra_forbidden``, a 400 naming it."""

    def check(value: Any) -> Any:
        if value is not None and not ok(value):
            raise PydanticCustomError("extra_forbidden", "{key}: {why}", {"key": key, "why": REFUSED[key]})
        return value

    return BeforeValidator(check)


def _blocks(value: Any) -> Any:
    # a string is shorthand for one text block; one list type keeps pydantic's error locations plain
    return [{"type": "text", "text": value}] if isinstance(value, str) else value


TextBlocks = BeforeValidator(_blocks)


class CacheControl(Strict):
    type: Literal["ephemeral"]
    ttl: Literal["5m", "1h"] | None = None


class TextBlock(Strict):
    type: Literal["text"]
    text: str
    cache_control: CacheControl | None = None
    citations: Annotated[
        list[dict[str, Any]] | None, _unless(lambda v: not v, "messages[].content[].citations")
    ] = None


class ToolUseBlock(Strict):
    type: Literal["tool_use"]
    id: str
    name: str
    input: dict[str, Any] = Field(default_factory=dict)
    cache_control: CacheControl | None = None
    caller: Annotated[
        dict[str, Any] | None, _unless(lambda v: v == {"type": "direct"}, "messages[].content[].caller")
    ] = None
    toolset_name: Annotated[str | None, _unless(lambda v: False, "messages[].content[].toolset_name")] = None


UNSUPPORTED_BLOCKS = (
    "image",
    "document",
    "search_result",
    "redacted_thinking",
    "server_tool_use",
    "web_search_tool_result",
    "web_fetch_tool_result",
    "code_execution_tool_result",
    "bash_code_execution_tool_result",
    "text_editor_code_execution_tool_result",
    "tool_search_tool_result",
    "container_upload",
    "tool_reference",
    "browser_state",
)


class UnsupportedBlock(BaseModel):
    """A content block of Anthropic's that astrai does not implement: always refused (400 naming it)."""

    type: Literal[UNSUPPORTED_BLOCKS]

    @model_validator(mode="before")
    @classmethod
    def _refuse(cls, data: Any) -> Any:
        kind = data.get("type") if isinstance(data, dict) else None
        raise PydanticCustomError("extra_forbidden", "{kind} blocks are not supported", {"kind": kind})


class ToolResultBlock(Strict):
    type: Literal["tool_result"]
    tool_use_id: str
    content: Annotated[
        list[Annotated[TextBlock | UnsupportedBlock, Field(discriminator="type")]] | None, TextBlocks
    ] = None
    is_error: bool = False
    cache_control: CacheControl | None = None
    toolset_name: Annotated[str | None, _unless(lambda v: False, "messages[].content[].toolset_name")] = None

    def text(self) -> str:
        return "".join(b.text for b in self.content or [])


class ThinkingBlock(Strict):
    """An earlier answer's thinking, sent back: verified against its ``signature``."""

    type: Literal["thinking"]
    thinking: str
    signature: str


#: The purpose a thinking block's signature is made for (``astrai_server.signing``).
THINKING = "anthropic.thinking"

Block = Annotated[
    TextBlock | ToolUseBlock | ToolResultBlock | ThinkingBlock | UnsupportedBlock, Field(discriminator="type")
]


class AnthropicMessage(Strict):
    role: Annotated[Literal["user", "assistant"], _unless(lambda v: v != "system", "messages[].role")]
    content: Annotated[list[Block], TextBlocks]


class ToolDef(Strict):
    type: Annotated[Literal["custom"] | None, _unless(lambda v: v == "custom", "tools[].type")] = None
    name: str = Field(min_length=1, max_length=64)
    description: str | None = None
    input_schema: dict[str, Any] = Field(default_factory=lambda: {"type": "object"})
    cache_control: CacheControl | None = None
    strict: Annotated[bool | None, _unless(lambda v: v is False, "tools[].strict")] = None
    defer_loading: Annotated[bool | None, _unless(lambda v: v is False, "tools[].defer_loading")] = None
    allowed_callers: Annotated[
        list[str] | None, _unless(lambda v: v == ["direct"], "tools[].allowed_callers")
    ] = None
    eager_input_streaming: bool | None = None
    input_examples: Annotated[
        list[dict[str, Any]] | None, _unless(lambda v: not v, "tools[].input_examples")
    ] = None


class ToolChoice(Strict):
    type: Literal["auto", "any", "tool", "none"] = "auto"
    name: str | None = None
    disable_parallel_tool_use: bool | None = None


class Thinking(Strict):
    """``enabled`` needs ``budget_tokens`` (at least 1: Anthropic's minimum of 1024 is not kept, a small
    local model's context may be shorter; below ``max_tokens``, checked in ``prepare``); ``adaptive``
    thinks without a budget; ``disabled`` asks the model not to think."""

    type: Literal["enabled", "adaptive", "disabled"]
    budget_tokens: int | None = Field(None, ge=1)
    display: Annotated[
        Literal["summarized", "omitted"] | None, _unless(lambda v: v != "omitted", "thinking")
    ] = None

    @model_validator(mode="after")
    def _budget_when_enabled(self) -> Thinking:
        if (self.budget_tokens is None) == (self.type == "enabled"):
            raise PydanticCustomError(
                "thinking", "budget_tokens is required with type enabled, and taken with it only", {}
            )
        if self.display is not None and self.type == "disabled":
            raise PydanticCustomError("thinking", "display is taken with thinking on only", {})
        return self

    @property
    def on(self) -> bool:
        return self.type != "disabled"


class OutputConfig(Strict):
    effort: str | None = None
    format: dict[str, Any] | None = None


class Metadata(Strict):
    user_id: str | None = None


class MessagesInput(BaseModel):
    """What shapes the prompt: the body of ``POST /v1/messages/count_tokens``, and the base of
    ``MessagesRequest``. Undeclared top-level fields are kept for sampling plugins."""

    model_config = ConfigDict(extra="allow")

    model: str = "astrai"
    messages: list[AnthropicMessage] = Field(min_length=1)
    system: Annotated[list[TextBlock] | None, TextBlocks] = None
    tools: list[ToolDef] | None = None
    tool_choice: ToolChoice | None = None
    thinking: Thinking | None = None
    output_config: OutputConfig | None = None
    cache_control: CacheControl | None = None
    speed: Literal["standard", "fast"] | None = None
    user_profile_id: str | None = None
    workspace_id: str | None = None

    _null_is_not_sent = null_is_not_sent(REFUSED)  # "container": null asks for nothing


class MessagesRequest(MessagesInput):
    """The request body of ``POST /v1/messages``; undeclared fields are kept for sampling plugins."""

    max_tokens: int = Field(1024, ge=0)  # the spec's table (Anthropic's API requires the field)
    temperature: float | None = Field(1.0, ge=0.0, le=2.0)
    top_p: float | None = Field(1.0, ge=0.0, le=1.0)
    top_k: int | None = Field(50, ge=0)
    min_p: float | None = Field(0.0, ge=0.0, le=1.0)
    repetition_penalty: float | None = Field(1.0, gt=0.0, le=10.0)
    min_tokens: int | None = Field(0, ge=0)
    # vLLM's: smaller first, with --scheduling-policy priority
    priority: int | None = Field(0, ge=-(2**31), le=2**31 - 1)
    stop_token_ids: list[int] | None = None
    ignore_eos: bool | None = False
    stream: bool | None = False
    stop_sequences: list[str] | None = None
    metadata: Metadata | None = None
    service_tier: Literal["auto", "standard_only"] | None = None
    inference_geo: str | None = None
    cache_salt: CacheSalt | None = None  # vLLM's: the prefix cache shares pages only within a salt

    def sampling_params(self) -> SamplingParams:
        """The engine's parameters for this request: null is the field's default (for ``top_k``: off).

        Empty stop sequences are dropped; undeclared fields go to ``extra`` (sampling
        plugins). Raises RequestRejected for a value the engine refuses although the
        schema takes it (``top_p`` 0, a negative stop token id).
        """
        return SamplingParams(
            max_tokens=self.max_tokens,
            temperature=value_or_default(self, "temperature"),
            top_p=value_or_default(self, "top_p"),
            top_k=self.top_k or 0,
            min_p=value_or_default(self, "min_p"),
            repetition_penalty=value_or_default(self, "repetition_penalty"),
            min_tokens=value_or_default(self, "min_tokens"),
            stop_token_ids=list(self.stop_token_ids or []),
            ignore_eos=bool(self.ignore_eos),
            stop=[s for s in self.stop_sequences or [] if s],
            grammar=anthropic_format(self.output_config.format if self.output_config is not None else None),
            thinking_budget=self.thinking.budget_tokens if self.thinking is not None else None,
            extra=plugin_sampling(self),
        )


def _thinking_on(req: MessagesInput) -> bool:
    return req.thinking is not None and req.thinking.on


def _refuse_unimplemented(req: MessagesInput) -> None:
    """RequestRejected (param set) for a declared top-level field whose value astrai does not serve."""
    if _thinking_on(req) and req.tool_choice is not None and req.tool_choice.type in ("any", "tool"):
        # as Anthropic's API: a forced call starts the answer at once, with no room to think
        raise RequestRejected(
            f"thinking cannot be combined with tool_choice {req.tool_choice.type!r}, which forces a call",
            param="thinking",
        )
    if req.output_config is not None and req.output_config.effort is not None:
        raise RequestRejected(
            f"output_config.effort: {REFUSED['output_config']}", param="output_config.effort"
        )
    if req.output_config is not None:
        anthropic_format(req.output_config.format)  # a malformed format is refused before templating


def _template_messages(req: MessagesInput, key: bytes) -> list[dict[str, Any]]:
    """Messages in the Hugging Face chat-template convention: tool_use -> tool_calls, tool_result ->
    role tool, thinking -> the assistant turn's reasoning_content (once its signature verified)."""
    out: list[dict[str, Any]] = []
    if req.system and (system := "".join(b.text for b in req.system)):
        out.append({"role": "system", "content": system})
    for i, m in enumerate(req.messages):
        text = "".join(b.text for b in m.content if isinstance(b, TextBlock))
        thinking = _verified_thinking(m, i, key)
        calls = [
            {"id": b.id, "type": "function", "function": {"name": b.name, "arguments": b.input}}
            for b in m.content
            if isinstance(b, ToolUseBlock)
        ]
        results = [b for b in m.content if isinstance(b, ToolResultBlock)]
        out += [{"role": "tool", "content": b.text(), "tool_call_id": b.tool_use_id} for b in results]
        if text or calls or thinking or not results:
            reasoning = {"reasoning_content": "\n\n".join(thinking)} if thinking else {}
            out.append(
                {"role": m.role, "content": text, **reasoning, **({"tool_calls": calls} if calls else {})}
            )
    return out


def _verified_thinking(m: AnthropicMessage, i: int, key: bytes) -> list[str]:
    """The texts of message ``i``'s thinking blocks; RequestRejected naming the block for one in a user
    turn, or whose signature is not the one astrai gave it."""
    texts = []
    for j, b in enumerate(m.content):
        if not isinstance(b, ThinkingBlock):
            continue
        if m.role != "assistant":
            raise RequestRejected(
                "thinking blocks belong to assistant turns", param=f"messages.{i}.content.{j}.type"
            )
        if not verify(key, THINKING, b.thinking, b.signature):
            raise RequestRejected(
                "the thinking block's signature does not match its thinking: send the block back unmodified, "
                "as this server wrote it (signatures of other servers, or of this one before a restart "
                "without --signing-key, are not valid here)",
                param=f"messages.{i}.content.{j}.signature",
            )
        texts.append(b.thinking)
    return texts


#: Anthropic's ``tool_choice.type`` as ``select_tools``' mode.
TOOL_MODE = {"auto": "auto", "any": "required", "tool": "named", "none": "none"}


def _select_tools(req: MessagesInput) -> list[dict[str, Any]]:
    choice = req.tool_choice or ToolChoice()
    return select_tools(
        req.tools,
        TOOL_MODE[choice.type],
        choice.name,
        to_template=_tool_dicts,
        requires=f"tool_choice {choice.type!r} requires tools",
        noun="tool",
    )


def _tool_dicts(tools: list[ToolDef]) -> list[dict[str, Any]]:
    return [
        {
            "type": "function",
            "function": {"name": t.name, "description": t.description or "", "parameters": t.input_schema},
        }
        for t in tools
    ]


def _prompt(req: MessagesInput, engine: Any, key: bytes) -> tuple[list[int], list[dict[str, Any]], bool]:
    """The templated prompt's ids, the tools shown and whether the answer must be a call: what
    ``prepare`` and ``count_tokens`` share. Raises RequestRejected for what cannot be served."""
    _refuse_unimplemented(req)
    tools, messages, tok = _select_tools(req), _template_messages(req, key), engine.tokenizer
    prefill = ""
    if messages[-1]["role"] == "assistant" and "tool_calls" not in messages[-1]:
        if "reasoning_content" in messages[-1] or _thinking_on(req):
            raise RequestRejected(  # as Anthropic's API: the answer would start after the thinking
                "a prefilled (final) assistant turn cannot be combined with thinking",
                param=f"messages.{len(req.messages) - 1}.content",
            )
        prefill = messages.pop()["content"].rstrip()  # Anthropic rejects trailing whitespace; we trim it
    required = bool(tools) and req.tool_choice is not None and req.tool_choice.type in ("any", "tool")
    if required and prefill:
        raise RequestRejected(
            f"tool_choice {req.tool_choice.type!r} cannot continue a prefilled assistant turn",
            param="tool_choice",
        )
    # thinking off, as Anthropic's default: through the template where it has the switch (Qwen3's)
    off = (
        {"enable_thinking": False} if not _thinking_on(req) and "enable_thinking" in _template(tok) else None
    )
    return chat_prompt_ids(tok, messages, tools, prefill=prefill, template_kwargs=off), tools, required


def _template(tokenizer: Any) -> str:
    return getattr(tokenizer, "chat_template", None) or ""


class AnthropicResponseBuilder(ResponseBuilder):
    """Anthropic Messages over JSON and SSE (named events), and its token counting."""

    name = "anthropic"
    streams_calls = True
    route = "/v1/messages"
    overloaded_status = 529  # Anthropic's "overloaded_error"
    request_model = MessagesRequest

    def prepare(self, request: MessagesRequest, engine: Any) -> Prepared:
        prompt_ids, tools, required = _prompt(request, engine, self.signing_key)
        if _thinking_on(request) and (budget := request.thinking.budget_tokens) is not None:
            if budget >= request.max_tokens:
                raise RequestRejected(
                    f"budget_tokens ({budget}) must be less than max_tokens ({request.max_tokens})",
                    param="thinking.budget_tokens",
                )
        one_call = bool(request.tool_choice and request.tool_choice.disable_parallel_tool_use)
        return Prepared(
            request=request,
            prompt_ids=prompt_ids,
            params=request.sampling_params(),
            stream=bool(request.stream),
            tools=tools,
            tool_call_required=required,
            max_tokens_explicit="max_tokens" in request.model_fields_set,
            cache_salt=request.cache_salt,
            sampling_sent=sent_fields(request),
            response_id=new_id("msg_"),
            model=request.model,
            # thinking: whether thinking blocks are shown; then what a stream keeps (STREAM_STATE)
            state={"one_call": one_call, "thinking": _thinking_on(request), **STREAM_STATE},
            thinking_param="thinking.budget_tokens",  # what a refused budget names (astrai_server.thinking)
        )

    def post_routes(self) -> dict[str, tuple[type[BaseModel], Callable[[Any, Any], dict[str, Any]]]]:
        return {"/v1/messages/count_tokens": (MessagesInput, self.count_tokens)}

    def count_tokens(self, request: MessagesInput, engine: Any) -> dict[str, Any]:
        """``{"input_tokens": N}``, the ``usage.input_tokens`` of ``/v1/messages`` for the same input
        (a forced call's opening included); the context limit is not checked: nothing runs."""
        prompt_ids, tools, required = _prompt(request, engine, self.signing_key)
        prepared = Prepared(
            request=request,
            prompt_ids=prompt_ids,
            params=SamplingParams(),
            tools=tools,
            tool_call_required=required,
        )
        parser = Parsers(tool=self.tool_call_parser).for_engine(engine).tool  # the server's, as generating
        open_tool_call(prepared, engine.tokenizer, parser)  # the handler's rule, not a copy of it
        return {"input_tokens": len(prepared.prompt_ids)}

    def format_stream_start(self, prepared: Prepared) -> list[str]:
        message = {
            "id": prepared.response_id,
            "type": "message",
            "role": "assistant",
            "model": prepared.model,
            "content": [],
            "stop_reason": None,
            "stop_sequence": None,
            "usage": {"input_tokens": len(prepared.prompt_ids), "output_tokens": 0},
        }
        frames = [sse({"type": "message_start", "message": message}, "message_start")]
        if _state(prepared)["thinking"]:
            return frames  # the blocks open as their text comes: the thinking's (if any), then the text's
        return [*frames, *self._open(prepared, "text")]  # without thinking: one text block, then calls

    def _open(self, p: Prepared, kind: str, call: ToolCall | None = None) -> list[str]:
        """Frames closing the open block, if any, and opening a ``kind`` block (thinking, text, or
        the tool_use of ``call``)."""
        frames = self._close(p)
        if call is not None:
            block = {"type": "tool_use", "id": _tool_id(call.id), "name": call.name, "input": {}}
        elif kind == "thinking":
            block = {"type": "thinking", "thinking": "", "signature": ""}
        else:
            block = {"type": "text", "text": ""}
        p.state["open"], p.state["blocks"], index = kind, p.state["blocks"] + 1, p.state["blocks"]
        p.state["text"] = p.state["text"] or kind == "text"
        return [
            *frames,
            sse(
                {"type": "content_block_start", "index": index, "content_block": block}, "content_block_start"
            ),
        ]

    def _close(self, p: Prepared) -> list[str]:
        """Frames ending the open block: a thinking block's signature first."""
        kind, index = p.state["open"], p.state["blocks"] - 1
        if kind is None:
            return []
        frames = []
        if kind == "thinking":
            delta = {
                "type": "signature_delta",
                "signature": sign(self.signing_key, THINKING, p.state["reasoning"]),
            }
            frames.append(
                sse({"type": "content_block_delta", "index": index, "delta": delta}, "content_block_delta")
            )
        p.state["open"] = None
        return [*frames, sse({"type": "content_block_stop", "index": index}, "content_block_stop")]

    def format_reasoning_chunk(self, prepared: Prepared, index: int, text: str) -> list[str]:
        if not _state(prepared)["thinking"]:
            return []  # thinking not asked for: dropped, as the answer's only
        frames = [] if prepared.state["open"] == "thinking" else self._open(prepared, "thinking")
        prepared.state["reasoning"] += text
        delta = {"type": "thinking_delta", "thinking": text}
        block = prepared.state["blocks"] - 1
        return [
            *frames,
            sse({"type": "content_block_delta", "index": block, "delta": delta}, "content_block_delta"),
        ]

    def format_chunk(self, prepared: Prepared, index: int, text: str, **logprobs: Any) -> list[str]:
        st = _state(prepared)
        frames = [] if st["open"] == "text" else self._open(prepared, "text")
        delta = {"type": "text_delta", "text": text}
        return [*frames, _input_delta(st["blocks"] - 1, delta)]

    def format_call_delta(
        self, prepared: Prepared, index: int, k: int, call: ToolCall, arguments: str, first: bool
    ) -> list[str]:
        st = _state(prepared)
        if k and st["one_call"]:
            return []
        frames = self._open(prepared, "tool", call) if first else []
        if first:
            st["tools"][k] = st["blocks"] - 1
        if arguments:
            frames.append(
                _input_delta(st["tools"][k], {"type": "input_json_delta", "partial_json": arguments})
            )
        return frames

    def format_stream_end(self, prepared: Prepared, result: ChatResult) -> list[str]:
        p, choice = prepared, result.choices[0]
        calls, st = _calls(prepared, choice), _state(p)
        # an answer of no text has an empty text block unless it is calls (as format_response)
        frames = self._open(p, "text") if not (st["text"] or choice.tool_calls) else []
        for k, call in enumerate(calls[: len(choice.calls_streamed)]):  # the rest of what streamed
            if rest := call.arguments[choice.calls_streamed[k] :]:
                frames.append(
                    _input_delta(st["tools"][k], {"type": "input_json_delta", "partial_json": rest})
                )
        frames += self._close(p)
        for call in calls[len(choice.calls_streamed) :]:
            delta = {"type": "input_json_delta", "partial_json": call.arguments}
            frames += [*self._open(p, "tool", call), _input_delta(st["blocks"] - 1, delta), *self._close(p)]
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
        if _state(prepared)["thinking"] and choice.reasoning is not None:
            signature = sign(self.signing_key, THINKING, choice.reasoning)
            content.append({"type": "thinking", "thinking": choice.reasoning, "signature": signature})
        if choice.text or not choice.tool_calls:
            content.append({"type": "text", "text": choice.text})
        content += [
            {"type": "tool_use", "id": _tool_id(t.id), "name": t.name, "input": _input(t.arguments)}
            for t in _calls(prepared, choice)
        ]
        return {
            "id": prepared.response_id,
            "type": "message",
            "role": "assistant",
            "model": prepared.model,
            "content": content,
            "stop_reason": STOP_REASON[choice.finish_reason],
            "stop_sequence": choice.stop_sequence,
            "usage": {"input_tokens": result.prompt_tokens, "output_tokens": result.completion_tokens},
        }

    def format_error(self, status: int, message: str, param: str | None = None) -> dict[str, Any]:
        # Anthropic's shape has no param: the message names the field instead
        kind = ERROR_TYPE.get(status, "api_error" if status >= 500 else "invalid_request_error")
        if param and param not in message:
            message = f"{param}: {message}"
        return {"type": "error", "error": {"type": kind, "message": message}}


#: A stream's blocks (``Prepared.state``): ``blocks`` streamed, the ``open`` one (None, "thinking",
#: "text" or "tool"), whether a ``text`` block opened, the ``reasoning`` streamed (to sign), and
#: ``tools``: each streamed call's block (a fresh dict per stream: ``_state``).
STREAM_STATE = {"blocks": 0, "open": None, "text": False, "reasoning": ""}


def _state(p: Prepared) -> dict[str, Any]:
    """``p.state``, with what a stream keeps there (a ``Prepared`` made elsewhere may have none)."""
    for key, value in {"thinking": False, "one_call": False, **STREAM_STATE}.items():
        p.state.setdefault(key, value)
    p.state.setdefault("tools", {})
    return p.state


def _input_delta(block: int, delta: dict[str, Any]) -> str:
    return sse({"type": "content_block_delta", "index": block, "delta": delta}, "content_block_delta")


def _input(arguments: str) -> dict[str, Any]:
    """A call's ``input``: its arguments decoded; {} for arguments a length limit cut short."""
    try:
        decoded = json.loads(arguments)
    except ValueError:
        return {}
    return decoded if isinstance(decoded, dict) else {}


def _calls(prepared: Prepared, choice: Choice) -> list[ToolCall]:
    """The tool calls to send: only the first with ``tool_choice.disable_parallel_tool_use``."""
    return choice.tool_calls[:1] if prepared.state.get("one_call") else choice.tool_calls


def _tool_id(call_id: str) -> str:
    return "toolu_" + call_id.removeprefix("call_")
