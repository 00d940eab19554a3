"""OpenAI's ``POST /v1/embeddings`` on the embedding models served beside the chat model
(``--embedding-model``: ``astrai.embedding.EmbeddingEngine``, in ``app.state.embedders`` by served
name once loaded).

The body is OpenAI's ``EmbeddingCreateParams``: ``input`` a string, a list of strings, a list of token
ids or a list of such lists (each item one vector, in order); ``encoding_format`` ``float`` (lists of
numbers, each float32 in the fewest digits that read back as it) or ``base64`` (the float32 bytes, little-endian, as the ``openai`` SDK decodes them);
``dimensions`` the model's own size, or a smaller one for a Matryoshka model (its ``config.json``
says ``is_matryoshka`` or ``matryoshka_dimensions``, vLLM's keys): its vectors' leading dimensions,
normalised again where the model normalises; any other size is a 400; ``user`` has no effect. vLLM's ``truncate_prompt_tokens`` cuts each input to
that many tokens (the tokenizer's own truncation, special tokens kept; -1: the model's limit) where an
input would otherwise be too long, which is a 400. A ``model`` that is not an embedding model served
here is a 400 (the chat model) or a 404, OpenAI's words.
"""

from __future__ import annotations

import asyncio
import base64
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import TYPE_CHECKING, Any, Literal

from pydantic import Field, ValidationError

from astrai.embedding import Withdrawable
from astrai.errors import EngineNotReady, ModelNotFound, RequestRejected
from astrai_server.errors import HTTPProblem, public_message, status_for
from astrai_server.openai_shapes import openai_error
from astrai_server.request_parts import Strict

if TYPE_CHECKING:  # (the protocols import model_cards from here: no web stack at import)
    from fastapi import Request
    from fastapi.responses import JSONResponse, Response

__all__ = ["EmbeddingRequest", "embeddings_endpoint", "model_cards", "pooling_endpoint", "refuse_embedder"]


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
    """base64 of the float32 bytes, or the float32 array that ``_json`` writes as numbers."""
    if encoding == "base64":
        return base64.b64encode(values.numpy().astype("<f4").tobytes()).decode("ascii")
    return values.float().numpy()


def _json(body: dict[str, Any]) -> bytes:
    """A response body as JSON: each float32 of a vector as the shortest number that reads back as
    that float32 (``-0.0069292835``, as OpenAI's API writes them: 4.8 KB for a MiniLM vector where
    Python floats' 17 digits take 8.1), by orjson, ~25 times faster than ``json.dumps``."""
    import orjson

    return orjson.dumps(body, option=orjson.OPT_SERIALIZE_NUMPY)


def _answer(req: EmbeddingRequest, engine: Any, name: str, futures: list) -> dict[str, Any]:
    cut = req.dimensions is not None and req.dimensions != engine.dimensions
    if cut:
        _check_dimensions(req.dimensions, engine, name)
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
    vectors = engine.embed(inputs, futures=futures)
    if cut:  # a Matryoshka model's leading dimensions, unit length again where its vectors are
        vectors = vectors[:, : req.dimensions]
        if engine.pooling.normalize:
            vectors = vectors / vectors.norm(dim=1, keepdim=True).clamp_min(1e-12)
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


def _check_dimensions(dimensions: int, engine: Any, name: str) -> None:
    """RequestRejected for ``dimensions`` that ``engine``'s vectors cannot be cut to."""
    sizes = getattr(engine, "truncations", None)
    if sizes is None:
        raise RequestRejected(
            f"{name} does not support dimensions {dimensions}: its vectors have {engine.dimensions} "
            "and cannot be shortened",
            param="dimensions",
        )
    if dimensions > engine.dimensions or (sizes and dimensions not in sizes):
        allowed = ", ".join(map(str, (*sizes, engine.dimensions))) if sizes else f"1 to {engine.dimensions}"
        raise RequestRejected(
            f"{name} does not support dimensions {dimensions}: its vectors can be cut to {allowed}",
            param="dimensions",
        )


def error_response(exc: BaseException) -> JSONResponse:
    """``exc`` as OpenAI's error body with its status (a validation error: a 400 naming the field)."""
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
        raise RequestRejected(
            f"{model} is a pooling model: it serves {SERVES[embedders[model].task]}", param="model"
        )


