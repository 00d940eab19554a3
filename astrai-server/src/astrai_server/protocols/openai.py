"""OpenAI Chat Completions (``POST /v1/chat/completions``), as the official ``openai`` SDK expects it.

Registered as entry point ``openai`` in ``astrai.protocols``. Parameters,
defaults and ranges are the fields of ``ChatCompletionRequest``, as documented in
docs/http-api.md; ``n``, ``seed``, ``presence_penalty``, ``logit_bias`` and log-probs
are implemented; ``top_k``, ``min_p``, ``repetition_penalty``, ``min_tokens``,
``stop_token_ids`` and ``ignore_eos`` are the vLLM extensions. Every field the ``openai``
SDK can send is implemented, accepted as metadata (``IGNORED``) or refused with a 400
naming it (``REFUSED``). Streams end with a usage chunk (``"choices": []``, unless
``stream_options.include_usage`` is false) and ``data: [DONE]``. The builder also serves
``GET /v1/models[/{model}]`` and vLLM's ``POST /tokenize`` and ``POST /detokenize``.

Over 300 lines because a builder is one file: its request models (every field the SDK can
send, each handled on purpose), log-probs, and the routes the protocol adds (the tokenizer
endpoints, at the end, are the first candidate for a module of their own).
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Discriminator, Field, Tag, field_validator, model_validator

from astrai.errors import ModelNotFound, RequestRejected
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
from astrai_server.embeddings import model_cards
from astrai_server.lora import adapter_cards
from astrai_server.openai_shapes import FINISH, StreamOptions, logprob_entries, openai_error, openai_usage
from astrai_server.request_parts import (
    Strict,
    decode_arguments,
    json_kind,
    null_is_not_sent,
    select_tools,
    text_or_parts,
)
from astrai_server.structured import one_of, openai_response_format, vllm_structured_outputs
from astrai_server.thinking import EFFORTS, budget_field, check_budget, effort_controls

if TYPE_CHECKING:
    from astrai.logprobs import TokenLogprob

#: Request fields of OpenAI's API that astrai refuses (400, ``param`` naming the field), and when.
#: Fields none of whose values can be served stay undeclared (the handler refuses undeclared
#: fields); JSON null for them means "not sent", as for any OpenAI field. docs/http-api.md shows it.
REFUSED = {
    "audio": "any value: astrai generates text only",
    "function_call": "any value: deprecated by OpenAI; use tool_choice",
    "functions": "any value: deprecated by OpenAI; use tools",
    "modalities": 'a list with "audio": astrai generates text only',
    "moderation": "any value: astrai moderates nothing",
    "prediction": "any value: predicted outputs are not implemented",
    "store": "true: astrai stores no completions",
    "verbosity": "any value: astrai has no verbosity control",
    "web_search_options": "any value: astrai does not search the web",
    "messages[].audio": "any value: an earlier audio answer cannot be resolved",
    "messages[].function_call": "any value: deprecated by OpenAI; use tool_calls",
}

#: Fields accepted and ignored: metadata that changes nothing a client can observe.
IGNORED = {
    "metadata": "Tags for OpenAI's dashboard; nothing is stored.",
    "prompt_cache_key": "A cache-routing hint; astrai's prefix cache needs none.",
    "prompt_cache_options": "Cache lifetime hints; the prefix cache keeps pages while there is room.",
    "prompt_cache_retention": "As prompt_cache_options.",
    "safety_identifier": "An end-user id for OpenAI's abuse detection.",
    "service_tier": "A billing and latency tier; astrai has one.",
    "store": "false: nothing is stored anyway.",
    "user": "An end-user id, replaced by safety_identifier and prompt_cache_key.",
    "messages[].annotations": "Citations of an earlier answer (sent back when replaying one).",
    "messages[].content[].prompt_cache_breakpoint": "A cache hint.",
    "stream_options.include_obfuscation": "Padding against side channels; chunks carry none.",
}


class TextPart(Strict):
    type: Literal["text"]
    text: str
    prompt_cache_breakpoint: dict[str, Any] | None = None


class FunctionCall(Strict):
    name: str
    arguments: str = "{}"


class ToolCallIn(Strict):
    id: str = ""
    type: Literal["function"] = "function"
    function: FunctionCall


class Message(Strict):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: text_or_parts(TextPart) | None = None
    name: str | None = None
    tool_calls: list[ToolCallIn] | None = None
    tool_call_id: str | None = None
    refusal: str | None = None
    annotations: list[Any] | None = None
    audio: dict[str, Any] | None = None
    function_call: dict[str, Any] | None = None

    @field_validator("content", mode="before")
    @classmethod
    def _text_parts_only(cls, content: Any) -> Any:
        # one clear 422 for an image or audio part, rather than every way it fails to be a TextPart
        for part in content if isinstance(content, list) else ():
            if isinstance(part, dict) and part.get("type") != "text":
                raise ValueError(f"content part of type {part.get('type')!r} is not supported (text only)")
        return content

    @model_validator(mode="after")
    def _content_present(self) -> Message:
        answered = self.role == "assistant" and (self.tool_calls or self.refusal is not None)
        if self.content is None and not answered:
            raise ValueError(f"a {self.role} message needs content")
        return self

    def text(self) -> str:
        if isinstance(self.content, list):
            return "".join(p.text for p in self.content)
        return self.content if self.content is not None else self.refusal or ""


class FunctionDef(Strict):
    name: str = Field(min_length=1, max_length=64)
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class ToolDef(Strict):
    type: Literal["function"] = "function"
    function: FunctionDef


class FunctionName(Strict):
    name: str


class NamedToolChoice(Strict):
    """``{"type": "function", "function": {"name": ...}}``. Another type (``allowed_tools``, ``custom``)
    keeps only its ``type``, refused in ``prepare`` naming it, as a hosted tool is."""

    type: str = "function"
    function: FunctionName | None = None

    @model_validator(mode="before")
    @classmethod
    def _other_type(cls, data: Any) -> Any:
        if isinstance(data, dict) and data.get("type", "function") != "function":
            return {"type": data["type"]}
        return data

    @model_validator(mode="after")
    def _named(self) -> NamedToolChoice:
        if self.type == "function" and self.function is None:
            raise ValueError('a function tool_choice needs "function": {"name": ...}')
        return self


#: ``tool_choice``: a mode or a named function, told apart by the JSON type (``json_kind``).
ToolChoice = Annotated[
    Annotated[Literal["none", "auto", "required"], Tag("str")] | Annotated[NamedToolChoice, Tag("dict")],
    Discriminator(
        json_kind,
        custom_error_type="tool_choice",
        custom_error_message=(
            'Input should be "none", "auto", "required" or {"type": "function", "function": {"name": ...}}'
        ),
    ),
]


class ChatCompletionRequest(BaseModel):
    """The request body of ``POST /v1/chat/completions``; undeclared fields are kept for sampling plugins
    (the handler refuses those no plugin claims)."""

    model_config = ConfigDict(extra="allow")

    model: str = "astrai"
    messages: list[Message] = Field(min_length=1)
    temperature: float | None = Field(1.0, ge=0.0, le=2.0)
    top_p: float | None = Field(1.0, ge=0.0, le=1.0)
    top_k: int | None = Field(50, ge=0)
    max_tokens: int | None = Field(2048, gt=0)  # the spec's table; fitted to the context when not sent
    max_completion_tokens: int | None = Field(None, gt=0)
    stream: bool | None = False
    stream_options: StreamOptions | None = None
    stop: str | list[str] | None = None
    n: int | None = Field(1, ge=1, le=16)
    presence_penalty: float | None = Field(0.0, ge=-2.0, le=2.0)
    frequency_penalty: float | None = Field(0.0, ge=-2.0, le=2.0)
    logit_bias: dict[int, Annotated[float, Field(ge=-100.0, le=100.0)]] | None = None
    logprobs: bool | None = False
    top_logprobs: int | None = Field(None, ge=0, le=20)
    seed: int | None = None
    tools: list[ToolDef] | None = None
    tool_choice: ToolChoice | None = "auto"
    parallel_tool_calls: bool | None = True
    response_format: dict[str, Any] | None = None
    structured_outputs: dict[str, Any] | None = None  # vLLM's
    modalities: list[Literal["text", "audio"]] | None = None
    store: bool | None = False
    metadata: dict[str, str] | None = None
    user: str | None = None
    safety_identifier: str | None = None
    service_tier: str | None = None
    prompt_cache_key: str | None = None
    prompt_cache_retention: str | None = None
    prompt_cache_options: dict[str, Any] | None = None
    min_p: float | None = Field(0.0, ge=0.0, le=1.0)
    repetition_penalty: float | None = Field(1.0, gt=0.0, le=10.0)
    min_tokens: int | None = Field(0, ge=0)
    # vLLM's: smaller first, with --scheduling-policy priority
    priority: int | None = Field(0, ge=-(2**31), le=2**31 - 1)
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False
    cache_salt: CacheSalt | None = None  # vLLM's: the prefix cache shares pages only within a salt
    chat_template_kwargs: dict[str, Any] | None = None  # vLLM's: more variables for the chat template
    # thinking controls (astrai_server.thinking): a budget in vLLM's or SGLang's spelling, an effort
    thinking_token_budget: int | None = None
    thinking_budget: int | None = None
    reasoning_effort: Literal[EFFORTS] | None = None

    _null_is_not_sent = null_is_not_sent(REFUSED)  # JSON null is OpenAI's "not set"

    def sampling_params(self) -> SamplingParams:
        """The engine's parameters for this request: null is the field's default (for ``top_k``: off).

        ``max_completion_tokens`` wins over ``max_tokens``; empty stop strings are dropped;
        undeclared fields go to ``extra`` (sampling plugins); ``logprobs`` true asks for
        ``top_logprobs`` (default 0) alternatives. Raises RequestRejected for a value the engine
        refuses although the schema takes it (``top_p`` 0), for ``top_logprobs`` without
        ``logprobs`` and for ``min_tokens`` above ``max_tokens``.
        """
        if self.top_logprobs is not None and not self.logprobs:
            raise RequestRejected("top_logprobs requires logprobs: true", param="top_logprobs")
        stop = [self.stop] if isinstance(self.stop, str) else self.stop or []
        params = SamplingParams(
            max_tokens=self.max_completion_tokens or value_or_default(self, "max_tokens"),
            temperature=value_or_default(self, "temperature"),
            top_p=value_or_default(self, "top_p"),
            top_k=self.top_k or 0,
            stop=[s for s in stop if s],
            seed=self.seed,
            frequency_penalty=value_or_default(self, "frequency_penalty"),
            presence_penalty=value_or_default(self, "presence_penalty"),
            logit_bias=dict(self.logit_bias or {}),
            min_p=value_or_default(self, "min_p"),
            repetition_penalty=value_or_default(self, "repetition_penalty"),
            min_tokens=value_or_default(self, "min_tokens"),
            stop_token_ids=list(self.stop_token_ids or []),
            ignore_eos=self.ignore_eos,
            logprobs=(self.top_logprobs or 0) if self.logprobs else None,
            grammar=one_of(
                ("response_format", openai_response_format(self.response_format)),
                ("structured_outputs", vllm_structured_outputs(self.structured_outputs)),
            ),
            extra=plugin_sampling(self),
        )
        budget, field = budget_field(self)
        check_budget(budget, field, params.max_tokens)
        if budget is not None:
            params = dataclasses.replace(params, thinking_budget=budget)
        if params.min_tokens > params.max_tokens:
            raise RequestRejected(
                f"min_tokens ({params.min_tokens}) must not exceed max_tokens ({params.max_tokens})",
                param="min_tokens",
            )
        return params

    @property
    def max_tokens_explicit(self) -> bool:
        """Whether the client set a token limit (null is the default, which may be shortened)."""
        sent = "max_tokens" in self.model_fields_set and self.max_tokens is not None
        return sent or self.max_completion_tokens is not None


def _template_info(template: Any) -> dict[str, str] | None:
    """The card's ``chat_template``: where the active template comes from and its SHA-256."""
    return None if template is None else {"source": template.source, "sha256": template.sha256}


