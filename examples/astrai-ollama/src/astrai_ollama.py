"""The Ollama chat and generate APIs on astrai: two ``ResponseBuilder``s in ``astrai.protocols``.

``ollama`` serves ``POST /api/chat``, ``GET /api/tags`` (the served models) and ``POST /api/embed``
(on the server's pooling model, ``--embedding-model``: ``embeddings``, one vector per input; an input
too long for the model is cut to fit unless ``"truncate": false``, as Ollama does);
``ollama_generate`` serves ``POST /api/generate``, a prompt rather than messages. Both
answer in Ollama's shape: with ``"stream": true`` (Ollama's default) one JSON object per
line (``application/x-ndjson``), each carrying a piece of the text (``message`` for
chat, ``response`` for generate), then a last one with ``"done": true``, the finish
reason, token counts and durations (nanoseconds); with ``"stream": false`` that last
object holds the whole text. Errors are ``{"error": "..."}`` with the HTTP status,
in-stream too, as the ``ollama`` client reads them.

The template of a protocol: copy this file (and the distribution around it) to serve another
API. It imports astrai-core's public API (``astrai.protocol``, ``astrai.errors``,
``astrai.sampling``) and the request pieces protocols share (``astrai_server.request_parts``:
``Strict`` here; ``text_or_parts``, ``null_is_not_sent``, ``select_tools`` where an API has
content parts, refused fields or tools), never a protocol module of astrai-server. Those pieces
import no web stack, so the builders are tested without HTTP.

Over 300 lines because it serves two APIs, each a builder and a request model on bases they share;
a protocol of one route is about half of it.
"""

from __future__ import annotations

import json
import time
from abc import abstractmethod
from collections.abc import Callable
from datetime import datetime, timezone
from functools import partial
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from astrai.errors import RequestRejected
from astrai.protocol import (
    ChatResult,
    Prepared,
    ResponseBuilder,
    chat_prompt_ids,
    new_id,
    plugin_sampling,
    value_or_default,
)
from astrai.sampling import SamplingParams
from astrai_server.request_parts import Strict

__all__ = [
    "ChatRequest",
    "GenerateRequest",
    "OllamaGenerateBuilder",
    "OllamaRequest",
    "OllamaResponseBuilder",
    "Options",
]

DONE_REASON = {
    "stop": "stop",
    "stop_sequence": "stop",
    "tool_calls": "stop",
    "length": "length",
    "abort": "stop",
}


class Message(Strict):
    role: Literal["system", "user", "assistant", "tool"]
    content: str = ""
    # what the ollama client may send and astrai cannot honour: refused when non-empty
    images: list[Any] | None = None
    thinking: str | None = None
    tool_calls: list[Any] | None = None
    tool_name: str | None = None

    def check(self, at: str) -> None:
        for name in ("images", "thinking", "tool_calls", "tool_name"):
            if getattr(self, name):
                raise RequestRejected(f"{at}.{name} is not supported by astrai", param=f"{at}.{name}")


RESOURCE_OPTIONS = frozenset(
    {
        "num_ctx",
        "num_batch",
        "num_gpu",
        "main_gpu",
        "num_thread",
        "num_keep",
        "use_mmap",
        "use_mlock",
        "numa",
        "low_vram",
    }
)
"""Options that tune how Ollama runs a model, not what it answers: accepted and ignored (astrai sizes its KV
pool and threads at start-up)."""


class Options(BaseModel):
    """``options`` of a request, with Ollama's defaults (``repeat_penalty`` off: astrai's default).

    Any other option must be a parameter of an installed sampling plugin (``typical_p``) or one of
    :data:`RESOURCE_OPTIONS`; anything else is refused (``check``).
    """

    model_config = ConfigDict(extra="allow")

    temperature: float | None = 0.8
    top_k: int | None = 40
    top_p: float | None = 0.9
    min_p: float | None = 0.0
    seed: int | None = None
    stop: str | list[str] | None = None
    num_predict: int | None = -1  # -1 (or any value < 1): until the context is full
    frequency_penalty: float | None = 0.0
    presence_penalty: float | None = 0.0
    repeat_penalty: float | None = 1.0  # over the whole context: repeat_last_n -1
    repeat_last_n: int | None = -1

    def check(self, claimed: frozenset[str]) -> None:
        """RequestRejected naming an option astrai cannot honour."""
        if self.repeat_last_n not in (None, -1):
            raise RequestRejected(
                "options.repeat_last_n: astrai's repeat_penalty covers the whole context (-1 only)",
                param="options.repeat_last_n",
            )
        for key in self.model_extra or {}:
            if key not in claimed and key not in RESOURCE_OPTIONS:
                raise RequestRejected(f"options.{key} is not supported by astrai", param=f"options.{key}")


