"""``EngineLoader``: the engine of ``astrai serve``, loaded on a daemon thread while uvicorn already
answers (``/health`` 503 until the engine is ready, then 200).

When the load fails (a missing or malformed model, one too large for the memory, kernels that do
not build), ``on_load_failure`` decides:

- ``"exit"`` (the default): the loader asks uvicorn to stop (it polls ``should_exit`` every
  0.1 s), and ``failure`` holds one line naming the file and the problem; ``cli.serve`` raises
  ``ModelLoadFailed`` with it, and ``astrai serve`` prints it and exits 1 within a second or so;
- ``"unhealthy"``: the line is logged as an error and the server goes on answering 503, for an
  orchestrator that reads the failure from ``/health`` rather than from the exit.

Either way the traceback goes to the log at debug level only (``--log-level debug``).

When the server stops first (SIGTERM or SIGINT while the model loads or kernels build), ``stop``
abandons the load: the thread is a daemon that nobody joins, and ``cli.serve`` ends the process
at once (``os._exit``: finalizing the interpreter under a thread inside torch aborts it); an
engine the thread completes in between is shut down by it, never served.
"""

from __future__ import annotations

import logging
import threading
from typing import Any

from astrai.errors import AstraiError
from astrai.hooks import PluginManager
from astrai_server.config import ServerSettings
from astrai_server.fit import text_bound

logger = logging.getLogger(__name__)


def describe_failure(exc: BaseException, model: str | None) -> str:
    """One line for a failed load: the model's file and the problem (astrai's errors say both;
    anything else gets the file and its type put in front)."""
    text = str(exc).strip() if isinstance(exc, AstraiError) else f"{type(exc).__name__}: {exc}".strip()
    from astrai.model.hub import parse_hub_id

    where = model or "the default model"
    try:
        from astrai.model.resolve import KNOWN_MODELS, resolve_model

        if model is None or model.lower() in KNOWN_MODELS or not parse_hub_id(model):  # never the Hub
            where = str(resolve_model(model)[1])
    except Exception:  # a name that does not resolve: its error says so already
        pass
    first, _, rest = text.partition("\n")
    line = first if where in first else f"{where}: {first}"
    return f"{line} (more in the log above)" if rest.strip() else line


def _generation_defaults(settings: ServerSettings, model: str | None) -> dict[str, Any]:
    """The sampling defaults ``--generation-config`` asks for, of ``model`` (the model's local name or
    path), logged once (``astrai.model.generation_config``)."""
    if settings.generation_config == "none":
        logger.info("generation defaults: none (--generation-config none): the API's defaults apply")
        return {}
    from astrai.model.generation_config import generation_defaults

    defaults, source = generation_defaults(model)
    if defaults:
        shown = ", ".join(f"{k}={v}" for k, v in defaults.items())
        logger.info("generation defaults from %s: %s (--generation-config none: the API's)", source, shown)
    else:
        logger.info("generation defaults: none in the checkpoint: the API's defaults apply")
    return defaults


