"""A checkpoint's metadata checked against its tensors before anything of the model is allocated.

A loader reads the file's header (GGUF metadata and tensor table, ``config.json`` and the
safetensors headers) into a ``ModelConfig`` and a ``TensorInfo`` per tensor, then calls
``check_model``: every size positive, the head counts consistent, the layer count equal to the
blocks whose tensors the file holds, and each tensor's shape the one the metadata implies (the
model class's ``parameter_shapes(config)`` says which those are, where the class has one). A
file whose metadata asks for a million layers or zero heads is refused here with
``ModelFormatError`` naming the file and the field, instead of driving the host out of memory
or dividing by zero later. The sizes no tensor bounds (the context length)
are the memory check's (``astrai.model.budget``).
"""

from __future__ import annotations

import math
import re
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path

from astrai.errors import ModelFormatError
from astrai.model.config import ModelConfig

__all__ = ["SIZE_FIELDS", "TensorInfo", "check_model", "derived_head_dim"]

#: The ``ModelConfig`` sizes that must be positive.
SIZE_FIELDS = (
    "vocab_size",
    "hidden_size",
    "intermediate_size",
    "num_hidden_layers",
    "num_attention_heads",
    "num_key_value_heads",
    "head_dim",
    "max_position_embeddings",
)
_LAYER = re.compile(r"model\.layers\.(\d+)\.")


@dataclass(frozen=True)
class TensorInfo:
    """One tensor of a checkpoint as its header describes it (nothing read from the data)."""

    source: str  # its name in the file ("blk.0.attn_q.weight"), for messages
    shape: tuple[int, ...]  # in HF order: [out, in] for a matrix
    nbytes: int  # bytes of its data in the file
    kind: str  # the file's type of it: "F32", "BF16", "Q4_1", ...

    @property
    def numel(self) -> int:
        return math.prod(self.shape)


def derived_head_dim(hidden: int, heads: int, path: Path, fields: Mapping[str, str]) -> int:
    """``hidden // heads`` for a file that does not give the head dim; 0 (refused by ``check_model``
    as a count that must be positive) when ``heads`` is not positive. Raises ModelFormatError when
    ``heads`` does not divide ``hidden``."""
    if heads <= 0 or hidden <= 0:
        return 0
    if hidden % heads:
        raise ModelFormatError(
            f"{path}: {fields.get('num_attention_heads', 'num_attention_heads')} {heads} does not divide "
            f"{fields.get('hidden_size', 'hidden_size')} {hidden}, and no head dim is given"
        )
    return hidden // heads


def _blocks(indices: set[int]) -> str:
    if not indices:
        return "no block"
    if indices == set(range(len(indices))):
        return f"{len(indices)} blocks (0-{len(indices) - 1})"
    shown = ", ".join(map(str, sorted(indices)[:8]))
    return f"{len(indices)} blocks ({shown}{', ...' if len(indices) > 8 else ''})"


def _expected_shapes(config: ModelConfig, path: Path) -> dict[str, tuple[int, ...]] | None:
    """Parameter name -> shape of the model ``config`` builds, from its class's ``parameter_shapes``
    (None for a class without one: its ``load_weights`` checks, once the model is built)."""
    from astrai.model.architecture import get_architecture

    shapes_of = getattr(
        get_architecture(config.architecture, str(path)).model_class, "parameter_shapes", None
    )
    return None if shapes_of is None else dict(shapes_of(config))


