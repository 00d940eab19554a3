"""A transformers checkpoint folder written as a GGUF file the way llama.cpp's converter writes it.

This follows ``convert_hf_to_gguf.py`` (its ``conversion/`` package) and ``gguf-py`` of llama.cpp as
vendored in llama-cpp-python 0.3.36, read rather than run: tensor names from gguf-py's own
``TensorNameMap`` of the architecture, the metadata keys each family's ``set_gguf_parameters``
writes, and each family's tensor changes:

- ``llama`` (Llama, and Mistral, whose ``MistralForCausalLM`` the converter writes as ``llama``):
  q/k rows permuted to interleaved RoPE pairs (``LlamaModel.permute``), ``vocab_size`` and
  ``rope.dimension_count``, Llama 3's RoPE scaling as the ``rope_freqs`` tensor of divisors; no
  sliding window. The converter has no ``MinistralForCausalLM``; Ministral's own checkpoints say
  ``MistralForCausalLM``, so a Ministral folder is written as Mistral's is;
- ``qwen3``: the common keys (``TextModel.set_gguf_parameters``), HF's row order (NEOX RoPE);
- ``gemma2``, ``gemma3``: every ``*norm.weight`` stored as ``1 + weight``; Gemma 2's soft-caps and
  window and no RoPE base, no ``lm_head``; Gemma 3's window and the local layers' RoPE base
  (``rope.freq_base_swa``), no window pattern (llama.cpp's loader assumes every sixth layer global);
- ``qwen3_moe``, ``qwen2_moe``, ``mixtral``: every expert of a layer and kind stacked in one
  ``ffn_{gate,up,down}_exps`` tensor, the routers (and Qwen2-MoE's shared-expert gate) in F32;
- ``phi3``: the fused ``attn_qkv`` and ``ffn_up`` (gate and up), ``rope.dimension_count`` the rotated
  dims, the LongRoPE factors as ``rope_factors_long``/``rope_factors_short`` with
  ``rope.scaling.attn_factor`` and the original context length.

Every file gets a small byte-level BPE vocabulary (``tokenizer.ggml.*``: the 256 bytes, two control
tokens, 42 merges) that transformers' GGUF tokenizer reads. ``qtype`` quantizes every 2-D tensor with
``gguf.quants`` (1-D ones stay F32, as in llama.cpp's files).

What the converter cannot carry, llama.cpp reads its own way: ``llama_cpp_reading`` is the
checkpoint's transformers config as llama.cpp reads the file (no window in ``llama`` files; Gemma 3's
softmax scale from the head dim and its layer pattern), ``reference`` the transformers model of it.
"""

from __future__ import annotations

import copy
import itertools
import json
import math
import re
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import gguf
import numpy as np
import torch
from gguf import GGMLQuantizationType, GGUFWriter, LlamaFileType
from gguf.quants import dequantize, quantize

__all__ = ["CONVERTERS", "llama_cpp_reading", "reference", "write_gguf"]

_FILE_TYPES = {
    None: LlamaFileType.ALL_F32,
    GGMLQuantizationType.Q8_0: LlamaFileType.MOSTLY_Q8_0,
    GGMLQuantizationType.Q4_0: LlamaFileType.MOSTLY_Q4_0,
    GGMLQuantizationType.Q4_1: LlamaFileType.MOSTLY_Q4_1,
    GGMLQuantizationType.Q5_0: LlamaFileType.MOSTLY_Q5_0,
    GGMLQuantizationType.Q5_1: LlamaFileType.MOSTLY_Q5_1,
}


def _rope(hp: dict[str, Any]) -> tuple[dict[str, Any], dict[str, Any]]:
    """(the global layers' RoPE parameters, the local layers' or {}) of a config.json."""
    rope = hp.get("rope_parameters") or {}
    return rope.get("full_attention", rope), rope.get("sliding_attention", {})