class OllamaRequest(BaseModel):
    """What the bodies of ``/api/chat`` and ``/api/generate`` share, and their sampling parameters."""

    model_config = ConfigDict(extra="allow")  # the server refuses an undeclared field (naming it)

    model: str = Field(min_length=1)
    stream: bool = True
    options: Options | None = None
    keep_alive: str | float | None = None  # accepted and ignored: the served model stays loaded

    def sampling_params(self, context_limit: int) -> SamplingParams:
        """The engine's parameters; null is Ollama's default, and "until the context is full"
        is ``context_limit`` tokens (the server shortens it to what the prompt leaves)."""
        o = self.options or Options()
        value = partial(value_or_default, o)
        return SamplingParams(
            max_tokens=value("num_predict") if self.max_tokens_explicit else context_limit,
            temperature=value("temperature"),
            top_k=value("top_k"),
            top_p=value("top_p"),
            min_p=value("min_p"),
            seed=o.seed,
            stop=o.stop,
            frequency_penalty=value("frequency_penalty"),
            presence_penalty=value("presence_penalty"),
            repetition_penalty=value("repeat_penalty"),
            # the options left over: parameters of sampling plugins (resource options are not)
            extra={k: v for k, v in plugin_sampling(o).items() if k not in RESOURCE_OPTIONS},
        )

    @property
    def max_tokens_explicit(self) -> bool:
        """Whether ``num_predict`` bounds the answer (else it runs until the context is full)."""
        return self.options is not None and (self.options.num_predict or 0) > 0


class ChatRequest(OllamaRequest):
    """The body of ``POST /api/chat``. ``tools`` (always sent by the ollama client) must be empty;
    ``format``, ``think``, ``logprobs`` are undeclared, so the server refuses them."""

    messages: list[Message] = Field(min_length=1)
    tools: list[Any] | None = None

    def check(self) -> None:
        if self.tools:
            raise RequestRejected("tools are not supported by astrai's /api/chat", param="tools")
        for i, m in enumerate(self.messages):
            m.check(f"messages[{i}]")


UNSUPPORTED = (
    "suffix",
    "images",
    "format",
    "template",
    "context",
    "think",
    "logprobs",
    "top_logprobs",
    "width",
    "height",
    "steps",
)
"""Fields of ``/api/generate`` astrai cannot honour: a request that sets one (to anything
but null or empty) is refused, never answered as if it had not."""


class GenerateRequest(OllamaRequest):
    """The body of ``POST /api/generate``: ``prompt``, ``system``, ``raw``; :data:`UNSUPPORTED` are
    refused."""

    model_config = ConfigDict(extra="allow")  # keeps the unsupported fields, to name them

    prompt: str = ""
    system: str | None = None
    raw: bool = False  # true: the prompt is the model's input as written, with no chat template

    def prompt_ids(self, tokenizer: Any) -> list[int]:
        """The token ids of the prompt: encoded as written with ``raw``, else one user message
        (after a ``system`` one) through the chat template. Raises RequestRejected (400) for a
        request that sets an unsupported field, an empty prompt, or ``system`` with ``raw``."""
        for name in UNSUPPORTED:
            if (self.model_extra or {}).get(name) not in (None, "", [], {}):
                raise RequestRejected(f"{name} is not supported by astrai's /api/generate")
        if not self.prompt:
            raise RequestRejected(
                "prompt must not be empty (astrai's model is always loaded: there is nothing to load)"
            )
        if self.raw:
            if self.system:
                raise RequestRejected(
                    "system cannot be honoured with raw: true (there is no template to put it in)"
                )
            return tokenizer.encode(self.prompt, add_special_tokens=False)
        system = [{"role": "system", "content": self.system}] if self.system else []
        return chat_prompt_ids(tokenizer, [*system, {"role": "user", "content": self.prompt}])


