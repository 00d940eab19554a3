"""``create_app(settings, engine)``: the FastAPI application (no import-time state).

Mounts one POST route per protocol builder (every ``astrai.protocols`` entry
point unless ``settings.protocols`` names some) and the GET and JSON POST routes
builders declare (OpenAI's ``/v1/models``, ``/tokenize``; Anthropic's token counting),
plus ``GET /health``, ``GET /stats``, ``GET /metrics`` (``metrics.py``: Prometheus; both an
operator's routes once keys are set: ``--admin-api-key``) and ``GET /openapi.json`` (behind the API
key like the rest); then hook plugins extend the app
(``astrai_server_app``). The engine hangs off ``app.state.engine`` and may arrive later
(``astrai serve`` loads it after the socket is open): until then /health is 503 and protocol
routes answer 503 in their own shape.

The event loop never waits on a request's size: a body is read in chunks up to
``settings.max_request_bytes`` (``body.read_body``), then decoded, validated, templated and
tokenized on worker threads (``body.decode_json``, ``ProtocolHandler.start``); the heap a large
body freed is handed back afterwards (``astrai.malloc.trim_heap``).

Over 300 lines because every route shares the guards kept here (drain, readiness, the key check's
responses) and the error shapes; the work behind them lives in edge.py, handler.py, body.py, fit.py
and metrics.py.
"""

from __future__ import annotations

import asyncio
import logging
import threading
import uuid
from collections.abc import Awaitable, Callable, Sequence
from functools import partial
from typing import TYPE_CHECKING, Any, TypeVar

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from pydantic import BaseModel, ValidationError
from starlette.convertors import FloatConvertor, IntegerConvertor
from starlette.routing import compile_path

from astrai.errors import EngineNotReady, Overloaded, RequestRejected
from astrai.hooks import PluginManager
from astrai.malloc import trim_heap
from astrai.protocol import ResponseBuilder
from astrai_server.body import (
    LARGE_BODY,
    ClientGone,
    decode_json,
    dispose,
    read_body,
)
from astrai_server.config import ServerSettings
from astrai_server.edge import install as install_edge
from astrai_server.embeddings import refuse_embedder
from astrai_server.errors import RETRY_AFTER_SECONDS, HTTPProblem, public_message, status_for
from astrai_server.fit import TextBound, refuse_oversized, text_bound
from astrai_server.handler import ProtocolHandler, count_choices, refuse_unknown
from astrai_server.keys import authorized as _authorized
from astrai_server.keys import caller as _caller
from astrai_server.lora import lora_routes
from astrai_server.metrics import ServerMetrics
from astrai_server.parsers import Parsers
from astrai_server.rerank import pooling_routes

if TYPE_CHECKING:
    from astrai.engine import InferenceEngine

logger = logging.getLogger(__name__)
T = TypeVar("T")
NOT_READY = {"detail": "Engine not initialized"}
UNAUTHORIZED = "invalid or missing API key (Authorization: Bearer or x-api-key)"
OPERATORS_ONLY = "this route answers only an operator key (--admin-api-key): it shows every tenant's traffic"