def _template_message(m: Message) -> dict[str, Any]:
    """A message in the Hugging Face chat-template convention (content always a string)."""
    role = "system" if m.role == "developer" else m.role
    out: dict[str, Any] = {"role": role, "content": m.text()}
    if m.tool_calls:
        out["tool_calls"] = [
            {
                "id": c.id,
                "type": "function",
                "function": {"name": c.function.name, "arguments": decode_arguments(c.function.arguments)},
            }
            for c in m.tool_calls
        ]
    if m.tool_call_id is not None:
        out["tool_call_id"] = m.tool_call_id
    if m.name is not None:
        out["name"] = m.name  # the template's to render or not (vLLM passes it on too)
    return out


def _refused(entry: str, param: str) -> RequestRejected:
    return RequestRejected(f"unsupported value for {param} (refused for {REFUSED[entry]})", param=param)


def _template_messages(messages: list[Message]) -> list[dict[str, Any]]:
    """``messages`` for the chat template; RequestRejected for parts of a turn that cannot be shown to it."""
    for i, m in enumerate(messages):
        for name in ("audio", "function_call"):
            if getattr(m, name) is not None:
                raise _refused(f"messages[].{name}", f"messages.{i}.{name}")
    return [_template_message(m) for m in messages]


def _tool_dicts(tools: list[ToolDef]) -> list[dict[str, Any]]:
    """The tools as the chat template sees them (``strict`` is the handler's: ``_strict_field``)."""
    return [t.model_dump(exclude_none=True, exclude={"function": {"strict"}}) for t in tools]


