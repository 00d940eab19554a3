"""``ServerSettings``: every option of ``astrai serve``, from defaults, a YAML file and CLI flags.

Precedence: CLI flags > environment variables (``ASTRAI_<KEY>``: ``read_environment``) > the
YAML file's ``server:`` section > defaults. An unknown key, or a value of the wrong type, is a
``ConfigError`` that names it (the file's key, the variable or the flag).
Options that hook plugins add (``astrai_add_options``) are keys of the same
section, by ``dest``; their values land in ``ServerSettings.plugin_options``.

Over 300 lines because every setting is one field of one class, with its default, range and
comment next to it; the readers of the file and the environment below them are small.
"""

from __future__ import annotations

import os
import re
import types
import typing
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Annotated, Any, Literal, Union

from pydantic import AfterValidator, BaseModel, ConfigDict, Field, ValidationError, field_validator

from astrai.config import EngineConfig
from astrai_server.errors import ConfigError

#: Top-level YAML sections: ``server`` is read, ``runtime`` belongs to the Docker scripts.
SECTIONS = ("server", "runtime")
ENV_PREFIX = "ASTRAI_"  # then the setting's key in upper case: env_name
_UNITS = {"": 1, "b": 1, "kb": 10**3, "mb": 10**6, "gb": 10**9, "kib": 2**10, "mib": 2**20, "gib": 2**30}


def parse_bytes(value: int | str) -> int:
    """``1073741824``, ``"512MiB"``, ``"2 GB"`` -> bytes; raises ValueError otherwise."""
    if isinstance(value, int):
        return value
    m = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([a-zA-Z]*)\s*", str(value))
    if not m or m.group(2).lower() not in _UNITS:
        raise ValueError(f"not a size: {value!r} (examples: 536870912, 512MiB, 2GB)")
    return int(float(m.group(1)) * _UNITS[m.group(2).lower()])


def check_key(value: str) -> str:
    """An API key, if a client can send it: a key no client can send would lock everyone out; an
    empty one used to mean "no key". Raises ValueError."""
    if not value.strip():
        raise ValueError("the API key is empty or only whitespace; leave it unset to serve without a key")
    if value != value.strip():
        raise ValueError("the API key begins or ends with whitespace, which HTTP headers drop")
    if any(ord(c) < 32 or ord(c) == 127 for c in value):
        raise ValueError("the API key holds a control character, which HTTP headers cannot carry")
    return value


ApiKey = Annotated[str, AfterValidator(check_key)]
#: The engine's defaults (astrai.config), which the settings of the engine take rather than repeat; the
#: few that differ say why where they are (max_queued_requests).
_ENGINE = EngineConfig()
_ORIGIN = re.compile(r"[A-Za-z][A-Za-z0-9+.-]*://[^/?#\s]+")
_TOKEN = re.compile(r"[A-Za-z0-9!#$%&'*+.^_`|~-]+")  # an HTTP token: a method or header name