def _common(w: GGUFWriter, hp: dict[str, Any]) -> None:
    """``TextModel.set_gguf_parameters``: the keys every text model gets."""
    full, local = _rope(hp)
    w.add_block_count(hp["num_hidden_layers"])
    w.add_context_length(hp["max_position_embeddings"])
    w.add_embedding_length(hp["hidden_size"])
    w.add_feed_forward_length(hp["intermediate_size"])
    w.add_head_count(hp["num_attention_heads"])
    w.add_head_count_kv(hp["num_key_value_heads"])
    if full.get("rope_type") not in (None, "default", "llama3"):  # llama3: the rope_freqs tensor
        raise NotImplementedError(f"rope_type {full['rope_type']!r}")
    w.add_rope_freq_base(full["rope_theta"])
    if local.get("rope_theta") is not None:
        w.add_rope_freq_base_swa(local["rope_theta"])
    w.add_layer_norm_rms_eps(hp["rms_norm_eps"])
    if hp.get("head_dim") is not None:
        w.add_key_length(hp["head_dim"])
        w.add_value_length(hp["head_dim"])


def _llama(w: GGUFWriter, hp: dict[str, Any]) -> dict[str, np.ndarray]:
    """``LlamaModel``: the common keys, the vocabulary size, the rotated dims, Llama 3's ``rope_freqs``."""
    _common(w, hp)
    w.add_vocab_size(hp["vocab_size"])
    dim = hp.get("head_dim") or hp["hidden_size"] // hp["num_attention_heads"]
    w.add_rope_dimension_count(dim)
    full, _ = _rope(hp)
    if full.get("rope_type") != "llama3":
        return {}
    # generate_extra_tensors: each frequency's divisor, in its arithmetic (float32 tensors, Python floats)
    freqs = 1.0 / (full["rope_theta"] ** (torch.arange(0, dim, 2, dtype=torch.float32) / dim))
    factor, low, high = (
        full.get("factor", 8.0),
        full.get("low_freq_factor", 1.0),
        full.get("high_freq_factor", 4.0),
    )
    old = full.get("original_max_position_embeddings", 8192)
    divisors = []
    for freq in freqs:
        wavelen = 2 * math.pi / freq
        if wavelen < old / high:
            divisors.append(1)
        elif wavelen > old / low:
            divisors.append(factor)
        else:
            smooth = (old / wavelen - low) / (high - low)
            divisors.append(1 / ((1 - smooth) / factor + smooth))
    return {"rope_freqs.weight": torch.tensor(divisors, dtype=torch.float32).numpy()}


def _qwen3(w: GGUFWriter, hp: dict[str, Any]) -> dict[str, np.ndarray]:
    _common(w, hp)
    return {}


def _gemma2(w: GGUFWriter, hp: dict[str, Any]) -> dict[str, np.ndarray]:
    """``Gemma2Model.set_gguf_parameters``: its own list (no RoPE base: llama.cpp's 10,000)."""
    w.add_context_length(hp["max_position_embeddings"])
    w.add_embedding_length(hp["hidden_size"])
    w.add_block_count(hp["num_hidden_layers"])
    w.add_feed_forward_length(hp["intermediate_size"])
    w.add_head_count(hp["num_attention_heads"])
    w.add_head_count_kv(hp.get("num_key_value_heads", hp["num_attention_heads"]))
    w.add_layer_norm_rms_eps(hp["rms_norm_eps"])
    w.add_key_length(hp["head_dim"])
    w.add_value_length(hp["head_dim"])
    w.add_attn_logit_softcapping(hp["attn_logit_softcapping"])
    w.add_final_logit_softcapping(hp["final_logit_softcapping"])
    w.add_sliding_window(hp["sliding_window"])
    return {}


def _gemma3(w: GGUFWriter, hp: dict[str, Any]) -> dict[str, np.ndarray]:
    """``Gemma3Model.set_gguf_parameters``: the common keys, the final soft-cap, the window."""
    _common(w, hp)
    assert hp.get("attn_logit_softcapping") is None
    if hp.get("final_logit_softcapping"):
        w.add_final_logit_softcapping(hp["final_logit_softcapping"])
    if hp.get("sliding_window_pattern") != 1:
        w.add_sliding_window(hp["sliding_window"])
    return {}


