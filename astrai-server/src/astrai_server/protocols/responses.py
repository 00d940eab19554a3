"""OpenAI Responses (``POST /v1/responses``), stateless, as the ``openai`` and OpenAI Agents SDKs use it.

Registered as entry point ``responses`` in ``astrai.protocols``. Stateless, as Ollama and
llama-server serve it: nothing is stored, so every request carries its whole conversation in
``input`` and what needs stored state (``store: true``, ``previous_response_id``,
``background``, ``conversation``) is refused. Input items become Hugging Face chat messages
(``function_call`` -> an assistant turn's ``tool_calls``, ``function_call_output`` -> a
``tool`` message) and go through the chat template as chat completions do, tool calls
included. Every field the ``openai`` SDK can send is implemented, accepted as metadata
(``IGNORED``) or refused with a 400 naming it (``REFUSED``). Streams are named events with a
``sequence_number``, ``response.created`` to ``response.completed`` (or ``.incomplete``).
A thinking model's reasoning is a ``reasoning`` output item (its text as ``reasoning_text``
content) before the message, streamed as ``response.reasoning_text.delta`` events; a reasoning
item sent back in ``input`` is the next assistant turn's ``reasoning_content`` for the template.

Over 300 lines because a builder is one file: its request models (every field the SDK can
send, each handled on purpose), the response object and the stream's event sequence.
"""

from __future__ import annotations

import dataclasses
import time
from typing import TYPE_CHECKING, Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Discriminator, Field, Tag, field_validator, model_validator

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
from astrai_server.openai_shapes import logprob_entries, openai_error
from astrai_server.request_parts import (
    Strict,
    decode_arguments,
    json_kind,
    null_is_not_sent,
    select_tools,
    text_or_parts,
)
from astrai_server.structured import responses_text_format
from astrai_server.thinking import EFFORTS, check_budget, effort_controls

if TYPE_CHECKING:
    from astrai.logprobs import TokenLogprob
    from astrai.protocol import ToolCall

LOGPROBS = "message.output_text.logprobs"  # the one ``include`` value there is something to include for

#: Request fields of the Responses API that astrai refuses (400, ``param`` naming the field), and when.
#: Those no value of which is served are not declared (the handler refuses undeclared fields);
#: JSON null for them means "not sent". docs/http-api.md shows this table.
REFUSED = {
    "access_programs": "any value: astrai has no access programs",
    "background": "true: responses are not stored, so they cannot be polled",
    "background_options": "any value: as background",
    "context_management": "any value: astrai never compacts a conversation",
    "conversation": "any value: astrai keeps no conversations; send the whole conversation in input",
    "image": "any value: astrai generates no images",
    "include": f"anything but {LOGPROBS!r}",
    "moderation": "any value: astrai moderates nothing",
    "previous_response_id": "any value: astrai keeps no responses; send the whole conversation in input",
    "prompt": "any value: astrai stores no prompt templates",
    "reasoning": "options other than effort and max_tokens (a thinking budget): summaries are not written",
    "store": "true: astrai stores no responses",
    "truncation": '"auto": astrai never truncates a prompt',
    "text.verbosity": "any value: astrai has no verbosity control",
    "tools[].type": '"function" only: astrai runs no hosted tools',
    "tool_choice": 'an object other than {"type": "function", "name": ...}: only function tools are served',
    "input[].encrypted_content": "any value: astrai writes no encrypted reasoning, so it cannot read one",
}

#: Fields accepted and ignored: metadata that changes nothing a client can observe.
IGNORED = {
    "max_tool_calls": "Limits calls to hosted tools; astrai runs none.",
    "metadata": "Tags for OpenAI's dashboard; echoed in the response, nothing is stored.",
    "prompt_cache_key": "A cache-routing hint; astrai's prefix cache needs none.",
    "prompt_cache_options": "Cache lifetime hints; the prefix cache keeps pages while there is room.",
    "prompt_cache_retention": "As prompt_cache_options.",
    "safety_identifier": "An end-user id for OpenAI's abuse detection.",
    "service_tier": "A billing and latency tier; astrai has one.",
    "store": "false: nothing is stored anyway.",
    "user": "An end-user id, replaced by safety_identifier and prompt_cache_key.",
    "input[].phase": "Marks an earlier answer as commentary or final (sent back when replaying one).",
    "input[].content[].annotations": "Citations of an earlier answer.",
    "input[].content[].logprobs": "Log-probs of an earlier answer.",
    "input[].content[].prompt_cache_breakpoint": "A cache hint.",
    "stream_options.include_obfuscation": "Padding against side channels; events carry none.",
}


