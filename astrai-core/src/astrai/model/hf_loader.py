"""Load a Hugging Face folder (``config.json`` + safetensors) into astrai's state-dict layout.

The state dict keeps HF parameter names and orientations (``[out, in]``), with one
change: q/k projection rows are permuted to llama.cpp's RoPE layout (rotate
interleaved pairs ``(2i, 2i+1)``), the layout astrai's model and GGUF files use.
``hf_header`` reads ``config.json`` and the safetensors headers alone and checks them
against each other (``astrai.model.checks``) before any weight is read.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

from tqdm.auto import tqdm

from astrai.errors import ModelFormatError, ModelNotFound
from astrai.model.architecture import get_architecture
from astrai.model.checks import TensorInfo, check_model
from astrai.model.config import ModelConfig
from astrai.model.hf_config import hf_config, read_json
from astrai.model.layout import fused_parts, to_rope_layout, unfuse

if TYPE_CHECKING:
    import torch

logger = logging.getLogger(__name__)


#: where an image-text checkpoint (Gemma 3 4B and up, Mistral 3) keeps its language model's tensors,
#: and the name each has in a text checkpoint
_TEXT_PREFIXES = (
    ("language_model.model.", "model."),
    ("model.language_model.", "model."),
    ("language_model.lm_head.", "lm_head."),
    ("language_model.", ""),
)
#: the other towers of such a checkpoint: not loaded (astrai serves its text model)
_OTHER_TOWERS = (
    "vision_tower.",
    "multi_modal_projector.",
    "model.vision_tower.",
    "model.multi_modal_projector.",
)


#: a sequence classifier's head (``*ForSequenceClassification``: a reranker's score): read by
#: ``astrai.embedding.decoder``, not part of the language model
CLASSIFIER_HEAD = "score."
#: the top-level names of a checkpoint saved from a bare decoder (``Qwen3Model``, as embedders
#: such as Qwen3-Embedding are): the language model's ``model.*`` without the prefix
_BARE = ("embed_tokens.", "layers.", "norm.")


def _text_names(shards: dict[str, list[str]]) -> Callable[[str], str | None]:
    """A checkpoint's tensor name -> its name in the text model (HF's ``model.*`` / ``lm_head.*``),
    or None for a tensor of another tower or the classifier head. A checkpoint none of whose
    names starts with ``model.`` and some with ``layers.`` is a bare decoder's."""
    names = [n for file in shards.values() for n in file]
    bare = not any(n.startswith("model.") for n in names) and any(n.startswith("layers.") for n in names)

    def text_name(name: str) -> str | None:
        if name.startswith((*_OTHER_TOWERS, CLASSIFIER_HEAD)):
            return None
        if bare and name.startswith(_BARE):
            return "model." + name
        for prefix, text in _TEXT_PREFIXES:
            if name.startswith(prefix):
                return text + name[len(prefix) :]
        return name

    return text_name


def _shards(folder: Path) -> dict[str, list[str]]:
    """File name -> tensor names in it, for a single-file or sharded checkpoint."""
    index = folder / "model.safetensors.index.json"
    if index.is_file():
        by_file: dict[str, list[str]] = {}
        for name, file in read_json(index)["weight_map"].items():
            by_file.setdefault(file, []).append(name)
        return by_file
    if (folder / "model.safetensors").is_file():
        with _open_shard(folder / "model.safetensors") as f:
            return {"model.safetensors": list(f.keys())}
    raise ModelNotFound(f"{folder}: no model.safetensors or model.safetensors.index.json")


# Bytes per element of the safetensors dtypes a checkpoint may hold.
_DTYPE_BYTES = {"F64": 8, "F32": 4, "F16": 2, "BF16": 2, "F8_E4M3": 1, "F8_E5M2": 1, "I32": 4, "U8": 1}


def _open_shard(file: Path) -> Any:
    """``safe_open`` of one weights file; a file cut short or not safetensors is ModelFormatError."""
    from safetensors import SafetensorError, safe_open

    if not file.is_file():
        raise ModelNotFound(f"{file}: no such weights file")
    try:
        return safe_open(file, framework="pt")
    except SafetensorError as e:  # "incomplete metadata, file not fully covered": truncated
        raise ModelFormatError(f"{file}: truncated or not a safetensors file ({e})") from None


