"""Load a Hugging Face folder (``config.json`` + safetensors) into astrai's state-dict layout.

The state dict keeps HF parameter names and orientations (``[out, in]``), with one
change: q/k projection rows are permuted to llama.cpp's RoPE layout (rotate
interleaved pairs ``(2i, 2i+1)``), the layout astrai's model and GGUF files use.
``hf_header`` reads ``config.json`` and the safetensors headers alone and checks them
against each other (``astrai.model.checks``) before any weight is read.
"""

from __future__ import annotations

import json
import logging
import math
from pathlib import Path
from typing import TYPE_CHECKING, Any

from tqdm.auto import tqdm

from astrai.errors import ModelFormatError, ModelNotFound
from astrai.model.architecture import get_architecture
from astrai.model.checks import TensorInfo, check_model, derived_head_dim
from astrai.model.config import ModelConfig
from astrai.model.layout import fused_parts, to_rope_layout, unfuse

if TYPE_CHECKING:
    import torch

logger = logging.getLogger(__name__)


def _read_json(path: Path) -> dict[str, Any]:
    with path.open(encoding="utf-8") as f:
        return json.load(f)


def _as_list(value: Any) -> list[int]:
    if value is None:
        return []
    return [int(v) for v in value] if isinstance(value, (list, tuple)) else [int(value)]


def _rope(cfg: dict[str, Any], params: dict[str, Any] | None = None) -> tuple[float, dict[str, Any] | None]:
    """(rope_theta, rope_scaling) from either transformers 4 or 5 spellings of config.json (or from
    ``params``, one layer type's ``rope_parameters``)."""
    # transformers >= 5 writes "rope_parameters" (theta inside); older files have
    # top-level "rope_theta" and an optional "rope_scaling" dict.
    params = dict(
        params if params is not None else cfg.get("rope_parameters") or cfg.get("rope_scaling") or {}
    )
    theta = float(params.pop("rope_theta", cfg.get("rope_theta", 10000.0)))
    params.pop("partial_rotary_factor", None)
    if "type" in params and "rope_type" not in params:
        params["rope_type"] = params.pop("type")
    if params.get("rope_type", "default") == "default":
        return theta, None
    if params["rope_type"] == "longrope":  # transformers' default factor: the context's growth
        original = params.setdefault(
            "original_max_position_embeddings", cfg.get("original_max_position_embeddings")
        )
        if params.get("factor") is None and original:
            params["factor"] = cfg.get("max_position_embeddings", original) / original
    return theta, params


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


def _text_name(name: str) -> str | None:
    """A tensor's name in the text model it belongs to; None for another tower's tensor."""
    if name.startswith(_OTHER_TOWERS):
        return None
    for prefix, text in _TEXT_PREFIXES:
        if name.startswith(prefix):
            return text + name[len(prefix) :]
    return name


def text_model_config(cfg: dict[str, Any]) -> dict[str, Any]:
    """The language model's part of an image-text checkpoint's ``config.json`` (its ``text_config``,
    with the ids and tying the outer config states); ``cfg`` itself for a text model."""
    inner = cfg.get("text_config")
    if not isinstance(inner, dict) or "hidden_size" in cfg:
        return cfg
    text = dict(inner)
    for key in ("bos_token_id", "eos_token_id", "pad_token_id", "tie_word_embeddings"):
        if key not in text and key in cfg:
            text[key] = cfg[key]
    if "model_type" not in text:
        raise ModelNotFound(
            f"an image-text config of model_type {cfg.get('model_type')!r} without a text model_type"
        )
    logger.info(
        "%s is an image-text checkpoint: serving its %s text model (its other towers are not loaded)",
        cfg.get("model_type"),
        text["model_type"],
    )
    return text


def _normalized(cfg: dict[str, Any]) -> dict[str, Any]:
    """``config.json`` as transformers' config class for its ``model_type`` reads it (defaults filled,
    ``layer_types`` and per-layer-type ``rope_parameters`` derived from older spellings), for the
    fields beyond the sizes; the raw dict for a model type transformers does not know."""
    from transformers import CONFIG_MAPPING

    if cfg.get("model_type") not in CONFIG_MAPPING:
        return cfg
    try:
        return {**cfg, **CONFIG_MAPPING[cfg["model_type"]](**cfg).to_dict()}
    except Exception:  # noqa: BLE001 - transformers validates sizes its own way; ours come next
        return cfg