#: the threads that tokenize a pooling request and wait for its vectors: more than the event loop's
#: default pool (cores + 4), so that every request in flight joins the encoder's next pass (with 6,
#: eight single-sentence clients got passes of six at most)
_WAITERS = ThreadPoolExecutor(max_workers=64, thread_name_prefix="astrai-pooling")

#: what each task's models serve, for the message that refuses a model of the other kind
SERVES = {"embed": "/v1/embeddings, /v1/rerank and /v1/score", "score": "/v1/rerank and /v1/score"}


def pooling_endpoint(
    check_key: Callable[[Request], None],
    route: str,
    request_model: type[Strict],
    answer: Callable[[Any, Any, str, list], dict[str, Any]],
    tasks: tuple[str, ...],
) -> Callable[[Request], Any]:
    """A POST route of the pooling models (embedders, cross-encoders): the key (``check_key`` raises
    HTTPProblem 401), the body as ``request_model``, the model its ``model`` names among those of
    ``tasks``, then ``answer(request, engine, name, futures)`` and its JSON (``_json``) on a worker
    thread, off the event loop; errors in OpenAI's
    shape. A client that leaves first withdraws its inputs not yet encoded (``futures``: what the
    answer submitted, cancelled) and is logged as 499."""
    from fastapi import Request
    from fastapi.responses import JSONResponse, Response

    from astrai_server.body import ClientGone, read_body

    async def endpoint(request: Request) -> Response:
        try:
            check_key(request)
            if request.app.state.draining:
                raise EngineNotReady("the server is shutting down: retry on another instance")
            raw = await read_body(request, request.app.state.settings.max_request_bytes)
            req = request_model.model_validate_json(bytes(raw))
            if request.app.state.engine is None:  # still loading (the pooling models come with the engine)
                raise EngineNotReady("the models are still loading")
            engine = _pick(req.model, request.app.state.embedders, request.app.state.settings, route, tasks)
            futures = Withdrawable()
            loop = asyncio.get_running_loop()
            work = loop.run_in_executor(_WAITERS, lambda: _json(answer(req, engine, req.model, futures)))
            gone = asyncio.ensure_future(_disconnected(request))
            await asyncio.wait({work, gone}, return_when=asyncio.FIRST_COMPLETED)
            if not work.done():  # the client left: its inputs not yet in a pass are withdrawn
                futures.withdraw()
                work.add_done_callback(lambda w: w.exception())  # (its CancelledError, retrieved)
                return Response(status_code=499)  # never sent
            gone.cancel()
            return Response(work.result(), media_type="application/json")
        except ClientGone:
            return Response(status_code=499)  # never sent: the client left
        except HTTPProblem as problem:
            body = openai_error(problem.status, problem.message, problem.param)
            return JSONResponse(body, status_code=problem.status)
        except Exception as exc:  # nothing a client sends may become a bare 500
            return error_response(exc)

    # FastAPI reads the annotations; this module's globals lack the web types they name
    endpoint.__annotations__.update({"request": Request, "return": Response})
    return endpoint


async def _disconnected(request: Any) -> None:
    """Return once the client has closed the connection (the body has been read already)."""
    while (await request.receive())["type"] != "http.disconnect":
        pass


def _pick(model: str, embedders: dict[str, Any], settings: Any, route: str, tasks: tuple[str, ...]) -> Any:
    engine = embedders.get(model)
    if engine is not None and engine.task in tasks:
        return engine
    fitting = ", ".join(n for n, e in embedders.items() if e.task in tasks) or "none (see --embedding-model)"
    if engine is not None:
        raise RequestRejected(
            f"{model} serves {SERVES[engine.task]}; {route} needs one of: {fitting}", param="model"
        )
    if model == settings.served_model_name:
        raise RequestRejected(
            f"{model} is a generation model; {route} needs one of: {fitting}", param="model"
        )
    raise ModelNotFound(f"The model `{model}` does not exist or you do not have access to it.")


def embeddings_endpoint(check_key: Callable[[Request], None]) -> Callable[[Request], Any]:
    """``POST /v1/embeddings``."""
    return pooling_endpoint(check_key, "/v1/embeddings", EmbeddingRequest, _answer, ("embed",))


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
            "task": engine.task,
            **({"dimensions": engine.dimensions} if engine.task == "embed" else {}),
        }
        for name, engine in embedders.items()
    ]
