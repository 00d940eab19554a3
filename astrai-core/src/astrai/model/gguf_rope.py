"""RoPE scaling from a GGUF file: its ``{arch}.rope.scaling.*`` keys, or the tensors llama.cpp's
converter writes instead of the parameters (Llama 3's ``rope_freqs``, Phi-3's LongRoPE
``rope_factors_long`` and ``rope_factors_short``), as HF's ``rope_scaling`` dict (or as the divisors
themselves, ``{"rope_type": "freq_factors"}``, where no llama3 parameters give them)."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np

from astrai.errors import ModelFormatError
from astrai.model.config import ModelConfig

__all__ = ["llama3_rope_factors", "rope_scaling", "rope_tensors_scaling"]


def rope_scaling(field: Callable[[str], Any]) -> dict[str, Any] | None:
    """HF-style ``rope_scaling`` from ``{arch}.rope.scaling.*`` (``field(name)`` reads
    ``{arch}.{name}``, None when absent); None for plain RoPE."""
    kind = field("rope.scaling.type") or "none"
    if kind == "none":
        return None
    scaling: dict[str, Any] = {"rope_type": kind, "factor": float(field("rope.scaling.factor") or 1.0)}
    original = field("rope.scaling.original_context_length")
    if original is not None:
        scaling["original_max_position_embeddings"] = int(original)
    for gguf_key, hf_key in (
        ("attn_factor", "attention_factor"),
        ("yarn_beta_fast", "beta_fast"),
        ("yarn_beta_slow", "beta_slow"),
    ):
        value = field(f"rope.scaling.{gguf_key}")
        if value is not None:
            scaling[hf_key] = float(value)
    return scaling


# What every Llama 3.x checkpoint uses besides its factor; llama.cpp keeps only the result.
_LLAMA3_DEFAULTS = {"low_freq_factor": 1.0, "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}


def llama3_rope_factors(head_dim: int, theta: float, scaling: dict[str, Any]) -> np.ndarray:
    """The per-frequency divisors ``[head_dim // 2]`` that llama3 RoPE scaling applies (HF's formula)."""
    freqs = 1.0 / theta ** (np.arange(0, head_dim, 2, dtype=np.float64) / head_dim)
    wavelen = 2 * np.pi / freqs
    old = scaling["original_max_position_embeddings"]
    low, high, factor = scaling["low_freq_factor"], scaling["high_freq_factor"], scaling["factor"]
    smooth = (old / wavelen - low) / (high - low)
    mid = 1 / ((1 - smooth) / factor + smooth)
    return np.where(wavelen < old / high, 1.0, np.where(wavelen > old / low, factor, mid))


def _rope_freqs_scaling(rope_freqs: np.ndarray, config: ModelConfig, path: Path) -> dict[str, Any]:
    """``rope_scaling`` from llama.cpp's ``rope_freqs`` tensor (one divisor per rotated frequency).

    The converter stores only the divisors Llama 3's scaling computed. Where the usual parameters
    (``_LLAMA3_DEFAULTS``, the largest divisor as the factor) give every divisor, that is the llama3
    scaling they came from; otherwise (another original context, say) the divisors themselves
    (``freq_factors``), which is what llama.cpp applies whatever computed them. Raises
    ModelFormatError when there is not one positive divisor per rotated frequency.
    """
    pairs = (config.rotary_dim or config.head_dim) // 2
    if rope_freqs.shape != (pairs,) or not np.all(np.isfinite(rope_freqs) & (rope_freqs > 0)):
        raise ModelFormatError(
            f"{path}: 'rope_freqs.weight' has shape {list(rope_freqs.shape)}; RoPE needs {pairs} positive "
            "divisors (one per rotated frequency)"
        )
    scaling = {"rope_type": "llama3", "factor": float(rope_freqs.max()), **_LLAMA3_DEFAULTS}
    expected = llama3_rope_factors(config.head_dim, config.rope_theta, scaling)
    if expected.shape == rope_freqs.shape and np.allclose(rope_freqs, expected, rtol=1e-4):
        return scaling
    return {"rope_type": "freq_factors", "freq_factors": rope_freqs.astype(np.float64).tolist()}


def rope_tensors_scaling(
    rope: dict[str, np.ndarray], config: ModelConfig, path: Path, key: Callable[..., Any]
) -> dict[str, Any] | None:
    """``rope_scaling`` from the file's RoPE tensors (by name; ``key(name, default)`` reads the
    ``{arch}.`` keys that go with them)."""
    if "rope_freqs.weight" in rope:
        return _rope_freqs_scaling(rope["rope_freqs.weight"], config, path)
    if "rope_factors_long.weight" not in rope:
        return config.rope_scaling
    original = int(key("rope.scaling.original_context_length", config.max_position_embeddings))
    long = rope["rope_factors_long.weight"]
    scaling = {
        "rope_type": "longrope",
        "long_factor": long.tolist(),
        "short_factor": rope.get("rope_factors_short.weight", long).tolist(),
        "original_max_position_embeddings": original,
        "factor": config.max_position_embeddings / original,
    }
    attn_factor = key("rope.scaling.attn_factor", None)
    if attn_factor is not None:
        scaling["attention_factor"] = float(attn_factor)
    return scaling
