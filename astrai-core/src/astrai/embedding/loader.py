"""Loading a pooling model: ``load_embedder`` (a BERT embedder or cross-encoder checkpoint folder with
its tokenizer and pooling, as an ``EmbeddingEngine``; a decoder embedder or classifier as a
``DecoderPooler``) and ``is_pooling_model`` (whether a name or
path is one, rather than a generation model)."""

from __future__ import annotations

import json
from pathlib import Path

import torch

from astrai.embedding.decoder import DecoderPooler, decoder_task, load_decoder_pooler
from astrai.embedding.engine import EmbeddingEngine, saved_activation
from astrai.embedding.pooling import Pooling
from astrai.errors import ModelFormatError, ModelNotFound
from astrai.model.bert import BertConfig, BertModel
from astrai.model.cpu_linear import prepack_linears, prepack_supported

__all__ = ["POOLING_TYPES", "is_pooling_model", "load_embedder", "truncations"]


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
        cfg = json.loads((folder / "config.json").read_text())
    except (OSError, ValueError):
        return False
    return cfg.get("model_type") in POOLING_TYPES or decoder_task(folder, cfg) is not None


def load_embedder(
    name_or_path: str,
    dtype: torch.dtype = torch.float32,
    task: str | None = None,
    engine_config: object = None,
    **engine: object,
) -> EmbeddingEngine | DecoderPooler:
    """A pooling model on a checkpoint folder (``config.json``, safetensors weights, a tokenizer,
    sentence-transformers' pooling files where it has them) or a decoder embedder's GGUF file
    (``astrai.embedding.gguf``): a path, a known name (``minilm-l6``) or a Hub id. A BERT encoder gives an ``EmbeddingEngine`` (``engine``: its batch budgets); a
    decoder family astrai serves gives a ``DecoderPooler`` (``astrai.embedding.decoder``; ``task``:
    "embed" or "score" where the checkpoint does not say, ``engine_config``: its ``EngineConfig``).
    Raises ModelNotFound for nothing there or another kind of model, ModelFormatError for a
    malformed one."""
    from astrai.model.architecture import get_architecture
    from astrai.model.hf_loader import read_safetensors_folder
    from astrai.model.resolve import resolve_model
    from astrai.model.tokenizer import Tokenizer

    kind, folder = resolve_model(name_or_path)
    name = Path(str(name_or_path)).name if Path(str(name_or_path)).exists() else str(name_or_path)
    if kind == "gguf":  # a decoder embedder's file (astrai.embedding.gguf)
        from astrai.embedding.gguf import load_gguf_pooler

        return load_gguf_pooler(folder, task, dtype, name, engine_config)
    cfg = json.loads((folder / "config.json").read_text())
    if cfg.get("model_type") != "bert":
        from astrai.model.hf_config import hf_config

        try:  # a decoder family astrai serves (ModelNotFound names them otherwise)
            get_architecture(hf_config(folder, cfg).architecture, str(folder / "config.json"))
        except ModelNotFound as exc:
            raise ModelNotFound(
                f"{name_or_path}: model_type {cfg.get('model_type')!r} is not a pooling model astrai serves "
                f"(bert, or a decoder family: {exc})"
            ) from None
        pooler = load_decoder_pooler(folder, cfg, task, dtype, name, engine_config)
        pooler.truncations = truncations(cfg, pooler.dimensions, str(folder / "config.json"))
        return pooler
    config = BertConfig.from_dict(cfg, str(folder))
    if task is not None and task != ("score" if config.num_labels else "embed"):
        raise ModelFormatError(
            f"{folder}: an encoder serves what its checkpoint is ({'a cross-encoder' if config.num_labels else 'an embedder'}), not --task {task}"
        )
    if config.num_labels > 1:
        raise ModelFormatError(
            f"{folder}: a classifier of {config.num_labels} labels; a cross-encoder gives one score per pair"
        )
    activation = saved_activation(cfg, str(folder))
    pooling = Pooling.from_folder(folder) if not config.num_labels else Pooling()
    model = BertModel(config)
    model.load_weights(read_safetensors_folder(folder), str(folder))
    model = model.to(dtype).eval()
    model.fuse()
    if prepack_supported("cpu", dtype):  # bf16 linears on packed weights: 6% of a pass on Zen 4
        prepack_linears(model)
    tokenizer = Tokenizer.from_pretrained(folder)
    if tokenizer.hf.cls_token_id is None and pooling.mode == "cls":
        raise ModelFormatError(f"{folder}: CLS pooling, but the tokenizer has no CLS token")
    embedder = EmbeddingEngine(model, tokenizer, pooling, name=name, activation=activation, **engine)  # type: ignore[arg-type]
    embedder.truncations = truncations(cfg, embedder.dimensions, str(folder / "config.json"))
    return embedder


def truncations(cfg: dict, dimensions: int, where: str) -> tuple[int, ...] | None:
    """The sizes a Matryoshka embedder's vectors may be cut to (``dimensions`` of a request), as its
    ``config.json`` says in vLLM's keys: ``matryoshka_dimensions`` (those sizes) or ``is_matryoshka``
    (any size up to its own: an empty tuple); None for a model whose vectors are not cut."""
    sizes = cfg.get("matryoshka_dimensions")
    if sizes is not None:
        if not isinstance(sizes, list) or not all(isinstance(d, int) and 0 < d <= dimensions for d in sizes):
            raise ModelFormatError(
                f"{where}: matryoshka_dimensions {sizes!r} must be sizes up to {dimensions}"
            )
        return tuple(sorted(sizes))
    return () if cfg.get("is_matryoshka") else None
