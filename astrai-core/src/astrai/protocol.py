"""``ResponseBuilder``: the one class a wire protocol implements (a Strategy the server drives).

A protocol is one builder: it declares its route, its request model (pydantic),
how it frames a stream (media type, SSE or anything else) and how it shapes
results and errors. Its request model holds the protocol's HTTP defaults and
ranges (its fields) and turns a request into ``SamplingParams`` in one method;
checks that depend on the model (vocabulary, context) are the engine's, at
submit. A protocol-neutral ``ProtocolHandler`` (astrai-server) drives any
builder, streaming or not::

    prepared = builder.prepare(request, engine)           # templating, request.sampling_params()
    # streaming: format_stream_start, format_chunk per piece, format_stream_end
    # otherwise: format_response(prepared, result)

Builders are registered in the ``astrai.protocols`` entry-point group (see
``astrai.plugins``). This module imports pydantic only: no fastapi, no torch,
so a protocol plugin depends on astrai-core alone and is testable without HTTP.

Over 300 lines because this is the whole contract a protocol plugin implements: the result
types it shapes and the builder interface the server drives, each documented where it is defined.
"""

from __future__ import annotations

import json
import os
import time
import uuid
from abc import ABC, abstractmethod
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Annotated, Any, ClassVar

from pydantic import BaseModel, Field

from astrai.chat_prompt import chat_prompt_ids
from astrai.errors import PluginError
from astrai.plugins import LoadedPlugins, check_class, load_plugins

if TYPE_CHECKING:
    from astrai.logprobs import TokenLogprob
    from astrai.sampling.params import SamplingParams

__all__ = ["PROTOCOLS", "CacheSalt", "ChatResult", "Choice", "Prepared", "ResponseBuilder"]
__all__ += ["ToolCall", "chat_prompt_ids", "check_builder_class", "error_type_for", "load_protocols"]
__all__ += ["new_id", "plugin_sampling", "sent_fields", "sse", "value_or_default"]

#: vLLM's ``cache_salt`` request field, on every protocol: the prefix cache reuses a page only for a
#: request of the same salt (and tenant); any text of 1 to 1024 characters.
CacheSalt = Annotated[str, Field(min_length=1, max_length=1024)]


@dataclass
class ToolCall:
    """One tool call the model emitted. ``arguments`` is a JSON object encoded as text."""

    id: str
    name: str
    arguments: str = "{}"


@dataclass
class Choice:
    """One finished completion of a request (``n`` > 1 gives several, ``index`` 0..n-1)."""

    index: int
    text: str  # without stop strings and without the tool-call markup
    finish_reason: str  # the engine's (stop, length, stop_sequence, abort), or tool_calls: calls were parsed
    completion_tokens: int
    stop_sequence: str | None = None  # the stop string that matched (finish_reason "stop_sequence")
    tool_calls: list[ToolCall] = field(default_factory=list)
    # the thinking before the answer (a reasoning parser split it off); None: none
    reasoning: str | None = None
    reasoning_tokens: int = 0  # generated tokens of the thinking, its tags included
    prompt_index: int = 0  # which of ``Prepared.prompts`` it completes
    logprobs: list[TokenLogprob] | None = None  # per generated token, when the request asked
    prompt_logprobs: list[TokenLogprob | None] | None = None  # per prompt token (first: None), when asked
    logprobs_streamed: int = 0  # how many of ``logprobs`` went out with streamed chunks already
    # the calls that went out as they streamed (the first of ``tool_calls``): per call, the characters
    # of its ``arguments`` that went out (``ResponseBuilder.format_call_delta``)
    calls_streamed: list[int] = field(default_factory=list)


@dataclass
class ChatResult:
    """Everything a builder needs to shape a final response or the end of a stream."""

    choices: list[Choice]
    prompt_tokens: int  # prompt tokens after templating (of every prompt), counted once whatever n is
    cached_tokens: int = 0  # of those, the tokens the prefix cache served (the caller's own namespace)

    @property
    def completion_tokens(self) -> int:
        return sum(c.completion_tokens for c in self.choices)

    @property
    def total_tokens(self) -> int:
        return self.prompt_tokens + self.completion_tokens