def _now() -> str:
    return datetime.now(timezone.utc).isoformat()


class EmbedRequest(Strict):
    """The body of ``POST /api/embed``. ``options`` and ``keep_alive`` change nothing here (the model
    stays loaded); ``dimensions`` only where it is the model's own size."""

    model: str
    input: str | list[str]
    truncate: bool = True
    dimensions: int | None = None
    options: dict[str, Any] | None = None
    keep_alive: str | int | None = None


class _OllamaBuilder(ResponseBuilder):
    """What both routes share: the prepared request, NDJSON lines, the last object, errors."""

    stream_media_type = "application/x-ndjson"

    @abstractmethod
    def _piece(self, text: str) -> dict[str, Any]:
        """The fields of an object that carry ``text``."""

    def _prepared(self, request: OllamaRequest, prompt_ids: list[int], engine: Any) -> Prepared:
        if request.options is not None:
            request.options.check(engine.pipeline.extra_keys)
        return Prepared(
            request=request,
            prompt_ids=prompt_ids,
            params=request.sampling_params(engine.context_limit),
            stream=request.stream,
            max_tokens_explicit=request.max_tokens_explicit,
            response_id=new_id("ollama-"),
            model=request.model,
            state={"start_ns": time.monotonic_ns()},
        )

    def _body(self, p: Prepared, body: dict[str, Any]) -> dict[str, Any]:
        return {"model": p.model, "created_at": _now(), **body}

    def _line(self, p: Prepared, body: dict[str, Any]) -> str:
        return json.dumps(self._body(p, body), ensure_ascii=False) + "\n"

    def _final(self, p: Prepared, result: ChatResult, text: str) -> dict[str, Any]:
        choice = result.choices[0]
        start, now = p.state["start_ns"], time.monotonic_ns()
        final = {
            **self._piece(text),
            "done": True,
            "done_reason": DONE_REASON.get(choice.finish_reason, choice.finish_reason),
            "total_duration": now - start,
            "load_duration": 0,
            "prompt_eval_count": result.prompt_tokens,
            "eval_count": result.completion_tokens,
        }
        first = p.state.get("first_ns")  # a stream's first piece: the prompt has been evaluated
        if first is not None:  # a whole response never sees its first piece: left out rather than made up
            final |= {"prompt_eval_duration": first - start, "eval_duration": now - first}
        return final

    def format_stream_start(self, prepared: Prepared) -> list[str]:
        return []

    def format_chunk(self, prepared: Prepared, index: int, text: str) -> list[str]:
        prepared.state.setdefault("first_ns", time.monotonic_ns())
        return [self._line(prepared, {**self._piece(text), "done": False})]

    def format_stream_end(self, prepared: Prepared, result: ChatResult) -> list[str]:
        return [self._line(prepared, self._final(prepared, result, ""))]

    def format_response(self, prepared: Prepared, result: ChatResult) -> dict[str, Any]:
        return self._body(prepared, self._final(prepared, result, result.choices[0].text))

    def format_error(self, status: int, message: str, param: str | None = None) -> dict[str, Any]:
        return {"error": message}

    def format_stream_error(self, prepared: Prepared, status: int, message: str) -> list[str]:
        return [json.dumps({"error": message}) + "\n"]


