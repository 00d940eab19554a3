"""A checkpoint's tensors put in the layout astrai's model holds: fused projections cut apart, and
the rows RoPE turns in llama.cpp's interleaved-pair order.

HF checkpoints (and llama.cpp's GGUF files of NEOX-RoPE architectures) rotate the two halves of a
head together; astrai's ``apply_rotary_emb`` rotates interleaved pairs, the layout of llama.cpp's
``llama`` files. The loaders permute the q/k projection rows (and the per-head q/k norms) once at
load, which leaves every attention score unchanged.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING

from astrai.errors import ModelFormatError
from astrai.model.architecture import get_architecture

if TYPE_CHECKING:
    import torch

    from astrai.model.config import ModelConfig

__all__ = ["fused_parts", "interleave_rope_rows", "rope_heads", "rope_order", "to_rope_layout", "unfuse"]


def rope_order(n_head: int, head_dim: int, rotary_dim: int | None = None) -> torch.Tensor:
    """The row order ``[n_head * head_dim]`` int64 that takes HF's rotate_half layout to interleaved
    pairs: within each head, HF rotates the halves ``(j, j + rotary_dim/2)`` of its first
    ``rotary_dim`` rows together (all of them by default); the order puts that pair at rows
    ``(2j, 2j + 1)`` and keeps the rows past ``rotary_dim`` (partial rotary) where they are."""
    import torch

    rot = rotary_dim or head_dim
    within = torch.cat([torch.arange(rot).view(2, rot // 2).t().reshape(-1), torch.arange(rot, head_dim)])
    return (torch.arange(n_head)[:, None] * head_dim + within[None, :]).reshape(-1)


def interleave_rope_rows(w: torch.Tensor, n_head: int, rotary_dim: int | None = None) -> torch.Tensor:
    """Permute q/k projection rows (or a q/k norm's weight, ``n_head`` 1) from HF's rotate_half layout
    to interleaved pairs (``rope_order``).

    ``w`` is a weight ``[n_head * head_dim, in]`` or a vector ``[n_head * head_dim]``. This is
    exactly llama.cpp's ``permute`` in ``convert_hf_to_gguf.py``; transformers' GGUF loader undoes
    it. Returns a new contiguous tensor, same shape, dtype and device.
    """
    order = rope_order(n_head, w.shape[0] // n_head, rotary_dim).to(w.device)
    return w.index_select(0, order).contiguous()


def to_rope_layout(name: str, t: torch.Tensor, config: ModelConfig) -> torch.Tensor:
    """Tensor ``name`` (HF, unfused) with its rows in astrai's RoPE order where it has heads."""
    heads = rope_heads(name, config)
    return t if heads is None else interleave_rope_rows(t, heads, config.rotary_dim)


def rope_heads(name: str, config: ModelConfig) -> int | None:
    """The heads whose rows parameter ``name`` (HF, unfused) holds in RoPE order: q/k projections
    and the per-head q/k norms, which RoPE follows; None for any other."""
    parts = name.rsplit(".", 3)
    if len(parts) < 3 or parts[-3] != "self_attn":
        return None
    heads = {
        "q_proj": config.num_attention_heads,
        "k_proj": config.num_key_value_heads,
        "q_norm": 1,
        "k_norm": 1,
    }
    return heads.get(parts[-2])


def fused_parts(config: ModelConfig) -> Mapping[str, Sequence[tuple[str, int]]]:
    """The architecture's fused projections for ``config`` (``Architecture.fused_parts``; empty for
    most): one lookup, for ``unfuse`` to take for every tensor."""
    arch = get_architecture(config.architecture)
    return {} if arch.fused_parts is None else arch.fused_parts(config)


def unfuse(
    name: str, rows: int, parts: Mapping[str, Sequence[tuple[str, int]]]
) -> list[tuple[str, slice]] | None:
    """``[(model name, its rows)]`` of a checkpoint tensor that fuses several of the model's
    projections (``parts``: ``fused_parts(config)``), or None. Raises ModelFormatError when the
    parts' rows do not add up to the tensor's."""
    if not parts or not name.startswith("model.layers."):
        return None
    layer, _, rest = name.removeprefix("model.layers.").partition(".")
    path, _, kind = rest.rpartition(".")  # "self_attn.qkv_proj", "weight"
    pieces = parts.get(path)
    if pieces is None:
        return None
    if sum(n for _, n in pieces) != rows:
        raise ModelFormatError(
            f"{name} has {rows} rows, but its parts ({', '.join(p for p, _ in pieces)}) make "
            f"{sum(n for _, n in pieces)} by the config"
        )
    out, start = [], 0
    for part, n in pieces:
        out.append((f"model.layers.{layer}.{part}.{kind}", slice(start, start + n)))
        start += n
    return out