def _phi3(w: GGUFWriter, hp: dict[str, Any]) -> dict[str, np.ndarray]:
    """``Phi3MiniModel``: its own list, the rotated dims, LongRoPE's factors as tensors."""
    rope, _ = _rope(hp)
    n_embd, n_head = hp["hidden_size"], hp["num_attention_heads"]
    original, ctx = rope["original_max_position_embeddings"], hp["max_position_embeddings"]
    rope_dims = int(rope.get("partial_rotary_factor", 1.0) * n_embd) // n_head
    w.add_context_length(ctx)
    w.add_rope_scaling_orig_ctx_len(original)
    w.add_embedding_length(n_embd)
    w.add_feed_forward_length(hp["intermediate_size"])
    w.add_block_count(hp["num_hidden_layers"])
    w.add_head_count(n_head)
    w.add_head_count_kv(hp["num_key_value_heads"])
    w.add_layer_norm_rms_eps(hp["rms_norm_eps"])
    w.add_rope_dimension_count(rope_dims)
    w.add_rope_freq_base(rope["rope_theta"])
    w.add_sliding_window(hp.get("sliding_window") or 0)  # 0 tells Phi-4 apart
    if not rope.get("long_factor"):
        return {}
    scale = ctx / original
    w.add_rope_scaling_attn_factors(
        math.sqrt(1 + math.log(scale) / math.log(original)) if scale > 1.0 else 1.0
    )
    return {
        "rope_factors_long.weight": np.array(rope["long_factor"], np.float32),
        "rope_factors_short.weight": np.array(rope["short_factor"], np.float32),
    }


def _experts(w: GGUFWriter, hp: dict[str, Any]) -> None:
    """The mixture-of-experts keys (``Qwen2MoeModel``, ``Qwen3MoeModel``, ``MixtralModel`` (as
    ``LlamaModel``))."""
    w.add_expert_count(hp.get("num_experts") or hp["num_local_experts"])
    w.add_expert_used_count(hp["num_experts_per_tok"])
    if hp.get("moe_intermediate_size"):
        w.add_expert_feed_forward_length(hp["moe_intermediate_size"])
    if hp.get("shared_expert_intermediate_size"):
        w.add_expert_shared_feed_forward_length(hp["shared_expert_intermediate_size"])


def _qwen_moe(w: GGUFWriter, hp: dict[str, Any]) -> dict[str, np.ndarray]:
    _common(w, hp)
    _experts(w, hp)
    return {}


def _mixtral(w: GGUFWriter, hp: dict[str, Any]) -> dict[str, np.ndarray]:
    extra = _llama(w, hp)
    _experts(w, hp)
    return extra


def _no_window(config: Any) -> None:
    if getattr(config, "layer_types", None) is not None:  # (Ministral's sliding_window must stay set)
        config.layer_types = ["full_attention"] * config.num_hidden_layers
    else:
        config.sliding_window = None


def _gemma3_reading(config: Any) -> None:
    # llama.cpp's Gemma 3: softmax scale 1/sqrt(head_dim) (but for the 62-layer 27B), every sixth layer global
    config.query_pre_attn_scalar = config.head_dim
    config.layer_types = [
        "sliding_attention" if i % 6 < 5 else "full_attention" for i in range(config.num_hidden_layers)
    ]


@dataclass(frozen=True)
class Converter:
    """How llama.cpp's converter writes one transformers ``model_type``."""

    arch: str  # general.architecture
    metadata: Callable[[GGUFWriter, dict[str, Any]], dict[str, np.ndarray]]  # keys; returns extra tensors
    permute_qk: bool = False  # LlamaModel's undo_permute
    norm_shift: float = 0.0  # added to every *norm.weight
    drops: tuple[str, ...] = ()  # checkpoint tensors it leaves out
    reading: Callable[[Any], None] | None = None  # what llama.cpp reads differently (on a config copy)


