"""GGUF decoder embedders (Qwen3-Embedding's GGUF files, as llama.cpp and Ollama serve them): the file's
``{arch}.pooling_type`` (llama.cpp's metadata: 0 none, 1 mean, 2 CLS, 3 last, 4 rank) says how it
pools. Last-token pooling, or none said, gives the last token's final-normed state, L2-normalised as
llama-server's embeddings are; mean and CLS pooling are encoder recipes and rank pooling a reranker's
head, and those files are refused. The weights stay in their quantized blocks where the kernels run
(``load_model``'s "auto"). A GGUF file is served as an embedding model where it is named one
(``--embedding-model``, or ``--model`` with ``--task embed``).
"""

from __future__ import annotations

from pathlib import Path

import torch

from astrai.embedding.decoder import DecoderPooler, start_pooler
from astrai.embedding.pooling import Pooling
from astrai.errors import ModelFormatError

__all__ = ["POOLING_TYPES", "load_gguf_pooler"]

#: llama.cpp's ``llama_pooling_type`` values
POOLING_TYPES = {0: "none", 1: "mean", 2: "cls", 3: "last", 4: "rank"}


def load_gguf_pooler(
    path: Path, task: str | None, dtype: torch.dtype, name: str, config: object = None
) -> DecoderPooler:
    """A ``DecoderPooler`` on a decoder GGUF file (see the module). Raises ModelFormatError for a
    file pooled another way, or asked to score."""
    from astrai.model import load_model
    from astrai.model.gguf_reader import open_gguf

    reader = open_gguf(path)
    arch_field = reader.fields.get("general.architecture")
    arch = arch_field.contents() if arch_field is not None else "?"
    field = reader.fields.get(f"{arch}.pooling_type")
    pooling = POOLING_TYPES.get(int(field.contents()), "?") if field is not None else "none"
    if task == "score" or pooling == "rank":
        raise ModelFormatError(
            f"{path}: a GGUF reranker is not served; serve its Hugging Face checkpoint (a one-label "
            "*ForSequenceClassification, or classifier_from_token in its config.json)"
        )
    if pooling not in ("none", "last"):
        raise ModelFormatError(
            f"{path}: {pooling} pooling of a decoder; decoders are pooled at their last token"
        )
    del reader
    model, tokenizer = load_model(str(path), dtype=dtype, weights="auto")
    return start_pooler(model, tokenizer, None, "embed", Pooling("last", True), name, config)
