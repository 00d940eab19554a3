"""``open_checkpoint``: a checkpoint's header read and checked, its weights not yet read.

Loading goes in two steps so that nothing is allocated for a file that cannot work:
``open_checkpoint`` resolves the name, reads the configuration and the tensor table (GGUF
metadata, or ``config.json`` and the safetensors headers) and checks them against each other
(``astrai.model.checks``: ``ModelFormatError``); the caller then sizes what it will build (the
served context, the memory: ``astrai.model.budget``) and ``read_weights`` reads the tensors.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal

from astrai.model.checks import TensorInfo
from astrai.model.config import ModelConfig

if TYPE_CHECKING:
    import torch

    from astrai.model.quant import QuantWeight

__all__ = ["Checkpoint", "open_checkpoint", "read_weights"]


@dataclass
class Checkpoint:
    """An opened checkpoint: ``config`` checked against ``tensors`` (HF name -> header entry)."""

    kind: Literal["gguf", "hf"]
    path: Path  # the .gguf file, or the HF folder
    config: ModelConfig
    tensors: dict[str, TensorInfo]
    reader: Any = None  # gguf: the open GGUFReader, whose memory map the weights are read from

    def stays_quantized(self, name: str, info: TensorInfo) -> bool:
        """Whether tensor ``name`` stays quantized when the weights are read with ``quantized=True``."""
        from astrai.model.gguf_loader import stays_quantized

        return self.kind == "gguf" and stays_quantized(name, info.kind)


def open_checkpoint(name_or_path: str | Path | None) -> Checkpoint:
    """Resolve ``name_or_path`` (``astrai.model.resolve``) and read its header; reads no weight.

    Raises ModelNotFound (no such model, unknown architecture, tensor or type) or
    ModelFormatError (a truncated file, metadata that contradicts itself or the tensors)."""
    from astrai.model.gguf_loader import gguf_header
    from astrai.model.gguf_reader import open_gguf
    from astrai.model.hf_loader import hf_header
    from astrai.model.resolve import resolve_model

    kind, path = resolve_model(name_or_path)
    reader = None
    if kind == "gguf":
        reader = open_gguf(path)
        config, tensors = gguf_header(reader, Path(path))
    else:
        config, tensors = hf_header(Path(path))
    config.name = config.name or str(name_or_path or "") or Path(path).stem
    return Checkpoint(kind, Path(path), config, tensors, reader)


def read_weights(
    checkpoint: Checkpoint, dtype: torch.dtype, quantized: bool = False
) -> dict[str, torch.Tensor | QuantWeight]:
    """The checkpoint's weights in astrai's layout (unfused), as ``load_gguf``/``load_hf`` give them."""
    from astrai.model.gguf_loader import gguf_weights
    from astrai.model.hf_loader import hf_weights

    if checkpoint.kind == "gguf":
        return gguf_weights(checkpoint.reader, checkpoint.config, checkpoint.path, dtype, quantized)
    return hf_weights(checkpoint.path, checkpoint.config, dtype)