class ServerSettings(BaseModel):
    """Settings of one server process. Field names are the YAML keys; flags are ``--key-with-dashes``."""

    model_config = ConfigDict(extra="forbid", validate_assignment=True)

    host: str = "127.0.0.1"
    port: int = Field(8000, ge=0, le=65535)
    model: str | None = None  # name, .gguf file, HF folder or Hub id; None: the default model
    revision: str | None = None  # branch, tag or commit of a Hub id; None: main
    served_model_name: str = "astrai"  # the name /v1/models lists
    # pooling models served beside the chat model (/v1/embeddings, /v1/rerank, /v1/score): known names
    # (minilm-l6), folders or Hub ids, an embedder and a reranker say; None: none
    embedding_model: list[str] | None = None
    # their names in requests and /v1/models, in the same order; None: what --embedding-model says
    served_embedding_model_name: list[str] | None = None
    # what --model serves: "embed" or "score" make a decoder checkpoint a pooling model (last-token
    # vectors, a classifier's scores), "generate" text; None: what its checkpoint is
    task: Literal["generate", "embed", "score"] | None = None
    chat_template: str | None = None  # a Jinja file or inline template over the checkpoint's; None: its own
    reasoning_parser: str | None = (
        None  # an astrai.reasoning_parsers name; None: chosen from the chat template
    )
    tool_call_parser: str | None = (
        None  # an astrai.tool_parsers name; None: from the chat template, else hermes
    )
    generation_config: Literal["auto", "none"] = (
        "auto"  # auto: the checkpoint's sampling defaults for values a request leaves out; none: the API's
    )
    device: str = "cpu"
    dtype: Literal["float32", "bfloat16", "float16"] | None = None  # None: astrai.model.default_dtype
    weights: Literal["auto", "gguf", "dense"] = (
        "auto"  # a GGUF file's quantized weights: kept (gguf), dequantized (dense), or auto
    )
    attention_backend: str | None = (
        None  # an astrai.attention_backends entry point: EngineConfig.attention_backend
    )
    max_batch_size: int = Field(_ENGINE.max_batch_size, ge=1)
    max_seq_len: int | None = Field(None, ge=2)  # None: the model's context length
    paged: bool = _ENGINE.paged
    page_size: int = Field(_ENGINE.page_size, ge=1)
    prefix_caching: bool = _ENGINE.prefix_caching
    kv_memory: int | None = Field(None, ge=1)  # KV pool budget in bytes (YAML/CLI accept "512MiB")
    kv_cache_dtype: Literal["auto", "int8"] = (
        "auto"  # what the KV pool keeps K and V in (astrai.kvcache.quant)
    )
    kv_cache_dtype_k: Literal["auto", "int8"] | None = None  # K's alone (None: kv_cache_dtype)
    kv_cache_dtype_v: Literal["auto", "int8"] | None = None  # V's alone
    # host RAM for the prefix cache's evicted pages, loaded back on a later hit (YAML/CLI: "1GiB"); 0: none
    kv_cache_host_memory: int = Field(0, ge=0)
    kv_cache_dir: str | None = None  # a folder those pages (and, at shutdown, the cached ones) go to
    kv_cache_dir_size: int = Field(_ENGINE.kv_cache_dir_bytes, ge=1)  # what the folder may hold ("8GiB")
    # "int8": a GGUF model's quantized linears take activations quantized to 8 bits; "dtype": the
    # model's own, exact; "auto": int8 where measured to keep the model's quality (astrai.model.activations)
    activations: Literal["auto", "int8", "dtype"] = "auto"
    max_prefill_tokens: int = Field(_ENGINE.max_prefill_tokens, ge=1)
    # while requests decode, a step may take this many decode steps' time (astrai.pacing); None: off
    prefill_step_ratio: float | None = Field(_ENGINE.prefill_step_ratio, gt=1)
    max_request_bytes: int = Field(
        32 * 2**20, ge=1
    )  # largest request body (YAML/CLI accept "32MiB"); 413 beyond
    header_timeout: float = Field(10.0, gt=0)  # seconds to send a request head, or a body may stall; then 408
    max_connections: int | None = Field(None, ge=1)  # open connections, then 503; None: fd limit - 64
    # requests waiting for admission (a request's choices count one each); beyond: 429 (None: no limit). The
    # engine's own default is None (a library caller bounds itself); a server takes clients it cannot trust
    max_queued_requests: int | None = Field(512, ge=1)
    max_choices: int = Field(
        128, ge=1
    )  # engine requests one HTTP request may make (prompts x n); beyond: 400
    queue_timeout: float | None = Field(None, gt=0)  # seconds a request may wait for admission; then 429
    scheduling_policy: Literal["fcfs", "priority"] = (
        "fcfs"  # "priority": the body's priority field orders requests
    )
    max_stop_sequences: int = Field(
        _ENGINE.limits.max_stop_sequences, ge=1
    )  # stop strings of one request (astrai.limits.RequestLimits)
    max_stop_length: int = Field(_ENGINE.limits.max_stop_length, ge=1)  # characters of one stop string
    max_logit_bias: int = Field(
        _ENGINE.limits.max_logit_bias, ge=1
    )  # logit_bias entries of one request (OpenAI's API takes 300)
    grammar_workers: int = Field(
        _ENGINE.grammar.workers, ge=0
    )  # grammar compile processes (0: on the request's thread, unbounded)
    grammar_queue: int = Field(
        _ENGINE.grammar.max_pending, ge=0
    )  # compiles that may wait for a worker; beyond: 429
    grammar_compile_timeout: float = Field(
        _ENGINE.grammar.timeout, gt=0
    )  # seconds one compile may take; then 400
    max_grammar_bytes: int = Field(
        _ENGINE.grammar.max_bytes, ge=1
    )  # largest schema, regex, choices, grammar or tool set (YAML/CLI: "256KiB")
    grammar_cache_memory: int = Field(
        _ENGINE.grammar.cache_bytes, ge=0
    )  # compiled grammars kept for reuse (YAML/CLI: "256MiB")
    speculative: Literal["ngram"] | None = (
        None  # "ngram": prompt-lookup speculative decoding of greedy requests
    )
    num_speculative_tokens: int = Field(
        _ENGINE.num_speculative_tokens, ge=1, le=15
    )  # drafts per request and step
    ngram_min: int = Field(
        _ENGINE.ngram_min, ge=1
    )  # shortest suffix n-gram matched against the request's earlier tokens
    ngram_max: int = Field(_ENGINE.ngram_max, ge=1)  # longest (tried first); >= ngram_min
    enable_lora: bool = False  # LoRA adapters: --lora at start, /v1/load_lora_adapter while serving
    # adapters loaded at start, NAME=PATH each (a PEFT folder, a GGUF LoRA file or a Hub id); implies enable_lora
    lora: list[str] | None = None
    max_loras: int = Field(
        _ENGINE.max_loras, ge=1
    )  # adapters resident at once; past it the idle LRU one goes
    max_lora_rank: int = Field(_ENGINE.max_lora_rank, ge=1)  # the largest rank an adapter may have
    # adapters' weights: auto (float16 on GGUF weights kept quantized, else float32), float32, ...
    lora_dtype: Literal["auto", "float32", "float16", "bfloat16"] = "auto"
    shutdown_timeout: float = Field(
        20.0, ge=0
    )  # seconds requests in flight get after SIGTERM; then they are aborted
    on_load_failure: Literal["exit", "unhealthy"] = "exit"  # a failed model load: exit 1, or serve 503
    tensor_parallel_size: int = Field(1, ge=1)  # ranks the model is split over (astrai.distributed)
    tp_timeout: float = Field(_ENGINE.tp_timeout, gt=0)  # seconds a tensor-parallel collective may wait
    data_parallel_size: int = Field(
        1, ge=1
    )  # engine replicas behind the SGLang Model Gateway (astrai_server.replicas)
    data_parallel_base_port: int | None = Field(
        None, ge=1, le=65535
    )  # replica i on 127.0.0.1:(this + i); None: free ports
    gateway_metrics_port: int | None = Field(
        None, ge=1, le=65535
    )  # the gateway's own Prometheus port (127.0.0.1); None: free
    api_key: list[ApiKey] | None = Field(
        None, min_length=1
    )  # accepted keys (a string: one key); never empty: check_key
    api_key_file: str | None = None  # more keys, one a line (# comments): edge.read_key_file, at start
    admin_api_key: list[ApiKey] | None = Field(
        None, min_length=1
    )  # operator keys: every route, /stats and /metrics too
    # the secret that signs what clients send back (Anthropic thinking signatures); None: random per process
    signing_key: str | None = Field(None, min_length=16)
    shared_prefix_cache: bool = False  # with keys: one prefix cache for every key (a single trusted tenant)
    allowed_origins: list[
        str
    ] = []  # CORS: origins browsers may call from ("*": any); []: no cross-origin access
    allowed_methods: list[str] = ["GET", "POST"]  # CORS: methods of cross-origin requests
    allowed_headers: list[str] = ["*"]  # CORS: request headers of cross-origin requests ("*": any)
    ssl_keyfile: str | None = None  # TLS private key (PEM); None: in ssl_certfile
    ssl_certfile: str | None = None  # TLS certificate chain (PEM); set: HTTPS
    ssl_keyfile_password: str | None = None  # of an encrypted ssl_keyfile
    ssl_ca_certs: str | None = None  # CA certificates (PEM) that verify client certificates
    ssl_cert_reqs: Literal["none", "optional", "required"] = "none"  # client certificates
    protocols: list[str] | None = None  # entry-point names to mount; None: every installed one
    log_level: Literal["debug", "info", "warning", "error"] = "info"
    log_format: Literal["text", "json"] = "text"  # json: one object a line (edge.JsonFormatter)
    sampling: dict[str, Any] = {}  # plugin sampling parameters for every request: {"typical_p": 0.9}
    plugin_options: dict[str, Any] = {}  # values of hook plugins' options, by dest

    @field_validator(
        "kv_memory",
        "max_request_bytes",
        "max_grammar_bytes",
        "grammar_cache_memory",
        "kv_cache_host_memory",
        "kv_cache_dir_size",
        mode="before",
    )
    @classmethod
    def _size(cls, value: Any) -> Any:
        return None if value is None else parse_bytes(value)

    @field_validator("ngram_max")
    @classmethod
    def _ngram(cls, value: int, info: Any) -> int:
        low = info.data.get("ngram_min")
        if low is not None and value < low:
            raise ValueError(f"ngram_max must be >= ngram_min ({low})")
        return value

    @field_validator("tensor_parallel_size")
    @classmethod
    def _tp_weights(cls, value: int, info: Any) -> int:
        if value > 1 and info.data.get("weights") == "gguf":
            raise ValueError(
                "tensor parallelism shards dense weights: --weights gguf needs --tensor-parallel-size 1"
            )
        return value

    @field_validator("embedding_model", "served_embedding_model_name", mode="before")
    @classmethod
    def _names(cls, value: Any) -> Any:
        return [x.strip() for x in value.split(",") if x.strip()] if isinstance(value, str) else value

    @field_validator("lora", mode="before")
    @classmethod
    def _loras(cls, value: Any) -> Any:
        items = [x.strip() for x in value.split(",") if x.strip()] if isinstance(value, str) else value
        for item in items or ():
            name, eq, path = str(item).partition("=")
            if not eq or not name.strip() or not path.strip():
                raise ValueError(
                    f"{item!r}: an adapter is NAME=PATH (a PEFT folder, a GGUF LoRA file, a Hub id)"
                )
        return items

    def loras(self) -> dict[str, str]:
        """``--lora``'s adapters, name -> path; ValueError for a name given twice or the model's own."""
        pairs = [tuple(x.strip() for x in item.partition("=")[::2]) for item in self.lora or ()]
        names = [n for n, _ in pairs]
        if len(set(names)) != len(names) or self.served_model_name in names:
            raise ValueError("every --lora adapter needs a name of its own, not the model's")
        return dict(pairs)

    @field_validator("served_embedding_model_name")
    @classmethod
    def _unique(cls, value: list[str] | None) -> list[str] | None:
        if value is not None and len(set(value)) != len(value):
            raise ValueError("the names must differ")
        return value

    def pooling_names(self) -> dict[str, str]:
        """Served name -> ``embedding_model`` entry. Raises ValueError for a count of names that does
        not match the models, or a name taken twice (the chat model's included)."""
        models = self.embedding_model or []
        names = self.served_embedding_model_name or models
        if len(names) != len(models):
            raise ValueError(
                f"--served-embedding-model-name gives {len(names)} names for {len(models)} --embedding-model"
            )
        if len(set(names)) != len(names) or self.served_model_name in names:
            raise ValueError("every served model needs a name of its own (--served-embedding-model-name)")
        return dict(zip(names, models, strict=True))

    @field_validator("api_key", "admin_api_key", mode="before")
    @classmethod
    def _keys(cls, value: Any) -> Any:
        return [value] if isinstance(value, str) else value  # one key, as it used to be written

    @field_validator("allowed_origins")
    @classmethod
    def _origins(cls, value: list[str]) -> list[str]:
        for origin in value:
            if origin != "*" and not _ORIGIN.fullmatch(origin):
                raise ValueError(
                    f"{origin!r} is not an origin: scheme://host[:port], "
                    "without a path or a trailing slash (or *)"
                )
        return value

    @field_validator("allowed_methods", "allowed_headers")
    @classmethod
    def _tokens(cls, value: list[str], info: Any) -> list[str]:
        for token in value:
            if not _TOKEN.fullmatch(token):
                raise ValueError(f"{token!r} is not an HTTP method or header name (or *)")
        return [t.upper() for t in value] if info.field_name == "allowed_methods" else value

    def engine_config(self) -> Any:
        """The ``astrai.engine.EngineConfig`` these settings describe."""
        from astrai.engine import EngineConfig
        from astrai.grammar import GrammarConfig
        from astrai.limits import RequestLimits

        return EngineConfig(
            max_batch_size=self.max_batch_size,
            max_seq_len=self.max_seq_len,
            paged=self.paged,
            page_size=self.page_size,
            kv_memory_bytes=self.kv_memory,
            kv_cache_dtype=self.kv_cache_dtype,
            kv_cache_dtype_k=self.kv_cache_dtype_k,
            kv_cache_dtype_v=self.kv_cache_dtype_v,
            kv_cache_host_memory_bytes=self.kv_cache_host_memory,
            kv_cache_dir=self.kv_cache_dir,
            kv_cache_dir_bytes=self.kv_cache_dir_size,
            activations=self.activations,
            prefix_caching=self.prefix_caching,
            max_prefill_tokens=self.max_prefill_tokens,
            prefill_step_ratio=self.prefill_step_ratio,
            attention_backend=self.attention_backend,
            sampling=dict(self.sampling),
            plugin_options=dict(self.plugin_options),
            max_queued_requests=self.max_queued_requests,
            queue_timeout=self.queue_timeout,
            scheduling_policy=self.scheduling_policy,
            tensor_parallel_size=self.tensor_parallel_size,
            tp_timeout=self.tp_timeout,
            speculative=self.speculative,
            num_speculative_tokens=self.num_speculative_tokens,
            ngram_min=self.ngram_min,
            ngram_max=self.ngram_max,
            chat_template=self.chat_template,
            enable_lora=self.enable_lora or bool(self.lora),
            max_loras=self.max_loras,
            max_lora_rank=self.max_lora_rank,
            lora_dtype=self.lora_dtype,
            limits=RequestLimits(self.max_stop_sequences, self.max_stop_length, self.max_logit_bias),
            grammar=GrammarConfig(
                workers=self.grammar_workers,
                max_pending=self.grammar_queue,
                timeout=self.grammar_compile_timeout,
                max_bytes=self.max_grammar_bytes,
                cache_bytes=self.grammar_cache_memory,
            ),
        )