class EngineLoader:
    """Loads the engine of ``settings`` into ``app.state.engine`` on the daemon thread ``astrai-load``."""

    def __init__(self, settings: ServerSettings, app: Any, plugins: PluginManager) -> None:
        self.settings, self.app, self.plugins = settings, app, plugins
        self.failure: str | None = None  # set when the load failed: the line ``astrai serve`` prints
        self._lock = threading.Lock()  # orders the loader's hand-over against stop()
        self._stopped = False
        self._server: Any = None
        self._thread = threading.Thread(target=self._run, name="astrai-load", daemon=True)

    def start(self, server: Any) -> None:
        """Start loading; a failure with ``on_load_failure: exit`` stops ``server`` (a uvicorn.Server)."""
        self._server = server
        self._thread.start()

    @property
    def loading(self) -> bool:
        """Whether the load is still running (neither done nor failed)."""
        return self._thread.is_alive() and self.failure is None and self.app.state.engine is None

    def stop(self) -> Any:
        """Once uvicorn has returned: the engine to shut down, or None. A load still running is
        abandoned, not waited for (see the module doc)."""
        with self._lock:
            self._stopped = True
            return self.app.state.engine

    def _run(self) -> None:
        import torch

        from astrai.embedding import is_pooling_model
        from astrai.engine import InferenceEngine
        from astrai.model.resolve import local_model

        s = self.settings
        try:
            model = local_model(s.model, s.revision)  # a Hub id: its files, from the cache or downloaded
            pooling = s.task in ("embed", "score") or (s.task is None and is_pooling_model(model))
            if pooling:  # an embedder or a reranker alone: no generation
                self._serve_pooling_only(model)
                return
            config = s.engine_config()
            config.generation_defaults = _generation_defaults(s, model)
            engine = InferenceEngine.from_model(
                model,
                dtype=getattr(torch, s.dtype) if s.dtype else None,
                device=s.device,
                config=config,
                plugins=self.plugins,
                weights=s.weights,
            )
            text_bound(engine)  # the tokenizer's longest token (fit.py), now rather than in the first request
            if engine.loras is not None:
                self._load_adapters(engine)
            embedders = self._embedders()
        except Exception as exc:  # every failure of the load ends in one line, whatever raised it
            self._failed(exc)
            return
        with self._lock:
            if not self._stopped:
                self.app.state.embedders.update(embedders)  # (before the engine: /health is ready with both)
                self.app.state.engine, engine = engine, None
        if engine is not None:  # the server stopped while the model loaded: nobody will serve it
            engine.shutdown()
            for embedder in embedders.values():
                embedder.shutdown()
            return
        logger.info("engine ready: %s", s.model or "the default model")

    def _load_adapters(self, engine: Any) -> None:
        """``--lora``'s adapters, before the server reports ready; a bad one fails the start."""
        import time

        from astrai.lora import resolve_adapter

        s = self.settings
        engine.loras.reserved = {s.served_model_name, *s.pooling_names()}
        try:
            for name, path in s.loras().items():
                engine.loras.load(name, resolve_adapter(path, None), time.time())
                logger.info("LoRA adapter %s loaded from %s", name, path)
        except BaseException:
            engine.shutdown()
            raise

    def _serve_pooling_only(self, model: str | None) -> None:
        """``--model`` is a pooling model: it is the engine (``/health``, ``/stats``) and the one
        pooling model, under ``--served-model-name`` (``--embedding-model`` adds another); the
        generation routes refuse every request (``app._ready_engine``)."""
        from astrai.embedding import load_embedder

        s = self.settings
        if s.embedding_model is not None:
            embedders = self._embedders()
        else:
            embedders = {}
        task = s.task if s.task != "generate" else None
        embedder = load_embedder(
            model or "", self._pooling_dtype(), task=task, engine_config=s.engine_config()
        )
        embedders = {s.served_model_name: embedder, **embedders}
        with self._lock:
            if not self._stopped:
                self.app.state.embedders.update(embedders)
                self.app.state.engine, embedder = embedder, None
        if embedder is not None:
            for e in embedders.values():
                e.shutdown()
            return
        logger.info(
            "serving the pooling model %s as %r alone (%s, %s)",
            s.model,
            s.served_model_name,
            embedders[s.served_model_name].task,
            str(self._pooling_dtype()).removeprefix("torch."),
        )

    def _embedders(self) -> dict[str, Any]:
        """The pooling models of ``--embedding-model`` by their served names (none: empty)."""
        from astrai.embedding import load_embedder
        from astrai.model.resolve import local_model

        loaded: dict[str, Any] = {}
        dtype = self._pooling_dtype()
        try:
            for name, model in self.settings.pooling_names().items():
                embedder = loaded[name] = load_embedder(local_model(model, None) or model, dtype)
                logger.info(
                    "pooling model ready: %s as %r (%s, %s; inputs of up to %d tokens%s)",
                    model,
                    name,
                    embedder.task,
                    str(dtype).removeprefix("torch."),
                    embedder.context_limit,
                    f", {embedder.dimensions} dimensions, {embedder.pooling.mode} pooling"
                    + (", normalized" if embedder.pooling.normalize else "")
                    if embedder.task == "embed"
                    else "",
                )
        except BaseException:
            for embedder in loaded.values():
                embedder.shutdown()
            raise
        return loaded

    def _pooling_dtype(self) -> Any:
        """What pooling models compute in: ``--dtype``, as the chat model does; by default bf16 on
        CPUs with native bf16 dot products (a MiniLM vector then within a cosine of 0.9999 of
        float32's; ``benchmarks/embed_bench.py``), else float32."""
        import torch

        from astrai.model import default_dtype

        return getattr(torch, self.settings.dtype) if self.settings.dtype else default_dtype("cpu")

    def _failed(self, exc: Exception) -> None:
        logger.debug("loading the model failed", exc_info=exc)
        if "\n" in str(exc).strip():  # a compiler's output, say: whole in the log, one line on stderr
            logger.error("loading the model failed: %s", exc)
        self.failure = describe_failure(exc, self.settings.model)
        if self.settings.on_load_failure == "exit":
            # uvicorn's main loop reads this every 0.1 s; a bool set from another thread is safe
            self._server.should_exit = True
        else:
            logger.error("%s; /health stays 503 (on_load_failure: unhealthy)", self.failure)
