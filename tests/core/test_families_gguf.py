"""Every family's tiny checkpoint (``families``) written as a GGUF file the way llama.cpp's converter
writes it (``gguf_families``: its tensor names, metadata keys, q/k permutation, Gemma's ``1 + w``
norms, Phi-3's fused tensors and LongRoPE factors, Llama 3's ``rope_freqs``), read through astrai's
GGUF loader, against transformers on what the file holds (the checkpoint's weights, or their
dequantized values, under its config as llama.cpp reads the file).

- F32 files: astrai's state dict equals the one of the safetensors folder; float32 logits of every
  prompt position equal transformers' (the safetensors test's tolerance) on torch_native and cpu,
  fresh and in chunks over a cached prefix.
- Q8_0 and Q4_0 files (every 2-D tensor, embeddings and LM head included): the logits of both ways
  astrai can hold the weights, dequantized at load (what ``load_model`` does on a CPU without
  astrai-backend-cpu's AVX512-BF16 ``quant_linear`` kernel) and kept in blocks
  (``astrai.model.quant``, here on its torch reference), equal transformers' on the dequantized
  weights to the same tolerance, far tighter than what quantizing moved them; greedy tokens of the
  kept Q4_0 weights through the engine equal transformers' while its top two are clear;
  ``load_model`` serves a Q4_0 file with the tokenizer its metadata holds.

Not here: K-quants (gguf-py 0.19 cannot quantize to Q4_K or Q6_K, and these checkpoints' rows of
64 and 128 are shorter than a K-quant block of 256; ``test_loaders`` reads K-quant blocks), and the
AVX512-BF16 kernels themselves (``tests/backend_cpu``, on a CPU that has them).
"""

from __future__ import annotations

import pytest
import torch
from families import FAMILIES, MOE_FAMILIES, clear_prefix, forward_all, load_astrai, prompts
from gguf_families import CONVERTERS

pytestmark = pytest.mark.usefixtures("one_torch_thread")

QTYPES = ["Q8_0", "Q4_0"]


def _assert_logits(model, ref, ids: list[int], backend: str = "torch_native") -> torch.Tensor:
    """astrai's logits of ``ids``, fresh and chunked over a cached prefix, equal ``ref``'s; returns them."""
    from astrai.extension import attn_backend

    with torch.no_grad():
        want = ref(torch.tensor([ids])).logits[0]
    with attn_backend(backend):
        fresh = forward_all(model, ids, [len(ids)])
        chunked = forward_all(model, ids, [7, 1, len(ids) - 12, 4])
    scale = want.abs().max()
    torch.testing.assert_close(fresh, want, rtol=0, atol=2e-4 * scale)
    torch.testing.assert_close(chunked, want, rtol=0, atol=2e-4 * scale)
    return want


@pytest.mark.parametrize("family", FAMILIES)
def test_the_gguf_holds_the_safetensors_weights(checkpoints, family_gguf, family):
    """Name for name, in astrai's layout (q/k rows in interleaved RoPE pairs, fused tensors cut apart);
    Gemma's norms back from ``1 + w`` to float32 rounding."""
    from astrai.model import read_checkpoint

    folder, hf = checkpoints[family]
    path, _ = family_gguf(family)
    config, weights, kind, _ = read_checkpoint(str(path), torch.float32)
    _, want, _, _ = read_checkpoint(str(folder), torch.float32)
    assert kind == "gguf" and config.architecture == CONVERTERS[hf.config.model_type].arch
    assert sorted(weights) == sorted(want)
    for name, w in want.items():
        torch.testing.assert_close(weights[name], w, rtol=0, atol=2**-23 if "norm" in name else 0)


@pytest.mark.parametrize("backend", ["torch_native", "cpu"])
@pytest.mark.parametrize("family", FAMILIES + MOE_FAMILIES)
def test_gguf_logits_match_transformers(family_gguf, family, backend):
    path, ref = family_gguf(family)
    model = load_astrai(path)
    for ids in prompts(2, seed=5):
        _assert_logits(model, ref, ids, backend)


