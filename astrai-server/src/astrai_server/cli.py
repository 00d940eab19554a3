"""``astrai serve``: start the HTTP server (flags, or ``--config serve.yaml``; flags win).

``add_serve_command(subparsers, pm)`` adds the subcommand to astrai-core's
``astrai`` parser (called by the hook plugin ``astrai_server.commands``);
``serve_main(argv)`` is the standalone entry (``python -m astrai_server``). The socket opens at
once; the model loads in the background and /health turns 200 when it is ready.

Over 300 lines because every ``astrai serve`` flag is declared here, one call each, in the
order of docs/configuration.md's table.
"""

from __future__ import annotations

import argparse
import logging
import logging.config
import os
import sys
from typing import Any, NoReturn

from astrai.cli import PluginOptions, parse_key_value
from astrai.errors import AstraiError
from astrai.hooks import PluginManager
from astrai_server.config import ServerSettings, load_settings
from astrai_server.errors import ConfigError, ModelLoadFailed

logger = logging.getLogger(__name__)


def _flag(p: argparse.ArgumentParser, name: str, help: str, **kw: Any) -> None:
    default = ServerSettings.model_fields[name].default
    p.add_argument(
        "--" + name.replace("_", "-"),
        dest=name,
        default=argparse.SUPPRESS,
        help=f"{help} (default: {default})",
        **kw,
    )


def _comma_list(text: str) -> list[str]:
    return [x.strip() for x in text.split(",") if x.strip()]