def _family_fields(cfg: dict[str, Any], head_dim: int) -> dict[str, Any]:
    """The ``ModelConfig`` fields of sliding windows, per-layer RoPE, partial rotary and soft-caps."""
    full = _normalized(cfg)
    params = full.get("rope_parameters") or {}
    per_type = isinstance(params.get("full_attention"), dict)
    fields: dict[str, Any] = {}
    if per_type:  # Gemma 3: {"full_attention": {...}, "sliding_attention": {...}}
        fields["rope_theta"], fields["rope_scaling"] = _rope(full, params["full_attention"])
        local = _rope(full, params.get("sliding_attention", params["full_attention"]))
        if local != (fields["rope_theta"], fields["rope_scaling"]):
            fields["local_rope_theta"], fields["local_rope_scaling"] = local
    partial = (params.get("full_attention", params) or {}).get("partial_rotary_factor")
    partial = partial or full.get("partial_rotary_factor") or 1.0
    if partial < 1.0:
        fields["rotary_dim"] = int(head_dim * partial)
    layer_types = full.get("layer_types")
    window = full.get("sliding_window")
    if window and (layer_types is None or "sliding_attention" in layer_types):
        fields["sliding_window"] = int(window)
        fields["layer_types"] = list(layer_types) if layer_types else None
    for name in ("query_pre_attn_scalar", "attn_logit_softcapping", "final_logit_softcapping"):
        if full.get(name) is not None:
            fields[name] = float(full[name])
    act = full.get("hidden_activation") or full.get("hidden_act")
    if act:
        fields["hidden_act"] = act
    return fields


def hf_config(folder: Path, cfg: dict[str, Any]) -> ModelConfig:
    """ModelConfig from a parsed ``config.json`` (and ``generation_config.json`` if present).

    ``tie_word_embeddings`` is as declared; ``load_hf`` also ties when the
    checkpoint has no ``lm_head.weight``. Raises ModelNotFound for a ``model_type``
    no ``astrai.models`` entry point provides, or a missing required key; ModelFormatError for
    a size that is not a number (the sizes' own checks are ``check_model``'s).
    """
    cfg = text_model_config(cfg)
    arch = cfg.get("model_type")
    architecture = get_architecture(arch, f"{folder}: model_type")
    try:
        hidden, n_heads = int(cfg["hidden_size"]), int(cfg["num_attention_heads"])
        head_dim = int(cfg.get("head_dim") or derived_head_dim(hidden, n_heads, folder / "config.json", {}))
        theta, scaling = _rope(cfg)
        eos = _as_list(cfg.get("eos_token_id"))
        gen_path = folder / "generation_config.json"
        if gen_path.is_file():
            eos += [i for i in _as_list(_read_json(gen_path).get("eos_token_id")) if i not in eos]
        config = ModelConfig(
            architecture=arch,
            vocab_size=int(cfg["vocab_size"]),
            hidden_size=hidden,
            intermediate_size=int(cfg["intermediate_size"]),
            num_hidden_layers=int(cfg["num_hidden_layers"]),
            num_attention_heads=n_heads,
            num_key_value_heads=int(cfg.get("num_key_value_heads") or n_heads),
            head_dim=head_dim,
            max_position_embeddings=int(cfg.get("max_position_embeddings", 2048)),
            rms_norm_eps=float(cfg.get("rms_norm_eps", 1e-6)),
            rope_theta=theta,
            rope_scaling=scaling,
            tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
            attention_bias=bool(cfg.get("attention_bias", architecture.attention_bias)),
            bos_token_id=cfg.get("bos_token_id"),
            eos_token_ids=eos,
            name=folder.name,
        )
        for field, value in _family_fields(cfg, head_dim).items():
            setattr(config, field, value)
        return config
    except KeyError as e:
        raise ModelNotFound(f"{folder / 'config.json'}: missing required key {e}") from None
    except (TypeError, ValueError) as e:  # a size that is not a number
        raise ModelFormatError(f"{folder / 'config.json'}: {e}") from None


def _shards(folder: Path) -> dict[str, list[str]]:
    """File name -> tensor names in it, for a single-file or sharded checkpoint."""
    index = folder / "model.safetensors.index.json"
    if index.is_file():
        by_file: dict[str, list[str]] = {}
        for name, file in _read_json(index)["weight_map"].items():
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
    config = hf_config(folder, _read_json(folder / "config.json"))
    tensors: dict[str, TensorInfo] = {}
    parts = fused_parts(config)
    for file, names in _shards(folder).items():
        with _open_shard(folder / file) as f:
            present = set(f.keys())
            for stored in names:
                name = _text_name(stored)
                if name is None or name.endswith("rotary_emb.inv_freq"):  # (a buffer older ones saved)
                    continue
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
    parts = fused_parts(config)
    state: dict[str, torch.Tensor] = {}
    bar = tqdm(
        total=sum(map(len, shards.values())), desc=f"Loading {folder.name}", unit="tensor", disable=None
    )
    with bar:
        for file, names in shards.items():
            with safe_open(folder / file, framework="pt") as f:
                for stored in names:
                    bar.update()
                    name = _text_name(stored)
                    if name is None or name.endswith("rotary_emb.inv_freq"):  # (a buffer older ones saved)
                        continue
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