def _describe(
    err: ValidationError, where: str, flags: bool = False, plugin_keys: Iterable[str] = (), env: bool = False
) -> str:
    """One message naming each bad key: ``serve.yaml: unknown key 'server.foo'``, ``--port: ...``
    or (``env``) the environment variable."""
    parts = []
    known = ", ".join([*ServerSettings.model_fields, *plugin_keys])
    for e in err.errors():
        key = ".".join(str(x) for x in e["loc"])
        top = str(e["loc"][0]) if e["loc"] else key  # a flag or a variable sets a list as a whole
        name = env_name(top) if env else "--" + top.replace("_", "-") if flags else f"'server.{key}'"
        if e["type"] == "extra_forbidden":
            parts.append(f"{where}unknown key {name} (known keys: {known})")
        else:
            parts.append(f"{where}{name}: {e['msg']} (got {e.get('input')!r})")
    return "; ".join(parts)


def read_yaml(path: str | Path) -> dict[str, Any]:
    """The ``server:`` section of a YAML config file; raises ConfigError naming what is wrong."""
    import yaml

    try:
        data = yaml.safe_load(Path(path).read_text()) or {}
    except (OSError, yaml.YAMLError) as e:
        raise ConfigError(f"cannot read config {path}: {e}") from e
    if not isinstance(data, dict):
        raise ConfigError(f"{path}: expected a mapping with a 'server:' section")
    for key in data:
        if key not in SECTIONS:
            raise ConfigError(f"{path}: unknown section {key!r} (known sections: {', '.join(SECTIONS)})")
    section = data.get("server") or {}
    if not isinstance(section, dict):
        raise ConfigError(f"{path}: 'server' must be a mapping of settings")
    return section


