"""``ServerSettings``: every option of ``astrai serve``, from defaults, a YAML file and CLI flags.

Precedence: CLI flags > the YAML file's ``server:`` section > defaults. An
unknown key, or a value of the wrong type, is a ``ConfigError`` that names it.
Options that hook plugins add (``astrai_add_options``) are keys of the same
section, by ``dest``; their values land in ``ServerSettings.plugin_options``.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator

from astrai_server.errors import ConfigError

#: Top-level YAML sections: ``server`` is read, ``runtime`` belongs to the Docker scripts.
SECTIONS = ("server", "runtime")
_UNITS = {"": 1, "b": 1, "kb": 10**3, "mb": 10**6, "gb": 10**9, "kib": 2**10, "mib": 2**20, "gib": 2**30}


def parse_bytes(value: int | str) -> int:
    """``1073741824``, ``"512MiB"``, ``"2 GB"`` -> bytes; raises ValueError otherwise."""
    if isinstance(value, int):
        return value
    m = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([a-zA-Z]*)\s*", str(value))
    if not m or m.group(2).lower() not in _UNITS:
        raise ValueError(f"not a size: {value!r} (examples: 536870912, 512MiB, 2GB)")
    return int(float(m.group(1)) * _UNITS[m.group(2).lower()])


class ServerSettings(BaseModel):
    """Settings of one server process. Field names are the YAML keys; flags are ``--key-with-dashes``."""

    model_config = ConfigDict(extra="forbid", validate_assignment=True)

    host: str = "127.0.0.1"
    port: int = Field(8000, ge=0, le=65535)
    model: str | None = None  # name, .gguf file or HF folder; None: the default model
    served_model_name: str = "astrai"  # the name /v1/models lists
    device: str = "cpu"
    dtype: Literal["float32", "bfloat16", "float16"] | None = None  # None: astrai.model.default_dtype
    attention_backend: str | None = None  # an astrai.attention_backends entry point: EngineConfig.attention_backend
    max_batch_size: int = Field(64, ge=1)
    max_seq_len: int | None = Field(None, ge=2)  # None: the model's context length
    paged: bool = True
    page_size: int = Field(16, ge=1)
    prefix_caching: bool = True
    kv_memory: int | None = Field(None, ge=1)  # KV pool budget in bytes (YAML/CLI accept "512MiB")
    max_prefill_tokens: int = Field(2048, ge=1)
    max_request_bytes: int = Field(32 * 2**20, ge=1)  # largest request body (YAML/CLI accept "32MiB"); 413 beyond
    api_key: str | None = None  # never empty: see _key
    protocols: list[str] | None = None  # entry-point names to mount; None: every installed one
    log_level: Literal["debug", "info", "warning", "error"] = "info"
    sampling: dict[str, Any] = {}  # plugin sampling parameters for every request: {"typical_p": 0.9}
    plugin_options: dict[str, Any] = {}  # values of hook plugins' options, by dest

    @field_validator("kv_memory", "max_request_bytes", mode="before")
    @classmethod
    def _size(cls, value: Any) -> Any:
        return None if value is None else parse_bytes(value)

    @field_validator("api_key")
    @classmethod
    def _key(cls, value: str | None) -> str | None:
        """A key no client can send would lock everyone out; an empty one used to mean "no key"."""
        if value is None:
            return None
        if not value.strip():
            raise ValueError("the API key is empty or only whitespace; leave it unset to serve without a key")
        if value != value.strip():
            raise ValueError("the API key begins or ends with whitespace, which HTTP headers drop")
        if any(ord(c) < 32 or ord(c) == 127 for c in value):
            raise ValueError("the API key holds a control character, which HTTP headers cannot carry")
        return value

    def engine_config(self) -> Any:
        """The ``astrai.engine.EngineConfig`` these settings describe."""
        from astrai.engine import EngineConfig

        return EngineConfig(
            max_batch_size=self.max_batch_size, max_seq_len=self.max_seq_len, paged=self.paged,
            page_size=self.page_size, kv_memory_bytes=self.kv_memory, prefix_caching=self.prefix_caching,
            max_prefill_tokens=self.max_prefill_tokens, attention_backend=self.attention_backend,
            sampling=dict(self.sampling), plugin_options=dict(self.plugin_options),
        )  # fmt: skip


def _describe(err: ValidationError, where: str, flags: bool = False, plugin_keys: Iterable[str] = ()) -> str:
    """One message naming each bad key: ``serve.yaml: unknown key 'server.foo'`` or ``--port: ...``."""
    parts = []
    known = ", ".join([*ServerSettings.model_fields, *plugin_keys])
    for e in err.errors():
        key = ".".join(str(x) for x in e["loc"])
        name = "--" + key.replace("_", "-") if flags else f"'server.{key}'"
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


def load_settings(
    cli: dict[str, Any],
    config_path: str | Path | None = None,
    plugin_defaults: Mapping[str, Any] | None = None,
) -> ServerSettings:
    """Defaults, overridden by the YAML file's ``server:`` section, overridden by ``cli``.

    ``cli`` holds only the flags given explicitly. ``plugin_defaults`` are the options
    hook plugins declared (``dest`` -> default): those keys, in the YAML section or in
    ``cli``, go to ``plugin_options`` (over the defaults). Raises ConfigError.
    """
    values = read_yaml(config_path) if config_path is not None else {}
    plugin = dict(plugin_defaults or {})
    given = values.get("plugin_options") or {}
    options = {**plugin, **(given if isinstance(given, dict) else {})}  # a non-mapping fails validation below
    for source in (values, cli):
        options.update({k: source.pop(k) for k in [k for k in source if k in plugin]})
    try:
        ServerSettings(**values)  # the YAML alone first, so that its errors name the file
    except ValidationError as e:
        raise ConfigError(_describe(e, f"{config_path}: ", plugin_keys=plugin)) from None
    try:
        return ServerSettings(**{**values, **cli, "plugin_options": options})
    except ValidationError as e:
        raise ConfigError(_describe(e, "", flags=True, plugin_keys=plugin)) from None