def create_app(
    settings: ServerSettings,
    engine: InferenceEngine | None,
    builders: Sequence[ResponseBuilder] | None = None,
    plugins: PluginManager | None = None,
) -> FastAPI:
    """The app serving ``engine`` (None: not ready yet; set ``app.state.engine`` later).

    ``builders`` defaults to the installed protocols (see ``registry.select_builders``);
    tests may pass in-memory builders instead. ``plugins`` (default: the engine's, else
    discovered) get ``astrai_server_app`` once the routes are mounted. Raises
    PluginError for a protocol named in ``settings.protocols`` that is missing or broken.
    """
    if builders is None:
        from astrai_server.registry import load_protocols, select_builders

        builders = select_builders(load_protocols(), settings.protocols, settings.served_model_name)
    for builder in builders:
        builder.tool_call_parser = settings.tool_call_parser
        if settings.signing_key is not None:
            builder.signing_key = settings.signing_key.encode("utf-8")
    if plugins is None:
        plugins = getattr(engine, "plugins", None) or PluginManager.discover()
    app = FastAPI(title="astrai", docs_url=None, redoc_url=None, openapi_url=None)  # /openapi.json: below
    app.state.engine, app.state.settings, app.state.plugins = engine, settings, plugins
    app.state.embedders = {}  # served name -> EmbeddingEngine (--embedding-model; astrai_server.loader)
    for builder in builders:
        if hasattr(builder, "embedders"):  # a protocol that lists models lists these too (OpenAI's)
            builder.embedders = app.state.embedders
    install_edge(app, settings)  # request ids, access log, in-flight count, CORS, API keys (edge.py)
    # a hook plugin: an engine made with ``plugins`` from now on reports its requests to it (metrics.py)
    app.state.metrics = ServerMetrics(
        settings.served_model_name, lambda: app.state.engine, lambda: app.state.embedders
    )
    plugins.register_checked(app.state.metrics, None, "astrai_server.metrics.ServerMetrics")
    app.state.draining = False  # set on SIGTERM (astrai_server.drain): new requests get 503
    for builder in builders:
        app.add_api_route(builder.route, _protocol_endpoint(builder), methods=["POST"], name=builder.name)
        for path, body in builder.get_routes().items():
            get = _get_endpoint(body, builder)
            name, extra = f"{builder.name}:{path}", _path_parameters(path)  # extra: what FastAPI cannot see
            app.add_api_route(path, get, methods=["GET"], name=name, openapi_extra=extra)
        for path, (model, body) in builder.post_routes().items():
            app.add_api_route(
                path, _json_endpoint(builder, model, body), methods=["POST"], name=f"{builder.name}:{path}"
            )
        logger.info("protocol %s mounted at POST %s", builder.name, builder.route)
    for path, endpoint in pooling_routes(_check_key).items():  # embeddings, rerank, score (rerank.py)
        app.add_api_route(path, endpoint, methods=["POST"], name=path)
    for path, endpoint in lora_routes(_check_adapter_key).items():  # LoRA adapters (lora.py)
        app.add_api_route(path, endpoint, methods=["POST"], name=path)
    app.add_api_route("/health", _health, methods=["GET"])
    app.add_api_route("/stats", _stats, methods=["GET"])
    app.add_api_route("/metrics", _metrics, methods=["GET"])
    app.add_api_route("/openapi.json", _openapi, methods=["GET"], include_in_schema=False)
    plugins.notify("astrai_server_app", app=app, settings=settings)
    return app


def _check_key(request: Request) -> None:
    """HTTPProblem 401 unless the request's key is accepted; the caller's prefix-cache tenant is left in
    ``request.state.cache_tenant`` (None: the shared namespace, when no key is set or
    ``--shared-prefix-cache``)."""
    who = _caller(request)
    if who is None:
        raise HTTPProblem(401, UNAUTHORIZED)
    shared = request.app.state.settings.shared_prefix_cache
    request.state.cache_tenant = None if shared else who.tenant


def _check_operator(request: Request) -> None:
    """HTTPProblem 401 for a missing or unknown key, 403 for a tenant's key: routes that show every
    tenant's traffic (``/stats``, ``/metrics``) answer an operator only, once keys are configured."""
    who = _caller(request)
    if who is None:
        raise HTTPProblem(401, UNAUTHORIZED)
    if not who.admin:
        raise HTTPProblem(403, OPERATORS_ONLY)


def _check_adapter_key(request: Request) -> None:
    """HTTPProblem 401 for a missing or unknown key, 403 for a tenant's key where operator keys are
    set: loading a LoRA adapter reads the server's files and changes what every client is served."""
    who = _caller(request)
    if who is None:
        raise HTTPProblem(401, UNAUTHORIZED)
    if request.app.state.settings.admin_api_key and not who.admin:
        raise HTTPProblem(403, OPERATORS_ONLY)


def _ready_engine(request: Request, generation: bool = True) -> Any:
    """The loaded engine; for a ``generation`` route, RequestRejected when the server serves a pooling
    model only (``astrai serve --model minilm-l6``)."""
    engine = request.app.state.engine
    if engine is None or not engine.is_healthy():
        raise EngineNotReady()
    if generation and getattr(engine, "task", None) is not None:
        raise RequestRejected(
            f"{request.app.state.settings.served_model_name} is a pooling model: this server answers "
            "/v1/embeddings, /v1/rerank and /v1/score",
            param="model",
        )
    return engine


