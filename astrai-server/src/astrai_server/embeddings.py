"""OpenAI's ``POST /v1/embeddings`` on the embedding models served beside the chat model
(``--embedding-model``: ``astrai.embedding.EmbeddingEngine``, in ``app.state.embedders`` by served
name once loaded).

The body is OpenAI's ``EmbeddingCreateParams``: ``input`` a string, a list of strings, a list of token
ids or a list of such lists (each item one vector, in order); ``encoding_format`` ``float`` (lists of
numbers) or ``base64`` (the float32 bytes, little-endian, as the ``openai`` SDK decodes them);
``dimensions`` only where it is the model's own size (none of the encoders served truncates its
vectors: a 400 says so); ``user`` has no effect. vLLM's ``truncate_prompt_tokens`` cuts each input to
that many tokens (the tokenizer's own truncation, special tokens kept; -1: the model's limit) where an
input would otherwise be too long, which is a 400. A ``model`` that is not an embedding model served
here is a 400 (the chat model) or a 404, OpenAI's words.
"""

from __future__ import annotations

import asyncio
import base64
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, Literal

from pydantic import Field, ValidationError

from astrai.errors import EngineNotReady, ModelNotFound, RequestRejected
from astrai_server.errors import HTTPProblem, public_message, status_for
from astrai_server.openai_shapes import openai_error
from astrai_server.request_parts import Strict

if TYPE_CHECKING:  # (the protocols import model_cards from here: no web stack at import)
    from fastapi import Request
    from fastapi.responses import JSONResponse, Response

__all__ = ["EmbeddingRequest", "embeddings_endpoint", "model_cards", "refuse_embedder"]


class EmbeddingRequest(Strict):
    """OpenAI's ``EmbeddingCreateParams`` and vLLM's ``truncate_prompt_tokens``."""

    model: str
    input: str | list[str] | list[int] | list[list[int]]
    encoding_format: Literal["float", "base64"] = "float"
    dimensions: int | None = Field(None, ge=1)
    user: str | None = None
    truncate_prompt_tokens: int | None = Field(None, ge=-1)


def _inputs(req: EmbeddingRequest, engine: Any) -> list[list[int]]:
    """Each item's token ids (texts through the model's tokenizer), cut as ``truncate_prompt_tokens`` asks."""
    items = req.input
    if isinstance(items, str):
        items = [items]
    if not items:
        raise RequestRejected("input must not be empty", param="input")
    limit = req.truncate_prompt_tokens
    if limit == -1 or (limit is not None and limit > engine.context_limit):
        limit = engine.context_limit
    if limit == 0:
        raise RequestRejected(
            "truncate_prompt_tokens must be at least 1 (or -1)", param="truncate_prompt_tokens"
        )
    if isinstance(items[0], int):
        items = [items]  # one input of token ids
    if isinstance(items[0], str):
        texts = list(items)
        if any(not t for t in texts):
            raise RequestRejected("input must not hold an empty string", param="input")
        hf = engine.tokenizer.hf
        coded = hf(texts, add_special_tokens=True, truncation=limit is not None, max_length=limit)[
            "input_ids"
        ]
        return [list(ids) for ids in coded]
    return [list(ids)[:limit] if limit is not None else list(ids) for ids in items]


def _vector(values: Any, encoding: str) -> Any:
    if encoding == "base64":
        return base64.b64encode(values.numpy().astype("<f4").tobytes()).decode("ascii")
    return values.tolist()


def _answer(req: EmbeddingRequest, engine: Any, name: str) -> dict[str, Any]:
    if req.dimensions is not None and req.dimensions != engine.dimensions:
        raise RequestRejected(
            f"{name} does not support dimensions {req.dimensions}: its vectors have {engine.dimensions} "
            "and cannot be shortened",
            param="dimensions",
        )
    inputs = _inputs(req, engine)
    for i, ids in enumerate(inputs):
        if len(ids) > engine.context_limit:
            raise RequestRejected(
                f"input {i} has {len(ids)} tokens; {name} takes at most {engine.context_limit} "
                "(truncate_prompt_tokens cuts inputs)",
                param="input",
            )
    try:
        engine.check(inputs)
    except RequestRejected as exc:
        raise RequestRejected(str(exc), param="input") from None
    vectors = engine.embed(inputs)
    tokens = sum(map(len, inputs))
    return {
        "object": "list",
        "data": [
            {"object": "embedding", "index": i, "embedding": _vector(v, req.encoding_format)}
            for i, v in enumerate(vectors)
        ],
        "model": name,
        "usage": {"prompt_tokens": tokens, "total_tokens": tokens},
    }


def _error(exc: BaseException) -> JSONResponse:
    from fastapi.responses import JSONResponse

    if isinstance(exc, ValidationError):
        first = exc.errors()[0]
        param = ".".join(str(p) for p in first["loc"]) or None
        return JSONResponse(openai_error(400, f"{param}: {first['msg']}", param), status_code=400)
    status = status_for(exc)
    return JSONResponse(
        openai_error(status, public_message(exc), getattr(exc, "param", None)), status_code=status
    )


def refuse_embedder(model: str | None, embedders: dict[str, Any]) -> None:
    """RequestRejected (400) for a generation request that names an embedding model."""
    if model is not None and model in embedders:
        raise RequestRejected(f"{model} is an embedding model: it serves /v1/embeddings only", param="model")


def embeddings_endpoint(check_key: Callable[[Request], None]) -> Callable[[Request], Any]:
    """The route's endpoint; ``check_key`` raises HTTPProblem 401 for a caller without a valid key."""
    from fastapi import Request
    from fastapi.responses import JSONResponse, Response

    from astrai_server.body import ClientGone, read_body

    async def endpoint(request: Request) -> Response:
        try:
            check_key(request)
            if request.app.state.draining:
                raise EngineNotReady("the server is shutting down: retry on another instance")
            raw = await read_body(request, request.app.state.settings.max_request_bytes)
            req = EmbeddingRequest.model_validate_json(bytes(raw))
            if request.app.state.engine is None:  # still loading (the embedders come with the engine)
                raise EngineNotReady("the models are still loading")
            embedders = request.app.state.embedders
            engine = embedders.get(req.model)
            if engine is None:
                chat = request.app.state.settings.served_model_name
                if req.model == chat:
                    served = ", ".join(embedders) or "none (start the server with --embedding-model)"
                    raise RequestRejected(
                        f"{req.model} is a generation model; /v1/embeddings needs an embedding model: {served}",
                        param="model",
                    )
                raise ModelNotFound(
                    f"The model `{req.model}` does not exist or you do not have access to it."
                )
            body = await asyncio.get_running_loop().run_in_executor(None, _answer, req, engine, req.model)
            return JSONResponse(body)
        except ClientGone:
            return Response(status_code=499)  # never sent: the client left
        except HTTPProblem as problem:
            body = openai_error(problem.status, problem.message, problem.param)
            return JSONResponse(body, status_code=problem.status)
        except Exception as exc:  # nothing a client sends may become a bare 500
            return _error(exc)

    # FastAPI reads the annotations; this module's globals lack the web types they name
    endpoint.__annotations__.update({"request": Request, "return": Response})
    return endpoint


def model_cards(embedders: dict[str, Any], created: int) -> list[dict[str, Any]]:
    """``/v1/models`` entries of the embedding models."""
    return [
        {
            "id": name,
            "object": "model",
            "created": created,
            "owned_by": "astrai",
            "context_length": engine.context_limit,
            "max_model_len": engine.context_limit,
            "task": "embed",
            "dimensions": engine.dimensions,
        }
        for name, engine in embedders.items()
    ]
