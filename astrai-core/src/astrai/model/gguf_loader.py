"""Load a GGUF file into astrai's state-dict layout (HF names, llama.cpp RoPE layout).

Parsing and dequantization are gguf-py's (``GGUFReader``, ``gguf.quants``);
this module reads metadata and converts one tensor at a time. Tensor names map
through the file's ``astrai.models`` architecture (``Architecture.hf_name``).
The header alone (``gguf_header``: metadata and tensor table) gives the configuration,
checked against the tensors (``astrai.model.checks``) before any weight is read; a file
cut short is refused when it is opened.
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

from astrai.errors import ModelFormatError, ModelNotFound
from astrai.model.architecture import get_architecture
from astrai.model.checks import TensorInfo, check_model, derived_head_dim
from astrai.model.config import ModelConfig
from astrai.model.gguf_reader import open_gguf
from astrai.model.gguf_rope import rope_scaling, rope_tensors_scaling
from astrai.model.layout import fused_parts, rope_heads, rope_order, to_rope_layout, unfuse
from astrai.model.quant import NATIVE, QuantWeight, pack, split_blocks

logger = logging.getLogger(__name__)

# Types whose dequantization gguf-py implements and astrai's tests cover.
SUPPORTED_TYPES = frozenset(
    ["F32", "F16", "BF16", "Q8_0", "Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q2_K", "Q3_K", "Q4_K", "Q5_K", "Q6_K"]
)


def _field(reader: GGUFReader, key: str, default: Any = None) -> Any:
    field = reader.fields.get(key)
    return default if field is None else field.contents()


def gguf_tensors(reader: GGUFReader, arch: str, path: Path) -> dict[str, TensorInfo]:
    """HF name -> ``TensorInfo`` of every weight in the file (``rope_freqs.weight`` is not one).

    Raises ModelNotFound for a tensor name the architecture does not know or a type astrai
    cannot load (the message names the tensor)."""
    architecture = get_architecture(arch, str(path))
    tensors: dict[str, TensorInfo] = {}
    for t in reader.tensors:
        if t.name in _ROPE_TENSORS:
            continue
        name, qtype = architecture.hf_name(t.name), t.tensor_type.name
        if name is None:
            raise ModelNotFound(f"{path}: unexpected tensor {t.name!r}")
        if qtype not in SUPPORTED_TYPES:
            raise ModelNotFound(
                f"{path}: tensor {t.name!r} has type {qtype}, which astrai cannot load "
                f"(supported: {', '.join(sorted(SUPPORTED_TYPES))})"
            )
        shape = tuple(int(d) for d in reversed(t.shape.tolist()))  # GGUF lists dims innermost first
        if "{e}" in name:  # experts stacked in one tensor: each under its own name
            for e in range(shape[0]):
                tensors[name.format(e=e)] = TensorInfo(t.name, shape[1:], int(t.n_bytes) // shape[0], qtype)
            continue
        tensors[name] = TensorInfo(t.name, shape, int(t.n_bytes), qtype)
    return tensors


#: Tensors that are RoPE parameters, not weights: read into ``ModelConfig.rope_scaling``.
_ROPE_TENSORS = ("rope_freqs.weight", "rope_factors_long.weight", "rope_factors_short.weight")


def _unfused(tensors: dict[str, TensorInfo], config: ModelConfig, path: Path) -> dict[str, TensorInfo]:
    """``tensors`` with each fused projection (``Architecture.fused_parts``) entered as its parts."""
    out: dict[str, TensorInfo] = {}
    parts = fused_parts(config)
    for name, info in tensors.items():
        try:
            pieces = unfuse(name, info.shape[0], parts) if info.shape else None
        except ModelFormatError as e:
            raise ModelFormatError(f"{path}: {e}") from None
        if pieces is None:
            out[name] = info
            continue
        for piece, rows in pieces:
            n = rows.stop - rows.start
            out[piece] = TensorInfo(
                info.source, (n, *info.shape[1:]), info.nbytes * n // info.shape[0], info.kind
            )
    return out


def gguf_header(reader: GGUFReader, path: Path) -> tuple[ModelConfig, dict[str, TensorInfo]]:
    """ModelConfig from GGUF metadata (``{arch}.*`` and ``tokenizer.ggml.*`` keys) and the tensor
    table, checked against each other (``check_model``); reads no weight. Raises ModelNotFound for
    an unsupported architecture, tensor or type, ModelFormatError for metadata that is missing,
    not a number or contradicts the tensors (the message names the key)."""
    arch = _field(reader, "general.architecture")  # the metadata keys' prefix
    model = arch  # the astrai.models architecture: llama.cpp writes Mixtral as "llama" with experts
    if arch == "llama" and _field(reader, "llama.expert_count"):
        model = "mixtral"
    tensors = gguf_tensors(reader, model, path)  # raises ModelNotFound (or the plugin's error) early

    def key(name: str, default: Any = ...) -> Any:
        value = _field(reader, f"{arch}.{name}", None if default is ... else default)
        if value is None and default is ...:
            raise ModelFormatError(f"{path}: missing metadata key {arch}.{name}")
        if value is not None and not isinstance(value, (int, float)):
            raise ModelFormatError(f"{path}: {arch}.{name} is {value!r}, not a number")
        return value

    fields = {field: f"{arch}.{name}" for field, name in _FIELDS.items()}
    architecture = get_architecture(model, str(path))
    hidden, n_heads = int(key("embedding_length")), int(key("attention.head_count"))
    head_dim = key("attention.key_length", None) or key("rope.dimension_count", None)
    if not head_dim:
        fields["head_dim"] = f"head dim ({arch}.embedding_length / {arch}.attention.head_count)"
        head_dim = derived_head_dim(hidden, n_heads, path, fields)
    elif not key("attention.key_length", None):
        fields["head_dim"] = f"{arch}.rope.dimension_count"
    tokens = reader.fields.get("tokenizer.ggml.tokens")
    if tokens is not None:
        vocab, fields["vocab_size"] = len(tokens.data), "vocab size (the entries of tokenizer.ggml.tokens)"
    elif key("vocab_size", None) is not None:
        vocab, fields["vocab_size"] = key("vocab_size"), f"{arch}.vocab_size"
    elif "model.embed_tokens.weight" in tensors:  # no tokenizer and no vocab_size: the embedding's row count
        vocab = tensors["model.embed_tokens.weight"].shape[0]
    else:
        raise ModelFormatError(f"{path}: no tokenizer.ggml.tokens, {arch}.vocab_size or token_embd.weight")
    bos, eos = _field(reader, "tokenizer.ggml.bos_token_id"), _field(reader, "tokenizer.ggml.eos_token_id")
    config = ModelConfig(
        architecture=model,
        vocab_size=int(vocab),
        hidden_size=hidden,
        intermediate_size=int(key("feed_forward_length")),
        num_hidden_layers=int(key("block_count")),
        num_attention_heads=n_heads,
        num_key_value_heads=int(key("attention.head_count_kv", n_heads)),
        head_dim=int(head_dim),
        max_position_embeddings=int(key("context_length")),
        rms_norm_eps=float(key("attention.layer_norm_rms_epsilon", 1e-5)),
        rope_theta=float(key("rope.freq_base", 10000.0)),
        rope_scaling=rope_scaling(lambda name: _field(reader, f"{arch}.{name}")),
        tie_word_embeddings="lm_head.weight" not in tensors,
        attention_bias="model.layers.0.self_attn.q_proj.bias" in tensors,
        bos_token_id=None if bos is None else int(bos),
        eos_token_ids=[] if eos is None else [int(eos)],
        name=path.stem,
        sliding_window=key("attention.sliding_window", None) or None,
    )
    if architecture.gguf_config is not None:
        architecture.gguf_config(lambda name, default: _field(reader, f"{arch}.{name}", default), config)
    if key("expert_count", None):  # a mixture of experts
        config.num_experts, config.num_experts_per_tok = (
            int(key("expert_count")),
            int(key("expert_used_count", 2)),
        )
        experts = key("expert_feed_forward_length", None)
        config.moe_intermediate_size = int(experts) if experts else None
    tensors = _unfused(tensors, config, path)
    check_model(config, tensors, path, fields)
    rope = {t.name: np.asarray(t.data, np.float32) for t in reader.tensors if t.name in _ROPE_TENSORS}
    if rope:
        config.rope_scaling = rope_tensors_scaling(rope, config, path, key)
    return config, tensors


# ModelConfig field -> its GGUF key after "{arch}.", for messages.
_FIELDS = {
    "num_hidden_layers": "block_count",
    "hidden_size": "embedding_length",
    "intermediate_size": "feed_forward_length",
    "num_attention_heads": "attention.head_count",
    "num_key_value_heads": "attention.head_count_kv",
    "head_dim": "attention.key_length",
    "max_position_embeddings": "context_length",
}


# The weights that may stay quantized (``quantized=True``): the linears and the embedding table.
_PROJECTIONS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
_QUANTIZABLE = (*_PROJECTIONS, "lm_head", "embed_tokens")


def stays_quantized(name: str, qtype: str) -> bool:
    """Whether weight ``name`` (HF) of type ``qtype`` stays quantized when the loader is asked to."""
    return qtype in NATIVE and name.rsplit(".", 2)[-2] in _QUANTIZABLE and name.endswith(".weight")


def gguf_weights(
    reader: GGUFReader, config: ModelConfig, path: Path, dtype: torch.dtype, quantized: bool = False
) -> dict[str, torch.Tensor | QuantWeight]:
    """The state dict of a GGUF file whose header ``gguf_header`` read (see ``load_gguf``)."""
    arch = get_architecture(config.architecture, str(path))
    permute = not arch.gguf_rope_interleaved
    parts = fused_parts(config)
    state: dict[str, torch.Tensor] = {}
    for t in tqdm(reader.tensors, desc=f"Loading {path.name}", unit="tensor", disable=None):
        fused, qtype = arch.hf_name(t.name), t.tensor_type.name
        if fused is None:  # RoPE tensors: read into config.rope_scaling by gguf_header
            continue
        if "{e}" in fused:  # experts stacked in one tensor: each one's rows under its own name
            for e in range(int(t.shape[-1])):
                state.update(
                    _tensor(np.asarray(t.data)[e], t.tensor_type, fused.format(e=e), config, dtype, quantized)
                )
            continue
        rows = int(t.shape[-1]) if len(t.shape) > 1 else int(t.shape[0])
        pieces = unfuse(fused, rows, parts) or [(fused, slice(0, rows))]
        # by the model's names: a fused tensor (Phi-3's attn_qkv) stays quantized as its parts do
        if quantized and all(stays_quantized(name, qtype) for name, _ in pieces):
            blocks = split_blocks(np.asarray(t.data), qtype)
            for name, part in pieces:
                codes, scales, mins = (None if b is None else b[part] for b in blocks)
                heads = rope_heads(name, config) if permute else None
                if heads is not None:  # the same row order as the dense path's
                    order = rope_order(heads, codes.shape[0] // heads, config.rotary_dim).numpy()
                    codes, scales = codes[order], scales[order]
                    mins = None if mins is None else mins[order]
                state[name] = QuantWeight(*pack(codes, scales, mins, NATIVE[qtype]), qtype)
            continue
        values = dequantize(t.data, t.tensor_type)  # float32, numpy order == HF order
        if not values.flags.writeable:  # F32 comes back as a view of the read-only map
            values = values.copy()
        w = torch.from_numpy(values)
        if arch.gguf_norm_offset and fused.endswith("norm.weight"):
            w = w - arch.gguf_norm_offset  # llama.cpp wrote Gemma's (1 + weight)
        for name, part in pieces:
            piece = w[part].to(dtype)
            state[name] = to_rope_layout(name, piece, config) if permute else piece
    logger.info("loaded %d tensors from %s", len(state), path)
    return state


def _tensor(
    data: np.ndarray, kind: Any, name: str, config: ModelConfig, dtype: torch.dtype, quantized: bool
) -> dict[str, torch.Tensor | QuantWeight]:
    """One expert's matrix of a stacked tensor, kept quantized or dequantized (no RoPE rows in it)."""
    qtype = kind.name
    if quantized and stays_quantized(name, qtype):
        return {name: QuantWeight(*pack(*split_blocks(data, qtype), NATIVE[qtype]), qtype)}
    return {name: torch.from_numpy(np.array(dequantize(data, kind), np.float32)).to(dtype)}


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
    tensor name or quantization type (the message names the tensor), and
    ModelFormatError for a truncated file or metadata that contradicts the tensors.
    """
    path = Path(path)
    reader = open_gguf(path)
    config, _tensors = gguf_header(reader, path)
    return config, gguf_weights(reader, config, path, dtype, quantized)