class InputText(Strict):
    type: Literal["input_text", "output_text", "reasoning_text"]  # reasoning_text: of a reasoning item
    text: str
    annotations: list[Any] | None = None
    logprobs: list[Any] | None = None
    prompt_cache_breakpoint: dict[str, Any] | None = None


class SummaryText(Strict):
    type: Literal["summary_text"]
    text: str


def _text(content: str | list[InputText]) -> str:
    return content if isinstance(content, str) else "".join(p.text for p in content)


#: What each input item type needs, and the keys only that type takes.
ITEM_FIELDS = {
    "message": (("role", "content"), {"role", "content", "phase"}),
    "function_call": (("call_id", "name", "arguments"), {"call_id", "name", "arguments"}),
    "function_call_output": (("call_id", "output"), {"call_id", "output", "name"}),
    "reasoning": ((), {"content", "summary", "encrypted_content"}),
}
#: The content parts each item type takes.
PART_TYPES = {"message": ("input_text", "output_text"), "reasoning": ("reasoning_text",)}


class InputItem(Strict):
    """One input item: a message (``type`` may be left out), a function call or its output, or an
    earlier answer's reasoning.

    One model rather than a union of three, so that a bad key's path is the item's (``input.0.foo``)."""

    type: Literal["message", "function_call", "function_call_output", "reasoning"] = "message"
    role: Literal["user", "assistant", "system", "developer"] | None = None
    content: text_or_parts(InputText) | None = None
    call_id: str | None = None
    name: str | None = None
    arguments: str | None = None
    output: text_or_parts(InputText) | None = None
    id: str | None = None
    status: Literal["in_progress", "completed", "incomplete"] | None = None
    phase: str | None = None
    summary: list[SummaryText] | None = None
    encrypted_content: str | None = None

    @field_validator("content", "output", mode="before")
    @classmethod
    def _text_parts_only(cls, content: Any) -> Any:
        # one clear 422 for an image or file part, rather than every way it fails to be InputText
        for part in content if isinstance(content, list) else ():
            if isinstance(part, dict) and part.get("type") not in (
                "input_text",
                "output_text",
                "reasoning_text",
            ):
                raise ValueError(f"content part of type {part.get('type')!r} is not supported (text only)")
        return content

    @model_validator(mode="after")
    def _fields_of_its_type(self) -> InputItem:
        needs, takes = ITEM_FIELDS[self.type]
        if missing := [f for f in needs if getattr(self, f) is None]:
            raise ValueError(f"a {self.type} item needs {', '.join(missing)}")
        specific = {f for _, own in ITEM_FIELDS.values() for f in own}
        if foreign := sorted(self.model_fields_set & specific - takes):
            raise ValueError(f"a {self.type} item does not take {', '.join(foreign)}")
        parts = PART_TYPES.get(self.type, ("input_text", "output_text"))
        for part in (self.content if isinstance(self.content, list) else []) + (
            self.output if isinstance(self.output, list) else []
        ):
            if part.type not in parts:
                raise ValueError(
                    f"a {self.type} item's content parts are {' or '.join(parts)}, not {part.type}"
                )
        return self


class FunctionTool(Strict):
    """A function tool. Another type (web_search, mcp, ...) keeps only its ``type``, to be refused
    naming it."""

    type: str
    name: str | None = Field(None, min_length=1, max_length=64)
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None

    @model_validator(mode="before")
    @classmethod
    def _hosted_tool(cls, data: Any) -> Any:
        if isinstance(data, dict) and data.get("type") != "function":
            return {"type": data.get("type")}  # refused in prepare as tools.<i>.type, not for its other keys
        return data

    @model_validator(mode="after")
    def _named(self) -> FunctionTool:
        if self.type == "function" and self.name is None:
            raise ValueError("a function tool needs a name")
        return self


