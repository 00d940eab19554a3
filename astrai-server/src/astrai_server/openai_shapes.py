"""The shapes OpenAI's three routes share: Chat Completions, (legacy) Completions and Responses.

Not a protocol module: ``protocols/openai.py``, ``protocols/completions.py`` and
``protocols/responses.py`` are one builder file each, and each takes what OpenAI's API gives the
three in common from here rather than from another builder file, so that any of them can be copied
as a template whole. A module of its own rather than a part of ``astrai_server.request_parts``
(what every protocol shares): these are OpenAI's shapes, of no use to Anthropic's or Ollama's.

- ``openai_error``: OpenAI's error body, which all three routes answer with;
- ``FINISH``: the engine's finish reasons as OpenAI names them (chat and completions);
- ``StreamOptions`` and ``openai_usage``: ``stream_options`` and ``usage`` of chat and completions
  (Responses has its own of both);
- ``logprob_entries``: OpenAI's per-token log-prob entries (chat and Responses), with
  ``LOGPROB_FLOOR`` for ``-inf``, which is no JSON number.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from astrai.protocol import error_type_for
from astrai_server.request_parts import Strict

if TYPE_CHECKING:
    from astrai.logprobs import TokenLogprob
    from astrai.protocol import ChatResult

__all__ = ["FINISH", "LOGPROB_FLOOR", "StreamOptions", "logprob_entries", "openai_error", "openai_usage"]

FINISH = {
    "stop": "stop",
    "stop_sequence": "stop",
    "length": "length",
    "tool_calls": "tool_calls",
    "abort": "abort",
}

#: A log-prob of -inf goes out as this (JSON has no infinity), as vLLM sends it.
LOGPROB_FLOOR = -9999.0


class StreamOptions(Strict):
    """``stream_options`` of chat and completions: without ``include_usage`` false, a stream ends
    with a usage chunk."""

    include_usage: bool = True
    include_obfuscation: bool | None = None


def openai_error(status: int, message: str, param: str | None = None) -> dict[str, Any]:
    """OpenAI's error body; a 404 (an unknown model) is OpenAI's invalid_request_error, model_not_found."""
    code = {401: "invalid_api_key", 404: "model_not_found", 429: "rate_limit_exceeded"}.get(status)
    if status >= 500:
        kind = "server_error"
    elif status == 404:
        kind = "invalid_request_error"
    elif status == 429:
        kind = "requests"  # OpenAI's request-rate limit
    else:
        kind = error_type_for(status)
    return {"error": {"message": message, "type": kind, "param": param, "code": code}}


def openai_usage(result: ChatResult) -> dict[str, Any]:
    """The ``usage`` of chat and completions; ``prompt_tokens_details.cached_tokens``: the prompt tokens
    the prefix cache served in the caller's own namespace (its API key's, its ``cache_salt``'s);
    ``completion_tokens_details.reasoning_tokens`` when a choice had reasoning (its thinking's tokens)."""
    usage: dict[str, Any] = {
        "prompt_tokens": result.prompt_tokens,
        "completion_tokens": result.completion_tokens,
        "total_tokens": result.total_tokens,
        "prompt_tokens_details": {"cached_tokens": result.cached_tokens},
    }
    if any(c.reasoning is not None for c in result.choices):
        usage["completion_tokens_details"] = {
            "reasoning_tokens": sum(c.reasoning_tokens for c in result.choices)
        }
    return usage


def logprob_entries(
    tokenizer: Any, entries: list[TokenLogprob], with_bytes: bool = True
) -> list[dict[str, Any]]:
    """One entry per token, ``{"token", "logprob", "bytes", "top_logprobs"}``, its ``top`` alternatives
    in ``top_logprobs`` (without ``"bytes"`` when not ``with_bytes``: a Responses stream event's)."""
    texts: dict[int, tuple[str, list[int] | None]] = {}  # alternatives repeat: look each token up once

    def token(token_id: int, logprob: float) -> dict[str, Any]:
        if token_id not in texts:
            raw = list(tokenizer.token_bytes(token_id)) if with_bytes else None
            texts[token_id] = (tokenizer.token_text(token_id), raw)
        text, raw = texts[token_id]
        out = {"token": text, "logprob": max(logprob, LOGPROB_FLOOR)}
        return {**out, "bytes": raw} if with_bytes else out

    return [
        {**token(e.token_id, e.logprob), "top_logprobs": [token(t, lp) for t, lp in e.top]} for e in entries
    ]