def _strict_field(req: ChatCompletionRequest) -> str | None:
    """``tools.<i>.function.strict`` of the first tool marked strict (its calls must be enforced)."""
    i = next((i for i, t in enumerate(req.tools or ()) if t.function.strict), None)
    return None if i is None or req.tool_choice == "none" else f"tools.{i}.function.strict"


def _refuse_unserved(req: ChatCompletionRequest) -> None:
    """RequestRejected (param: the field) for a declared field whose value astrai cannot honour."""
    unserved = {
        "store": bool(req.store),
        "modalities": "audio" in (req.modalities or ()),
    }
    for name, refused in unserved.items():
        if refused:
            raise _refused(name, name)


def _select_tools(req: ChatCompletionRequest) -> list[dict[str, Any]]:
    """The tools shown to the model; RequestRejected for a tool_choice that cannot be served."""
    choice = req.tool_choice
    named = isinstance(choice, NamedToolChoice)
    # another type than function asks a call as "required" does: refused after the checks those get
    mode = ("named" if choice.function else "required") if named else choice or "auto"
    tools = select_tools(
        req.tools,
        mode,
        choice.function.name if named and choice.function else None,
        to_template=_tool_dicts,
        requires_param=None,
        name_param="tool_choice.function.name",
    )
    if named and choice.function is None:  # only named functions are served
        raise RequestRejected(
            f"tool_choice of type {choice.type!r} is not supported", param="tool_choice.type"
        )
    return tools