#: ``tool_choice``: a mode or an object (refused unless ``{"type": "function", "name": ...}``), told
#: apart by the JSON type (``json_kind``)
ToolChoice = Annotated[
    Annotated[Literal["none", "auto", "required"], Tag("str")] | Annotated[dict[str, Any], Tag("dict")],
    Discriminator(
        json_kind,
        custom_error_type="tool_choice",
        custom_error_message=(
            'Input should be "none", "auto", "required" or {"type": "function", "name": ...}'
        ),
    ),
]


class TextConfig(Strict):
    format: dict[str, Any] | None = None
    verbosity: str | None = None


class StreamOptions(Strict):
    include_obfuscation: bool | None = None


class ResponsesRequest(BaseModel):
    """The request body of ``POST /v1/responses``; undeclared fields are kept for sampling plugins
    (the handler refuses those no plugin claims)."""

    model_config = ConfigDict(extra="allow")

    model: str = "astrai"
    input: list[InputItem] = Field(min_length=1)  # a string: one user message
    instructions: str | None = None
    max_output_tokens: int | None = Field(None, gt=0)  # OpenAI's: none, i.e. what the context leaves
    temperature: float | None = Field(1.0, ge=0.0, le=2.0)
    top_p: float | None = Field(1.0, ge=0.0, le=1.0)
    top_logprobs: int | None = Field(None, ge=0, le=20)
    include: list[str] | None = None
    tools: list[FunctionTool] | None = None
    tool_choice: ToolChoice | None = "auto"
    parallel_tool_calls: bool | None = True
    max_tool_calls: int | None = None
    text: TextConfig | None = None
    stream: bool | None = False
    stream_options: StreamOptions | None = None
    store: bool | None = False
    previous_response_id: str | None = None
    background: bool | None = False
    reasoning: dict[str, Any] | None = None
    truncation: Literal["auto", "disabled"] | None = "disabled"
    cache_salt: CacheSalt | None = None  # vLLM's: the prefix cache shares pages only within a salt
    metadata: dict[str, str] | None = None
    user: str | None = None
    safety_identifier: str | None = None
    service_tier: str | None = None
    prompt_cache_key: str | None = None
    prompt_cache_retention: str | None = None
    prompt_cache_options: dict[str, Any] | None = None
    # vLLM's: smaller first, with --scheduling-policy priority
    priority: int | None = Field(0, ge=-(2**31), le=2**31 - 1)

    _null_is_not_sent = null_is_not_sent(REFUSED)  # JSON null is OpenAI's "not set"

    @model_validator(mode="before")
    @classmethod
    def _string_input(cls, data: Any) -> Any:
        # a string input is one user message: so that the errors of a list name its items only
        if isinstance(data, dict) and isinstance(data.get("input"), str):
            data = {**data, "input": [{"role": "user", "content": data["input"]}]}
        return data

    def refuse_unserved(self) -> None:
        """RequestRejected (param: the field) for a declared field whose value astrai cannot honour."""
        text = self.text or TextConfig()
        unserved = {
            "store": ("store", bool(self.store)),
            "previous_response_id": ("previous_response_id", self.previous_response_id is not None),
            "background": ("background", bool(self.background)),
            "reasoning": (
                "reasoning",
                any(v is not None for k, v in (self.reasoning or {}).items() if k not in SERVED),
            ),
            "include": ("include", any(i != LOGPROBS for i in self.include or ())),
            "truncation": ("truncation", self.truncation == "auto"),
            "text.verbosity": ("text.verbosity", text.verbosity is not None),
        }
        for i, tool in enumerate(self.tools or ()):
            unserved[f"tools.{i}.type"] = ("tools[].type", tool.type != "function")
        choice = self.tool_choice
        named = isinstance(choice, dict) and set(choice) == {"type", "name"} and choice["type"] == "function"
        named = named and isinstance(choice["name"], str)
        unserved["tool_choice"] = ("tool_choice", isinstance(choice, dict) and not named)
        for param, (entry, refused) in unserved.items():
            if refused:
                raise RequestRejected(
                    f"unsupported value for {param} (refused for {REFUSED[entry]})", param=param
                )

    def sampling_params(self, context_limit: int) -> SamplingParams:
        """The engine's parameters: without ``max_output_tokens``, all the context has room for (the
        handler fits it); log-probs with ``top_logprobs`` (default 0) alternatives when ``include``
        asks for them or ``top_logprobs`` is set."""
        asked = LOGPROBS in (self.include or ()) or self.top_logprobs is not None
        return SamplingParams(
            max_tokens=self.max_output_tokens or context_limit,
            temperature=value_or_default(self, "temperature"),
            top_p=value_or_default(self, "top_p"),
            logprobs=(self.top_logprobs or 0) if asked else None,
            grammar=responses_text_format((self.text or TextConfig()).format),
            extra=plugin_sampling(self),
        )


