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
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from astrai.protocol import ChatResult, Prepared, ResponseBuilder, chat_prompt_ids, context_limit, new_id
from astrai.sampling import SamplingParams

__all__ = ["ChatRequest", "OllamaResponseBuilder"]

#: Ollama option -> SamplingParams field; every other option goes to ``SamplingParams.extra``.
OPTIONS = {
    "temperature": "temperature", "top_k": "top_k", "top_p": "top_p", "seed": "seed", "stop": "stop",
    "num_predict": "max_tokens", "frequency_penalty": "frequency_penalty", "presence_penalty": "presence_penalty",
}  # fmt: skip
#: Ollama's own defaults for the options it documents.
DEFAULTS = {"temperature": 0.8, "top_k": 40, "top_p": 0.9}
DONE_REASON = {"stop": "stop", "stop_sequence": "stop", "tool_calls": "stop", "length": "length", "abort": "stop"}


class Message(BaseModel):
    model_config = ConfigDict(extra="ignore")  # images, thinking, tool_calls: not supported

    role: Literal["system", "user", "assistant", "tool"]
    content: str = ""


class ChatRequest(BaseModel):
    """The body of ``POST /api/chat`` (``format``, ``tools``, ``keep_alive``, ``think`` are ignored)."""

    model_config = ConfigDict(extra="ignore")

    model: str = Field(min_length=1)
    messages: list[Message] = Field(min_length=1)
    stream: bool = True
    options: dict[str, Any] | None = None


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
        options = dict(request.options or {})
        sampling = {**DEFAULTS, **{field: options.pop(key) for key, field in OPTIONS.items() if key in options}}
        explicit = isinstance(sampling.get("max_tokens"), int) and sampling["max_tokens"] > 0
        if not explicit:  # -1 or absent: until the context is full (the handler shrinks it to fit)
            sampling["max_tokens"] = context_limit(engine)
        messages = [m.model_dump() for m in request.messages]
        prompt_ids = chat_prompt_ids(engine.tokenizer, messages)
        params = SamplingParams(**sampling, extra=options)  # what is left: parameters of sampling plugins
        return Prepared(
            request=request, prompt_ids=prompt_ids, params=params, stream=request.stream,
            max_tokens_explicit=explicit, response_id=new_id("ollama-"), model=request.model,
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

