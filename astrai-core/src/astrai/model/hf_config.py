"""Read a Hugging Face ``config.json`` (and ``generation_config.json``) into a ``ModelConfig``.

Both spellings transformers has written (4.x ``rope_theta``/``rope_scaling``, 5.x
``rope_parameters``, per layer type for Gemma 3) are read; an image-text checkpoint's
``text_config`` is its language model's config. Fields beyond the sizes (windows, soft-caps,
partial rotary) come from transformers' own config class for the ``model_type``, defaults filled.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Any

from astrai.errors import ModelFormatError, ModelNotFound
from astrai.model.architecture import get_architecture
from astrai.model.checks import derived_head_dim
from astrai.model.config import ModelConfig

logger = logging.getLogger(__name__)


def read_json(path: Path) -> dict[str, Any]:
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
    experts = full.get("num_experts") or full.get("num_local_experts")  # (Mixtral's name)
    if experts:
        fields["num_experts"] = int(experts)
        fields["num_experts_per_tok"] = int(full.get("num_experts_per_tok") or 2)
        size = full.get("moe_intermediate_size")  # (Mixtral's experts are intermediate_size wide)
        fields["moe_intermediate_size"] = int(size) if size else None
        fields["norm_topk_prob"] = bool(full.get("norm_topk_prob", True))
        fields["decoder_sparse_step"] = int(full.get("decoder_sparse_step") or 1)
        fields["shared_expert_intermediate_size"] = int(full.get("shared_expert_intermediate_size") or 0)
        fields["mlp_only_layers"] = [int(i) for i in full.get("mlp_only_layers") or ()]
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
            eos += [i for i in _as_list(read_json(gen_path).get("eos_token_id")) if i not in eos]
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
            attention_bias=bool(cfg.get("attention_bias", cfg.get("qkv_bias", architecture.attention_bias))),
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