SERVED = ("effort", "max_tokens")  # of ``reasoning``: the rest is refused (``refuse_unserved``)


def _reasoning_controls(
    reasoning: dict[str, Any], params: SamplingParams, engine: Any
) -> tuple[SamplingParams, dict[str, Any] | None, str | None]:
    """``reasoning.effort`` and ``reasoning.max_tokens`` as chat's ``reasoning_effort`` and thinking
    budget (``astrai_server.thinking``): the params, the template's kwargs, the field of the budget."""
    effort, budget = reasoning.get("effort"), reasoning.get("max_tokens")
    if effort is not None and effort not in EFFORTS:
        raise RequestRejected(
            f"reasoning.effort must be one of {', '.join(EFFORTS)}, got {effort!r}", param="reasoning.effort"
        )
    if budget is not None and (isinstance(budget, bool) or not isinstance(budget, int) or budget < 0):
        raise RequestRejected(
            f"reasoning.max_tokens must be an integer >= 0, got {budget!r}", param="reasoning.max_tokens"
        )
    check_budget(budget, "reasoning.max_tokens", params.max_tokens)
    template = getattr(engine.tokenizer, "chat_template", None) or ""
    kwargs, effort_budget = effort_controls(effort, template, None, params.max_tokens)
    field = (
        "reasoning.max_tokens"
        if budget is not None
        else "reasoning_effort"
        if effort_budget is not None
        else None
    )
    budget = budget if budget is not None else effort_budget
    return dataclasses.replace(params, thinking_budget=budget), kwargs, field


def _messages(req: ResponsesRequest) -> list[dict[str, Any]]:
    """The input in the Hugging Face chat convention; function calls join the assistant turn before them."""
    out: list[dict[str, Any]] = [{"role": "system", "content": req.instructions}] if req.instructions else []
    for i, item in enumerate(req.input):
        if item.type == "reasoning":
            if item.encrypted_content is not None:
                raise RequestRejected(
                    f"unsupported value for input.{i}.encrypted_content "
                    f"(refused for {REFUSED['input[].encrypted_content']})",
                    param=f"input.{i}.encrypted_content",
                )
            # the next assistant turn's thinking: its text, else its summary (what a client has of it)
            text = _text(item.content or []) or "".join(s.text for s in item.summary or ())
            out.append({"role": "assistant", "content": "", "reasoning_content": text})
        elif item.type == "message" and _after_reasoning(out, item):
            out[-1]["content"] = _text(item.content)  # the answer that followed the reasoning
        elif item.type == "message":
            out.append(
                {"role": "system" if item.role == "developer" else item.role, "content": _text(item.content)}
            )
        elif item.type == "function_call_output":
            named = {"name": item.name} if item.name is not None else {}  # the template's to render or not
            out.append({"role": "tool", "content": _text(item.output), "tool_call_id": item.call_id, **named})
        else:
            if not (out and out[-1]["role"] == "assistant"):
                out.append({"role": "assistant", "content": ""})
            function = {"name": item.name, "arguments": decode_arguments(item.arguments)}
            out[-1].setdefault("tool_calls", []).append(
                {"id": item.call_id, "type": "function", "function": function}
            )
    return out