def _check_family_fields(config: ModelConfig, fail: Callable[[str, str], None]) -> None:
    """The fields of windows, partial rotary and soft-caps, where a family has them."""
    rotary = config.rotary_dim
    if rotary is not None and not (0 < rotary <= config.head_dim and rotary % 2 == 0):
        fail(
            "rotary_dim",
            f"is {rotary}: rotated dims must be even, positive and at most head_dim {config.head_dim}",
        )
    window = config.sliding_window
    if window is not None and window < 0:
        fail("sliding_window", f"is {window}: a window must be positive (or absent)")
    types = config.layer_types
    if types is not None:
        if len(types) != config.num_hidden_layers:
            fail("layer_types", f"names {len(types)} layers, but the model has {config.num_hidden_layers}")
        unknown = sorted(set(types) - {"sliding_attention", "full_attention"})
        if unknown:
            fail("layer_types", f"has {unknown}: astrai serves sliding_attention and full_attention layers")
    for field in ("query_pre_attn_scalar", "attn_logit_softcapping", "final_logit_softcapping"):
        value = getattr(config, field)
        if value is not None and not (math.isfinite(value) and value > 0):
            fail(field, f"is {value}: it must be a positive number")


def check_model(
    config: ModelConfig, tensors: Mapping[str, TensorInfo], path: Path, fields: Mapping[str, str]
) -> None:
    """Refuse a checkpoint whose metadata contradicts itself or its tensors (by HF name, in HF order).

    ``fields`` maps a ``ModelConfig`` field to the file's name for it (``block_count`` in GGUF),
    so that the message names what to fix. Raises ModelFormatError; allocates nothing.
    """

    def fail(field: str, problem: str) -> None:
        raise ModelFormatError(f"{path}: {fields.get(field, field)} {problem}")

    for field in SIZE_FIELDS:
        value = getattr(config, field)
        if value < 1:
            fail(field, f"is {value}: it must be positive")
    heads, kv_heads, head_dim = config.num_attention_heads, config.num_key_value_heads, config.head_dim
    if heads % kv_heads:
        fail(
            "num_key_value_heads",
            f"{kv_heads} does not divide {fields.get('num_attention_heads', 'num_attention_heads')} {heads}",
        )
    if head_dim % 2:
        fail("head_dim", f"is {head_dim}: rotary embeddings need an even head dim")
    _check_family_fields(config, fail)
    blocks = {int(m.group(1)) for name in tensors if (m := _LAYER.match(name))}
    if blocks != set(range(config.num_hidden_layers)):
        fail(
            "num_hidden_layers",
            f"is {config.num_hidden_layers}, but the file holds the tensors of {_blocks(blocks)}",
        )
    # The tensors that pin one field each, for a message that names it.
    pinned = [
        ("model.embed_tokens.weight", 0, "vocab_size", config.vocab_size),
        ("model.embed_tokens.weight", 1, "hidden_size", config.hidden_size),
        ("model.layers.0.self_attn.q_proj.weight", 0, "num_attention_heads", heads * head_dim),
        ("model.layers.0.self_attn.k_proj.weight", 0, "num_key_value_heads", kv_heads * head_dim),
        ("model.layers.0.mlp.gate_proj.weight", 0, "intermediate_size", config.intermediate_size),
    ]
    for name, dim, field, want in pinned:
        info = tensors.get(name)
        if info is None or len(info.shape) != 2 or info.shape[dim] == want:
            continue  # a missing or odd tensor: the comparison below names it
        if field in ("num_attention_heads", "num_key_value_heads"):
            count = heads if field == "num_attention_heads" else kv_heads
            fail(
                field,
                f"{count} x head dim {head_dim} makes {want} rows, but {info.source} has {info.shape[dim]}",
            )
        fail(field, f"is {want}, but {info.source} has shape {list(info.shape)}")
    expected = _expected_shapes(config, path)
    if expected is None:
        return
    missing = sorted(set(expected) - set(tensors))
    if missing:
        raise ModelFormatError(
            f"{path}: tensors missing: {', '.join(missing[:4])}{', ...' if len(missing) > 4 else ''}"
        )
    for name, info in tensors.items():
        want = expected.get(name)
        if want is None:
            raise ModelFormatError(f"{path}: unexpected tensor {info.source!r} for this architecture")
        if info.shape != want:
            raise ModelFormatError(
                f"{path}: tensor {info.source!r} has shape {list(info.shape)}, "
                f"the metadata makes it {list(want)}"
            )