def env_name(key: str) -> str:
    """The environment variable of setting ``key``: ``ASTRAI_`` and the key in upper case."""
    return ENV_PREFIX + key.upper()


def _env_kind(annotation: Any) -> str:
    """How a variable's text becomes the setting: "list", "mapping", "text" (as is) or "yaml"."""
    union = typing.get_origin(annotation) in (Union, types.UnionType)
    kinds = {
        typing.get_origin(a) or a
        for a in (typing.get_args(annotation) if union else (annotation,))
        if a is not type(None)
    }
    if list in kinds:
        return "list"
    if dict in kinds:
        return "mapping"
    return "text" if kinds <= {str, Literal} else "yaml"


def read_environment(environ: Mapping[str, str]) -> dict[str, Any]:
    """The settings ``environ`` sets, by key: ``ASTRAI_<KEY>`` for every setting (``ASTRAI_PORT``,
    ``ASTRAI_MAX_BATCH_SIZE``). A list is comma-separated (blanks around an item dropped; an empty
    item is ignored, except an empty API key, which is an error); a mapping is YAML flow
    (``{typical_p: 0.9}``); a string is taken as it is; any other value is read as YAML
    (``8000``, ``true``, ``null``, ``512MiB``). Raises ConfigError naming the variable."""
    import yaml

    values: dict[str, Any] = {}
    for key, field in ServerSettings.model_fields.items():
        name = env_name(key)
        raw = environ.get(name)
        if raw is None:
            continue
        kind = _env_kind(field.annotation)
        if kind == "list":
            items = [item.strip() for item in raw.split(",")]
            values[key] = items if key == "api_key" else [item for item in items if item]
        elif kind == "text":
            values[key] = raw
        else:
            try:
                values[key] = yaml.safe_load(raw)
            except yaml.YAMLError as e:
                if kind == "mapping":
                    raise ConfigError(f"{name}: not a YAML mapping such as {{typical_p: 0.9}}: {e}") from None
                values[key] = raw  # the settings' check names it
            if kind == "mapping" and not isinstance(values[key], dict):
                raise ConfigError(f"{name}: expected a YAML mapping such as {{typical_p: 0.9}} (got {raw!r})")
    return values