def _after_reasoning(out: list[dict[str, Any]], item: InputItem) -> bool:
    """Whether ``item`` is the assistant message of the reasoning item before it (a turn of its own
    so far, with no answer and no call yet)."""
    last = out[-1] if out else {}
    return (
        item.role == "assistant"
        and "reasoning_content" in last
        and not last["content"]
        and "tool_calls" not in last
    )


def _select_tools(req: ResponsesRequest) -> list[dict[str, Any]]:
    """The function tools to show the model, in the chat form ``chat_prompt_ids`` takes (``tool_choice``
    is a mode or, once ``refuse_unserved`` passed it, ``{"type": "function", "name": ...}``)."""
    choice = req.tool_choice
    named = isinstance(choice, dict)
    return select_tools(
        req.tools,
        "named" if named else choice or "auto",
        choice["name"] if named else None,
        to_template=_tool_dicts,
    )


def _tool_dicts(tools: list[FunctionTool]) -> list[dict[str, Any]]:
    return [
        {"type": "function", "function": t.model_dump(exclude={"type", "strict"}, exclude_none=True)}
        for t in tools
    ]


class ResponsesBuilder(ResponseBuilder):
    """OpenAI Responses over JSON and SSE (named events with sequence numbers)."""

    name = "responses"
    route = "/v1/responses"
    request_model = ResponsesRequest
    streams_calls = True

    def prepare(self, request: ResponsesRequest, engine: Any) -> Prepared:
        """``state``: ``seq`` (the next event's sequence number), ``message_id``, ``opened`` (whether the
        stream has opened the message item), ``reasoning_id``, ``reasoning`` (the reasoning streamed;
        None before any), ``reasoned`` (whether the stream closed the reasoning item), ``text`` and
        ``text_logprobs`` (the message's, streamed), ``closed`` (whether the message item ended, as a
        streamed call began), ``calls`` (per streamed call: its output index, ended or not) and, when
        log-probs were asked, ``tokenizer``."""
        request.refuse_unserved()
        tools = _select_tools(request)
        params = request.sampling_params(engine.context_limit)
        params, kwargs, thinking_param = _reasoning_controls(request.reasoning or {}, params, engine)
        prompt_ids = chat_prompt_ids(engine.tokenizer, _messages(request), tools, template_kwargs=kwargs)
        state: dict[str, Any] = {"seq": 0, "message_id": new_id("msg_"), "opened": False, **REASONING_STATE}
        if params.logprobs is not None:
            state["tokenizer"] = engine.tokenizer
        return Prepared(
            request=request,
            prompt_ids=prompt_ids,
            params=params,
            stream=bool(request.stream),
            tools=tools,
            tool_call_required=bool(tools) and request.tool_choice not in ("auto", None),
            max_tokens_explicit=request.max_output_tokens is not None,
            cache_salt=request.cache_salt,
            sampling_sent=sent_fields(request),
            thinking_param=thinking_param,
            response_id=new_id("resp_"),
            model=request.model,
            state=state,
        )

    # ---------------------------------------------------------------- the response object
    def _response(self, p: Prepared, result: ChatResult | None = None) -> dict[str, Any]:
        """The response: in progress (no result yet), completed, or incomplete (``max_output_tokens``)."""
        req: ResponsesRequest = p.request  # type: ignore[assignment]
        c = result.choices[0] if result else None
        status = "in_progress" if c is None else "incomplete" if c.finish_reason == "length" else "completed"
        return {
            "id": p.response_id,
            "object": "response",
            "created_at": p.created,
            "status": status,
            "completed_at": int(time.time()) if status == "completed" else None,
            "error": None,
            "incomplete_details": {"reason": "max_output_tokens"} if status == "incomplete" else None,
            "instructions": req.instructions,
            "max_output_tokens": req.max_output_tokens,
            "model": p.model,
            "output": self._output(p, c) if c else [],
            "parallel_tool_calls": value_or_default(req, "parallel_tool_calls"),
            "previous_response_id": None,
            "reasoning": {"effort": None, "summary": None},
            "store": False,
            "temperature": p.params.temperature,
            "text": {"format": {"type": "text"}},
            "tool_choice": value_or_default(req, "tool_choice"),
            "tools": [t.model_dump() for t in req.tools or ()],
            "top_logprobs": req.top_logprobs,
            "top_p": p.params.top_p,
            "truncation": "disabled",
            "usage": _usage(result) if result else None,
            "user": req.user,
            "metadata": req.metadata or {},
        }

    def _output(self, p: Prepared, c: Choice) -> list[dict[str, Any]]:
        """The reasoning, if any; a message when there is text or no call (an empty answer is an empty
        message) or the stream opened one; then the calls."""
        reasoning = [_reasoning(p, c.reasoning)] if c.reasoning is not None else []
        message = [self._message(p, c)] if c.text or not c.tool_calls or p.state["opened"] else []
        return reasoning + message + [_function_call(call, "completed") for call in _calls(p, c)]

    def _message(self, p: Prepared, c: Choice | None) -> dict[str, Any]:
        """The assistant message item: in progress and empty (``c`` None), or finished."""
        status = "in_progress" if c is None else "completed"
        if (
            c is not None and c.finish_reason == "length" and not c.tool_calls
        ):  # (calls: it ended before them)
            status = "incomplete"
        content = [] if c is None else [self._part(p, c.text, c.logprobs)]
        return {
            "type": "message",
            "id": p.state["message_id"],
            "status": status,
            "role": "assistant",
            "content": content,
        }

    def _part(self, p: Prepared, text: str, logprobs: list[TokenLogprob] | None) -> dict[str, Any]:
        return {
            "type": "output_text",
            "text": text,
            "annotations": [],
            "logprobs": _logprobs(p, logprobs, True),
        }

    def format_response(self, prepared: Prepared, result: ChatResult) -> dict[str, Any]:
        return self._response(prepared, result)

    # ---------------------------------------------------------------- the stream
    def _event(self, p: Prepared, kind: str, **fields: Any) -> str:
        seq, p.state["seq"] = p.state["seq"], p.state["seq"] + 1
        return sse({"type": kind, "sequence_number": seq, **fields}, event=kind)

    def _open_message(self, p: Prepared) -> list[str]:
        """The message item and its text part, before the first text (an answer that is only calls has
        none); the reasoning item ends first."""
        if p.state["opened"]:
            return []
        frames = self._close_reasoning(p)
        p.state["opened"] = True
        part = {"type": "output_text", "text": "", "annotations": [], "logprobs": []}
        where = _in_message(p)
        return [
            *frames,
            self._event(
                p,
                "response.output_item.added",
                output_index=where["output_index"],
                item=self._message(p, None),
            ),
            self._event(p, "response.content_part.added", **where, part=part),
        ]

    def format_reasoning_chunk(self, prepared: Prepared, index: int, text: str) -> list[str]:
        p, frames = prepared, []
        _reasoning_state(p)
        if p.state["reasoning"] is None:  # the reasoning item opens: it is the first output item
            p.state["reasoning"] = ""
            item = {**_reasoning(p, None), "content": [], "status": "in_progress"}
            part = {"type": "reasoning_text", "text": ""}
            frames += [
                self._event(p, "response.output_item.added", output_index=0, item=item),
                self._event(p, "response.content_part.added", **_in_reasoning(p), part=part),
            ]
        p.state["reasoning"] += text
        return [*frames, self._event(p, "response.reasoning_text.delta", **_in_reasoning(p), delta=text)]

    def _close_reasoning(self, p: Prepared) -> list[str]:
        """The end of the reasoning item, once, if the stream opened one."""
        _reasoning_state(p)
        text = p.state["reasoning"]
        if text is None or p.state["reasoned"]:
            return []
        p.state["reasoned"] = True
        part = {"type": "reasoning_text", "text": text}
        return [
            self._event(p, "response.reasoning_text.done", **_in_reasoning(p), text=text),
            self._event(p, "response.content_part.done", **_in_reasoning(p), part=part),
            self._event(p, "response.output_item.done", output_index=0, item=_reasoning(p, text)),
        ]

    def format_stream_start(self, prepared: Prepared) -> list[str]:
        response = self._response(prepared)
        return [
            self._event(prepared, "response.created", response=response),
            self._event(prepared, "response.in_progress", response=response),
        ]

    def format_chunk(self, prepared: Prepared, index: int, text: str, **logprobs: Any) -> list[str]:
        frames = self._open_message(prepared)  # first: sequence numbers follow the frames' order
        _reasoning_state(prepared)
        prepared.state["text"] += text
        prepared.state["text_logprobs"] += logprobs.get("logprobs") or []
        entries = _logprobs(prepared, logprobs.get("logprobs"), False)
        where = _in_message(prepared)
        return [
            *frames,
            self._event(prepared, "response.output_text.delta", **where, delta=text, logprobs=entries),
        ]

    def _close_message(self, p: Prepared, c: Choice) -> list[str]:
        """The end of the message item (opened first if the stream has not), as ``c`` finished it."""
        p.state["closed"] = True
        entries = _logprobs(p, c.logprobs, False)
        return self._open_message(p) + [
            self._event(p, "response.output_text.done", **_in_message(p), text=c.text, logprobs=entries),
            self._event(
                p, "response.content_part.done", **_in_message(p), part=self._part(p, c.text, c.logprobs)
            ),
            self._event(
                p,
                "response.output_item.done",
                output_index=_in_message(p)["output_index"],
                item=self._message(p, c),
            ),
        ]

    def _call_added(self, p: Prepared, k: int, call: ToolCall) -> list[str]:
        at = (p.state["reasoning"] is not None) + p.state["opened"] + k  # after the reasoning and message
        p.state["calls"][k] = [at, False]
        item = {**_function_call(call, "in_progress"), "arguments": ""}
        return [self._event(p, "response.output_item.added", output_index=at, item=item)]

    def _call_delta(self, p: Prepared, k: int, call: ToolCall, piece: str) -> list[str]:
        where = {"item_id": _function_call(call, "")["id"], "output_index": p.state["calls"][k][0]}
        return [self._event(p, "response.function_call_arguments.delta", **where, delta=piece)]

    def _call_done(self, p: Prepared, k: int, call: ToolCall) -> list[str]:
        at, p.state["calls"][k][1] = p.state["calls"][k][0], True
        where = {"item_id": _function_call(call, "")["id"], "output_index": at}
        return [
            self._event(p, "response.function_call_arguments.done", **where, arguments=call.arguments),
            self._event(
                p, "response.output_item.done", output_index=at, item=_function_call(call, "completed")
            ),
        ]

    def format_call_delta(
        self, prepared: Prepared, index: int, k: int, call: ToolCall, arguments: str, first: bool
    ) -> list[str]:
        p, frames = prepared, []
        _reasoning_state(p)
        if k and not value_or_default(p.request, "parallel_tool_calls"):
            return []
        if first:
            frames += self._close_reasoning(p)
            if p.state["opened"] and not p.state["closed"]:  # the text before the calls ends
                text = p.state["text"].rstrip()
                frames += self._close_message(
                    p, Choice(0, text, "tool_calls", 0, tool_calls=[call], logprobs=p.state["text_logprobs"])
                )
            if k:
                frames += self._call_done(p, k - 1, p.state["calls"][k - 1][2])
            frames += self._call_added(p, k, call)
            p.state["calls"][k].append(call)
        if arguments:
            frames += self._call_delta(p, k, call, arguments)
        return frames

    def format_stream_end(self, prepared: Prepared, result: ChatResult) -> list[str]:
        p, c = prepared, result.choices[0]
        frames = self._close_reasoning(p)  # (the state's keys set: _reasoning_state)
        if (p.state["opened"] and not p.state["closed"]) or not (c.tool_calls or p.state["closed"]):
            frames += self._close_message(
                p, c
            )  # every token's log-probs, those that brought no text included
        calls = _calls(p, c)
        for k, call in enumerate(calls):
            if k not in p.state["calls"]:
                frames += self._call_added(p, k, call)
                p.state["calls"][k].append(call)
                rest = call.arguments
            else:
                rest = call.arguments[c.calls_streamed[k] :] if k < len(c.calls_streamed) else ""
            if rest:
                frames += self._call_delta(p, k, call, rest)
            if not p.state["calls"][k][1]:
                frames += self._call_done(p, k, call)
        response = self._response(p, result)
        return [*frames, self._event(p, f"response.{response['status']}", response=response)]

    def format_error(self, status: int, message: str, param: str | None = None) -> dict[str, Any]:
        return openai_error(status, message, param)

    def format_stream_error(self, prepared: Prepared, status: int, message: str) -> list[str]:
        error = openai_error(status, message)["error"]
        return [
            self._event(prepared, "error", code=error["code"] or error["type"], message=message, param=None)
        ]


