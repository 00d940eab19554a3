"""Every architecture astrai serves against HF transformers, the oracle, on tiny random checkpoints.

Each family's checkpoint (``families``: built once per session from transformers' own config class)
is saved as safetensors and loaded through astrai's HF loader. Checked for each family:

- float32 logits of every prompt position equal transformers' to a tolerance, on torch_native and on
  the cpu backend, for a fresh prompt and for the same prompt in chunks over a cached prefix;
- greedy tokens through ``InferenceEngine`` (chunked prefill, prefix-cache hits, preemption in a
  small pool) equal transformers' ``generate`` for 32 tokens, up to where transformers' own top two
  are too close to call.

The same checkpoints written as llama.cpp writes them are checked in ``test_families_gguf``.
"""

from __future__ import annotations

import math

import pytest
import torch
from families import FAMILIES, MOE_FAMILIES, SIZES, VOCAB, clear_prefix, forward_all, load_astrai, prompts

from astrai.kvcache.layout import KVLayout

pytestmark = pytest.mark.usefixtures("one_torch_thread")


@pytest.mark.parametrize("backend", ["torch_native", "cpu"])
@pytest.mark.parametrize("family", FAMILIES + MOE_FAMILIES)
def test_logits_match_transformers(checkpoints, family, backend):
    from astrai.extension import attn_backend

    folder, hf = checkpoints[family]
    model = load_astrai(folder)
    assert model.config.architecture == hf.config.model_type
    for ids in prompts(2, seed=5):
        with torch.no_grad():
            want = hf(torch.tensor([ids])).logits[0]
        with attn_backend(backend):
            fresh = forward_all(model, ids, [len(ids)])
            chunked = forward_all(model, ids, [7, 1, len(ids) - 12, 4])
        scale = want.abs().max()
        torch.testing.assert_close(fresh, want, rtol=0, atol=2e-4 * scale)
        torch.testing.assert_close(chunked, want, rtol=0, atol=2e-4 * scale)


@pytest.mark.parametrize("family", FAMILIES + MOE_FAMILIES)
def test_greedy_matches_transformers_through_the_engine(checkpoints, make_engine, tiny_tokenizer, family):
    """Chunked prefill (16 tokens a step), prefix-cache hits (prompts sharing 24 tokens, pages of 4) and
    preemption (a pool of 176 tokens for 4 requests of up to 72). Where layers have a window of 8, their
    pages leave the pool as the window slides: there the pool has room for 1.2 requests of 72
    positions as the layer groups hold them, and the chunks are of 4 tokens, so that the global layers' growth still preempts; a model
    of windowed layers only never outgrows what it was admitted with, so it waits instead."""
    from astrai.sampling import SamplingParams

    folder, hf = checkpoints[family]
    base = prompts(3, seed=9)
    batch = [*base, base[2][:24] + base[0][:16]]  # the last shares 24 tokens with the third
    model = load_astrai(folder)
    windowed = any(model.config.windows)
    n_tokens = 176
    if windowed:  # room for 1.2 requests of 72 positions, as the layer groups hold them
        layout = KVLayout.of(model.config.windows)
        n_tokens = math.ceil(1.2 * layout.pages(72, 4, 4) / layout.n_groups) * 4
    engine = make_engine(
        model,
        tiny_tokenizer,
        max_prefill_tokens=4 if windowed else 16,
        page_size=4,
        n_tokens=n_tokens,
        max_batch_size=4,
    )
    assert engine.pool.layout.trivial == (not windowed)
    params = SamplingParams(max_tokens=32, temperature=0.0, ignore_eos=True)
    results = [engine.submit(p, params) for p in batch]
    for prompt, result in zip(batch, results, strict=True):
        result.wait_completion()
        result.raise_for_error()
        want, clear = clear_prefix(hf, prompt, 32)
        assert clear >= 8, f"transformers' greedy path is a near tie after {clear} tokens"
        assert result.output_ids[:clear] == want[:clear]
    assert results[3].cached_tokens >= 20  # the shared prefix's whole pages
    if engine.pool.layout.n_global:
        assert engine.scheduler.policy.counters["preemptions"] > 0


def test_phi3_longrope_takes_its_long_factors_for_a_context_past_the_original(tmp_path):
    """LongRoPE's factors are chosen by the context served, as llama.cpp and vLLM choose them: serving
    at most the original context (64 here), the short ones, which transformers takes for a sequence
    that short; serving more, the long ones for every position, which transformers takes for a
    sequence past the original context."""
    import transformers as tf

    from astrai.model import build_model, read_checkpoint

    rope = {
        "rope_type": "longrope",
        "rope_theta": 10000.0,
        "partial_rotary_factor": 0.5,
        "short_factor": [1.0, 1.1, 1.2, 1.3],
        "long_factor": [2.0, 2.5, 3.0, 3.5],
        "original_max_position_embeddings": 64,
    }
    sizes = {k: v for k, v in SIZES.items() if k != "head_dim"}
    config = tf.Phi3Config(
        **sizes, num_hidden_layers=2, rope_parameters=rope, original_max_position_embeddings=64
    )
    hf = tf.AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()
    gen = torch.Generator().manual_seed(7)
    with torch.no_grad():
        for p in hf.parameters():
            p.copy_(
                1.0 + 0.2 * torch.randn(p.shape, generator=gen)
                if p.dim() == 1
                else torch.randn(p.shape, generator=gen) / p.shape[-1] ** 0.5
            )
    hf.save_pretrained(tmp_path)
    ids = torch.randint(2, VOCAB, (80,), generator=gen).tolist()
    for served, prompt in ((64, ids[:40]), (None, ids)):
        cfg, weights, _, _ = read_checkpoint(str(tmp_path), torch.float32)
        model = build_model(cfg, torch.float32, random_init=False, max_seq_len=served)
        model.load_weights(weights)
        model.fuse_projections()
        with torch.no_grad():
            want = hf(torch.tensor([prompt])).logits[0]
        got = forward_all(model, prompt, [len(prompt)])
        torch.testing.assert_close(got, want, rtol=0, atol=2e-4 * want.abs().max())
    short = build_model(cfg, torch.float32, random_init=False, max_seq_len=64)
    assert not torch.equal(short.rotary.freqs_cis[:64], model.rotary.freqs_cis[:64])  # the factors differ