@dataclass
class Prepared:
    """What ``ResponseBuilder.prepare`` returns: one request made ready for the engine.

    ``prompt_ids`` are the templated prompt's token ids; ``params`` the sampling
    parameters of choice 0 (choice i > 0 gets ``seed + i`` when a seed is set).
    ``max_tokens_explicit`` False lets the handler shorten ``params.max_tokens``
    to what the context has room for (a defaulted value must not reject a
    request); an explicit value that cannot fit is a 400. ``tools`` non-empty
    makes the handler parse tool calls out of the generated text;
    ``tool_call_required`` (OpenAI ``"required"`` or a named function, Anthropic
    ``any`` or ``tool``) makes it open a call at the end of the prompt, naming the
    tool when ``tools`` holds just one, so that the answer is a call.
    ``prompts`` holds several prompts when one request completes each (``/v1/completions``
    with a list): choice ``k`` completes prompt ``k // n``; ``None`` means ``[prompt_ids]``.
    ``cache_salt`` (vLLM's field): the prefix cache reuses only pages of requests with the same salt
    (and the same tenant: the server adds the API key's). ``state`` is the builder's own
    per-request scratch space. ``sampling_sent``: the ``SamplingParams`` fields the client set
    (``sent_fields``), the others take the model's generation defaults; None: no default applies.
    """

    request: BaseModel
    prompt_ids: list[int]
    params: SamplingParams
    prompts: list[list[int]] | None = None
    stream: bool = False
    n: int = 1
    tools: list[dict[str, Any]] = field(default_factory=list)
    tool_call_required: bool = False
    max_tokens_explicit: bool = True
    response_id: str = ""
    created: int = field(default_factory=lambda: int(time.time()))
    model: str = "astrai"
    cache_salt: str | None = None
    state: dict[str, Any] = field(default_factory=dict)
    sampling_sent: frozenset[str] | None = None
    # the request field that set ``params.thinking_budget`` (errors name it); "reasoning_effort" when an
    # effort did, which a model that does not think ignores (astrai_server.thinking)
    thinking_param: str | None = None
    # the field of a tool the client marked strict (OpenAI ``tools[].function.strict``): its calls must
    # be enforced by grammar, or the request is a 400 naming it (astrai_server.tools); None: none is
    strict_tools: str | None = None


def value_or_default(request: BaseModel, name: str) -> Any:
    """``request.<name>``, or that field's declared default when the client sent JSON null.

    Lets a request model keep its HTTP defaults in one place, its pydantic fields,
    while ``"temperature": null`` still means "the default".
    """
    value = getattr(request, name)
    return type(request).model_fields[name].get_default(call_default_factory=True) if value is None else value


def sent_fields(request: BaseModel) -> frozenset[str]:
    """The top-level fields, declared or not, ``request`` sent a value for (null is none): the
    ``Prepared.sampling_sent`` of a request model whose fields are named as ``SamplingParams``'s."""
    declared = {n for n in request.model_fields_set if getattr(request, n, None) is not None}
    return frozenset(declared | {k for k, v in (request.model_extra or {}).items() if v is not None})


def plugin_sampling(request: BaseModel) -> dict[str, Any]:
    """The request's undeclared fields (``model_extra``), for ``SamplingParams.extra``.

    How parameters of sampling plugins travel without any protocol naming them: a
    request model with ``extra="allow"`` keeps ``"typical_p": 0.9``, and the engine's
    pipeline runs the strategy named by such a key and validates its value at admission.
    A key no installed strategy claims never gets here: the server refuses it first
    (``astrai_server.handler.refuse_unknown``, a 400 naming the field).
    """
    return {k: v for k, v in (request.model_extra or {}).items() if v is not None}  # null: not set


def new_id(prefix: str) -> str:
    """A fresh response id such as ``chatcmpl-<24 hex>``."""
    return f"{prefix}{uuid.uuid4().hex[:24]}"