def _in_message(p: Prepared) -> dict[str, Any]:
    """Where the message's text part is: after the reasoning item, if the stream sent one."""
    index = int(_reasoning_state(p)["reasoning"] is not None)
    return {"item_id": p.state["message_id"], "output_index": index, "content_index": 0}


#: What a stream keeps of its reasoning item (``Prepared.state``; see ``ResponsesBuilder.prepare``).
REASONING_STATE = {"reasoning": None, "reasoned": False}


def _reasoning_state(p: Prepared) -> dict[str, Any]:
    """``p.state`` with a reasoning id, ``REASONING_STATE`` and what a stream keeps of its message and
    calls (a ``Prepared`` made elsewhere may have none of them)."""
    p.state.setdefault("reasoning_id", "rs_" + p.state.get("message_id", new_id("msg_")).removeprefix("msg_"))
    for key, value in REASONING_STATE.items():
        p.state.setdefault(key, value)
    for key, make in (("text", str), ("text_logprobs", list), ("closed", bool), ("calls", dict)):
        p.state.setdefault(key, make())
    return p.state


def _in_reasoning(p: Prepared) -> dict[str, Any]:
    return {"item_id": p.state["reasoning_id"], "output_index": 0, "content_index": 0}


def _reasoning(p: Prepared, text: str | None) -> dict[str, Any]:
    """The reasoning output item, finished (``text`` None: its id and type only)."""
    item = {"type": "reasoning", "id": _reasoning_state(p)["reasoning_id"], "summary": []}
    return (
        item
        if text is None
        else {**item, "content": [{"type": "reasoning_text", "text": text}], "status": "completed"}
    )


