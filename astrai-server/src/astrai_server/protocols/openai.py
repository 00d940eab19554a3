"""OpenAI Chat Completions (``POST /v1/chat/completions``), as the official ``openai`` SDK expects it.

Registered as entry point ``openai`` in ``astrai.protocols``. Parameters,
defaults and ranges are the fields of ``ChatCompletionRequest``, as documented in
docs/http-api.md; ``n``, ``seed``, ``presence_penalty`` and ``logit_bias`` are
implemented; ``ignore_eos`` is the vLLM / llama.cpp extension. Streams end with a
usage chunk (``"choices": []``, unless ``stream_options.include_usage`` is false)
and ``data: [DONE]``.
"""

from __future__ import annotations

import json
import logging
import time
from collections.abc import Callable
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

from astrai.errors import RequestRejected
from astrai.protocol import (
    ChatResult,
    Prepared,
    ResponseBuilder,
    chat_prompt_ids,
    error_type_for,
    new_id,
    plugin_sampling,
    sse,
    value_or_default,
)
from astrai.sampling import SamplingParams

logger = logging.getLogger(__name__)

FINISH = {"stop": "stop", "stop_sequence": "stop", "length": "length", "tool_calls": "tool_calls", "abort": "stop"}


class TextPart(BaseModel):
    type: Literal["text"]
    text: str


class FunctionCall(BaseModel):
    name: str
    arguments: str = "{}"


class ToolCallIn(BaseModel):
    id: str = ""
    type: Literal["function"] = "function"
    function: FunctionCall


class Message(BaseModel):
    model_config = ConfigDict(extra="ignore")

    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[TextPart] | None = None
    name: str | None = None
    tool_calls: list[ToolCallIn] | None = None
    tool_call_id: str | None = None

    @model_validator(mode="after")
    def _content_present(self) -> Message:
        if self.content is None and not (self.role == "assistant" and self.tool_calls):
            raise ValueError(f"a {self.role} message needs content")
        return self

    def text(self) -> str:
        if isinstance(self.content, list):
            return "".join(p.text for p in self.content)
        return self.content or ""


class FunctionDef(BaseModel):
    name: str = Field(min_length=1, max_length=64)
    description: str | None = None
    parameters: dict[str, Any] | None = None


class ToolDef(BaseModel):
    type: Literal["function"] = "function"
    function: FunctionDef


class StreamOptions(BaseModel):
    include_usage: bool = True


class ChatCompletionRequest(BaseModel):
    """The request body of ``POST /v1/chat/completions``; undeclared fields are kept for sampling plugins."""

    model_config = ConfigDict(extra="allow")

    model: str = "astrai"
    messages: list[Message] = Field(min_length=1)
    temperature: float | None = Field(1.0, ge=0.0, le=2.0)
    top_p: float | None = Field(1.0, ge=0.0, le=1.0)
    top_k: int | None = Field(50, ge=0)
    max_tokens: int | None = Field(2048, gt=0)
    max_completion_tokens: int | None = Field(None, gt=0)
    stream: bool | None = False
    stream_options: StreamOptions | None = None
    stop: str | list[str] | None = None
    n: int | None = Field(1, ge=1, le=16)
    presence_penalty: float | None = Field(0.0, ge=-2.0, le=2.0)
    frequency_penalty: float | None = Field(0.0, ge=-2.0, le=2.0)
    logit_bias: dict[int, Annotated[float, Field(ge=-100.0, le=100.0)]] | None = None
    user: str | None = None
    seed: int | None = None
    tools: list[ToolDef] | None = None
    tool_choice: Literal["none", "auto", "required"] | dict[str, Any] | None = "auto"
    ignore_eos: bool = False

    def sampling_params(self) -> SamplingParams:
        """The engine's parameters for this request: null is the field's default (for ``top_k``: off).

        ``max_completion_tokens`` wins over ``max_tokens``; empty stop strings are dropped;
        undeclared fields go to ``extra`` (sampling plugins). Raises RequestRejected for a
        value the engine refuses although the schema takes it (``top_p`` 0).
        """
        stop = [self.stop] if isinstance(self.stop, str) else self.stop or []
        return SamplingParams(
            max_tokens=self.max_completion_tokens or value_or_default(self, "max_tokens"),
            temperature=value_or_default(self, "temperature"),
            top_p=value_or_default(self, "top_p"),
            top_k=self.top_k or 0,
            stop=[s for s in stop if s],
            seed=self.seed,
            frequency_penalty=value_or_default(self, "frequency_penalty"),
            presence_penalty=value_or_default(self, "presence_penalty"),
            logit_bias=dict(self.logit_bias or {}),
            ignore_eos=self.ignore_eos,
            extra=plugin_sampling(self),
        )

    @property
    def max_tokens_explicit(self) -> bool:
        """Whether the client set a token limit (null is the default, which may be shortened)."""
        sent = "max_tokens" in self.model_fields_set and self.max_tokens is not None
        return sent or self.max_completion_tokens is not None


def _template_message(m: Message) -> dict[str, Any]:
    """A message in the Hugging Face chat-template convention (content always a string)."""
    role = "system" if m.role == "developer" else m.role
    out: dict[str, Any] = {"role": role, "content": m.text()}
    if m.tool_calls:
        out["tool_calls"] = [
            {"id": c.id, "type": "function", "function": {"name": c.function.name, "arguments": _loads(c.function.arguments)}}
            for c in m.tool_calls
        ]
    if m.tool_call_id is not None:
        out["tool_call_id"] = m.tool_call_id
    return out