def add_serve_arguments(p: argparse.ArgumentParser) -> None:
    """Every ``ServerSettings`` field as a flag; only flags given explicitly reach the settings."""
    p.add_argument("--config", default=None, help="YAML file whose 'server:' section sets any option below")
    p.add_argument(
        "model_arg", nargs="?", default=None, metavar="MODEL", help="the model to serve, as --model"
    )
    _flag(p, "host", "address to bind")
    _flag(p, "port", "TCP port (0: any free port)", type=int)
    _flag(
        p,
        "model",
        "model name, .gguf file, HF folder or Hub id (org/name, org/name-GGUF:QUANT); default: smollm2-135m",
    )
    _flag(p, "revision", "branch, tag or commit of a Hub id model; default: main")
    _flag(p, "served_model_name", "model name reported by /v1/models")
    _flag(
        p,
        "embedding_model",
        "an embedding model served beside --model at /v1/embeddings (minilm-l6, a folder, a Hub id)",
    )
    _flag(
        p,
        "served_embedding_model_name",
        "the embedding model's name in requests and /v1/models (default: --embedding-model)",
    )
    _flag(
        p,
        "task",
        "what --model serves: generate, or embed / score for a decoder used as a pooling model; "
        "default: what the checkpoint is",
        choices=["generate", "embed", "score"],
    )
    _flag(p, "chat_template", "chat template over the checkpoint's: a Jinja file, or an inline Jinja string")
    _flag(
        p,
        "reasoning_parser",
        "reasoning parser (qwen3, deepseek_r1, none, ...); default: from the chat template",
    )
    _flag(
        p,
        "tool_call_parser",
        "tool-call parser (hermes, llama3_json, mistral, pythonic, qwen3_coder, ...); default: from the chat template, else hermes",
    )
    _flag(
        p,
        "generation_config",
        "sampling defaults of requests that leave them out: the checkpoint's (auto), or the API's (none)",
        choices=["auto", "none"],
    )
    _flag(p, "device", "torch device")
    _flag(
        p,
        "dtype",
        "weights and KV dtype of every model served, pooling models too; default: bf16 where native, else float32",
        choices=["float32", "bfloat16", "float16"],
    )
    _flag(
        p,
        "weights",
        "a GGUF file's quantized weights: kept quantized (gguf), dequantized into --dtype (dense), or auto",
        choices=["auto", "gguf", "dense"],
    )
    _flag(
        p,
        "activations",
        "int8: multiply a GGUF model's quantized weights by activations quantized to 8 bits per group of "
        "32, as llama.cpp does (faster, not exact); dtype: by the model's own, exactly; auto: int8 where "
        "its kernel keeps the model's quality (bf16 models on AVX512-VNNI CPUs), else dtype",
        choices=["auto", "int8", "dtype"],
    )
    _flag(
        p, "attention_backend", "attention backend entry point, strict for every request (beats ASTR_BACKEND)"
    )
    _flag(p, "max_batch_size", "concurrent requests", type=int)
    _flag(p, "max_seq_len", "context per request; default: the model's", type=int)
    _flag(p, "paged", "paged KV pool (--no-paged: contiguous)", action=argparse.BooleanOptionalAction)
    _flag(p, "page_size", "KV page size in tokens", type=int)
    _flag(p, "prefix_caching", "radix prefix cache", action=argparse.BooleanOptionalAction)
    _flag(p, "kv_memory", "KV pool budget, e.g. 512MiB")
    kv_types = ["auto", "int8"]
    _flag(
        p,
        "kv_cache_dtype",
        "what the KV cache keeps K and V in: auto (the model's dtype) or int8 (a scale per token and head)",
        choices=kv_types,
    )
    _flag(p, "kv_cache_dtype_k", "K's alone (default: --kv-cache-dtype)", choices=kv_types)
    _flag(p, "kv_cache_dtype_v", "V's alone (default: --kv-cache-dtype)", choices=kv_types)
    _flag(
        p,
        "kv_cache_host_memory",
        "host RAM for the prefix cache's evicted pages, loaded back on a later hit, e.g. 2GiB (default: none)",
    )
    _flag(
        p,
        "kv_cache_dir",
        "a folder the prefix cache's evicted pages go to, and at shutdown the cached ones: a restart loads them back",
    )
    _flag(
        p,
        "kv_cache_dir_size",
        "what --kv-cache-dir may hold, e.g. 20GiB (least recently used pages go first)",
    )
    _flag(p, "max_prefill_tokens", "prefill tokens per step (chunked prefill)", type=int)
    _flag(
        p,
        "prefill_step_ratio",
        "while requests decode, cut a step's prefill so that it takes at most this many decode steps' "
        "time (measured; e.g. 3); default: off, every step may prefill --max-prefill-tokens",
        type=float,
    )
    _flag(p, "max_request_bytes", "largest request body accepted, e.g. 32MiB (413 beyond)")
    _flag(p, "header_timeout", "seconds to send a request head, or a body may stall; then 408", type=float)
    _flag(p, "max_connections", "open connections, then 503; default: descriptor limit - 64", type=int)
    _flag(
        p,
        "max_queued_requests",
        "requests that may wait for admission; beyond, 429 (Anthropic: 529) with Retry-After",
        type=int,
    )
    _flag(p, "max_choices", "engine requests one HTTP request may make (prompts x n); beyond, 400", type=int)
    _flag(
        p,
        "queue_timeout",
        "seconds a request may wait for admission before it is refused like a full queue",
        type=float,
    )
    _flag(
        p,
        "scheduling_policy",
        "admission order: fcfs, or priority (the request's priority field, smaller first)",
        choices=["fcfs", "priority"],
    )
    _flag(p, "max_stop_sequences", "stop strings one request may send; beyond, 400", type=int)
    _flag(p, "max_stop_length", "characters of one stop string; beyond, 400", type=int)
    _flag(p, "max_logit_bias", "logit_bias entries one request may send; beyond, 400", type=int)
    _flag(
        p,
        "grammar_workers",
        "grammar compile processes (0: compile on the request's thread, without time-out)",
        type=int,
    )
    _flag(p, "grammar_queue", "grammar compiles that may wait for a worker; beyond, 429", type=int)
    _flag(
        p,
        "grammar_compile_timeout",
        "seconds one grammar compile may take; then it is stopped and the request gets 400",
        type=float,
    )
    _flag(
        p,
        "max_grammar_bytes",
        "largest JSON schema, regex, choice list, grammar or tool set compiled, e.g. 256KiB",
    )
    _flag(p, "grammar_cache_memory", "memory the compiled grammars kept for reuse may hold, e.g. 256MiB")
    _flag(
        p,
        "enable_lora",
        "serve LoRA adapters (loaded with --lora or POST /v1/load_lora_adapter)",
        action="store_true",
    )
    _flag(
        p,
        "lora",
        "a LoRA adapter served under NAME: NAME=PATH (a PEFT folder, a GGUF LoRA file, a Hub id); repeatable",
        action="append",
    )
    _flag(
        p,
        "max_loras",
        "LoRA adapters resident at once (past it the least recently used idle one goes)",
        type=int,
    )
    _flag(p, "max_lora_rank", "the largest rank a LoRA adapter may have", type=int)
    _flag(
        p,
        "lora_dtype",
        "what adapters' weights are kept in (auto: float16 on GGUF weights kept quantized, else float32)",
        choices=["auto", "float32", "float16", "bfloat16"],
    )
    _flag(
        p,
        "speculative",
        "speculative decoding of greedy requests: ngram (prompt lookup); default: off",
        choices=["ngram"],
    )
    _flag(p, "num_speculative_tokens", "with --speculative: drafts per request and step, 1 to 15", type=int)
    _flag(
        p,
        "ngram_min",
        "with --speculative ngram: shortest suffix n-gram looked up in the request's tokens",
        type=int,
    )
    _flag(
        p,
        "ngram_max",
        "with --speculative ngram: longest suffix n-gram, tried first (>= --ngram-min)",
        type=int,
    )
    _flag(
        p,
        "shutdown_timeout",
        "seconds requests in flight may take to finish after SIGTERM/SIGINT",
        type=float,
    )
    _flag(
        p,
        "on_load_failure",
        "when the model fails to load: exit (status 1, one line on stderr), "
        "or stay up unhealthy (/health 503)",
        choices=["exit", "unhealthy"],
    )
    _flag(
        p,
        "tensor_parallel_size",
        "split the model over this many ranks (worker processes, or torchrun's)",
        type=int,
    )
    _flag(
        p,
        "tp_timeout",
        "seconds a tensor-parallel collective may wait (idle ranks get a heartbeat)",
        type=float,
    )
    _flag(
        p,
        "data_parallel_size",
        "engine replicas (processes on loopback) behind the SGLang Model Gateway on --host/--port",
        type=int,
    )
    _flag(
        p,
        "data_parallel_base_port",
        "replica i listens on 127.0.0.1:(this + i); default: free ports",
        type=int,
    )
    _flag(
        p,
        "gateway_metrics_port",
        "port of the gateway's own Prometheus /metrics, on 127.0.0.1; default: a free one",
        type=int,
    )
    _flag(
        p,
        "api_key",
        "require this key (Authorization: Bearer or x-api-key); repeat it for several keys; never empty",
        action="append",
    )
    _flag(
        p, "api_key_file", "file of API keys, one a line (blank lines and # comments skipped), read at start"
    )
    _flag(
        p,
        "admin_api_key",
        "operator key: every route, and the only key /stats and /metrics accept once keys are set; "
        "repeatable",
        action="append",
    )
    _flag(
        p,
        "signing_key",
        "secret (16 characters or more) that signs Anthropic thinking blocks, so that they verify after a "
        "restart and on every replica; default: a random one per process",
    )
    _flag(
        p,
        "shared_prefix_cache",
        "with API keys: one prefix cache for every key (a single trusted tenant); "
        "by default each key has its own",
        action=argparse.BooleanOptionalAction,
    )
    _flag(
        p,
        "allowed_origins",
        "CORS: origins browsers may call from, comma-separated (*: any); default: none",
        type=_comma_list,
    )
    _flag(
        p,
        "allowed_methods",
        "CORS: methods cross-origin requests may use, comma-separated (*: any)",
        type=_comma_list,
    )
    _flag(
        p,
        "allowed_headers",
        "CORS: headers cross-origin requests may send, comma-separated (*: any)",
        type=_comma_list,
    )
    _flag(p, "ssl_keyfile", "TLS private key (PEM); default: in --ssl-certfile")
    _flag(p, "ssl_certfile", "TLS certificate chain (PEM): serve HTTPS")
    _flag(p, "ssl_keyfile_password", "password of an encrypted --ssl-keyfile")
    _flag(p, "ssl_ca_certs", "CA certificates (PEM) that verify client certificates")
    _flag(
        p,
        "ssl_cert_reqs",
        "client certificates (optional, required: needs --ssl-ca-certs)",
        choices=["none", "optional", "required"],
    )
    _flag(
        p,
        "protocols",
        "protocol entry points to mount, comma-separated; default: all installed",
        type=lambda s: [x for x in s.split(",") if x],
    )
    _flag(p, "log_level", "log level", choices=["debug", "info", "warning", "error"])
    _flag(
        p,
        "log_format",
        "log lines: text, or json (one object a line, with the request id)",
        choices=["text", "json"],
    )
    p.add_argument(
        "--sampling",
        dest="sampling",
        action="append",
        type=parse_key_value,
        default=argparse.SUPPRESS,
        metavar="KEY=VALUE",
        help="parameter of a sampling plugin for every request, e.g. typical_p=0.9 (repeatable)",
    )


