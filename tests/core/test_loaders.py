"""Weight loaders (GGUF, HF safetensors) against independent references."""

from __future__ import annotations

import dataclasses
import json
import math
import re
from pathlib import Path

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as Q
from gguf import GGUFWriter, RopeScalingType
from gguf.quants import dequantize, quantize

from astrai.config import EngineConfig
from astrai.errors import InsufficientMemory, ModelFormatError, ModelNotFound
from astrai.kvcache.sizing import kv_config
from astrai.model import open_checkpoint, read_config
from astrai.model.gguf_loader import load_gguf
from astrai.model.hf_loader import load_hf
from astrai.model.layout import interleave_rope_rows


def interleave_reference(w: torch.Tensor, n_head: int) -> torch.Tensor:
    """llama.cpp's q/k row order by explicit indices: in each head, row j pairs with j + d/2."""
    d = w.shape[0] // n_head
    order = [h * d + j + half * (d // 2) for h in range(n_head) for j in range(d // 2) for half in (0, 1)]
    return w[order]


# ---------------------------------------------------------------- the default model


@pytest.fixture(scope="module")
def default_gguf(default_model_path):
    return default_model_path


@pytest.fixture(scope="module")
def smollm_loaded(default_gguf):
    return load_gguf(default_gguf, torch.float32)


@pytest.fixture(scope="module")
def smollm_reference(hf_oracle):
    """transformers' own GGUF import (it undoes llama.cpp's q/k permutation) as a state dict."""
    return hf_oracle.state_dict()


@pytest.mark.slow
def test_default_gguf_equals_transformers_import(smollm_loaded, smollm_reference):
    config, state = smollm_loaded
    # Both dequantize the same blocks in float32 (gguf-py), so equality is exact.
    assert set(state) == set(smollm_reference) - {"lm_head.weight"}
    heads = {"q_proj": config.num_attention_heads, "k_proj": config.num_key_value_heads}
    for name, ref in smollm_reference.items():
        if name == "lm_head.weight":
            continue
        proj = name.split(".")[-2]
        expected = interleave_reference(ref, heads[proj]) if proj in heads else ref
        assert state[name].dtype == torch.float32
        torch.testing.assert_close(state[name], expected, rtol=0, atol=0, msg=name)


@pytest.mark.slow
def test_default_gguf_config(smollm_loaded):
    config, _ = smollm_loaded
    assert (config.architecture, config.num_hidden_layers, config.hidden_size) == ("llama", 30, 576)
    assert (config.num_attention_heads, config.num_key_value_heads, config.head_dim) == (9, 3, 64)
    assert (config.intermediate_size, config.vocab_size, config.max_position_embeddings) == (
        1536,
        49152,
        8192,
    )
    assert config.rope_theta == 100000.0 and config.rope_scaling is None
    assert (
        config.rms_norm_eps == pytest.approx(1e-5)
        and config.tie_word_embeddings
        and not config.attention_bias
    )
    assert (config.bos_token_id, config.eos_token_ids) == (1, [2])
    assert config.name == "SmolLM2-135M-Instruct.Q4_1"


# ---------------------------------------------------------------- synthetic GGUF, every type

HIDDEN, HEADS, KV_HEADS, FFN, VOCAB, LAYERS = 256, 4, 2, 256, 32, 2
QUANTIZED = [Q.F32, Q.F16, Q.BF16, Q.Q8_0, Q.Q4_0, Q.Q4_1, Q.Q5_0, Q.Q5_1]  # gguf-py can quantize these
K_QUANTS = [Q.Q2_K, Q.Q3_K, Q.Q4_K, Q.Q5_K, Q.Q6_K]  # written as random blocks
# Bytes per 256-value block, and offsets of its f16 super-block scales (ggml's block_qN_K structs).
K_BLOCK_BYTES = {Q.Q2_K: 84, Q.Q3_K: 110, Q.Q4_K: 144, Q.Q5_K: 176, Q.Q6_K: 210}
K_SCALE_OFFSETS = {Q.Q2_K: (80, 82), Q.Q3_K: (108,), Q.Q4_K: (0, 2), Q.Q5_K: (0, 2), Q.Q6_K: (208,)}
# Round-trip error bound relative to the tensor's max |x|: a half step of the grid or less.
# (One step where the grid is clamped at its asymmetric end: Q4_0, Q5_0, Q8_0.)
TOLERANCE = {
    Q.F32: 0,
    Q.F16: 1e-3,
    Q.BF16: 4e-3,
    Q.Q8_0: 0.01,
    Q.Q5_0: 0.07,
    Q.Q5_1: 0.035,
    Q.Q4_0: 0.13,
    Q.Q4_1: 0.07,
}


def _scale_min_k4(scales: np.ndarray, j: int) -> tuple[np.ndarray, np.ndarray]:
    """ggml's get_scale_min_k4 over all blocks: 6-bit scale and min of sub-block j."""
    if j < 4:
        return scales[:, j] & 63, scales[:, j + 4] & 63
    return (
        (scales[:, j + 4] & 0xF) | ((scales[:, j - 4] >> 6) << 4),
        (scales[:, j + 4] >> 4) | ((scales[:, j] >> 6) << 4),
    )


def dequant_k_reference(raw: np.ndarray, qtype: Q) -> np.ndarray:
    """Q4_K/Q5_K/Q6_K as written in ggml-quants.c's dequantize_row_*, vectorised over blocks."""
    rows, b = raw.shape[0], raw.reshape(-1, K_BLOCK_BYTES[qtype])
    f16 = lambda lo: b[:, lo : lo + 2].copy().view(np.float16).astype(np.float32)[:, 0]  # noqa: E731
    y = np.zeros((b.shape[0], 256), np.float32)
    if qtype in (Q.Q4_K, Q.Q5_K):
        d, dmin, scales = f16(0), f16(2), b[:, 4:16]
        qh, ql = (b[:, 16:48], b[:, 48:176]) if qtype == Q.Q5_K else (None, b[:, 16:144])
        for chunk in range(4):
            for half in range(2):
                sc, m = _scale_min_k4(scales, 2 * chunk + half)
                q = (ql[:, 32 * chunk : 32 * chunk + 32] >> (4 * half)) & 0xF
                if qh is not None:
                    q = q + 16 * ((qh >> (2 * chunk + half)) & 1)
                d1, m1 = d * sc.astype(np.float32), dmin * m.astype(np.float32)
                y[:, 64 * chunk + 32 * half : 64 * chunk + 32 * half + 32] = d1[:, None] * q - m1[:, None]
    else:
        ql, qh, sc, d = b[:, :128], b[:, 128:192], b[:, 192:208].view(np.int8), f16(208)
        for n in range(2):
            lo, hi, s = ql[:, 64 * n : 64 * n + 64], qh[:, 32 * n : 32 * n + 32], sc[:, 8 * n : 8 * n + 8]
            for k, (nibbles, shift) in enumerate(
                [(lo[:, :32] & 0xF, 0), (lo[:, 32:] & 0xF, 2), (lo[:, :32] >> 4, 4), (lo[:, 32:] >> 4, 6)]
            ):
                q = (nibbles | (((hi >> shift) & 3) << 4)).astype(np.float32) - 32
                scale = np.repeat(s[:, [2 * k, 2 * k + 1]].astype(np.float32), 16, axis=1)
                y[:, 128 * n + 32 * k : 128 * n + 32 * k + 32] = d[:, None] * scale * q
    return y.reshape(rows, -1)


def _random_k_blocks(rng: np.random.Generator, shape: tuple[int, int], qtype: Q) -> np.ndarray:
    """Random K-quant blocks for a float tensor of ``shape``, with finite small f16 scales."""
    raw = rng.integers(0, 256, size=(shape[0], shape[1] // 256 * K_BLOCK_BYTES[qtype]), dtype=np.uint8)
    blocks = raw.reshape(-1, K_BLOCK_BYTES[qtype])  # a view: writes land in raw
    for off in K_SCALE_OFFSETS[qtype]:
        scale = rng.uniform(1e-3, 1e-2, (blocks.shape[0], 1)).astype(np.float16)
        blocks[:, off : off + 2] = scale.view(np.uint8)
    return raw


def llama_cpp_rope_freqs(factor: float, theta: float = 5000.0, dim: int = 64) -> np.ndarray:
    """llama.cpp's convert_hf_to_gguf.py (LlamaModel) for llama3 rope_scaling, verbatim in spirit."""
    low_freq_factor, high_freq_factor, old_context_len = 1.0, 4.0, 8192
    rope_factors = []
    for i in range(0, dim, 2):
        wavelen = 2 * math.pi / (1.0 / theta ** (i / dim))
        if wavelen < old_context_len / high_freq_factor:
            rope_factors.append(1)
        elif wavelen > old_context_len / low_freq_factor:
            rope_factors.append(factor)
        else:
            smooth = (old_context_len / wavelen - low_freq_factor) / (high_freq_factor - low_freq_factor)
            rope_factors.append(1 / ((1 - smooth) / factor + smooth))
    return np.array(rope_factors, np.float32)


def write_tiny_gguf(
    path, arch: str, rng: np.random.Generator, rope_freqs: np.ndarray | None = None
) -> tuple[dict[str, np.ndarray], dict[str, Q]]:
    """A 2-layer model cycling its matrices through every supported type.

    Returns the expected float32 value of each GGUF tensor (numpy order) and its type
    (``rope_freqs``, when given, is written but is not a weight).
    """
    writer = GGUFWriter(str(path), arch)
    writer.add_block_count(LAYERS)
    writer.add_context_length(512)
    writer.add_embedding_length(HIDDEN)
    writer.add_feed_forward_length(FFN)
    writer.add_head_count(HEADS)
    writer.add_head_count_kv(KV_HEADS)
    writer.add_rope_freq_base(5000.0)
    writer.add_layer_norm_rms_eps(1e-6)
    writer.add_tokenizer_model("gpt2")
    writer.add_token_list([f"t{i}" for i in range(VOCAB)])
    writer.add_bos_token_id(3)
    writer.add_eos_token_id(4)
    if arch == "qwen2":
        writer.add_rope_scaling_type(RopeScalingType.YARN)
        writer.add_rope_scaling_factor(4.0)
        writer.add_rope_scaling_orig_ctx_len(128)
    shapes = {
        "token_embd.weight": (VOCAB, HIDDEN),
        "output_norm.weight": (HIDDEN,),
        "output.weight": (VOCAB, HIDDEN),
    }
    for i in range(LAYERS):
        kv = HIDDEN // HEADS * KV_HEADS
        shapes |= {
            f"blk.{i}.attn_norm.weight": (HIDDEN,),
            f"blk.{i}.attn_q.weight": (HIDDEN, HIDDEN),
            f"blk.{i}.attn_k.weight": (kv, HIDDEN),
            f"blk.{i}.attn_v.weight": (kv, HIDDEN),
            f"blk.{i}.attn_output.weight": (HIDDEN, HIDDEN),
            f"blk.{i}.ffn_norm.weight": (HIDDEN,),
            f"blk.{i}.ffn_gate.weight": (FFN, HIDDEN),
            f"blk.{i}.ffn_up.weight": (FFN, HIDDEN),
            f"blk.{i}.ffn_down.weight": (HIDDEN, FFN),
        }
        if arch == "qwen2":
            shapes |= {
                f"blk.{i}.attn_q.bias": (HIDDEN,),
                f"blk.{i}.attn_k.bias": (kv,),
                f"blk.{i}.attn_v.bias": (kv,),
            }
    cycle = iter(K_QUANTS + QUANTIZED + K_QUANTS + QUANTIZED)
    expected, types = {}, {}
    for name, shape in shapes.items():
        qtype = Q.F32 if len(shape) == 1 else next(cycle)
        if qtype in K_QUANTS:
            raw = _random_k_blocks(rng, shape, qtype)
            # Q2_K/Q3_K: gguf-py's dequantize is the reference (checks the loader's plumbing only).
            by_hand = qtype in (Q.Q4_K, Q.Q5_K, Q.Q6_K)
            value = dequant_k_reference(raw, qtype) if by_hand else dequantize(raw, qtype)
        else:
            x = rng.standard_normal(shape).astype(np.float32)
            raw = quantize(x, qtype)
            value = dequantize(raw, qtype)
            tol = TOLERANCE[qtype] * np.abs(x).max()
            assert np.abs(value - x).max() <= tol, qtype  # the grid is what the type promises
        writer.add_tensor(name, raw, raw_dtype=None if qtype in (Q.F32, Q.F16) else qtype)
        expected[name], types[name] = np.asarray(value, np.float32), qtype
    if rope_freqs is not None:
        writer.add_tensor("rope_freqs.weight", rope_freqs)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return expected, types


GGUF_TO_HF = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
    "attn_norm": "input_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "ffn_norm": "post_attention_layernorm",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}


@pytest.mark.parametrize(
    ("arch", "dtype"), [("llama", torch.float32), ("qwen2", torch.bfloat16)], ids=["llama-f32", "qwen2-bf16"]
)
def test_synthetic_gguf_every_type(tmp_path, arch, dtype):
    rope_freqs = llama_cpp_rope_freqs(factor=32.0) if arch == "llama" else None
    expected, types = write_tiny_gguf(tmp_path / "tiny.gguf", arch, np.random.default_rng(0), rope_freqs)
    assert set(types.values()) == set(QUANTIZED + K_QUANTS)
    config, state = load_gguf(tmp_path / "tiny.gguf", dtype)

    assert len(state) == len(expected)
    for gguf_name, value in expected.items():
        if gguf_name in GGUF_TO_HF:
            name = GGUF_TO_HF[gguf_name]
        else:
            _, layer, part, kind = gguf_name.split(".")
            name = f"model.layers.{layer}.{GGUF_TO_HF[part]}.{kind}"
        want = torch.from_numpy(value)
        if arch == "qwen2" and ("attn_q" in gguf_name or "attn_k" in gguf_name):
            # llama.cpp stores NEOX-RoPE (qwen2) q/k in HF order: the loader interleaves them.
            want = interleave_reference(want, HEADS if "attn_q" in gguf_name else KV_HEADS)
        assert state[name].dtype == dtype
        torch.testing.assert_close(
            state[name], want.to(dtype), rtol=0, atol=0, msg=f"{gguf_name} ({types[gguf_name].name})"
        )

    assert (config.architecture, config.num_hidden_layers, config.hidden_size, config.intermediate_size) == (
        arch,
        LAYERS,
        HIDDEN,
        FFN,
    )
    assert (config.num_attention_heads, config.num_key_value_heads, config.head_dim) == (HEADS, KV_HEADS, 64)
    assert (config.vocab_size, config.max_position_embeddings, config.rope_theta) == (VOCAB, 512, 5000.0)
    assert config.rms_norm_eps == pytest.approx(1e-6) and not config.tie_word_embeddings
    assert (config.bos_token_id, config.eos_token_ids, config.name) == (3, [4], "tiny")
    assert config.attention_bias == (arch == "qwen2")
    if arch == "qwen2":
        assert config.rope_scaling == {
            "rope_type": "yarn",
            "factor": 4.0,
            "original_max_position_embeddings": 128,
        }
    else:  # recovered from rope_freqs.weight, which is not in the state dict
        assert config.rope_scaling == {
            "rope_type": "llama3",
            "factor": 32.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 8192,
        }


def test_gguf_rope_freqs_that_no_llama3_defaults_give_are_applied_as_divisors(tmp_path):
    """llama.cpp divides each RoPE frequency by its ``rope_freqs`` entry whatever computed it (Llama 3's
    scaling with another original context, say): so does astrai; a tensor of the wrong length is refused."""
    from astrai.extension import RotaryEmbedding

    rope_freqs = llama_cpp_rope_freqs(factor=8.0)
    rope_freqs[-3] *= 1.5  # no llama3 parameter set gives this
    write_tiny_gguf(tmp_path / "odd.gguf", "llama", np.random.default_rng(1), rope_freqs)
    config, _ = load_gguf(tmp_path / "odd.gguf", torch.float32)
    assert config.rope_scaling == {"rope_type": "freq_factors", "freq_factors": rope_freqs.tolist()}
    table = RotaryEmbedding(64, 16, 5000.0, config.rope_scaling).freqs_cis  # [position, pair, cos/sin]
    inv_freq = 1.0 / 5000.0 ** (np.arange(0, 64, 2) / 64) / rope_freqs.astype(np.float64)
    angles = np.arange(16)[:, None] * inv_freq[None, :]
    np.testing.assert_allclose(table[..., 0].numpy(), np.cos(angles), atol=1e-6)
    np.testing.assert_allclose(table[..., 1].numpy(), np.sin(angles), atol=1e-6)
    write_tiny_gguf(tmp_path / "short.gguf", "llama", np.random.default_rng(1), rope_freqs[:-1])
    with pytest.raises(ModelFormatError, match="rope_freqs.*31.*32 positive divisors"):
        load_gguf(tmp_path / "short.gguf", torch.float32)


def test_gguf_unsupported_type_names_tensor(tmp_path):
    writer = GGUFWriter(str(tmp_path / "f64.gguf"), "llama")
    for key, value in [
        ("block_count", 1),
        ("context_length", 8),
        ("embedding_length", 4),
        ("feed_forward_length", 4),
        ("attention.head_count", 1),
    ]:
        writer.add_uint32(f"llama.{key}", value)
    writer.add_tensor("token_embd.weight", np.zeros((2, 4), np.float64))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    with pytest.raises(ModelNotFound, match=r"'token_embd.weight' has type F64"):
        load_gguf(tmp_path / "f64.gguf", torch.float32)


def test_gguf_unreadable_file(tmp_path):
    (tmp_path / "bad.gguf").write_bytes(b"not a gguf file at all")
    with pytest.raises(ModelNotFound, match="not a readable GGUF"):
        load_gguf(tmp_path / "bad.gguf", torch.float32)


# ---------------------------------------------------------------- HF folders


def _random_hf_model(arch: str):
    from transformers import LlamaConfig, LlamaForCausalLM, Qwen2Config, Qwen2ForCausalLM

    common = dict(
        vocab_size=64,
        hidden_size=64,
        intermediate_size=96,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=128,
        bos_token_id=1,
    )
    if arch == "llama":
        scaling = {
            "rope_type": "llama3",
            "factor": 8.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 64,
            "rope_theta": 5000.0,
        }
        model = LlamaForCausalLM(
            LlamaConfig(**common, rope_parameters=scaling, eos_token_id=[2, 3], tie_word_embeddings=False)
        )
    else:
        model = Qwen2ForCausalLM(Qwen2Config(**common, eos_token_id=5, tie_word_embeddings=True))
    gen = torch.Generator().manual_seed(7)
    with torch.no_grad():
        for p in model.parameters():  # biases too: transformers initialises them to zero
            p.copy_(torch.randn(p.shape, generator=gen))
    return model


@pytest.mark.parametrize(
    ("arch", "shard", "dtype"),
    [("llama", None, torch.float32), ("qwen2", "20KB", torch.bfloat16)],
    ids=["llama-single-f32", "qwen2-sharded-bf16"],
)
def test_hf_folder(tmp_path, arch, shard, dtype):
    model = _random_hf_model(arch)
    model.save_pretrained(tmp_path, **({"max_shard_size": shard} if shard else {}))
    assert (tmp_path / "model.safetensors.index.json").is_file() == bool(shard)
    config, state = load_hf(tmp_path, dtype)

    original = model.state_dict()
    if arch == "qwen2":
        assert torch.equal(original.pop("lm_head.weight"), original["model.embed_tokens.weight"])  # tied
    assert set(state) == set(original)
    heads = {"q_proj": 4, "k_proj": 2}
    for name, value in original.items():
        proj = name.split(".")[-2]
        want = interleave_reference(value, heads[proj]) if proj in heads else value
        assert state[name].dtype == dtype
        assert torch.equal(state[name], want.to(dtype)), name

    assert (config.architecture, config.num_hidden_layers, config.hidden_size, config.head_dim) == (
        arch,
        2,
        64,
        16,
    )
    assert (config.num_attention_heads, config.num_key_value_heads, config.vocab_size) == (4, 2, 64)
    assert (config.intermediate_size, config.max_position_embeddings, config.bos_token_id) == (96, 128, 1)
    assert config.tie_word_embeddings == (arch == "qwen2") and config.attention_bias == (arch == "qwen2")
    if arch == "llama":
        assert config.rope_theta == 5000.0 and config.eos_token_ids == [2, 3]
        assert config.rope_scaling == {
            "rope_type": "llama3",
            "factor": 8.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 64,
        }
    else:
        assert config.rope_theta == 10000.0 and config.eos_token_ids == [5] and config.rope_scaling is None


def test_hf_folder_without_weights(tmp_path):
    (tmp_path / "config.json").write_text('{"model_type": "llama"}')
    with pytest.raises(ModelNotFound):
        load_hf(tmp_path, torch.float32)
    (tmp_path / "config.json").write_text('{"model_type": "gpt2"}')
    with pytest.raises(ModelNotFound, match="gpt2"):
        load_hf(tmp_path, torch.float32)


def test_interleaved_rows_preserve_attention_scores():
    """HF rope (rotate_half) on W x equals interleaved-pair rope on permuted W x, score for score."""
    from transformers.models.llama.modeling_llama import rotate_half

    n_head, d, hidden, seq = 3, 8, 12, 5
    gen = torch.Generator().manual_seed(3)
    wq, wk = torch.randn(n_head * d, hidden, generator=gen), torch.randn(n_head * d, hidden, generator=gen)
    x = torch.randn(seq, hidden, generator=gen)
    angles = torch.arange(seq)[:, None] * 10000.0 ** (-torch.arange(0, d, 2) / d)  # [seq, d/2]

    def hf_rope(t):  # [seq, heads, d], halves rotate together
        cos, sin = torch.cat([angles.cos()] * 2, -1)[:, None], torch.cat([angles.sin()] * 2, -1)[:, None]
        return t * cos + rotate_half(t) * sin

    def interleaved_rope(t):  # pairs (2i, 2i+1) rotate together
        z = torch.view_as_complex(t.reshape(*t.shape[:-1], d // 2, 2).contiguous())
        return torch.view_as_real(z * torch.polar(torch.ones_like(angles), angles)[:, None]).flatten(-2)

    def scores(q, k):
        return torch.einsum("qhd,khd->hqk", q, k)

    q_hf, k_hf = hf_rope((x @ wq.T).view(seq, n_head, d)), hf_rope((x @ wk.T).view(seq, n_head, d))
    wq2, wk2 = interleave_rope_rows(wq, n_head), interleave_rope_rows(wk, n_head)
    q2, k2 = (
        interleaved_rope((x @ wq2.T).view(seq, n_head, d)),
        interleaved_rope((x @ wk2.T).view(seq, n_head, d)),
    )
    torch.testing.assert_close(scores(q2, k2), scores(q_hf, k_hf), rtol=1e-5, atol=1e-4)
    assert torch.equal(wq2, interleave_reference(wq, n_head))
    bias = torch.arange(n_head * d, dtype=torch.float32)
    assert torch.equal(interleave_rope_rows(bias, n_head), interleave_reference(bias, n_head))


# ---------------------------------------------------------------- metadata checked against the tensors

BLOCK_SHAPES = {  # GGUF tensor kind -> shape (numpy order) in write_checked_gguf's model
    "attn_norm.weight": (HIDDEN,),
    "attn_q.weight": (HIDDEN, HIDDEN),
    "attn_k.weight": (HIDDEN // HEADS * KV_HEADS, HIDDEN),
    "attn_v.weight": (HIDDEN // HEADS * KV_HEADS, HIDDEN),
    "attn_output.weight": (HIDDEN, HIDDEN),
    "ffn_norm.weight": (HIDDEN,),
    "ffn_gate.weight": (FFN, HIDDEN),
    "ffn_up.weight": (FFN, HIDDEN),
    "ffn_down.weight": (HIDDEN, FFN),
}


def write_checked_gguf(
    path, meta: dict | None = None, drop: tuple[str, ...] = (), vocab_rows: int = VOCAB
) -> None:
    """A 2-layer F32 llama GGUF (zeros) whose metadata ``meta`` overrides (key after ``llama.``);
    the tensors named in ``drop`` are left out."""
    values = {
        "block_count": LAYERS,
        "context_length": 512,
        "embedding_length": HIDDEN,
        "feed_forward_length": FFN,
        "attention.head_count": HEADS,
        "attention.head_count_kv": KV_HEADS,
    }
    writer = GGUFWriter(str(path), "llama")
    for key, value in (values | (meta or {})).items():
        writer.add_uint32(f"llama.{key}", value)
    writer.add_tokenizer_model("gpt2")
    writer.add_token_list([f"t{i}" for i in range(VOCAB)])
    shapes = {"token_embd.weight": (vocab_rows, HIDDEN), "output_norm.weight": (HIDDEN,)}
    for i in range(LAYERS):
        shapes |= {f"blk.{i}.{kind}": shape for kind, shape in BLOCK_SHAPES.items()}
    for name, shape in shapes.items():
        if name not in drop:
            writer.add_tensor(name, np.zeros(shape, np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


def test_a_consistent_gguf_passes_the_checks(tmp_path):
    write_checked_gguf(tmp_path / "ok.gguf")
    config, state = load_gguf(tmp_path / "ok.gguf", torch.float32)
    assert (config.num_hidden_layers, config.head_dim, config.vocab_size) == (LAYERS, HIDDEN // HEADS, VOCAB)
    assert len(state) == 2 + LAYERS * len(BLOCK_SHAPES)


GGUF_CASES = [  # metadata overrides, tensors left out, embedding rows; what the error says
    pytest.param(
        {"block_count": 10**6},
        (),
        VOCAB,
        r"\.block_count is 1000000, but the file holds the tensors "
        r"of 2 blocks \(0-1\)",
        id="blocks-1e6",
    ),
    pytest.param(
        {"block_count": 1},
        (),
        VOCAB,
        r"\.block_count is 1, but the file holds the tensors of 2 blocks",
        id="blocks-fewer",
    ),
    pytest.param(
        {"attention.head_count": 0},
        (),
        VOCAB,
        r"\.attention\.head_count is 0: it must be positive",
        id="heads-0",
    ),
    pytest.param(
        {"attention.head_count_kv": 0},
        (),
        VOCAB,
        r"\.head_count_kv is 0: it must be positive",
        id="kv-heads-0",
    ),
    pytest.param(
        {"attention.head_count_kv": 3},
        (),
        VOCAB,
        r"head_count_kv 3 does not divide llama\."
        r"attention\.head_count 4",
        id="kv-heads-no-divisor",
    ),
    pytest.param(
        {"attention.head_count": 3, "attention.head_count_kv": 3},
        (),
        VOCAB,
        r"head_count 3 does not divide llama\.embedding_length 256, and no head dim",
        id="heads-no-divisor",
    ),
    pytest.param(
        {"attention.key_length": 32},
        (),
        VOCAB,
        r"head_count 4 x head dim 32 makes 128 rows, but "
        r"blk\.0\.attn_q\.weight has 256",
        id="head-dim-vs-q",
    ),
    pytest.param(
        {"attention.key_length": 63},
        (),
        VOCAB,
        r"\.key_length is 63: rotary embeddings need an even",
        id="head-dim-odd",
    ),
    pytest.param(
        {"embedding_length": 128},
        (),
        VOCAB,
        r"\.embedding_length is 128, but token_embd\.weight has "
        r"shape \[32, 256\]",
        id="hidden-vs-embedding",
    ),
    pytest.param(
        {"feed_forward_length": 512},
        (),
        VOCAB,
        r"\.feed_forward_length is 512, but blk\.0\.ffn_gate",
        id="ffn-vs-gate",
    ),
    pytest.param(
        {"context_length": 0}, (), VOCAB, r"\.context_length is 0: it must be positive", id="context-0"
    ),
    pytest.param(
        {},
        (),
        40,
        r"vocab size \(the entries of tokenizer\.ggml\.tokens\) is 32, but token_embd",
        id="vocab-vs-embedding",
    ),
    pytest.param(
        {},
        ("blk.1.ffn_up.weight",),
        VOCAB,
        r"tensors missing: model\.layers\.1\.mlp\.up_proj\.weight",
        id="missing-tensor",
    ),
]


@pytest.mark.parametrize(("meta", "drop", "vocab_rows", "message"), GGUF_CASES)
def test_gguf_metadata_that_contradicts_the_tensors_is_refused_naming_the_field(
    tmp_path, meta, drop, vocab_rows, message
):
    path = tmp_path / "bad.gguf"
    write_checked_gguf(path, meta, drop, vocab_rows)
    with pytest.raises(ModelFormatError, match=message) as info:
        load_gguf(path, torch.float32)
    assert str(info.value).startswith(f"{path}: ")
    with pytest.raises(
        ModelFormatError, match=message
    ):  # the header alone says it (read_config, open_checkpoint)
        read_config(str(path))


@pytest.mark.parametrize(
    "keep", [0.01, 0.3, 0.9999], ids=["in-the-metadata", "in-the-data", "the-last-bytes"]
)
def test_a_truncated_gguf_is_refused_naming_the_file(tmp_path, default_gguf, keep):
    data = default_gguf.read_bytes()
    path = tmp_path / "cut.gguf"
    path.write_bytes(data[: int(len(data) * keep)])
    with pytest.raises(
        ModelFormatError, match=rf"^{re.escape(str(path))}: truncated: the file has \d+ bytes"
    ):
        open_checkpoint(str(path))


def test_parameter_shapes_are_the_shapes_of_the_model_built(tiny_model):
    from astrai.model import build_model

    for config in (
        tiny_model.config,
        dataclasses.replace(tiny_model.config, attention_bias=True, tie_word_embeddings=True),
    ):
        model = build_model(config, torch.float32)
        built = {name: tuple(p.shape) for name, p in model.named_parameters()}
        if config.tie_word_embeddings:
            built.pop("lm_head.weight", None)
        assert type(model).parameter_shapes(config) == built


def test_a_model_built_for_loading_holds_no_parameter_until_its_weights_come(tiny_model):
    """``build_model(random_init=False)``: every parameter on the meta device (a mixture of experts kept
    quantized never exists in float), the RoPE table real; ``load_weights`` gives each parameter its
    tensor (a copy, in the model's dtype) and ties the LM head to the embeddings again."""
    from astrai.model import build_model

    config = dataclasses.replace(tiny_model.config, tie_word_embeddings=True)
    model = build_model(config, torch.bfloat16, random_init=False)
    assert all(p.is_meta for p in model.parameters())
    assert not model.rotary.freqs_cis.is_meta and model.rotary.freqs_cis.dtype == torch.float32
    weights = {name: torch.randn(shape) for name, shape in type(model).parameter_shapes(config).items()}
    model.load_weights(weights)
    for name, p in model.named_parameters():
        assert p.dtype == torch.bfloat16 and torch.equal(p, weights[name].bfloat16()), name
    assert model.lm_head.weight is model.model.embed_tokens.weight


def test_the_rotary_table_is_sized_by_the_context_served(tiny_model):
    from astrai.model import build_model

    huge = dataclasses.replace(tiny_model.config, max_position_embeddings=2**31 - 1)
    model = build_model(huge, torch.float32, max_seq_len=64)  # 2**31 positions would be 512 GiB of table
    assert model.rotary.freqs_cis.shape == (64, huge.head_dim // 2, 2)
    assert model.config.max_position_embeddings == 64 and huge.max_position_embeddings == 2**31 - 1
    # paged, the context is also capped by the pool's slots: a request never holds more positions
    kv = kv_config(EngineConfig(kv_memory_bytes=1 << 20, max_batch_size=2), huge, torch.float32)
    per_token = 2 * huge.num_hidden_layers * huge.num_key_value_heads * huge.head_dim * 4
    assert kv.max_seq_len == (1 << 20) // per_token // 16 * 16


def test_the_memory_check_refuses_before_reading_a_weight(tmp_path, monkeypatch):
    import astrai.model
    from astrai.model import budget

    write_checked_gguf(tmp_path / "ok.gguf")
    monkeypatch.setattr(budget, "available_memory", lambda device="cpu": (2**30, "a test's 1 GiB"))
    monkeypatch.setattr(
        astrai.model, "read_weights", lambda *a, **k: pytest.fail("weights read before the check")
    )
    with pytest.raises(
        InsufficientMemory,
        match=r"needs about 1\.0 TiB .*1\.0 TiB KV pool.* the 1\.0 GiB available \(a test's",
    ):
        astrai.model.load_model(str(tmp_path / "ok.gguf"), torch.float32, reserve={"KV pool": 2**40})
    assert budget.weight_bytes(
        open_checkpoint(str(tmp_path / "ok.gguf")).tensors, torch.bfloat16, lambda n, i: False
    )[0] == ((VOCAB * HIDDEN + HIDDEN + LAYERS * sum(math.prod(s) for s in BLOCK_SHAPES.values())) * 2)


def test_available_memory_is_at_most_memavailable():
    from astrai.model.budget import available_memory

    room, where = available_memory()
    meminfo = Path("/proc/meminfo").read_text()
    total = int(next(line for line in meminfo.splitlines() if line.startswith("MemTotal:")).split()[1]) * 1024
    assert 0 <= room <= total and where


def _checked_hf_folder(tmp_path, **config):
    model = _random_hf_model("llama")
    model.save_pretrained(tmp_path)
    path = tmp_path / "config.json"
    path.write_text(json.dumps(json.loads(path.read_text()) | config))
    return path


@pytest.mark.parametrize(
    ("config", "message"),
    [
        (
            {"num_hidden_layers": 1000000},
            r"num_hidden_layers is 1000000, but the file holds the tensors of 2 blocks",
        ),
        ({"num_attention_heads": 0}, r"num_attention_heads is 0: it must be positive"),
        (
            {"num_attention_heads": 3, "num_key_value_heads": 3, "head_dim": None},
            r"num_attention_heads 3 does not divide hidden_size 64, and no head dim is given",
        ),
        ({"num_key_value_heads": 3}, r"num_key_value_heads 3 does not divide num_attention_heads 4"),
        (
            {"num_key_value_heads": 4},
            r"num_key_value_heads 4 x head dim 16 makes 64 rows, but model\.layers\.0\.self_attn",
        ),
        ({"vocab_size": 65}, r"vocab_size is 65, but model\.embed_tokens\.weight has shape \[64, 64\]"),
        ({"max_position_embeddings": -1}, r"max_position_embeddings is -1: it must be positive"),
        ({"hidden_size": "big"}, r"config\.json: invalid literal"),
        ({"sliding_window": -4}, r"sliding_window is -4: a window must be positive"),
        (
            {"sliding_window": 4, "layer_types": ["sliding_attention"]},
            r"layer_types names 1 layers, but the model has 2",
        ),
        (
            {"sliding_window": 4, "layer_types": ["sliding_attention", "linear_attention"]},
            r"layer_types has \['linear_attention'\]: astrai serves",
        ),
        ({"partial_rotary_factor": 0.01}, r"rotary_dim is 0: rotated dims must be even"),
        ({"final_logit_softcapping": -1.0}, r"final_logit_softcapping is -1.0: it must be a positive number"),
    ],
    ids=[
        "layers",
        "heads-0",
        "heads-no-divisor",
        "kv-heads-no-divisor",
        "kv-heads-vs-k",
        "vocab",
        "context",
        "not-a-number",
        "window",
        "layer-types-count",
        "layer-types-kind",
        "rotary-dim",
        "softcap",
    ],
)
def test_hf_config_that_contradicts_the_tensors_is_refused_naming_the_field(tmp_path, config, message):
    path = _checked_hf_folder(tmp_path, **config)
    with pytest.raises(ModelFormatError, match=message) as info:
        load_hf(tmp_path, torch.float32)
    assert str(info.value).startswith(f"{path}: ")


def test_a_truncated_safetensors_file_is_refused_naming_the_file(tmp_path):
    _checked_hf_folder(tmp_path)
    weights = tmp_path / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[:-1000])
    with pytest.raises(ModelFormatError, match=rf"^{re.escape(str(weights))}: truncated"):
        load_hf(tmp_path, torch.float32)