def hf_header(folder: Path) -> tuple[ModelConfig, dict[str, TensorInfo]]:
    """``config.json`` and the safetensors headers of a checkpoint folder, checked against each other
    (``check_model``); reads no weight. ``tie_word_embeddings`` becomes True when the checkpoint has
    no ``lm_head.weight``. Raises ModelNotFound (no config.json or weights, unknown architecture)
    or ModelFormatError (a truncated file, metadata that contradicts the tensors)."""
    if not (folder / "config.json").is_file():
        raise ModelNotFound(f"{folder}: no config.json")
    config = hf_config(folder, read_json(folder / "config.json"))
    rename = get_architecture(config.architecture).checkpoint_name
    tensors: dict[str, TensorInfo] = {}
    parts = fused_parts(config)
    shards = _shards(folder)
    text_name = _text_names(shards)
    for file, names in shards.items():
        with _open_shard(folder / file) as f:
            present = set(f.keys())
            for stored in names:
                name = text_name(stored)
                if name is None or name.endswith("rotary_emb.inv_freq"):  # (a buffer older ones saved)
                    continue
                name = rename(name)
                if stored not in present:
                    raise ModelFormatError(
                        f"{folder / file}: no tensor {stored!r} (the index lists it there)"
                    )
                part = f.get_slice(stored)
                shape, kind = tuple(part.get_shape()), part.get_dtype()
                pieces = unfuse(name, shape[0], parts) if shape else None
                for piece, rows in pieces or [(name, slice(0, shape[0] if shape else 0))]:
                    cut = shape if pieces is None else (rows.stop - rows.start, *shape[1:])
                    tensors[piece] = TensorInfo(stored, cut, math.prod(cut) * _DTYPE_BYTES.get(kind, 4), kind)
    if "lm_head.weight" not in tensors:
        config.tie_word_embeddings = True
    elif config.tie_word_embeddings:
        del tensors["lm_head.weight"]  # some exporters save the tied copy too
    check_model(config, tensors, folder / "config.json", {})
    return config, tensors


def hf_weights(folder: Path, config: ModelConfig, dtype: torch.dtype) -> dict[str, torch.Tensor]:
    """The state dict of a checkpoint folder whose header ``hf_header`` read (see ``load_hf``)."""
    from safetensors import safe_open

    shards = _shards(folder)
    text_name = _text_names(shards)
    parts = fused_parts(config)
    rename = get_architecture(config.architecture).checkpoint_name
    state: dict[str, torch.Tensor] = {}
    bar = tqdm(
        total=sum(map(len, shards.values())), desc=f"Loading {folder.name}", unit="tensor", disable=None
    )
    with bar:
        for file, names in shards.items():
            with safe_open(folder / file, framework="pt") as f:
                for stored in names:
                    bar.update()
                    name = text_name(stored)
                    if name is None or name.endswith("rotary_emb.inv_freq"):  # (a buffer older ones saved)
                        continue
                    name = rename(name)
                    if name == "lm_head.weight" and config.tie_word_embeddings:
                        continue  # some exporters save the tied copy too
                    t = f.get_tensor(stored).to(dtype)
                    pieces = unfuse(name, t.shape[0], parts) if t.dim() else None
                    for piece, rows in pieces or [(name, slice(None))]:
                        state[piece] = to_rope_layout(piece, t[rows], config)
    logger.info("loaded %d tensors from %s", len(state), folder)
    return state


def load_hf(folder: str | Path, dtype: torch.dtype) -> tuple[ModelConfig, dict[str, torch.Tensor]]:
    """Read an HF Llama/Qwen2 checkpoint folder into (config, state dict) on CPU.

    Tensors come back in ``dtype`` with HF names (see the module docstring);
    ``lm_head.weight`` is absent when embeddings are tied. Loads one tensor at a
    time, so peak memory is the state dict plus one tensor. Raises ModelNotFound
    when ``config.json`` or the weights are missing, or the architecture is unknown;
    ModelFormatError for a truncated file or metadata that contradicts the tensors.
    """
    folder = Path(folder)
    config, _tensors = hf_header(folder)
    return config, hf_weights(folder, config, dtype)


def read_safetensors_folder(folder: Path, prefix: str = "") -> dict[str, torch.Tensor]:
    """Every tensor of a checkpoint folder's safetensors file(s) whose name starts with ``prefix``,
    as stored (names and dtypes): a model outside the decoder families (an encoder), a classifier's
    head. Raises ModelNotFound or ModelFormatError."""
    state: dict[str, torch.Tensor] = {}
    for file, names in _shards(folder).items():
        wanted = [n for n in names if n.startswith(prefix)]
        if not wanted:
            continue
        with _open_shard(folder / file) as f:
            for name in wanted:
                state[name] = f.get_tensor(name)
    return state