class OpenAIResponseBuilder(ResponseBuilder):
    """OpenAI Chat Completions over JSON and SSE."""

    name = "openai"
    route = "/v1/chat/completions"
    request_model = ChatCompletionRequest
    streams_calls = True

    def prepare(self, request: ChatCompletionRequest, engine: Any) -> Prepared:
        """``state``: ``include_usage``, ``one_call`` (``parallel_tool_calls`` false: only the first
        call is returned) and, when log-probs were asked, ``tokenizer`` (to render their tokens)."""
        _refuse_unserved(request)
        tools = _select_tools(request)
        params = request.sampling_params()
        template = getattr(engine.tokenizer, "chat_template", None) or ""
        kwargs, effort_budget = effort_controls(
            request.reasoning_effort, template, request.chat_template_kwargs, params.max_tokens
        )
        prompt_ids = chat_prompt_ids(
            engine.tokenizer, _template_messages(request.messages), tools, template_kwargs=kwargs
        )
        thinking_param = budget_field(request)[1]
        if thinking_param is None and effort_budget is not None:
            params = dataclasses.replace(params, thinking_budget=effort_budget)
            thinking_param = "reasoning_effort"
        state = {
            "include_usage": request.stream_options.include_usage if request.stream_options else True,
            "one_call": request.parallel_tool_calls is False,
        }
        if params.logprobs is not None:
            state["tokenizer"] = engine.tokenizer
        required = bool(tools) and (
            request.tool_choice == "required" or isinstance(request.tool_choice, NamedToolChoice)
        )
        return Prepared(
            request=request,
            prompt_ids=list(prompt_ids),
            params=params,
            stream=bool(request.stream),
            n=value_or_default(request, "n"),
            tools=tools,
            tool_call_required=required,
            max_tokens_explicit=request.max_tokens_explicit,
            cache_salt=request.cache_salt,
            sampling_sent=sent_fields(request),
            thinking_param=thinking_param,
            strict_tools=_strict_field(request),
            response_id=new_id("chatcmpl-"),
            model=request.model,
            state=state,
        )

    def __init__(self, model_name: str = "astrai") -> None:
        super().__init__(model_name)
        self.created = int(time.time())
        self.embedders: dict[str, Any] = {}  # the embedding models served beside (the app sets it)

    def get_routes(self) -> dict[str, Callable[..., dict[str, Any]]]:
        # {model:path}: served names such as "HuggingFaceTB/SmolLM2-135M" hold a slash
        return {"/v1/models": self._models, "/v1/models/{model:path}": self._model}

    def post_routes(self) -> dict[str, tuple[type[BaseModel], Callable[[Any, Any], dict[str, Any]]]]:
        return {"/tokenize": (TokenizeRequest, _tokenize), "/detokenize": (DetokenizeRequest, _detokenize)}

    def _card(self, engine: Any) -> dict[str, Any]:
        limit = engine.context_limit
        return {
            "id": self.model_name,
            "object": "model",
            "created": self.created,
            "owned_by": "astrai",
            "root": None,
            "parent": None,
            "context_length": limit,
            "max_model_len": limit,
            # astrai's: which chat template renders chats (None: the model has none), and the
            # sampling values requests that leave them out get (--chat-template, --generation-config)
            "chat_template": _template_info(getattr(getattr(engine, "tokenizer", None), "template", None)),
            "generation_defaults": dict(
                getattr(getattr(engine, "config", None), "generation_defaults", None) or {}
            ),
        }

    def _models(self, engine: Any) -> dict[str, Any]:
        chat = [] if getattr(engine, "task", None) else [self._card(engine)]  # (a pooling model alone)
        adapters = adapter_cards(engine, self.model_name, self.created)  # LoRA adapters, with their parent
        return {"object": "list", "data": [*chat, *adapters, *model_cards(self.embedders, self.created)]}

    def _model(self, engine: Any, model: str) -> dict[str, Any]:
        if model in self.embedders:
            return model_cards({model: self.embedders[model]}, self.created)[0]
        for card in adapter_cards(engine, self.model_name, self.created):
            if card["id"] == model:
                return card
        if model != self.model_name or getattr(engine, "task", None):  # OpenAI's words
            raise ModelNotFound(f"The model `{model}` does not exist or you do not have access to it.")
        return self._card(engine)

    def _chunk(self, p: Prepared, choices: list[dict[str, Any]], **extra: Any) -> str:
        body = {
            "id": p.response_id,
            "object": "chat.completion.chunk",
            "created": p.created,
            "model": p.model,
        }
        return sse({**body, "choices": choices, **extra})

    def format_stream_start(self, prepared: Prepared) -> list[str]:
        return [
            self._chunk(prepared, [{"index": i, "delta": {"role": "assistant"}, "finish_reason": None}])
            for i in range(prepared.n)
        ]

    def format_chunk(self, prepared: Prepared, index: int, text: str, **logprobs: Any) -> list[str]:
        choice: dict[str, Any] = {"index": index, "delta": {"content": text}}
        if (entries := _logprobs(prepared, logprobs.get("logprobs"))) is not None:
            choice["logprobs"] = entries
        return [self._chunk(prepared, [{**choice, "finish_reason": None}])]

    def format_reasoning_chunk(self, prepared: Prepared, index: int, text: str) -> list[str]:
        choice = {"index": index, "delta": {"reasoning_content": text}, "finish_reason": None}
        return [self._chunk(prepared, [choice])]

    def format_call_delta(
        self, prepared: Prepared, index: int, k: int, call: ToolCall, arguments: str, first: bool
    ) -> list[str]:
        if k and prepared.state.get("one_call"):
            return []
        entry: dict[str, Any] = {"index": k, "function": {"arguments": arguments}}
        if first:
            entry = {
                "index": k,
                "id": call.id,
                "type": "function",
                "function": {"name": call.name, "arguments": arguments},
            }
        delta = {"tool_calls": [entry]}
        return [self._chunk(prepared, [{"index": index, "delta": delta, "finish_reason": None}])]

    def format_stream_end(self, prepared: Prepared, result: ChatResult) -> list[str]:
        frames = []
        for c in result.choices:
            entries = []  # what of the calls did not stream: the rest of their arguments, the others whole
            for k, call in enumerate(_calls(prepared, c)):
                if k >= len(c.calls_streamed):
                    entries.append({"index": k, **call})
                elif rest := call["function"]["arguments"][c.calls_streamed[k] :]:
                    entries.append({"index": k, "function": {"arguments": rest}})
            if entries:
                delta = {"tool_calls": entries}
                frames.append(
                    self._chunk(prepared, [{"index": c.index, "delta": delta, "finish_reason": None}])
                )
            end: dict[str, Any] = {"index": c.index, "delta": {}}
            # the log-probs of tokens that brought no text
            rest = None if c.logprobs is None else c.logprobs[c.logprobs_streamed :]
            if (entries := _logprobs(prepared, rest)) is not None:
                end["logprobs"] = entries
            frames.append(self._chunk(prepared, [{**end, "finish_reason": FINISH[c.finish_reason]}]))
        if prepared.state.get("include_usage", True):
            frames.append(self._chunk(prepared, [], usage=openai_usage(result)))
        frames.append(sse("[DONE]"))
        return frames

    def format_response(self, prepared: Prepared, result: ChatResult) -> dict[str, Any]:
        choices = []
        for c in result.choices:
            message: dict[str, Any] = {
                "role": "assistant",
                "content": c.text if (c.text or not c.tool_calls) else None,
            }
            if c.reasoning is not None:
                message["reasoning_content"] = c.reasoning
            if calls := _calls(prepared, c):
                message["tool_calls"] = calls
            logprobs = _logprobs(prepared, c.logprobs)
            choices.append(
                {
                    "index": c.index,
                    "message": message,
                    "logprobs": logprobs,
                    "finish_reason": FINISH[c.finish_reason],
                }
            )
        return {
            "id": prepared.response_id,
            "object": "chat.completion",
            "created": prepared.created,
            "model": prepared.model,
            "choices": choices,
            "usage": openai_usage(result),
        }

    def format_error(self, status: int, message: str, param: str | None = None) -> dict[str, Any]:
        return openai_error(status, message, param)

    def format_stream_error(self, prepared: Prepared, status: int, message: str) -> list[str]:
        return [sse(self.format_error(status, message))]  # the SDK raises on a data line with "error"


