"""Loading a pooling model: ``load_embedder`` (a BERT embedder or cross-encoder checkpoint folder with
its tokenizer and pooling, as an ``EmbeddingEngine``) and ``is_pooling_model`` (whether a name or
path is one, rather than a generation model)."""

from __future__ import annotations

import json
from pathlib import Path

import torch

from astrai.embedding.engine import ACTIVATIONS, EmbeddingEngine
from astrai.embedding.pooling import Pooling
from astrai.errors import ModelFormatError, ModelNotFound
from astrai.model.bert import BertConfig, BertModel

__all__ = ["POOLING_TYPES", "is_pooling_model", "load_embedder"]


#: the ``model_type``s of the pooling models served (their checkpoints are folders)
POOLING_TYPES = ("bert",)


def is_pooling_model(name_or_path: str | None) -> bool:
    """Whether ``name_or_path`` (a known name, a path; a Hub id once downloaded) is a pooling model
    (``load_embedder``'s) rather than a generation one; False for anything that does not resolve."""
    from astrai.model.resolve import resolve_model

    try:
        kind, folder = resolve_model(name_or_path)
    except Exception:  # the generation loader reports what is wrong with it
        return False
    if kind != "hf":
        return False
    try:
        return json.loads((folder / "config.json").read_text()).get("model_type") in POOLING_TYPES
    except (OSError, ValueError):
        return False


def load_embedder(name_or_path: str, dtype: torch.dtype = torch.float32, **engine: object) -> EmbeddingEngine:
    """An ``EmbeddingEngine`` on a BERT checkpoint folder (``config.json``, safetensors weights, a
    tokenizer, sentence-transformers' pooling files where it has them): a path, a known name
    (``minilm-l6``) or a Hub id. ``engine``: ``EmbeddingEngine``'s batch budgets. Raises
    ModelNotFound for nothing there or another kind of model, ModelFormatError for a malformed one."""
    from astrai.model.hf_loader import read_safetensors_folder
    from astrai.model.resolve import resolve_model
    from astrai.model.tokenizer import Tokenizer

    kind, folder = resolve_model(name_or_path)
    if kind != "hf":
        raise ModelNotFound(f"{name_or_path}: an embedding model is a checkpoint folder, not a GGUF file")
    cfg = json.loads((folder / "config.json").read_text())
    if cfg.get("model_type") != "bert":
        raise ModelNotFound(
            f"{name_or_path}: model_type {cfg.get('model_type')!r} is not an embedding model astrai serves (bert)"
        )
    config = BertConfig.from_dict(cfg, str(folder))
    if config.num_labels > 1:
        raise ModelFormatError(
            f"{folder}: a classifier of {config.num_labels} labels; a cross-encoder gives one score per pair"
        )
    activation = _activation(cfg, str(folder))
    pooling = Pooling.from_folder(folder) if not config.num_labels else Pooling()
    model = BertModel(config)
    model.load_weights(read_safetensors_folder(folder), str(folder))
    model = model.to(dtype).eval()
    model.fuse()
    tokenizer = Tokenizer.from_pretrained(folder)
    if tokenizer.hf.cls_token_id is None and pooling.mode == "cls":
        raise ModelFormatError(f"{folder}: CLS pooling, but the tokenizer has no CLS token")
    name = Path(str(name_or_path)).name if Path(str(name_or_path)).exists() else str(name_or_path)
    return EmbeddingEngine(model, tokenizer, pooling, name=name, activation=activation, **engine)  # type: ignore[arg-type]


def _activation(cfg: dict, where: str) -> str:
    """The cross-encoder's activation, as sentence-transformers saved it in ``config.json``
    (``sentence_transformers.activation_fn``, or the older ``sbert_ce_default_activation_function``):
    a dotted class path whose last part names it; Sigmoid where none is saved."""
    saved = (cfg.get("sentence_transformers") or {}).get("activation_fn") or cfg.get(
        "sbert_ce_default_activation_function"
    )
    name = str(saved).rpartition(".")[2] if saved else "Sigmoid"
    if name not in ACTIVATIONS:
        raise ModelFormatError(f"{where}: activation {saved!r} is not supported ({', '.join(ACTIVATIONS)})")
    return name