def load_settings(
    cli: dict[str, Any],
    config_path: str | Path | None = None,
    plugin_defaults: Mapping[str, Any] | None = None,
    environ: Mapping[str, str] | None = None,
) -> ServerSettings:
    """Defaults, overridden by the YAML file's ``server:`` section, overridden by the environment
    (``environ``, default ``os.environ``: see ``read_environment``), overridden by ``cli``.

    ``cli`` holds only the flags given explicitly. ``plugin_defaults`` are the options
    hook plugins declared (``dest`` -> default): those keys, in the YAML section or in
    ``cli``, go to ``plugin_options`` (over the defaults, the file's ``plugin_options`` and
    ``ASTRAI_PLUGIN_OPTIONS``, in that order). Raises ConfigError.
    """
    values = read_yaml(config_path) if config_path is not None else {}
    env = read_environment(os.environ if environ is None else environ)
    plugin = dict(plugin_defaults or {})
    given = values.get("plugin_options") or {}
    options = {**plugin, **(given if isinstance(given, dict) else {})}  # a non-mapping fails validation below
    options.update({k: values.pop(k) for k in [k for k in values if k in plugin]})
    options.update(env.get("plugin_options", {}))
    options.update({k: cli.pop(k) for k in [k for k in cli if k in plugin]})
    try:
        ServerSettings(**values)  # the YAML alone first, so that its errors name the file
    except ValidationError as e:
        raise ConfigError(_describe(e, f"{config_path}: ", plugin_keys=plugin)) from None
    try:
        ServerSettings(**env)  # then the environment alone, so that its errors name the variable
    except ValidationError as e:
        raise ConfigError(_describe(e, "", plugin_keys=plugin, env=True)) from None
    try:
        return ServerSettings(**{**values, **env, **cli, "plugin_options": options})
    except ValidationError as e:
        raise ConfigError(_describe(e, "", flags=True, plugin_keys=plugin)) from None