def add_serve_command(subparsers: Any, pm: PluginManager | None = None) -> argparse.ArgumentParser:
    """Add ``serve`` to the ``astrai`` parser's subparsers; its ``args.run(args)`` runs it.

    ``pm`` (default: discovered) is the hook plugin manager: its plugins' options join
    the flags, and the engine and app of the server use it.
    """
    pm = PluginManager.discover() if pm is None else pm
    p = subparsers.add_parser(
        "serve", help="serve the installed protocols (OpenAI, Anthropic, ...) over HTTP"
    )
    add_serve_arguments(p)
    p.set_defaults(run=run_serve, plugins=pm, plugin_options=PluginOptions(p, pm))
    return p


def settings_from_args(args: argparse.Namespace) -> ServerSettings:
    """Settings from parsed args: YAML (``--config``) under the explicit flags. Raises ConfigError."""
    cli = {k: v for k, v in vars(args).items() if k in ServerSettings.model_fields}
    positional = getattr(args, "model_arg", None)
    if positional is not None:
        if cli.get("model", positional) != positional:
            raise ConfigError(f"two models: {positional!r} and --model {cli['model']!r}; give one")
        cli["model"] = positional
    if "sampling" in cli:
        cli["sampling"] = dict(cli["sampling"])
    plugin_options = getattr(args, "plugin_options", None)
    if plugin_options is not None:
        cli.update({k: v for k, v in vars(args).items() if k in plugin_options.defaults})
    return load_settings(cli, args.config, plugin_options.defaults if plugin_options else None)