class OllamaResponseBuilder(_OllamaBuilder):
    """Ollama ``/api/chat`` over NDJSON, and ``/api/tags``."""

    name = "ollama"
    route = "/api/chat"
    request_model = ChatRequest

    def __init__(self, model_name: str = "astrai") -> None:
        super().__init__(model_name)
        self.modified_at = _now()
        self.embedders: dict[str, Any] = {}  # the server's pooling models by name (astrai serve sets it)

    def prepare(self, request: ChatRequest, engine: Any) -> Prepared:
        request.check()
        messages = [{"role": m.role, "content": m.content} for m in request.messages]
        return self._prepared(request, chat_prompt_ids(engine.tokenizer, messages), engine)

    def _piece(self, text: str) -> dict[str, Any]:
        return {"message": {"role": "assistant", "content": text}}

    def get_routes(self) -> dict[str, Callable[[Any], dict[str, Any]]]:
        return {"/api/tags": self._tags}

    def post_routes(self) -> dict[str, tuple[type[BaseModel], Callable[[Any, Any], dict[str, Any]]]]:
        return {"/api/embed": (EmbedRequest, self._embed)}

    def _embed(self, request: EmbedRequest, engine: Any) -> dict[str, Any]:
        start = time.monotonic_ns()
        embedder = self.embedders.get(request.model)
        if embedder is None or embedder.task != "embed":
            names = ", ".join(n for n, e in self.embedders.items() if e.task == "embed") or "none"
            raise RequestRejected(
                f"model {request.model!r} does not embed; embedding models: {names}", param="model"
            )
        if request.dimensions is not None and request.dimensions != embedder.dimensions:
            raise RequestRejected(
                f"dimensions must be {embedder.dimensions} for {request.model}", param="dimensions"
            )
        texts = [request.input] if isinstance(request.input, str) else request.input
        if not texts or not all(texts):
            raise RequestRejected("input must hold at least one text and no empty one", param="input")
        limit = embedder.context_limit
        coded = embedder.tokenizer.hf(texts, add_special_tokens=True)["input_ids"]
        if any(len(ids) > limit for ids in coded):
            if not request.truncate:
                raise RequestRejected(f"an input is longer than the model's {limit} tokens", param="input")
            coded = embedder.tokenizer.hf(texts, add_special_tokens=True, truncation=True, max_length=limit)[
                "input_ids"
            ]
        vectors = embedder.embed([list(ids) for ids in coded])
        return {
            "model": request.model,
            "embeddings": vectors.tolist(),
            "total_duration": time.monotonic_ns() - start,
            "load_duration": 0,
            "prompt_eval_count": sum(map(len, coded)),
        }

    def _tags(self, engine: Any) -> dict[str, Any]:
        count, size = _weights(engine.model)
        family = engine.model.config.architecture
        details = {
            "parent_model": "",
            "format": "astrai",
            "family": family,
            "families": [family],
            "parameter_size": f"{count / 1e6:.0f}M",
            "quantization_level": "",
        }
        model = {
            "name": self.model_name,
            "model": self.model_name,
            "modified_at": self.modified_at,
            "size": size,
            "digest": "",
            "details": details,
        }
        pooling = [
            {
                **model,
                "name": name,
                "model": name,
                "size": _weights(e.model)[1],
                "details": {
                    **details,
                    "family": "bert",
                    "families": ["bert"],
                    "parameter_size": f"{_weights(e.model)[0] / 1e6:.0f}M",
                },
            }
            for name, e in self.embedders.items()
        ]
        return {"models": [model, *pooling]}


def _weights(model: Any) -> tuple[int, int]:
    """``(parameters, bytes)`` of ``model``'s weights, each tensor once (a tied head shares its table).
    A table astrai keeps quantized (GGUF blocks: a buffer with its layout's ``n`` x ``k``) counts the
    matrix it holds, at its packed size."""
    seen: set[int] = set()
    count = size = 0
    tables = [(p, None) for p in model.parameters()]
    for m in model.modules():
        if hasattr(m, "segments"):  # a quantized linear: one table per fused projection
            tables += m.segments
        elif hasattr(m, "packed") and hasattr(m, "layout"):  # a quantized embedding
            tables.append((m.packed, m.layout))
    for tensor, layout in tables:
        if tensor.data_ptr() in seen:
            continue
        seen.add(tensor.data_ptr())
        count += tensor.numel() if layout is None else layout.n * layout.k
        size += tensor.numel() * tensor.element_size()
    return count, size


class OllamaGenerateBuilder(_OllamaBuilder):
    """Ollama ``/api/generate`` over NDJSON: a prompt, templated unless ``raw``."""

    name = "ollama_generate"
    route = "/api/generate"
    request_model = GenerateRequest

    def prepare(self, request: GenerateRequest, engine: Any) -> Prepared:
        return self._prepared(request, request.prompt_ids(engine.tokenizer), engine)

    def _piece(self, text: str) -> dict[str, Any]:
        return {"response": text}
