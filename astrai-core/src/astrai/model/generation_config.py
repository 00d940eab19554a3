"""A checkpoint's sampling defaults: what requests that leave a sampling value out get
(vLLM's ``--generation-config auto``).

An HF folder's ``generation_config.json`` gives its ``temperature``, ``top_p``, ``top_k``, ``min_p``
and ``repetition_penalty``; ``"do_sample": false`` (transformers' greedy search) gives temperature 0.
A GGUF file carries none, so a known model (``astrai.model.resolve.KNOWN_MODELS``) may have defaults
written here, taken from its model card; any other GGUF file has none (the API's defaults apply).
"""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Any

from astrai.errors import AstraiError, ModelFormatError, RequestRejected
from astrai.sampling.params import SamplingParams

__all__ = ["KNOWN_DEFAULTS", "SAMPLING_KEYS", "generation_defaults", "read_generation_config"]

logger = logging.getLogger(__name__)

#: The ``generation_config.json`` keys that become request defaults (``SamplingParams`` fields).
SAMPLING_KEYS = ("temperature", "top_p", "top_k", "min_p", "repetition_penalty")

#: Defaults of known models whose files carry none, by known name. SmolLM2-135M-Instruct (Q4_1): its
#: model card samples at temperature 0.2 and top_p 0.9, but on this file "The" and "L'" nearly tie as
#: the first token of "What is the capital of France?", and at 0.2 it answered in French for 5 of 12
#: seeds (at the API's temperature 1, nearly always); greedy answers "The capital of France is Paris."
KNOWN_DEFAULTS: dict[str, dict[str, Any]] = {
    "smollm2-135m": {"temperature": 0.0},
}


def read_generation_config(folder: str | Path) -> dict[str, Any]:
    """The sampling defaults of ``folder/generation_config.json`` ({} without the file).

    Values ``SamplingParams`` would refuse are left out with a warning (the request's own default
    applies); a file that is not a JSON object raises ModelFormatError naming it.
    """
    path = Path(folder) / "generation_config.json"
    if not path.is_file():
        return {}
    try:
        raw = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise ModelFormatError(f"{path}: not readable JSON ({e})") from e
    if not isinstance(raw, dict):
        raise ModelFormatError(f"{path}: not a JSON object")
    found = {k: raw[k] for k in SAMPLING_KEYS if raw.get(k) is not None}
    if raw.get("do_sample") is False:  # transformers' greedy search ignores temperature, top_p, top_k
        found["temperature"] = 0.0
    defaults = {}
    for key, value in found.items():
        try:
            SamplingParams(**{key: value})
        except (RequestRejected, TypeError) as e:
            logger.warning("%s: %s=%r is left out: %s", path, key, value, e)
            continue
        defaults[key] = value
    return defaults


def generation_defaults(name_or_path: str | None) -> tuple[dict[str, Any], str | None]:
    """The sampling defaults of the model ``name_or_path`` names (``resolve_model``'s argument) and
    where they come from (a file, or "astrai's defaults for <name>"; None when there are none).
    Raises ModelNotFound as ``resolve_model`` does."""
    from astrai.model.resolve import DEFAULT_MODEL, resolve_model

    kind, path = resolve_model(name_or_path)
    if kind == "hf":
        defaults = read_generation_config(path)
        return defaults, (str(path / "generation_config.json") if defaults else None)
    ref = (DEFAULT_MODEL if name_or_path is None else str(name_or_path)).lower()
    for name, values in KNOWN_DEFAULTS.items():  # the known name, or the path of its file
        if ref == name or _is_file_of(name, path):
            return dict(values), f"astrai's defaults for {name}"
    return {}, None


def _is_file_of(name: str, path: Path) -> bool:
    """Whether ``path`` is the file the known model ``name`` resolves to (False: not installed)."""
    from astrai.model.resolve import resolve_model

    try:
        return resolve_model(name)[1].resolve() == path.resolve()
    except AstraiError:
        return False