def serve(settings: ServerSettings, pm: PluginManager | None = None) -> None:
    """Run uvicorn until a signal has drained it; the engine loads in a background thread meanwhile
    (``astrai_server.loader``). A signal during the load stops the server at once, without waiting
    for the load. Raises ModelLoadFailed once uvicorn has stopped when the model failed to load
    (``on_load_failure: exit``), with one line naming the file and the problem.

    ``pm`` (default: discovered) serves both the app (``astrai_server_app``) and the engine.
    """
    import uvicorn

    from astrai.malloc import tune_malloc
    from astrai.sampling import SamplingPipeline
    from astrai_server.app import create_app
    from astrai_server.descriptors import raise_descriptor_limit
    from astrai_server.drain import DrainingServer
    from astrai_server.edge import uvicorn_options
    from astrai_server.loader import EngineLoader

    raise_descriptor_limit()  # a connection holds a descriptor; replicas, workers, the gateway inherit it
    try:  # the pooling models' names: a count that does not match, or a name taken twice, stops the start
        settings.pooling_names()
    except ValueError as exc:
        raise ConfigError(str(exc)) from None
    if settings.chat_template is not None:  # a missing file or a syntax error stops the start (exit 2)
        from astrai.model.chat_template import load_chat_template

        load_chat_template(settings.chat_template)
    if (
        settings.reasoning_parser is not None
    ):  # a name not installed stops the start (exit 2), listing those that are
        from astrai.reasoning import choose_reasoning_parser

        choose_reasoning_parser(settings.reasoning_parser, "")
    if settings.tool_call_parser is not None:
        from astrai.tool_parsers import choose_tool_parser

        choose_tool_parser(settings.tool_call_parser)
    _check_kv_cache(settings)
    _check_activations(settings)
    _check_attention_backend(settings)
    if settings.tensor_parallel_size > 1:
        from astrai.distributed.sharding import check_tp_size
        from astrai.model import read_config
        from astrai.model.resolve import local_model

        # every rank loads the same files: a Hub id becomes its local copy once, here
        model = local_model(settings.model, settings.revision)
        settings = settings.model_copy(update={"model": model, "revision": None})

        check_tp_size(
            read_config(settings.model), settings.tensor_parallel_size
        )  # at start, naming the valid sizes
        _tp_worker(settings)  # a torchrun rank > 0 runs its shard until rank 0 stops, and ends here
    if settings.data_parallel_size > 1:  # replicas behind the SGLang Model Gateway, supervised
        from astrai_server.replicas import serve_replicas

        serve_replicas(settings)
        return
    pm = PluginManager.discover() if pm is None else pm
    SamplingPipeline.discover(settings.sampling)  # a bad --sampling fails now, not in the background loader
    tune_malloc()  # the process's allocator setting, before anything large is allocated (astrai.malloc)
    edge_options = uvicorn_options(settings)  # TLS, logging, connection bounds; a bad TLS file fails now
    app = create_app(settings, None, plugins=pm)
    config = uvicorn.Config(
        app, host=settings.host, port=settings.port, log_level=settings.log_level, **edge_options
    )
    server = DrainingServer(config, app, settings.shutdown_timeout)  # SIGTERM drains (astrai_server.drain)
    loader = EngineLoader(settings, app, pm)
    loader.start(server)
    try:
        server.run()
    finally:
        engine = loader.stop()  # a load still running is abandoned: its thread is a daemon
        if engine is not None:
            engine.shutdown()
        if loader.loading:  # stopped during the start
            _exit_now(0 if sys.exc_info()[0] is None else 1)
    if loader.failure is not None and settings.on_load_failure == "exit":
        raise ModelLoadFailed(loader.failure)
    if settings.tensor_parallel_size > 1:  # its process group's threads: as on the other ranks
        _exit_now(0, "tensor-parallel rank 0 stopped")


