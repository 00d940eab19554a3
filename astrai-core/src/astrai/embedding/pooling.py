"""How token states become one vector per input: the checkpoint's sentence-transformers files say.

``modules.json`` lists the pipeline: a ``Pooling`` module (its folder's ``config.json``:
``pooling_mode_mean_tokens``, ``_cls_token``, ``_max_tokens``, ``_lasttoken``), and a ``Normalize``
module where the vectors are L2-normalised; ``sentence_bert_config.json`` gives ``max_seq_length``,
the longest input the model was trained on (sentence-transformers cuts inputs there). A checkpoint
without these files is pooled as vLLM pools a bare encoder: its first token (CLS), normalised.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

import torch
import torch.nn.functional as F

from astrai.errors import ModelFormatError

__all__ = ["MODES", "Pooling", "pool"]

MODES = ("mean", "cls", "last", "max")
#: sentence-transformers' Pooling config key -> the mode it turns on
_KEYS = {
    "pooling_mode_mean_tokens": "mean",
    "pooling_mode_cls_token": "cls",
    "pooling_mode_lasttoken": "last",
    "pooling_mode_max_tokens": "max",
}


@dataclass(frozen=True)
class Pooling:
    """``mode`` over each input's tokens, then L2 ``normalize``; inputs of at most
    ``max_seq_length`` tokens (None: the model's positions)."""

    mode: Literal["mean", "cls", "last", "max"] = "cls"
    normalize: bool = True
    max_seq_length: int | None = None

    @classmethod
    def from_folder(cls, folder: Path) -> Pooling:
        """The pooling a sentence-transformers checkpoint declares (the default without one).
        Raises ModelFormatError for a pipeline this does not compute (two modes at once, a
        ``Dense`` projection)."""
        modules_file = folder / "modules.json"
        if not modules_file.is_file():
            return cls()
        modules = json.loads(modules_file.read_text())
        kinds = {m.get("type", "").rpartition(".")[2]: m for m in modules}
        unknown = sorted(set(kinds) - {"Transformer", "Pooling", "Normalize"})
        if unknown:
            raise ModelFormatError(f"{modules_file}: modules {', '.join(unknown)} are not supported")
        mode: str = "cls"
        if "Pooling" in kinds:
            config = json.loads((folder / kinds["Pooling"].get("path", "") / "config.json").read_text())
            on = [m for key, m in _KEYS.items() if config.get(key)]
            off_keys = [k for k, v in config.items() if k.startswith("pooling_mode") and v and k not in _KEYS]
            if len(on) != 1 or off_keys:
                raise ModelFormatError(
                    f"{folder / kinds['Pooling'].get('path', '')}: pooling {on + off_keys or 'none'} is not "
                    f"supported (exactly one of {', '.join(_KEYS)})"
                )
            mode = on[0]
        bert_config = folder / "sentence_bert_config.json"
        longest = json.loads(bert_config.read_text()).get("max_seq_length") if bert_config.is_file() else None
        return cls(mode, "Normalize" in kinds, int(longest) if longest else None)  # type: ignore[arg-type]


def pool(hidden: torch.Tensor, lengths: torch.Tensor, pooling: Pooling) -> torch.Tensor:
    """``hidden`` [T, H] (inputs one after another, ``lengths`` [B] tokens each) -> [B, H] float32."""
    hidden = hidden.float()
    B = lengths.shape[0]
    ends = torch.cumsum(lengths, 0)
    starts = ends - lengths
    if pooling.mode == "cls":
        out = hidden.index_select(0, starts)
    elif pooling.mode == "last":
        out = hidden.index_select(0, ends - 1)
    elif pooling.mode == "mean":
        owner = torch.repeat_interleave(torch.arange(B), lengths)  # each token's input
        out = hidden.new_zeros(B, hidden.shape[1]).index_add_(0, owner, hidden) / lengths.unsqueeze(1)
    else:  # max: over the inputs padded with -inf
        L = int(lengths.max())
        column = torch.arange(L)
        is_token = column.unsqueeze(0) < lengths.unsqueeze(1)
        rows = torch.where(is_token, starts.unsqueeze(1) + column, hidden.shape[0])
        padded = torch.cat([hidden, hidden.new_full((1, hidden.shape[1]), float("-inf"))])[rows]
        out = padded.amax(dim=1)
    return F.normalize(out, p=2, dim=1) if pooling.normalize else out