async def _wait_disconnect(request: Request) -> None:
    """Return once the client has closed the connection (the body has been read already)."""
    while (await request.receive())["type"] != "http.disconnect":
        pass


async def _unless_gone(work: Awaitable[T], request: Request) -> T | None:
    """``work``'s result, or None once the client has gone first (``work`` is then cancelled: a grammar
    compile it waits for is stopped, requests it submitted are withdrawn)."""
    task = asyncio.ensure_future(work)
    gone = asyncio.ensure_future(_wait_disconnect(request))
    try:
        await asyncio.wait((task, gone), return_when=asyncio.FIRST_COMPLETED)
    finally:
        gone.cancel()
    if task.done():
        return task.result()
    task.cancel()
    try:
        await task  # the cancelled work withdrawn (a grammar compile's worker freed) before the log says so
    except (asyncio.CancelledError, Exception):
        pass
    logger.info(
        "client of request %s left before its request was submitted: abandoned",
        getattr(request.state, "request_id", "?"),
    )
    return None


async def _in_thread(fn: Callable[..., Any], *args: Any) -> Any:
    """``fn(*args)`` on the loop's worker threads: CPU-bound work never runs on the event loop."""
    return await asyncio.get_running_loop().run_in_executor(None, fn, *args)


async def _read(request: Request) -> bytearray:
    raw = await read_body(request, request.app.state.settings.max_request_bytes)
    if len(raw) > LARGE_BODY:
        request.state.large_body = True  # see _releasing
    return raw


def _parse(
    builder: ResponseBuilder,
    raw: bytes | bytearray,
    model: type[BaseModel] | None = None,
    engine: Any = None,
    max_choices: int | None = None,
) -> Any:
    """The validated request model (``builder.request_model`` by default); HTTPProblem 400 for
    a body ``decode_json`` refuses, one that is no object, or a field the model forbids (an unknown
    nested field), 422 for schema errors; with ``engine``, RequestRejected (400) first for a text
    that cannot fit its context (``refuse_oversized``), and with ``max_choices`` for one that fans out
    to more choices (``count_choices``). Runs on a worker thread."""
    bound = None if engine is None else text_bound(engine)
    body = decode_json(raw, bound)
    try:
        return _validate(builder, body, model, bound, len(raw), max_choices)
    except BaseException:
        if len(raw) > LARGE_BODY:  # refused: freed bit by bit, not at once when the last reference goes,
            # on a thread of its own, so that the refusal is not held back by it (0.5 s for 960,000 values)
            threading.Thread(target=dispose, args=(body,), name="astrai-dispose", daemon=True).start()
        raise


def _validate(
    builder: ResponseBuilder,
    body: Any,
    model: type[BaseModel] | None,
    bound: TextBound | None,
    size: int,
    max_choices: int | None = None,
) -> Any:
    if not isinstance(body, dict):
        raise HTTPProblem(400, "request body must be a JSON object")
    model = model or builder.request_model
    if max_choices is not None:
        _refuse_wide(builder, model, body, max_choices)
    if bound is not None:
        refuse_oversized(body, bound, size)
    try:
        return model.model_validate(body)
    except ValidationError as e:
        errors = e.errors(include_url=False)
        unknown = [err for err in errors if err["type"] == "extra_forbidden"]
        first = (unknown or errors)[0]
        # without pydantic's union-member labels ("list[TextPart]", "function-after[...]"): the field's path
        loc = ".".join(str(x) for x in first["loc"] if not _union_label(x))
        if unknown:
            raise HTTPProblem(
                400, f"unsupported parameter {loc}: astrai does not implement it", param=loc
            ) from None
        more = f" (and {e.error_count() - 1} more errors)" if e.error_count() > 1 else ""
        raise HTTPProblem(422, f"{loc or 'body'}: {first['msg']}{more}", param=loc or None) from None


def _refuse_wide(builder: ResponseBuilder, model: type[BaseModel], body: dict, max_choices: int) -> None:
    """The ``--max-choices`` check before validation: validating 320,000 prompts alone takes 1.5 s, to
    refuse them after. The builder's ``fan_out`` reads an unvalidated ``model_construct``; a body it
    cannot count is left to the validation, and to the same check after it."""
    try:
        factors = [(name, int(value)) for name, value in builder.fan_out(model.model_construct(**body))]
    except Exception:  # a body the validation refuses, or counts, properly
        return
    count_choices(factors, max_choices)