def _check_attention_backend(settings: ServerSettings) -> None:
    """An attention backend chosen by name (``--attention-backend``, else ``ASTR_BACKEND``) that is
    misspelled, not installed, broken or unavailable on this machine stops the start (ConfigError:
    exit 2) with the registry's reason, rather than failing every request once loaded."""
    from astrai.errors import BackendUnavailable
    from astrai.extension.backend.policy import get_registry
    from astrai.extension.backend.selection import requested_backend

    try:
        get_registry().check_choice(requested_backend(settings.attention_backend))
    except BackendUnavailable as exc:
        raise ConfigError(str(exc)) from None


def _check_activations(settings: ServerSettings) -> None:
    """``--activations int8`` where nothing could take it stops the start (ConfigError: exit 2):
    under tensor parallelism (whose ranks shard dense weights) or with ``--weights dense``. The
    model and kernel checks (``astrai.model.activations``) fail the load with their reason."""
    if settings.activations != "int8":
        return
    what = "--activations int8 applies to a GGUF model's weights kept quantized"
    if settings.tensor_parallel_size > 1:
        raise ConfigError(f"{what}: tensor parallelism shards dense weights (--tensor-parallel-size 1)")
    if settings.weights == "dense":
        raise ConfigError(f"{what}: --weights dense dequantizes them (use --weights gguf or auto)")