def sse(data: dict[str, Any] | str, event: str | None = None) -> str:
    """One Server-Sent Event frame: optional ``event:`` line, one ``data:`` line, blank line.

    ``data`` dicts are compact JSON (no spaces after separators), strings go as is.
    """
    payload = data if isinstance(data, str) else json.dumps(data, separators=(",", ":"), ensure_ascii=False)
    head = f"event: {event}\n" if event else ""
    return f"{head}data: {payload}\n\n"


class ResponseBuilder(ABC):
    """A wire protocol: request model, route, and the shape of every response and error.

    Subclasses set the class attributes and implement the five ``format_*`` /
    ``prepare`` methods; ``format_error`` and ``format_stream_error`` have
    defaults. Instances are created once per app with the served model name and
    are shared by concurrent requests: keep per-request state in ``Prepared``.
    Every ``format_*`` method is pure (no I/O) and must not raise for a valid
    ``Prepared``.
    """

    name: ClassVar[str]  # entry-point name, e.g. "openai"
    route: ClassVar[str]  # POST route, e.g. "/v1/chat/completions"; starts with "/"
    request_model: ClassVar[type[BaseModel]]  # validates the JSON body
    stream_media_type: ClassVar[str] = "text/event-stream"
    # the status of a request shed under load (astrai.errors.Overloaded): 429 Too Many Requests;
    # Anthropic's API answers 529 with an overloaded_error
    overloaded_status: ClassVar[int] = 429
    # whether a thinking model's reasoning is split off the answer (``format_reasoning_chunk``,
    # ``Choice.reasoning``); a raw-text protocol (``/v1/completions``) keeps the text as generated
    splits_reasoning: ClassVar[bool] = True
    # whether tool calls stream as the model writes them (``format_call_delta``); else they go out
    # whole in ``format_stream_end``
    streams_calls: ClassVar[bool] = False

    def __init__(self, model_name: str = "astrai") -> None:
        self.model_name = model_name
        # the secret of opaque values a protocol hands out and verifies when a client sends them back
        # (Anthropic's thinking signatures): the server sets its ``signing_key`` setting here; this
        # random one lasts as long as the process
        self.signing_key: bytes = os.urandom(32)
        # the tool-call parser the server was told to use (``--tool-call-parser``; None: chosen from
        # the chat template), for routes that shape a prompt outside a generation (count_tokens)
        self.tool_call_parser: str | None = None

    @abstractmethod
    def prepare(self, request: BaseModel, engine: Any) -> Prepared:
        """Turn a validated ``request_model`` instance into a ``Prepared``.

        ``engine`` is the ``InferenceEngine``; builders use ``engine.tokenizer``
        (``apply_chat_template``, ``encode``). Raises ``astrai.errors.RequestRejected``
        for a request that passes the schema but cannot be served (a 400).
        """

    @abstractmethod
    def format_stream_start(self, prepared: Prepared) -> list[str]:
        """Frames sent before the first piece (e.g. OpenAI role deltas, Anthropic message_start)."""

    @abstractmethod
    def format_chunk(self, prepared: Prepared, index: int, text: str, **logprobs: Any) -> list[str]:
        """Frames carrying ``text``, a non-empty piece of choice ``index``.

        When the request asked for log-probs (``params.logprobs`` / ``prompt_logprobs`` set) the
        handler adds ``logprobs=`` (the ``TokenLogprob`` of the tokens this text comes from) and, on a
        choice's first chunk, ``prompt_logprobs=`` (``Choice.prompt_logprobs``). The rest, of tokens
        that brought no text (EOS, a held-back stop string), is ``Choice.logprobs[logprobs_streamed:]``.
        """

    def format_reasoning_chunk(self, prepared: Prepared, index: int, text: str) -> list[str]:
        """Frames carrying ``text``, a non-empty piece of choice ``index``'s reasoning (the thinking a
        reasoning parser split off the answer; it always comes before the answer's chunks). Default:
        none (a protocol that cannot show reasoning drops it; ``Choice.reasoning`` still holds it)."""
        return []

    def format_call_delta(
        self, prepared: Prepared, index: int, k: int, call: ToolCall, arguments: str, first: bool
    ) -> list[str]:
        """Frames carrying call ``k`` of choice ``index`` as it streams (``streams_calls``): ``first``
        when it starts (its id and name go out then), ``arguments`` the next piece of its arguments
        (possibly empty). Calls come after the choice's text; ``format_stream_end`` sends what of them
        did not go out here (``Choice.calls_streamed``). Default: none."""
        return []

    @abstractmethod
    def format_stream_end(self, prepared: Prepared, result: ChatResult) -> list[str]:
        """Frames after the last piece: tool calls, finish reasons, usage, terminators."""

    @abstractmethod
    def format_response(self, prepared: Prepared, result: ChatResult) -> dict[str, Any]:
        """The JSON body of a non-streaming response."""

    def fan_out(self, request: BaseModel) -> list[tuple[str, int]]:
        """The fields that multiply the engine requests of ``request``, with their values, read before it is
        prepared: the server refuses a request whose product passes its bound (``--max-choices``) before
        templating anything, and names these fields. Default: ``n`` when the request model declares it."""
        if "n" not in type(request).model_fields:
            return []
        return [("n", value_or_default(request, "n"))]

    def get_routes(self) -> dict[str, Callable[..., dict[str, Any]]]:
        """GET routes the protocol adds besides its POST route (e.g. a model listing).

        Maps a path (starting with "/"; ``{name}`` segments are path parameters) to a function
        of the engine (and the path parameters, by keyword) returning the JSON body. The server
        guards them with the API key, answers 503 while the engine is not ready, and shapes
        errors with :meth:`format_error` (``ModelNotFound`` is a 404). Default: none.
        """
        return {}

    def post_routes(self) -> dict[str, tuple[type[BaseModel], Callable[[Any, Any], dict[str, Any]]]]:
        """JSON POST routes that generate nothing (tokenizer endpoints, token counting).

        Maps a path to ``(request model, function(request, engine) -> JSON body)``; the body is
        validated and checked for unknown fields as a generation request is, errors are shaped
        by :meth:`format_error`. Default: none.
        """
        return {}

    def format_error(self, status: int, message: str, param: str | None = None) -> dict[str, Any]:
        """The JSON body of an error response with HTTP ``status`` (400, 401, 422, 503, ...).

        ``param`` names the offending request field when known. The default is
        ``{"error": {"type", "message", "param"}}``; protocols override it.
        """
        return {"error": {"type": error_type_for(status), "message": message, "param": param}}

    def format_stream_error(self, prepared: Prepared, status: int, message: str) -> list[str]:
        """Frames reporting an error after the stream has started (the status line is gone)."""
        return [sse(self.format_error(status, message), event="error")]