def _error(builder: ResponseBuilder, exc: BaseException) -> JSONResponse:
    """``exc`` as the builder's error body, with its status (``param`` when the error names a field);
    a request shed under load gets the builder's ``overloaded_status`` and ``Retry-After``."""
    status, headers = status_for(exc), None
    if isinstance(exc, Overloaded):
        status, headers = builder.overloaded_status, {"Retry-After": str(RETRY_AFTER_SECONDS)}
    if status >= 500 and not isinstance(exc, EngineNotReady | Overloaded):
        logger.error("%s request failed", builder.name, exc_info=exc)
    body = builder.format_error(status, public_message(exc), getattr(exc, "param", None))
    return JSONResponse(body, status_code=status, headers=headers)


_PLAIN_TYPES = frozenset({"str", "int", "float", "bool", "bytes", "dict", "list", "none"})


def _union_label(part: object) -> bool:
    """Whether a pydantic error location part names a union member (``str``, ``list[TextPart]``),
    not a field."""
    return isinstance(part, str) and ("[" in part or part in _PLAIN_TYPES)


def _gone(request: Request, gone: ClientGone) -> Response:
    """A client that hung up mid-body: an INFO line, not an error (nothing was queued, nobody listens)."""
    rid = getattr(request.state, "request_id", None) or f"req-{uuid.uuid4().hex[:16]}"  # edge.py names it
    client = f"{request.client.host}:{request.client.port}" if request.client else "?"
    stalled = getattr(request.state, "timed_out", False)  # astrai_server.connections answered 408
    why = "its body stalled past --header-timeout (408)" if stalled else gone
    path = request.url.path
    logger.info("request %s (%s %s from %s): %s; nothing was queued", rid, request.method, path, client, why)
    return Response(status_code=499)  # never sent: nginx's "client closed request", for ASGI middleware


def _releasing(endpoint: Callable[[Request], Any]) -> Any:
    """``endpoint``, then, after a large body, ``trim_heap`` on a worker thread: by then the
    endpoint's frame, which held the body and what was decoded from it, is gone."""

    async def wrapper(request: Request) -> Response:
        try:
            return await endpoint(request)
        finally:
            if getattr(request.state, "large_body", False):
                asyncio.get_running_loop().run_in_executor(None, trim_heap)

    wrapper.__name__ = endpoint.__name__
    return wrapper


def _protocol_endpoint(builder: ResponseBuilder) -> Any:
    error = partial(_error, builder)

    async def endpoint(request: Request) -> Response:
        request.app.state.metrics.count_request(builder.name)  # every arrival, refused ones too
        try:
            _check_key(request)
            if request.app.state.draining:
                raise EngineNotReady("the server is shutting down: retry on another instance")
            raw = await _read(request)
            settings = request.app.state.settings
            parsed = await _in_thread(
                _parse, builder, raw, None, request.app.state.engine, settings.max_choices
            )
            del raw
            refuse_embedder(getattr(parsed, "model", None), request.app.state.embedders)
            parsers = Parsers(settings.reasoning_parser, settings.tool_call_parser)
            handler = ProtocolHandler(
                builder, _ready_engine(request), request.state, settings.max_choices, parsers
            )
            run = await _unless_gone(handler.start(parsed), request)
            del parsed
            if run is None:
                return Response(status_code=499)  # never sent: the client left while it was prepared
            if run.prepared.stream and request.app.state.settings.queue_timeout is not None:
                # the status line waits for the first output, so that a queue timeout is still a 429
                if not await handler.admitted(run, lambda: _wait_disconnect(request)):
                    return Response(status_code=499)  # never sent: the client is gone
        except ClientGone as gone:
            return _gone(request, gone)
        except Exception as exc:  # nothing a client sends may become a bare 500 or a traceback
            return error(exc)
        disconnected = lambda: _wait_disconnect(request)  # noqa: E731
        if run.prepared.stream:
            headers = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}
            frames = handler.stream(run, disconnected)
            return StreamingResponse(frames, media_type=builder.stream_media_type, headers=headers)
        try:
            return JSONResponse(await handler.respond(run, disconnected))
        except Exception as exc:
            return error(exc)

    endpoint.__name__ = f"{builder.name}_endpoint"
    return _releasing(endpoint)


