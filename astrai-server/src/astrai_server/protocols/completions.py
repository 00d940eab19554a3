"""OpenAI legacy Completions (``POST /v1/completions``), as vLLM serves it to lm-eval, litellm and ``openai``.

Registered as entry point ``completions`` in ``astrai.protocols``. Parameters, defaults and
ranges are the fields of ``CompletionRequest`` (docs/http-api.md); errors, ``usage`` and
``stream_options`` have OpenAI's shapes, as chat's do (``astrai_server.openai_shapes``). Where
OpenAI leaves a detail open this follows vLLM's ``serving_completion.py``:

- ``prompt`` is a string, a list of strings, a list of token ids or a list of such lists. A string
  is encoded with the tokenizer's special tokens (``add_special_tokens=True``: BOS where the
  tokenizer adds one, as vLLM does), never with a chat template; token ids are used as given. Choice
  ``k`` completes prompt ``k // n``.
- ``logprobs: k`` covers every generated token, EOS and the tokens of a matched stop string
  included although their text is not in ``text``. ``tokens`` are the tokens' texts;
  ``top_logprobs`` maps the token itself, then the ``k`` most likely, to their log-probs (``k`` or
  ``k + 1`` entries); ``-inf`` is sent as ``-9999.0``.
- ``echo``: ``text`` starts with the prompt as sent (a token-id prompt decoded, special tokens
  kept), and with ``logprobs`` the entries start with the prompt's tokens, the first with a null
  log-prob and null ``top_logprobs``. ``max_tokens: 0`` with ``echo`` scores the prompt only (finish
  ``length``); vLLM generates a token and drops it, here nothing is generated.
- ``text_offset``: where each token starts in the choice's text, as the running sum of the lengths
  of ``tokens`` from 0. A stream keeps that sum across its chunks (vLLM restarts each chunk from
  the length of the text sent), so streamed and whole offsets agree.
- A stream sends per piece ``{"index", "text", "logprobs", "finish_reason": null}``, the echo in a
  choice's first chunk (at the end when it generated no text), then per choice a ``"text": ""``
  chunk with the finish reason and the log-probs of the tokens that brought no text, the usage
  chunk (``"choices": []``, unless ``stream_options.include_usage`` is false) and ``data: [DONE]``.

Over 300 lines because a builder is one file: the request model, and each of the rules above a few
lines of log-probs, echo or framing.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import TYPE_CHECKING, Annotated, Any

from pydantic import BaseModel, ConfigDict, Field

from astrai.errors import RequestRejected
from astrai.protocol import (
    CacheSalt,
    ChatResult,
    Choice,
    Prepared,
    ResponseBuilder,
    new_id,
    plugin_sampling,
    sent_fields,
    sse,
    value_or_default,
)
from astrai.sampling import SamplingParams
from astrai_server.openai_shapes import FINISH, LOGPROB_FLOOR, StreamOptions, openai_error, openai_usage
from astrai_server.structured import one_of, openai_response_format, vllm_structured_outputs
from astrai_server.thinking import budget_field, check_budget

if TYPE_CHECKING:
    from astrai.logprobs import TokenLogprob

__all__ = ["CompletionRequest", "CompletionsResponseBuilder", "StreamOptions"]

Entry = tuple[int, "TokenLogprob | None"]  # a token id and its log-prob (None: the first prompt token)


class CompletionRequest(BaseModel):
    """The request body of ``POST /v1/completions``; undeclared fields are kept for sampling plugins."""

    model_config = ConfigDict(extra="allow")

    model: str = "astrai"
    prompt: str | list[str] | list[int] | list[list[int]]
    suffix: str | None = None
    max_tokens: int | None = Field(16, ge=0)  # OpenAI's and vLLM's default for completions
    temperature: float | None = Field(1.0, ge=0.0, le=2.0)
    top_p: float | None = Field(1.0, ge=0.0, le=1.0)
    top_k: int | None = Field(None, ge=0)
    min_p: float | None = Field(0.0, ge=0.0, le=1.0)
    n: int | None = Field(1, ge=1, le=16)
    best_of: int | None = None
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    seed: int | None = None
    stream: bool | None = False
    stream_options: StreamOptions | None = None
    echo: bool | None = False
    logprobs: int | None = Field(None, ge=0, le=5)
    presence_penalty: float | None = Field(0.0, ge=-2.0, le=2.0)
    frequency_penalty: float | None = Field(0.0, ge=-2.0, le=2.0)
    repetition_penalty: float | None = Field(1.0, gt=0.0, le=10.0)
    min_tokens: int | None = Field(0, ge=0)
    # vLLM's: smaller first, with --scheduling-policy priority
    priority: int | None = Field(0, ge=-(2**31), le=2**31 - 1)
    logit_bias: dict[int, Annotated[float, Field(ge=-100.0, le=100.0)]] | None = None
    ignore_eos: bool = False
    response_format: dict[str, Any] | None = None  # vLLM accepts it on completions too
    structured_outputs: dict[str, Any] | None = None  # vLLM's
    user: str | None = None
    cache_salt: CacheSalt | None = None  # vLLM's: the prefix cache shares pages only within a salt
    thinking_token_budget: int | None = None  # vLLM's spelling of a thinking budget (astrai_server.thinking)
    thinking_budget: int | None = None  # SGLang's

    def sampling_params(self) -> SamplingParams:
        """The engine's parameters: null is the field's default (``top_k``: off); ``echo`` with
        ``logprobs`` asks the prompt's log-probs too. Raises RequestRejected for a value the engine
        refuses although the schema takes it (``top_p`` 0) and for ``min_tokens`` above ``max_tokens``."""
        stop = [self.stop] if isinstance(self.stop, str) else self.stop or []
        params = SamplingParams(
            max_tokens=value_or_default(self, "max_tokens"),
            temperature=value_or_default(self, "temperature"),
            top_p=value_or_default(self, "top_p"),
            top_k=self.top_k or 0,
            min_p=value_or_default(self, "min_p"),
            stop=[s for s in stop if s],
            stop_token_ids=list(self.stop_token_ids or []),
            seed=self.seed,
            frequency_penalty=value_or_default(self, "frequency_penalty"),
            presence_penalty=value_or_default(self, "presence_penalty"),
            repetition_penalty=value_or_default(self, "repetition_penalty"),
            min_tokens=value_or_default(self, "min_tokens"),
            logit_bias=dict(self.logit_bias or {}),
            ignore_eos=self.ignore_eos,
            logprobs=self.logprobs,
            prompt_logprobs=self.logprobs if self.echo else None,
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

    def prompt_ids(self, tokenizer: Any) -> list[list[int]]:
        """The token ids of each prompt. Raises RequestRejected (``param`` prompt) for an empty
        prompt or a token id outside ``[0, tokenizer.vocab_size)``."""
        items, vocab, out = self._items(), tokenizer.vocab_size, []
        if not items:
            raise RequestRejected("prompt must hold at least one prompt", param="prompt")
        for item in items:
            ids = tokenizer.encode(item, add_special_tokens=True) if isinstance(item, str) else list(item)
            bad = next((t for t in ids if not 0 <= t < vocab), None)
            if bad is not None:
                raise RequestRejected(
                    f"prompt token id {bad} is outside the vocabulary [0, {vocab})", param="prompt"
                )
            if not ids:
                raise RequestRejected("a prompt is empty: at least one token is needed", param="prompt")
            out.append(ids)
        return out

    def echo_texts(self, prompts: list[list[int]], tokenizer: Any) -> list[str]:
        """What ``echo`` returns of each prompt: a string as sent, token ids decoded with special tokens."""
        return [
            item if isinstance(item, str) else tokenizer.decode(ids, skip_special_tokens=False)
            for item, ids in zip(self._items(), prompts, strict=True)
        ]

    def _items(self) -> list[Any]:
        """``prompt`` as a list of prompts (strings or token-id lists; a string or a list of ids is one)."""
        p = self.prompt
        return [p] if isinstance(p, str) or (p and isinstance(p[0], int)) else list(p)

    @property
    def max_tokens_explicit(self) -> bool:
        """Whether the client set ``max_tokens`` (null is the default, which may be shortened)."""
        return "max_tokens" in self.model_fields_set and self.max_tokens is not None


class CompletionsResponseBuilder(ResponseBuilder):
    """OpenAI text completions over JSON and SSE (``object: "text_completion"``)."""

    name = "completions"
    splits_reasoning = False  # a raw continuation: its text is the text generated
    route = "/v1/completions"
    request_model = CompletionRequest

    def fan_out(self, request: CompletionRequest) -> list[tuple[str, int]]:
        """Every prompt of the list, times ``n``."""
        return [("prompt", len(request._items())), ("n", value_or_default(request, "n"))]

    def prepare(self, request: CompletionRequest, engine: Any) -> Prepared:
        n = value_or_default(request, "n")
        if request.suffix is not None:
            raise RequestRejected("suffix is not supported (no fill-in-the-middle)", param="suffix")
        if request.best_of not in (None, n):
            raise RequestRejected(
                f"best_of must be null or equal to n ({n}): every choice is returned", param="best_of"
            )
        tokenizer = engine.tokenizer
        prompts = request.prompt_ids(tokenizer)
        include_usage = request.stream_options.include_usage if request.stream_options else True
        state = {
            "include_usage": include_usage,
            "k": request.logprobs,
            "token_text": tokenizer.token_text,
            "echo": request.echo_texts(prompts, tokenizer) if request.echo else None,
            "echoed": set(),
            "offsets": {},  # streaming: choices whose echo went out; text_offset so far
        }
        return Prepared(
            request=request,
            prompt_ids=prompts[0],
            params=request.sampling_params(),
            prompts=prompts,
            stream=bool(request.stream),
            n=n,
            max_tokens_explicit=request.max_tokens_explicit,
            cache_salt=request.cache_salt,
            sampling_sent=sent_fields(request),
            thinking_param=budget_field(request)[1],
            response_id=new_id("cmpl-"),
            model=request.model,
            state=state,
        )

    # ------------------------------------------------------------ log-probs
    def _echo(
        self, p: Prepared, prompt_index: int, prompt_logprobs: list[TokenLogprob | None] | None
    ) -> tuple[str, list[Entry]]:
        """The echoed text of a prompt and its tokens' entries (none unless log-probs were asked)."""
        echo = p.state["echo"]
        if echo is None or p.state["k"] is None:
            return ("" if echo is None else echo[prompt_index]), []
        ids = (p.prompts or [p.prompt_ids])[prompt_index]
        lps = prompt_logprobs if prompt_logprobs and len(prompt_logprobs) == len(ids) else [None] * len(ids)
        return echo[prompt_index], list(zip(ids, lps, strict=True))

    def _logprobs(
        self, p: Prepared, entries: list[Entry], offset: int = 0
    ) -> tuple[dict[str, list[Any]] | None, int]:
        """OpenAI's ``logprobs`` object of ``entries`` (None: not asked), ``text_offset`` counted from
        ``offset``; and the offset after them."""
        k, token_text = p.state["k"], p.state["token_text"]
        if k is None:
            return None, offset
        out: dict[str, list[Any]] = {
            key: [] for key in ("tokens", "token_logprobs", "top_logprobs", "text_offset")
        }
        for token_id, lp in entries:
            text = token_text(token_id)
            out["tokens"].append(text)
            out["text_offset"].append(offset)
            offset += len(text)
            out["token_logprobs"].append(None if lp is None else max(lp.logprob, LOGPROB_FLOOR))
            out["top_logprobs"].append(None if lp is None else _top(lp, k, token_text))
        return out, offset

    # ------------------------------------------------------------ responses
    def _chunk(self, p: Prepared, choices: list[dict[str, Any]], **extra: Any) -> str:
        body = {"id": p.response_id, "object": "text_completion", "created": p.created, "model": p.model}
        return sse({**body, "choices": choices, **extra})

    def _piece(
        self, p: Prepared, index: int, text: str, entries: list[Entry], finish: str | None = None
    ) -> str:
        offsets = p.state["offsets"]
        logprobs, offsets[index] = self._logprobs(p, entries, offsets.get(index, 0))
        return self._chunk(p, [{"index": index, "text": text, "logprobs": logprobs, "finish_reason": finish}])

    def format_stream_start(self, prepared: Prepared) -> list[str]:
        return []

    def format_chunk(self, prepared: Prepared, index: int, text: str, **logprobs: Any) -> list[str]:
        head, entries = "", []
        if index not in prepared.state["echoed"]:
            prepared.state["echoed"].add(index)
            head, entries = self._echo(prepared, index // prepared.n, logprobs.get("prompt_logprobs"))
        entries += [(lp.token_id, lp) for lp in logprobs.get("logprobs", ())]
        return [self._piece(prepared, index, head + text, entries)]

    def format_stream_end(self, prepared: Prepared, result: ChatResult) -> list[str]:
        frames = []
        for c in result.choices:
            if c.index not in prepared.state["echoed"] and prepared.state["echo"] is not None:  # no text came
                frames.append(
                    self._piece(prepared, c.index, *self._echo(prepared, c.prompt_index, c.prompt_logprobs))
                )
            rest = [(lp.token_id, lp) for lp in (c.logprobs or [])[c.logprobs_streamed :]]
            frames.append(self._piece(prepared, c.index, "", rest, FINISH[c.finish_reason]))
        if prepared.state["include_usage"]:
            frames.append(self._chunk(prepared, [], usage=openai_usage(result)))
        frames.append(sse("[DONE]"))
        return frames

    def format_response(self, prepared: Prepared, result: ChatResult) -> dict[str, Any]:
        return {
            "id": prepared.response_id,
            "object": "text_completion",
            "created": prepared.created,
            "model": prepared.model,
            "choices": [self._choice(prepared, c) for c in result.choices],
            "usage": openai_usage(result),
        }

    def format_error(self, status: int, message: str, param: str | None = None) -> dict[str, Any]:
        return openai_error(status, message, param)

    def format_stream_error(self, prepared: Prepared, status: int, message: str) -> list[str]:
        return [sse(openai_error(status, message))]  # the SDK raises on a data line with "error"

    def _choice(self, p: Prepared, c: Choice) -> dict[str, Any]:
        head, entries = self._echo(p, c.prompt_index, c.prompt_logprobs)
        entries += [(lp.token_id, lp) for lp in c.logprobs or []]
        logprobs, _ = self._logprobs(p, entries)
        return {
            "index": c.index,
            "text": head + c.text,
            "logprobs": logprobs,
            "finish_reason": FINISH[c.finish_reason],
        }


def _top(lp: TokenLogprob, k: int, token_text: Callable[[int], str]) -> dict[str, float]:
    """The token itself, then its position's ``k`` most likely, by text (vLLM's order; at most k + 1)."""
    ranked = {lp.token_id: lp.logprob}
    for token_id, logprob in lp.top[:k]:
        ranked.setdefault(token_id, logprob)
    return {token_text(t): max(v, LOGPROB_FLOOR) for t, v in ranked.items()}
