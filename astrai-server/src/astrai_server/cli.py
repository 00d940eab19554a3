"""``astrai serve``: start the HTTP server (flags, or ``--config serve.yaml``; flags win).

``add_serve_command(subparsers, pm)`` adds the subcommand to astrai-core's
``astrai`` parser (called by the hook plugin ``astrai_server.commands``);
``serve_main(argv)`` is the standalone entry (``python -m astrai_server``). The socket opens at once; the model loads in
the background and /health turns 200 when it is ready.
"""

from __future__ import annotations

import argparse
import logging
import logging.config
import sys
import threading
from typing import Any

from astrai.cli import PluginOptions, parse_key_value
from astrai.errors import AstraiError
from astrai.plugins import PluginManager
from astrai_server.config import ServerSettings, load_settings
from astrai_server.errors import ConfigError

logger = logging.getLogger(__name__)


def _flag(p: argparse.ArgumentParser, name: str, help: str, **kw: Any) -> None:
    default = ServerSettings.model_fields[name].default
    p.add_argument("--" + name.replace("_", "-"), dest=name, default=argparse.SUPPRESS, help=f"{help} (default: {default})", **kw)


def _comma_list(text: str) -> list[str]:
    return [x.strip() for x in text.split(",") if x.strip()]


def add_serve_arguments(p: argparse.ArgumentParser) -> None:
    """Every ``ServerSettings`` field as a flag; only flags given explicitly reach the settings."""
    p.add_argument("--config", default=None, help="YAML file whose 'server:' section sets any option below")
    _flag(p, "host", "address to bind")
    _flag(p, "port", "TCP port (0: any free port)", type=int)
    _flag(p, "model", "model name, .gguf file or HF folder; default: smollm2-135m")
    _flag(p, "served_model_name", "model name reported by /v1/models")
    _flag(p, "device", "torch device")
    _flag(p, "dtype", "weights and KV dtype; default: bf16 where native, else float32", choices=["float32", "bfloat16", "float16"])
    _flag(p, "weights", "a GGUF file's quantized weights: kept quantized (gguf), dequantized into --dtype (dense), or auto", choices=["auto", "gguf", "dense"])
    _flag(p, "attention_backend", "attention backend entry point, strict for every request (beats ASTR_BACKEND)")
    _flag(p, "max_batch_size", "concurrent requests", type=int)
    _flag(p, "max_seq_len", "context per request; default: the model's", type=int)
    _flag(p, "paged", "paged KV pool (--no-paged: contiguous)", action=argparse.BooleanOptionalAction)
    _flag(p, "page_size", "KV page size in tokens", type=int)
    _flag(p, "prefix_caching", "radix prefix cache", action=argparse.BooleanOptionalAction)
    _flag(p, "kv_memory", "KV pool budget, e.g. 512MiB")
    _flag(p, "max_prefill_tokens", "prefill tokens per step (chunked prefill)", type=int)
    _flag(p, "max_request_bytes", "largest request body accepted, e.g. 32MiB (413 beyond)")
    _flag(p, "header_timeout", "seconds to send a request head, or a body may stall; then 408", type=float)
    _flag(p, "max_connections", "open connections, then 503; default: descriptor limit - 64", type=int)
    _flag(p, "max_queued_requests", "requests that may wait for admission; beyond, 429 (Anthropic: 529) with Retry-After", type=int)
    _flag(p, "queue_timeout", "seconds a request may wait for admission before it is refused like a full queue", type=float)
    _flag(p, "scheduling_policy", "admission order: fcfs, or priority (the request's priority field, smaller first)",
          choices=["fcfs", "priority"])  # fmt: skip
    _flag(p, "speculative", "speculative decoding of greedy requests: ngram (prompt lookup); default: off", choices=["ngram"])
    _flag(p, "num_speculative_tokens", "with --speculative: drafts per request and step, 1 to 15", type=int)
    _flag(p, "ngram_min", "with --speculative ngram: shortest suffix n-gram looked up in the request's tokens", type=int)
    _flag(p, "ngram_max", "with --speculative ngram: longest suffix n-gram, tried first (>= --ngram-min)", type=int)
    _flag(p, "shutdown_timeout", "seconds requests in flight may take to finish after SIGTERM/SIGINT", type=float)
    _flag(p, "tensor_parallel_size", "split the model over this many ranks (worker processes, or torchrun's)", type=int)
    _flag(p, "tp_timeout", "seconds a tensor-parallel collective may wait (idle ranks get a heartbeat)", type=float)
    _flag(p, "data_parallel_size", "engine replicas (processes on loopback) behind the SGLang Model Gateway on --host/--port", type=int)
    _flag(p, "data_parallel_base_port", "replica i listens on 127.0.0.1:(this + i); default: free ports", type=int)
    _flag(p, "gateway_metrics_port", "port of the gateway's own Prometheus /metrics, on 127.0.0.1; default: a free one", type=int)
    _flag(p, "api_key", "require this key (Authorization: Bearer or x-api-key); repeat it for several keys; never empty", action="append")
    _flag(p, "api_key_file", "file of API keys, one a line (blank lines and # comments skipped), read at start")
    _flag(p, "allowed_origins", "CORS: origins browsers may call from, comma-separated (*: any); default: none", type=_comma_list)
    _flag(p, "allowed_methods", "CORS: methods cross-origin requests may use, comma-separated (*: any)", type=_comma_list)
    _flag(p, "allowed_headers", "CORS: headers cross-origin requests may send, comma-separated (*: any)", type=_comma_list)
    _flag(p, "ssl_keyfile", "TLS private key (PEM); default: in --ssl-certfile")
    _flag(p, "ssl_certfile", "TLS certificate chain (PEM): serve HTTPS")
    _flag(p, "ssl_keyfile_password", "password of an encrypted --ssl-keyfile")
    _flag(p, "ssl_ca_certs", "CA certificates (PEM) that verify client certificates")
    _flag(p, "ssl_cert_reqs", "client certificates (optional, required: needs --ssl-ca-certs)", choices=["none", "optional", "required"])
    _flag(p, "protocols", "protocol entry points to mount, comma-separated; default: all installed", type=lambda s: [x for x in s.split(",") if x])
    _flag(p, "log_level", "log level", choices=["debug", "info", "warning", "error"])
    _flag(p, "log_format", "log lines: text, or json (one object a line, with the request id)", choices=["text", "json"])
    p.add_argument(
        "--sampling", dest="sampling", action="append", type=parse_key_value, default=argparse.SUPPRESS,
        metavar="KEY=VALUE", help="parameter of a sampling plugin for every request, e.g. typical_p=0.9 (repeatable)",
    )  # fmt: skip