async def _health(request: Request) -> JSONResponse:
    engine = request.app.state.engine
    if request.app.state.draining:  # a load balancer takes the instance out
        return JSONResponse({"status": "draining"}, status_code=503)
    if engine is None or not engine.is_healthy():
        return JSONResponse(NOT_READY, status_code=503)
    return JSONResponse({"status": "ok", "model_loaded": True})


def _guarded(request: Request, generation: bool = True) -> Any:
    _check_key(request)
    return _ready_engine(request, generation)


async def _openapi(request: Request) -> JSONResponse:
    """FastAPI's schema of the routes, behind the API key like every route but /health."""
    if not _authorized(request):
        return _plain_error(HTTPProblem(401, UNAUTHORIZED))
    return JSONResponse(request.app.openapi())


async def _stats(request: Request) -> JSONResponse:
    """The engine's counters (``InferenceEngine.get_stats``): an operator's route (``_check_operator``)."""
    try:
        _check_operator(request)
        engine = _ready_engine(request, generation=False)
        pooling = {name: e.get_stats() for name, e in request.app.state.embedders.items()}
        if getattr(engine, "task", None) is not None:  # a pooling model alone
            return JSONResponse({"pooling": pooling})
        stats = engine.get_stats()
        return JSONResponse({**stats, "pooling": pooling} if pooling else stats)
    except Exception as exc:
        return _plain_error(exc)


async def _metrics(request: Request) -> Response:
    """Prometheus exposition (``astrai_server.metrics``): an operator's route (``_check_operator``)."""
    try:
        _check_operator(request)
    except HTTPProblem as exc:
        return _plain_error(exc)
    body, content_type = request.app.state.metrics.exposition(request.headers.get("accept"))
    return Response(body, headers={"Content-Type": content_type})


def _get_endpoint(body: Callable[..., dict[str, Any]], builder: ResponseBuilder) -> Any:
    """A builder's GET route: ``body(engine, **path parameters)``; errors in ``builder``'s shape."""

    async def endpoint(request: Request) -> JSONResponse:
        try:
            return JSONResponse(body(_guarded(request, generation=False), **request.path_params))
        except Exception as exc:
            return _error(builder, exc)

    return endpoint


#: The OpenAPI type of a path parameter by its Starlette convertor (``{n:int}``); any other is a string.
_PATH_TYPES = {IntegerConvertor: "integer", FloatConvertor: "number"}


def _path_parameters(path: str) -> dict[str, Any] | None:
    """``openapi_extra`` declaring the path parameters of a builder's GET route (None: it has none).

    Its endpoint passes them on from ``request.path_params``, so FastAPI, which declares what an
    endpoint's signature names, never sees them; and a path parameter the document does not declare
    makes the whole document invalid (schema-driven clients and fuzzers stop on it)."""
    _, _, convertors = compile_path(path)
    parameters = [
        {"name": name, "in": "path", "required": True, "schema": {"type": _PATH_TYPES.get(type(c), "string")}}
        for name, c in convertors.items()
    ]
    return {"parameters": parameters} if parameters else None


def _json_endpoint(
    builder: ResponseBuilder, model: type[BaseModel], body: Callable[[Any, Any], dict[str, Any]]
) -> Any:
    """A JSON POST route that generates nothing: validated like a generation request, errors in the
    builder's shape."""

    def answer(raw: bytearray, engine: Any) -> JSONResponse:  # on a worker thread: tokenizing, rendering
        parsed = _parse(builder, raw, model)
        refuse_unknown(parsed, engine)
        return JSONResponse(body(parsed, engine))

    async def endpoint(request: Request) -> Response:
        try:
            engine = _guarded(request)
            return await _in_thread(answer, await _read(request), engine)
        except ClientGone as gone:
            return _gone(request, gone)
        except Exception as exc:
            return _error(builder, exc)

    return _releasing(endpoint)


def _plain_error(exc: BaseException) -> JSONResponse:
    status = status_for(exc)
    body = NOT_READY if isinstance(exc, EngineNotReady) else {"detail": public_message(exc)}
    return JSONResponse(body, status_code=status)
