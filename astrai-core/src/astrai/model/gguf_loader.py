"""Load a GGUF file into astrai's state-dict layout (HF names, llama.cpp RoPE layout).

Parsing and dequantization are gguf-py's (``GGUFReader``, ``gguf.quants``);
this module reads metadata and converts one tensor at a time. Tensor names map
through the file's ``astrai.models`` architecture (``Architecture.hf_name``).
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

import numpy as np
import torch
from gguf import GGUFReader
from gguf.quants import dequantize
from tqdm.auto import tqdm

from astrai.errors import ModelNotFound
from astrai.model.architecture import get_architecture
from astrai.model.config import ModelConfig
from astrai.model.hf_loader import interleave_rope_rows
from astrai.model.quant import NATIVE, QuantWeight, pack, split_blocks

logger = logging.getLogger(__name__)

# Types whose dequantization gguf-py implements and astrai's tests cover.
SUPPORTED_TYPES = frozenset(
    ["F32", "F16", "BF16", "Q8_0", "Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q2_K", "Q3_K", "Q4_K", "Q5_K", "Q6_K"]
)
class _MappedReader(GGUFReader):
    """A GGUFReader whose buffer is a plain ndarray view of the file's memory map.

    gguf-py slices ``reader.data`` once per metadata element (100k+ for a
    tokenizer); on a plain ndarray that is about 3x faster than on np.memmap.
    The view still maps the file: nothing is read until a tensor is used.
    """

    @property
    def data(self) -> np.ndarray:
        return self._buf

    @data.setter
    def data(self, value: np.ndarray) -> None:
        self._buf = value.view(np.ndarray)


def open_gguf(path: str | Path) -> GGUFReader:
    """Parse a GGUF file's header; raises ModelNotFound when it is missing or not GGUF."""
    try:
        return _MappedReader(path)
    except (OSError, ValueError) as e:
        raise ModelNotFound(f"{path}: not a readable GGUF file ({e})") from e


def _field(reader: GGUFReader, key: str, default: Any = None) -> Any:
    field = reader.fields.get(key)
    return default if field is None else field.contents()


def gguf_config(reader: GGUFReader, path: Path) -> ModelConfig:
    """ModelConfig from GGUF metadata (``{arch}.*`` and ``tokenizer.ggml.*`` keys)."""
    arch = _field(reader, "general.architecture")
    get_architecture(arch, str(path))  # raises ModelNotFound (or the plugin's error) early

    def key(name: str, default: Any = ...) -> Any:
        value = _field(reader, f"{arch}.{name}", None if default is ... else default)
        if value is None and default is ...:
            raise ModelNotFound(f"{path}: missing metadata key {arch}.{name}")
        return value

    names = {t.name for t in reader.tensors}
    hidden, n_heads = int(key("embedding_length")), int(key("attention.head_count"))
    tokens = reader.fields.get("tokenizer.ggml.tokens")
    vocab = len(tokens.data) if tokens is not None else key("vocab_size", None)
    if vocab is None:  # no tokenizer and no vocab_size: the embedding's row count
        vocab = next(int(t.shape[-1]) for t in reader.tensors if t.name == "token_embd.weight")
    bos, eos = _field(reader, "tokenizer.ggml.bos_token_id"), _field(reader, "tokenizer.ggml.eos_token_id")
    return ModelConfig(
        architecture=arch,
        vocab_size=int(vocab),
        hidden_size=hidden,
        intermediate_size=int(key("feed_forward_length")),
        num_hidden_layers=int(key("block_count")),
        num_attention_heads=n_heads,
        num_key_value_heads=int(key("attention.head_count_kv", n_heads)),
        head_dim=int(
            key("attention.key_length", None) or key("rope.dimension_count", None) or hidden // n_heads
        ),
        max_position_embeddings=int(key("context_length")),
        rms_norm_eps=float(key("attention.layer_norm_rms_epsilon", 1e-5)),
        rope_theta=float(key("rope.freq_base", 10000.0)),
        rope_scaling=_rope_scaling(reader, arch),
        tie_word_embeddings="output.weight" not in names,
        attention_bias="blk.0.attn_q.bias" in names,
        bos_token_id=None if bos is None else int(bos),
        eos_token_ids=[] if eos is None else [int(eos)],
        name=path.stem,
    )