def _loads(arguments: str) -> Any:
    try:
        return json.loads(arguments)
    except ValueError:
        return arguments  # templates render it as given


def _select_tools(req: ChatCompletionRequest) -> list[dict[str, Any]]:
    if not req.tools and req.tool_choice not in ("none", "auto", None):
        raise RequestRejected("tool_choice requires tools")
    if not req.tools or req.tool_choice == "none":
        return []
    tools = [t.model_dump(exclude_none=True) for t in req.tools]
    if isinstance(req.tool_choice, dict):
        name = (req.tool_choice.get("function") or {}).get("name")
        tools = [t for t in tools if t["function"]["name"] == name]
        if not tools:
            raise RequestRejected(f"tool_choice names function {name!r}, which is not in tools")
    return tools


class OpenAIResponseBuilder(ResponseBuilder):
    """OpenAI Chat Completions over JSON and SSE."""

    name = "openai"
    route = "/v1/chat/completions"
    request_model = ChatCompletionRequest

    def prepare(self, request: ChatCompletionRequest, engine: Any) -> Prepared:
        for field_name in ("user",):
            if getattr(request, field_name) is not None:
                logger.warning("%s is accepted for compatibility and ignored", field_name)
        tools = _select_tools(request)
        messages = [_template_message(m) for m in request.messages]
        prompt_ids = chat_prompt_ids(engine.tokenizer, messages, tools)
        params = request.sampling_params()
        include_usage = request.stream_options.include_usage if request.stream_options else True
        required = bool(tools) and (request.tool_choice == "required" or isinstance(request.tool_choice, dict))
        return Prepared(
            request=request, prompt_ids=list(prompt_ids), params=params, stream=bool(request.stream),
            n=value_or_default(request, "n"), tools=tools, tool_call_required=required,
            max_tokens_explicit=request.max_tokens_explicit,
            response_id=new_id("chatcmpl-"), model=request.model, state={"include_usage": include_usage},
        )  # fmt: skip

    def __init__(self, model_name: str = "astrai") -> None:
        super().__init__(model_name)
        self.created = int(time.time())

    def get_routes(self) -> dict[str, Callable[[Any], dict[str, Any]]]:
        return {"/v1/models": self._models}

    def _models(self, engine: Any) -> dict[str, Any]:
        limit = engine.context_limit
        model = {
            "id": self.model_name, "object": "model", "created": self.created, "owned_by": "astrai",
            "context_length": limit, "max_model_len": limit,
        }  # fmt: skip
        return {"object": "list", "data": [model]}

    def _chunk(self, p: Prepared, choices: list[dict[str, Any]], **extra: Any) -> str:
        body = {"id": p.response_id, "object": "chat.completion.chunk", "created": p.created, "model": p.model}
        return sse({**body, "choices": choices, **extra})

    def format_stream_start(self, prepared: Prepared) -> list[str]:
        return [
            self._chunk(prepared, [{"index": i, "delta": {"role": "assistant"}, "finish_reason": None}])
            for i in range(prepared.n)
        ]

    def format_chunk(self, prepared: Prepared, index: int, text: str) -> list[str]:
        return [self._chunk(prepared, [{"index": index, "delta": {"content": text}, "finish_reason": None}])]

    def format_stream_end(self, prepared: Prepared, result: ChatResult) -> list[str]:
        frames = []
        for c in result.choices:
            if c.tool_calls:
                calls = [
                    {"index": k, "id": t.id, "type": "function", "function": {"name": t.name, "arguments": t.arguments}}
                    for k, t in enumerate(c.tool_calls)
                ]
                frames.append(self._chunk(prepared, [{"index": c.index, "delta": {"tool_calls": calls}, "finish_reason": None}]))
            frames.append(self._chunk(prepared, [{"index": c.index, "delta": {}, "finish_reason": FINISH[c.finish_reason]}]))
        if prepared.state.get("include_usage", True):
            frames.append(self._chunk(prepared, [], usage=_usage(result)))
        frames.append(sse("[DONE]"))
        return frames

    def format_response(self, prepared: Prepared, result: ChatResult) -> dict[str, Any]:
        choices = []
        for c in result.choices:
            message: dict[str, Any] = {"role": "assistant", "content": c.text if (c.text or not c.tool_calls) else None}
            if c.tool_calls:
                message["tool_calls"] = [
                    {"id": t.id, "type": "function", "function": {"name": t.name, "arguments": t.arguments}}
                    for t in c.tool_calls
                ]
            choices.append({"index": c.index, "message": message, "logprobs": None, "finish_reason": FINISH[c.finish_reason]})
        return {
            "id": prepared.response_id, "object": "chat.completion", "created": prepared.created,
            "model": prepared.model, "choices": choices, "usage": _usage(result),
        }  # fmt: skip

    def format_error(self, status: int, message: str, param: str | None = None) -> dict[str, Any]:
        code = "invalid_api_key" if status == 401 else None
        kind = "server_error" if status >= 500 else error_type_for(status)
        return {"error": {"message": message, "type": kind, "param": param, "code": code}}

    def format_stream_error(self, prepared: Prepared, status: int, message: str) -> list[str]:
        return [sse(self.format_error(status, message))]  # the SDK raises on a data line with "error"


def _usage(result: ChatResult) -> dict[str, int]:
    return {
        "prompt_tokens": result.prompt_tokens,
        "completion_tokens": result.completion_tokens,
        "total_tokens": result.total_tokens,
    }