CONVERTERS = {
    "llama": Converter("llama", _llama, permute_qk=True),
    "mistral": Converter("llama", _llama, permute_qk=True, reading=_no_window),
    "ministral": Converter("llama", _llama, permute_qk=True, reading=_no_window),
    "qwen3": Converter("qwen3", _qwen3),
    "gemma2": Converter("gemma2", _gemma2, norm_shift=1.0, drops=("lm_head.weight",)),
    "gemma3_text": Converter("gemma3", _gemma3, norm_shift=1.0, reading=_gemma3_reading),
    "phi3": Converter("phi3", _phi3),
    "qwen3_moe": Converter("qwen3moe", _qwen_moe),
    "qwen2_moe": Converter("qwen2moe", _qwen_moe),
    "mixtral": Converter("llama", _mixtral, permute_qk=True),
}

#: an expert's projection in a checkpoint -> llama.cpp's stacked tensor of that kind
_EXPERT = re.compile(r"model\.layers\.(\d+)\.(?:mlp|block_sparse_moe)\.experts\.(\d+)\.(\w+)\.weight")
_EXPERT_KIND = {
    "gate_proj": "gate",
    "w1": "gate",
    "up_proj": "up",
    "w3": "up",
    "down_proj": "down",
    "w2": "down",
}