def add_serve_command(subparsers: Any, pm: PluginManager | None = None) -> argparse.ArgumentParser:
    """Add ``serve`` to the ``astrai`` parser's subparsers; its ``args.run(args)`` runs it.

    ``pm`` (default: discovered) is the hook plugin manager: its plugins' options join
    the flags, and the engine and app of the server use it.
    """
    pm = PluginManager.discover() if pm is None else pm
    p = subparsers.add_parser("serve", help="serve the installed protocols (OpenAI, Anthropic, ...) over HTTP")
    add_serve_arguments(p)
    p.set_defaults(run=run_serve, plugins=pm, plugin_options=PluginOptions(p, pm))
    return p


def settings_from_args(args: argparse.Namespace) -> ServerSettings:
    """Settings from parsed args: YAML (``--config``) under the explicit flags. Raises ConfigError."""
    cli = {k: v for k, v in vars(args).items() if k in ServerSettings.model_fields}
    if "sampling" in cli:
        cli["sampling"] = dict(cli["sampling"])
    plugin_options = getattr(args, "plugin_options", None)
    if plugin_options is not None:
        cli.update({k: v for k, v in vars(args).items() if k in plugin_options.defaults})
    return load_settings(cli, args.config, plugin_options.defaults if plugin_options else None)


def _load_engine(settings: ServerSettings, app: Any, pm: PluginManager) -> None:
    import torch

    from astrai.engine import InferenceEngine

    try:
        dtype = getattr(torch, settings.dtype) if settings.dtype else None
        engine = InferenceEngine.from_model(
            settings.model, dtype=dtype, device=settings.device, config=settings.engine_config(), plugins=pm,
            weights=settings.weights,
        )
    except Exception:
        logger.exception("loading the model failed; /health stays 503")
        return
    app.state.engine = engine
    logger.info("engine ready: %s", settings.model or "the default model")