def _calls(p: Prepared, c: Choice) -> list[ToolCall]:
    """The choice's tool calls; only the first when the request set ``parallel_tool_calls`` false."""
    return c.tool_calls if value_or_default(p.request, "parallel_tool_calls") else c.tool_calls[:1]


def _function_call(call: ToolCall, status: str) -> dict[str, Any]:
    return {
        "type": "function_call",
        "id": "fc_" + call.id.removeprefix("call_"),
        "call_id": call.id,
        "name": call.name,
        "arguments": call.arguments,
        "status": status,
    }


def _usage(result: ChatResult) -> dict[str, Any]:
    return {
        "input_tokens": result.prompt_tokens,
        "input_tokens_details": {"cached_tokens": result.cached_tokens, "cache_write_tokens": 0},
        "output_tokens": result.completion_tokens,
        "output_tokens_details": {"reasoning_tokens": sum(c.reasoning_tokens for c in result.choices)},
        "total_tokens": result.total_tokens,
    }


def _logprobs(p: Prepared, entries: list[TokenLogprob] | None, with_bytes: bool) -> list[dict[str, Any]]:
    """OpenAI log-prob entries (a content part's carry ``bytes``, a stream event's do not); [] when not
    asked."""
    tokenizer = p.state.get("tokenizer")
    if tokenizer is None or not entries:
        return []
    return logprob_entries(tokenizer, entries, with_bytes)