def _permute(w: torch.Tensor, n_head: int) -> torch.Tensor:
    """``LlamaModel.permute``: each head's rows from rotate-half halves to interleaved pairs."""
    return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def _unpermute(w: torch.Tensor, n_head: int) -> torch.Tensor:
    return w.reshape(n_head, w.shape[0] // n_head // 2, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def _tokenizer(w: GGUFWriter, hp: dict[str, Any]) -> None:
    """A byte-level BPE vocabulary of ``hp["vocab_size"]`` (300) tokens: <bos>, <eos>, the bytes, merges."""
    from transformers.convert_slow_tokenizer import bytes_to_unicode

    byte_chars = [bytes_to_unicode()[b] for b in range(256)]
    pairs = [a + b for a, b in itertools.product("etaoinsrh", repeat=2)][: hp["vocab_size"] - 258]
    tokens = ["<bos>", "<eos>", *byte_chars, *pairs]
    assert len(tokens) == hp["vocab_size"]
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("default")
    w.add_token_list(tokens)
    w.add_token_types([gguf.TokenType.CONTROL] * 2 + [gguf.TokenType.NORMAL] * (len(tokens) - 2))
    w.add_token_merges([f"{p[0]} {p[1]}" for p in pairs])
    w.add_bos_token_id(hp["bos_token_id"])
    w.add_eos_token_id(hp["eos_token_id"])


def write_gguf(
    folder: str | Path,
    path: str | Path,
    qtype: GGMLQuantizationType | None = None,
    metadata: dict[str, int] | None = None,
) -> dict[str, torch.Tensor]:
    """Write the checkpoint in ``folder`` (config.json, model.safetensors) to ``path`` as llama.cpp's
    converter would for its ``model_type``, every 2-D tensor quantized to ``qtype`` (None: all F32);
    ``metadata``: more keys, unsigned integers (an embedder's ``{arch}.pooling_type``).

    Returns what the file holds as the checkpoint's state dict (HF names and layout, float32): the
    dequantized values of quantized tensors, the checkpoint's values (norms through ``1 + w - 1``)
    of the others.
    """
    from safetensors.torch import load_file

    folder = Path(folder)
    hp = json.loads((folder / "config.json").read_text())
    conv = CONVERTERS[hp["model_type"]]
    arch = next(a for a, name in gguf.MODEL_ARCH_NAMES.items() if name == conv.arch)
    names = gguf.get_tensor_name_map(arch, hp["num_hidden_layers"])
    writer = GGUFWriter(str(path), conv.arch)
    writer.add_name(folder.name)
    extra = conv.metadata(writer, hp)
    writer.add_file_type(_FILE_TYPES[qtype])
    if qtype is not None:
        writer.add_quantization_version(gguf.GGML_QUANT_VERSION)
    _tokenizer(writer, hp)
    for key, value in (metadata or {}).items():
        writer.add_uint32(key, value)
    heads = {"q_proj": hp["num_attention_heads"], "k_proj": hp["num_key_value_heads"]}
    held: dict[str, torch.Tensor] = {}
    experts: dict[tuple[int, str], dict[int, torch.Tensor]] = {}
    for name, tensor in load_file(folder / "model.safetensors").items():
        if name in conv.drops:
            continue
        if m := _EXPERT.fullmatch(name):  # stacked per layer and kind below, as the converter does
            experts.setdefault((int(m[1]), _EXPERT_KIND[m[3]]), {})[int(m[2])] = tensor.float()
            continue
        data = tensor.float()
        n_head = heads.get(name.rsplit(".", 2)[-2]) if conv.permute_qk else None
        if n_head is not None:
            data = _permute(data, n_head)
        if conv.norm_shift and name.endswith("norm.weight"):
            data = data + conv.norm_shift
        gguf_name = names.get_name(name, try_suffixes=(".weight", ".bias"))
        assert gguf_name is not None, name
        values = data.numpy()
        if qtype is not None and values.ndim == 2 and "ffn_gate_inp" not in gguf_name:  # (routers stay F32)
            raw = quantize(values, qtype)
            writer.add_tensor(gguf_name, raw, raw_dtype=qtype)
            values = dequantize(raw, qtype)
        else:
            writer.add_tensor(gguf_name, values)
        back = torch.from_numpy(np.array(values, np.float32))
        if conv.norm_shift and name.endswith("norm.weight"):
            back = back - conv.norm_shift
        held[name] = _unpermute(back, n_head) if n_head is not None else back
    for (layer, kind), by_expert in sorted(experts.items()):
        values = torch.stack([by_expert[e] for e in sorted(by_expert)]).numpy()  # [experts, rows, cols]
        if qtype is not None:
            raw = quantize(values, qtype)
            writer.add_tensor(f"blk.{layer}.ffn_{kind}_exps.weight", raw, raw_dtype=qtype)
            values = dequantize(raw, qtype)
        else:
            writer.add_tensor(f"blk.{layer}.ffn_{kind}_exps.weight", values)
        held[f"model.layers.{layer}.mlp.experts.{kind}"] = torch.from_numpy(np.array(values, np.float32))
    for layer in sorted({layer for layer, _ in experts}):  # transformers' own layout: gate and up stacked
        prefix = f"model.layers.{layer}.mlp.experts."
        gate, up = held.pop(prefix + "gate"), held.pop(prefix + "up")
        held[prefix + "gate_up_proj"] = torch.cat([gate, up], dim=1)
        held[prefix + "down_proj"] = held.pop(prefix + "down")
    for name in [n for n in held if ".block_sparse_moe.gate." in n]:
        held[name.replace(".block_sparse_moe.", ".mlp.")] = held.pop(name)
    for name, values in extra.items():
        writer.add_tensor(name, values)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return held


def llama_cpp_reading(config: Any) -> Any:
    """A copy of a transformers config as llama.cpp reads the file ``write_gguf`` makes of it."""
    config = copy.deepcopy(config)
    reading = CONVERTERS[config.model_type].reading
    if reading is not None:
        reading(config)
    return config


def reference(hf_model: torch.nn.Module, held: dict[str, torch.Tensor]) -> torch.nn.Module:
    """The transformers model (float32, eval) of a file ``write_gguf`` wrote from ``hf_model``'s
    checkpoint: its config as llama.cpp reads it, the weights the file ``held``."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_config(llama_cpp_reading(hf_model.config), dtype=torch.float32)
    missing, unexpected = model.load_state_dict(held, strict=False)
    tied = {"lm_head.weight"} if model.config.tie_word_embeddings else set()
    assert set(missing) <= tied and not unexpected, (missing, unexpected)
    model.tie_weights()
    return model.eval()