@pytest.mark.parametrize("qtype", QTYPES)
@pytest.mark.parametrize("family", FAMILIES)
def test_quantized_gguf_logits_match_transformers_on_the_dequantized_weights(
    checkpoints, family_gguf, family, qtype
):
    from astrai.model.quant import QuantizedEmbedding, QuantizedLinear

    path, ref = family_gguf(family, qtype)
    dense, kept = load_astrai(path), load_astrai(path, quantized=True)
    assert isinstance(kept.model.embed_tokens, QuantizedEmbedding)
    for layer in kept.model.layers:
        attn, mlp = layer.self_attn, layer.mlp
        for linear in (attn.qkv_proj, attn.o_proj, mlp.gate_up_proj, mlp.down_proj):
            assert isinstance(linear, QuantizedLinear)
    ids = prompts(1, seed=5)[0]
    for model in (dense, kept):
        want = _assert_logits(model, ref, ids)
    with torch.no_grad():  # the unquantized checkpoint: quantizing moved the logits past the tolerance
        moved = (checkpoints[family][1](torch.tensor([ids])).logits[0] - want).abs().max()
    assert moved > 20 * 2e-4 * want.abs().max()


@pytest.mark.parametrize("family", FAMILIES)
def test_quantized_gguf_greedy_matches_transformers_through_the_engine(
    family_gguf, make_engine, tiny_tokenizer, family
):
    """Q4_0 weights kept in blocks; chunked prefill (16 tokens a step) of two prompts, pages of 4."""
    from astrai.sampling import SamplingParams

    path, ref = family_gguf(family, "Q4_0")
    model = load_astrai(path, quantized=True)
    engine = make_engine(model, tiny_tokenizer, max_prefill_tokens=16, page_size=4, max_batch_size=2)
    params = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)
    batch = prompts(2, seed=9)
    results = [engine.submit(p, params) for p in batch]
    for prompt, result in zip(batch, results, strict=True):
        result.wait_completion()
        result.raise_for_error()
        want, clear = clear_prefix(ref, prompt, 24)
        assert clear >= 8, f"transformers' greedy path is a near tie after {clear} tokens"
        assert result.output_ids[:clear] == want[:clear]


def test_load_model_serves_a_quantized_family_gguf_with_its_tokenizer(family_gguf):
    """``load_model``, as ``astrai serve`` calls it: "auto" in float32 keeps the blocks where a quantized
    kernel takes float32 (astrai-backend-cpu on AVX2 or AVX512-BF16), else dense weights; the tokenizer
    and end ids from the file's metadata."""
    from astrai.model import load_model, quantized_kernels
    from astrai.model.quant import QuantizedLinear

    path, ref = family_gguf("gemma3", "Q4_0")
    model, tokenizer = load_model(str(path), torch.float32, weights="auto")
    kept = quantized_kernels("cpu", torch.float32) is None
    qkv = model.model.layers[0].self_attn.qkv_proj
    assert isinstance(qkv, QuantizedLinear if kept else torch.nn.Linear)
    assert model.config.eos_token_ids == [1] and tokenizer.decode(tokenizer.encode("the heat")) == "the heat"
    _assert_logits(model, ref, prompts(1, seed=5)[0])


@pytest.mark.parametrize("qtype", QTYPES)
@pytest.mark.parametrize("family", MOE_FAMILIES)
def test_quantized_experts_stay_quantized_and_match_transformers(checkpoints, family_gguf, family, qtype):
    """llama.cpp's stacked expert tensors (``ffn_*_exps``) read as each expert's own matrices, kept in
    blocks (each expert's gate and up fused); the logits equal transformers' on the dequantized
    weights, as the dense families' do."""
    from astrai.model.moe import SparseMoE
    from astrai.model.quant import QuantizedLinear

    path, ref = family_gguf(family, qtype)
    kept = load_astrai(path, quantized=True)
    moe = [layer.mlp for layer in kept.model.layers if isinstance(layer.mlp, SparseMoE)]
    assert moe and all(
        isinstance(x.gate_up_proj, QuantizedLinear) and isinstance(x.down_proj, QuantizedLinear)
        for layer in moe
        for x in layer.experts
    )
    _assert_logits(kept, ref, prompts(1, seed=5)[0])