def error_type_for(status: int) -> str:
    """A protocol-neutral error type name for an HTTP status (builders may use their own)."""
    if status == 401:
        return "authentication_error"
    if status == 404:
        return "not_found_error"
    if status in (503, 529):
        return "overloaded_error"
    if status >= 500:
        return "server_error"
    return "invalid_request_error"


PROTOCOLS = "astrai.protocols"
"""The entry-point group of ``ResponseBuilder`` subclasses that astrai-server mounts."""


def check_builder_class(name: str, plugin: object, origin: str) -> type[ResponseBuilder]:
    """Validate an ``astrai.protocols`` plugin: a ``ResponseBuilder`` named ``name`` whose
    ``route`` starts with "/" and whose ``request_model`` is a pydantic model. Raises PluginError."""
    cls = check_class(ResponseBuilder, name, plugin, origin)
    route = getattr(cls, "route", None)
    if not (isinstance(route, str) and route.startswith("/")):
        raise PluginError(
            f"{origin}: {cls.__qualname__}.route must be a path starting with '/', got {route!r}"
        )
    model = getattr(cls, "request_model", None)
    if not (isinstance(model, type) and issubclass(model, BaseModel)):
        raise PluginError(f"{origin}: {cls.__qualname__}.request_model must be a pydantic BaseModel subclass")
    return cls


def load_protocols() -> LoadedPlugins:
    """Every installed ``ResponseBuilder`` class (validated by ``check_builder_class``; failures kept)."""
    return load_plugins(PROTOCOLS, check_builder_class)