def _calls(p: Prepared, c: Choice) -> list[dict[str, Any]]:
    """The choice's tool calls in OpenAI's shape; only the first with ``parallel_tool_calls`` false."""
    calls = c.tool_calls[:1] if p.state.get("one_call") else c.tool_calls
    return [
        {"id": t.id, "type": "function", "function": {"name": t.name, "arguments": t.arguments}}
        for t in calls
    ]


def _logprobs(p: Prepared, entries: list[TokenLogprob] | None) -> dict[str, Any] | None:
    """A choice's (or a chunk's) ``logprobs`` object, one entry per token with its ``top`` alternatives;
    None when the request asked for none."""
    tokenizer = p.state.get("tokenizer")
    if tokenizer is None or entries is None:
        return None
    return {"content": logprob_entries(tokenizer, entries), "refusal": None}


# ---------------------------------------------------------------- vLLM's tokenizer endpoints
class TokenizeRequest(Strict):
    """``POST /tokenize``: vLLM's ``TokenizeCompletionRequest`` (``prompt``) or ``TokenizeChatRequest``
    (``messages``)."""

    model: str | None = None
    prompt: str | None = None
    messages: list[Message] | None = Field(None, min_length=1)
    tools: list[ToolDef] | None = None
    add_generation_prompt: bool = True
    add_special_tokens: bool | None = None  # vLLM's defaults: true for a prompt, false for messages
    return_token_strs: bool = False

    @model_validator(mode="after")
    def _prompt_or_messages(self) -> TokenizeRequest:
        if (self.prompt is None) == (self.messages is None):
            raise ValueError("send either prompt or messages")
        return self


