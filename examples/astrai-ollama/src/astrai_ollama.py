"""The Ollama chat API on astrai: one ``ResponseBuilder``, entry point ``ollama`` in ``astrai.protocols``.

``POST /api/chat`` answers in Ollama's shape: with ``"stream": true`` (Ollama's
default) one JSON object per line (``application/x-ndjson``), each carrying a piece
of the assistant message, then a last one with ``"done": true``, the finish reason,
token counts and durations (nanoseconds); with ``"stream": false`` that last object
holds the whole message. ``GET /api/tags`` lists the served model. Errors are
``{"error": "..."}`` with the HTTP status, in-stream too, as the ``ollama`` client reads them.
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable
from datetime import datetime, timezone
from functools import partial
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

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

__all__ = ["ChatRequest", "OllamaResponseBuilder", "Options"]

DONE_REASON = {"stop": "stop", "stop_sequence": "stop", "tool_calls": "stop", "length": "length", "abort": "stop"}


class Message(BaseModel):
    model_config = ConfigDict(extra="ignore")  # images, thinking, tool_calls: not supported

    role: Literal["system", "user", "assistant", "tool"]
    content: str = ""


class Options(BaseModel):
    """``options`` of a chat request, with Ollama's defaults; any other option goes to sampling plugins."""

    model_config = ConfigDict(extra="allow")

    temperature: float | None = 0.8
    top_k: int | None = 40
    top_p: float | None = 0.9
    seed: int | None = None
    stop: str | list[str] | None = None
    num_predict: int | None = -1  # -1 (or any value < 1): until the context is full
    frequency_penalty: float | None = 0.0
    presence_penalty: float | None = 0.0


class ChatRequest(BaseModel):
    """The body of ``POST /api/chat`` (``format``, ``tools``, ``keep_alive``, ``think`` are ignored)."""

    model_config = ConfigDict(extra="ignore")

    model: str = Field(min_length=1)
    messages: list[Message] = Field(min_length=1)
    stream: bool = True
    options: Options | None = None

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
            seed=o.seed,
            stop=o.stop,
            frequency_penalty=value("frequency_penalty"),
            presence_penalty=value("presence_penalty"),
            extra=plugin_sampling(o),  # the options left over: parameters of sampling plugins
        )

    @property
    def max_tokens_explicit(self) -> bool:
        """Whether ``num_predict`` bounds the answer (else it runs until the context is full)."""
        return self.options is not None and (self.options.num_predict or 0) > 0


def _now() -> str:
    return datetime.now(timezone.utc).isoformat()


class OllamaResponseBuilder(ResponseBuilder):
    """Ollama ``/api/chat`` over NDJSON, and ``/api/tags``."""

    name = "ollama"
    route = "/api/chat"
    request_model = ChatRequest
    stream_media_type = "application/x-ndjson"

    def __init__(self, model_name: str = "astrai") -> None:
        super().__init__(model_name)
        self.modified_at = _now()

    def prepare(self, request: ChatRequest, engine: Any) -> Prepared:
        messages = [m.model_dump() for m in request.messages]
        prompt_ids = chat_prompt_ids(engine.tokenizer, messages)
        return Prepared(
            request=request, prompt_ids=prompt_ids, params=request.sampling_params(engine.context_limit),
            stream=request.stream, max_tokens_explicit=request.max_tokens_explicit,
            response_id=new_id("ollama-"), model=request.model,
            state={"start_ns": time.monotonic_ns()},
        )  # fmt: skip

    def get_routes(self) -> dict[str, Callable[[Any], dict[str, Any]]]:
        return {"/api/tags": self._tags}

    def _tags(self, engine: Any) -> dict[str, Any]:
        params = list(engine.model.parameters())
        family = engine.model.config.architecture
        details = {
            "parent_model": "", "format": "astrai", "family": family, "families": [family],
            "parameter_size": f"{sum(p.numel() for p in params) / 1e6:.0f}M", "quantization_level": "",
        }  # fmt: skip
        size = sum(p.numel() * p.element_size() for p in params)
        model = {"name": self.model_name, "model": self.model_name, "modified_at": self.modified_at,
                 "size": size, "digest": "", "details": details}  # fmt: skip
        return {"models": [model]}

    def _body(self, p: Prepared, body: dict[str, Any]) -> dict[str, Any]:
        return {"model": p.model, "created_at": _now(), **body}

    def _line(self, p: Prepared, body: dict[str, Any]) -> str:
        return json.dumps(self._body(p, body), ensure_ascii=False) + "\n"

    def _final(self, p: Prepared, result: ChatResult, content: str) -> dict[str, Any]:
        choice = result.choices[0]
        return {
            "message": {"role": "assistant", "content": content}, "done": True,
            "done_reason": DONE_REASON.get(choice.finish_reason, choice.finish_reason),
            "total_duration": time.monotonic_ns() - p.state["start_ns"], "load_duration": 0,
            "prompt_eval_count": result.prompt_tokens, "eval_count": result.completion_tokens,
        }  # fmt: skip

    def format_stream_start(self, prepared: Prepared) -> list[str]:
        return []

    def format_chunk(self, prepared: Prepared, index: int, text: str) -> list[str]:
        return [self._line(prepared, {"message": {"role": "assistant", "content": text}, "done": False})]

    def format_stream_end(self, prepared: Prepared, result: ChatResult) -> list[str]:
        return [self._line(prepared, self._final(prepared, result, ""))]

    def format_response(self, prepared: Prepared, result: ChatResult) -> dict[str, Any]:
        return self._body(prepared, self._final(prepared, result, result.choices[0].text))

    def format_error(self, status: int, message: str, param: str | None = None) -> dict[str, Any]:
        return {"error": message}

    def format_stream_error(self, prepared: Prepared, status: int, message: str) -> list[str]:
        return [json.dumps({"error": message}) + "\n"]