def serve(settings: ServerSettings, pm: PluginManager | None = None) -> None:
    """Run uvicorn until a signal has drained it; the engine loads in a background thread meanwhile.

    ``pm`` (default: discovered) serves both the app (``astrai_server_app``) and the engine.
    """
    import uvicorn

    from astrai.sampling import SamplingPipeline
    from astrai_server.app import create_app
    from astrai_server.body import return_large_blocks
    from astrai_server.descriptors import raise_descriptor_limit
    from astrai_server.drain import DrainingServer
    from astrai_server.edge import uvicorn_options

    raise_descriptor_limit()  # a connection holds a descriptor; replicas, workers, the gateway inherit it
    if settings.tensor_parallel_size > 1:
        from astrai.distributed.sharding import check_tp_size
        from astrai.model import read_config

        check_tp_size(read_config(settings.model), settings.tensor_parallel_size)  # at start, naming the valid sizes
        if _tp_worker(settings):
            return  # a torchrun rank > 0: it ran its shard until rank 0 stopped
    if settings.data_parallel_size > 1:  # replicas behind the SGLang Model Gateway, supervised
        from astrai_server.replicas import serve_replicas

        serve_replicas(settings)
        return
    pm = PluginManager.discover() if pm is None else pm
    SamplingPipeline.discover(settings.sampling)  # a bad --sampling fails now, not in the background loader
    return_large_blocks()  # a large request body's memory goes back to the system when it is freed
    edge_options = uvicorn_options(settings)  # TLS, logging, connection bounds; a bad TLS file fails now
    app = create_app(settings, None, plugins=pm)
    loader = threading.Thread(target=_load_engine, args=(settings, app, pm), name="astrai-load", daemon=True)
    loader.start()
    try:
        config = uvicorn.Config(app, host=settings.host, port=settings.port, log_level=settings.log_level, **edge_options)
        DrainingServer(config, app, settings.shutdown_timeout).run()  # SIGTERM drains (astrai_server.drain)
    finally:
        loader.join()
        if app.state.engine is not None:
            app.state.engine.shutdown()


def _tp_worker(settings: ServerSettings) -> bool:
    """Under torchrun, ranks > 0 of a tensor-parallel ``astrai serve`` serve no HTTP: they run their
    shard (``astrai.distributed.launch.worker_main``) and return True; anywhere else, False."""
    import os

    import torch

    from astrai.distributed.launch import torchrun_rank, worker_main
    from astrai.model import default_dtype

    rank = torchrun_rank()
    if not rank:
        return False
    if int(os.environ["WORLD_SIZE"]) != settings.tensor_parallel_size:
        raise ConfigError(f"torchrun started {os.environ['WORLD_SIZE']} processes for --tensor-parallel-size {settings.tensor_parallel_size}")
    device = torch.device(settings.device)
    if device.type == "cuda":  # one GPU per rank on its machine
        device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", rank)))
    dtype = settings.dtype or str(default_dtype(device)).removeprefix("torch.")
    spec = {"rank": rank, "size": settings.tensor_parallel_size, "source": {"model": settings.model}, "dtype": dtype,
            "device": str(device), "timeout": settings.tp_timeout}  # fmt: skip
    code = worker_main(spec)
    if code:
        raise SystemExit(code)
    return True


def configure_logging(settings: ServerSettings) -> None:
    """The logging of ``astrai serve`` (and of each replica of ``--data-parallel-size``)."""
    from astrai_server.logs import log_config

    logging.config.dictConfig(log_config(settings))  # --log-format; uvicorn's loggers too
    logging.captureWarnings(True)  # warnings become records, in the same format
    for name in ("astrai", "astrai_server"):  # also when the ``astrai`` command configured logging first
        logging.getLogger(name).setLevel(settings.log_level.upper())


def run_serve(args: argparse.Namespace) -> int:
    """The ``serve`` subcommand: 0 on a clean stop, 2 on a configuration or plugin error."""
    try:
        settings = settings_from_args(args)
        configure_logging(settings)
        serve(settings, getattr(args, "plugins", None))
    except AstraiError as exc:
        sys.stderr.write(f"astrai serve: error: {exc}\n")
        return 2
    except KeyboardInterrupt:
        return 130
    return 0


def serve_main(argv: list[str] | None = None) -> int:
    """``python -m astrai_server [flags]``: the same as ``astrai serve [flags]``."""
    parser = argparse.ArgumentParser(prog="astrai serve", description=__doc__.splitlines()[0])
    add_serve_arguments(parser)
    pm = PluginManager.discover()
    parser.set_defaults(plugins=pm, plugin_options=PluginOptions(parser, pm))
    return run_serve(parser.parse_args(argv))