class DetokenizeRequest(Strict):
    """``POST /detokenize``: vLLM's ``DetokenizeRequest``."""

    model: str | None = None
    tokens: list[int]


def _tokenize(req: TokenizeRequest, engine: Any) -> dict[str, Any]:
    """vLLM's ``TokenizeResponse``; messages go through the chat template as in a chat completion."""
    tokenizer = engine.tokenizer
    if req.messages is None:
        if req.tools:
            raise RequestRejected("tools need messages", param="tools")
        ids = tokenizer.encode(req.prompt, add_special_tokens=req.add_special_tokens is not False)
    else:
        if req.add_special_tokens:
            raise RequestRejected(
                "add_special_tokens with messages is not supported: the chat template "
                "writes the special tokens",
                param="add_special_tokens",
            )
        if not req.add_generation_prompt:
            raise RequestRejected(
                "add_generation_prompt false is not supported yet", param="add_generation_prompt"
            )
        ids = chat_prompt_ids(tokenizer, _template_messages(req.messages), _tool_dicts(req.tools or []))
    strs = [tokenizer.token_text(i) for i in ids] if req.return_token_strs else None
    return {"count": len(ids), "max_model_len": engine.context_limit, "tokens": list(ids), "token_strs": strs}


def _detokenize(req: DetokenizeRequest, engine: Any) -> dict[str, Any]:
    """vLLM's ``DetokenizeResponse``: the text of ``tokens``, special tokens included."""
    vocab = engine.tokenizer.vocab_size
    if bad := [t for t in req.tokens if not 0 <= t < vocab]:
        raise RequestRejected(f"token ids must be in [0, {vocab}), got {bad[:8]}", param="tokens")
    return {"prompt": engine.tokenizer.decode(req.tokens, skip_special_tokens=False)}