def _check_kv_cache(settings: ServerSettings) -> None:
    """A quantized KV cache the attention backend chosen cannot serve, or one under tensor
    parallelism, stops the start (ConfigError: exit 2), naming the backends that can serve it; so
    do KV tiers without a prefix cache or under tensor parallelism."""
    engine = settings.engine_config()
    if engine.kv_cache_host_memory_bytes or engine.kv_cache_dir:
        tiers = "--kv-cache-host-memory and --kv-cache-dir keep the prefix cache's pages"
        if not (engine.paged and engine.prefix_caching):
            raise ConfigError(f"{tiers}: they need --paged and --prefix-caching")
        if settings.tensor_parallel_size > 1:
            raise ConfigError(f"{tiers}: they are not supported under tensor parallelism")
    from astrai.errors import BackendUnavailable
    from astrai.extension.backend.policy import check_features

    what = f"--kv-cache-dtype {'/'.join(engine.kv_kinds)} (K/V)"
    if engine.kv_kinds == ("auto", "auto"):
        return
    if settings.tensor_parallel_size > 1:
        raise ConfigError(
            f"{what} is not supported under tensor parallelism (--tensor-parallel-size 1 serves it)"
        )
    try:
        check_features(frozenset({"kv_int8"}), what, settings.attention_backend)
    except BackendUnavailable as exc:
        raise ConfigError(str(exc)) from None


def _exit_now(status: int, why: str = "stopped during the start: the model load is abandoned") -> NoReturn:
    """End the process without finalizing the interpreter: torch's native threads (a loader still
    inside torch, gloo's) abort the process when Python is torn down under them, and nothing left
    is worth waiting for. ``why`` is logged; logs and stdio are flushed first."""
    logger.info("%s", why)
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(status)


def _tp_worker(settings: ServerSettings) -> None:
    """Under torchrun, ranks > 0 of a tensor-parallel ``astrai serve`` serve no HTTP: they run their
    shard (``astrai.distributed.launch.worker_main``) and end the process; anywhere else, nothing."""
    import torch

    from astrai.distributed.launch import torchrun_rank, worker_main
    from astrai.model import default_dtype

    rank = torchrun_rank()
    if not rank:
        return
    if int(os.environ["WORLD_SIZE"]) != settings.tensor_parallel_size:
        raise ConfigError(
            f"torchrun started {os.environ['WORLD_SIZE']} processes "
            f"for --tensor-parallel-size {settings.tensor_parallel_size}"
        )
    device = torch.device(settings.device)
    if device.type == "cuda":  # one GPU per rank on its machine
        device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", rank)))
    dtype = settings.dtype or str(default_dtype(device)).removeprefix("torch.")
    source = {"model": settings.model, "max_seq_len": settings.max_seq_len}
    spec = {
        "rank": rank,
        "size": settings.tensor_parallel_size,
        "source": source,
        "dtype": dtype,
        "device": str(device),
        "timeout": settings.tp_timeout,
    }
    # Like ``python -m astrai.distributed.worker``, the rank leaves without finalizing the
    # interpreter: a native thread of torch's still joinable at teardown aborts it (SIGABRT after a
    # clean STOP, which torchrun reports as a failed run).
    code = worker_main(spec)
    _exit_now(code, f"tensor-parallel rank {rank} stops (status {code})")


def configure_logging(settings: ServerSettings) -> None:
    """The logging of ``astrai serve`` (and of each replica of ``--data-parallel-size``)."""
    from astrai_server.logs import log_config

    logging.config.dictConfig(log_config(settings))  # --log-format; uvicorn's loggers too
    logging.captureWarnings(True)  # warnings become records, in the same format
    for name in ("astrai", "astrai_server"):  # also when the ``astrai`` command configured logging first
        logging.getLogger(name).setLevel(settings.log_level.upper())


def run_serve(args: argparse.Namespace) -> int:
    """The ``serve`` subcommand: 0 on a clean stop (a signal, also during the start), 1 when the
    model fails to load (``on_load_failure: exit``), 2 on a configuration or plugin error found
    before serving; each error is one line on stderr."""
    try:
        settings = settings_from_args(args)
        configure_logging(settings)
        serve(settings, getattr(args, "plugins", None))
    except ModelLoadFailed as exc:
        sys.stderr.write(f"astrai serve: error: {exc}\n")
        return 1
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