def _rope_scaling(reader: GGUFReader, arch: str) -> dict[str, Any] | None:
    """HF-style ``rope_scaling`` from ``{arch}.rope.scaling.*``; None for plain RoPE."""
    kind = _field(reader, f"{arch}.rope.scaling.type", "none")
    if kind == "none":
        return None
    scaling: dict[str, Any] = {
        "rope_type": kind,
        "factor": float(_field(reader, f"{arch}.rope.scaling.factor", 1.0)),
    }
    original = _field(reader, f"{arch}.rope.scaling.original_context_length")
    if original is not None:
        scaling["original_max_position_embeddings"] = int(original)
    for gguf_key, hf_key in (
        ("attn_factor", "attention_factor"),
        ("yarn_beta_fast", "beta_fast"),
        ("yarn_beta_slow", "beta_slow"),
    ):
        value = _field(reader, f"{arch}.rope.scaling.{gguf_key}")
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


def _llama3_scaling(rope_freqs: np.ndarray, config: ModelConfig, path: Path) -> dict[str, Any]:
    """Recover llama3 ``rope_scaling`` from llama.cpp's ``rope_freqs`` tensor.

    The converter stores only the computed divisors; their maximum is the factor,
    and the other parameters are checked by recomputing every divisor.
    """
    scaling = {"rope_type": "llama3", "factor": float(rope_freqs.max()), **_LLAMA3_DEFAULTS}
    expected = llama3_rope_factors(config.head_dim, config.rope_theta, scaling)
    if rope_freqs.shape != expected.shape or not np.allclose(rope_freqs, expected, rtol=1e-4):
        raise ModelNotFound(f"{path}: 'rope_freqs.weight' does not match llama3 RoPE scaling; not supported")
    return scaling


# The weights that may stay quantized (``quantized=True``): the linears and the embedding table.
_QUANTIZABLE = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj", "lm_head", "embed_tokens")


def load_gguf(
    path: str | Path, dtype: torch.dtype, quantized: bool = False
) -> tuple[ModelConfig, dict[str, torch.Tensor | QuantWeight]]:
    """Read and dequantize a GGUF file into (config, state dict) on CPU.

    ``quantized``: the linears' and the embedding's weights whose type ``astrai.model.quant``
    keeps (``NATIVE``) come back as ``QuantWeight``s in its tile layout instead of dense
    tensors (their rows in the same order as the dense ones would be).

    Tensors come back in ``dtype``, named and oriented as HF's (``[out, in]``),
    q/k rows in interleaved-pair RoPE layout; ``lm_head.weight`` is absent when
    the file has no ``output.weight`` (tied embeddings). Dequantizes one tensor
    at a time, so peak memory is the state dict plus one float32 tensor.
    Raises ModelNotFound for an unreadable file, an unsupported architecture,
    tensor name or quantization type (the message names the tensor).
    """
    path = Path(path)
    reader = open_gguf(path)
    config = gguf_config(reader, path)
    rope_freqs = next((t for t in reader.tensors if t.name == "rope_freqs.weight"), None)
    if rope_freqs is not None:
        config.rope_scaling = _llama3_scaling(np.asarray(rope_freqs.data, np.float32), config, path)
    heads = {"q_proj": config.num_attention_heads, "k_proj": config.num_key_value_heads}
    arch = get_architecture(config.architecture, str(path))
    permute = not arch.gguf_rope_interleaved
    state: dict[str, torch.Tensor] = {}
    for t in tqdm(reader.tensors, desc=f"Loading {path.name}", unit="tensor", disable=None):
        if t is rope_freqs:
            continue
        name, qtype = arch.hf_name(t.name), t.tensor_type.name
        if name is None:
            raise ModelNotFound(f"{path}: unexpected tensor {t.name!r}")
        if qtype not in SUPPORTED_TYPES:
            raise ModelNotFound(
                f"{path}: tensor {t.name!r} has type {qtype}, which astrai cannot load "
                f"(supported: {', '.join(sorted(SUPPORTED_TYPES))})"
            )
        proj = name.rsplit(".", 2)[-2]
        if quantized and qtype in NATIVE and proj in _QUANTIZABLE and name.endswith(".weight"):
            codes, scales, mins = split_blocks(np.asarray(t.data), qtype)
            if permute and proj in heads:  # the same row order as the dense path's
                order = interleave_rope_rows(torch.arange(codes.shape[0]), heads[proj]).numpy()
                codes, scales = codes[order], scales[order]
                mins = None if mins is None else mins[order]
            state[name] = QuantWeight(*pack(codes, scales, mins, NATIVE[qtype]), qtype)
            continue
        values = dequantize(t.data, t.tensor_type)  # float32, numpy order == HF order
        if not values.flags.writeable:  # F32 comes back as a view of the read-only map
            values = values.copy()
        w = torch.from_numpy(values).to(dtype)
        if permute and proj in heads:
            w = interleave_rope_rows(w, heads[proj])
        state[name] = w
    logger.info("loaded %d tensors from %s", len(state), path)
    return config, state
