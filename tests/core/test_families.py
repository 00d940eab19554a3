"""Every architecture astrai serves against HF transformers, the oracle, on tiny random checkpoints.

Each family's checkpoint is built once per session from transformers' own config class (two or
three layers, a sliding window of 8 positions where the family has windows, so that the test
prompts of 20-40 tokens reach past it), saved as safetensors, and written as a GGUF with
llama.cpp's tensor names and metadata keys. Checked for each family:

- float32 logits of every prompt position equal transformers' to a tolerance, on torch_native and on
  the cpu backend, for a fresh prompt and for the same prompt in chunks over a cached prefix;
- greedy tokens through ``InferenceEngine`` (chunked prefill, prefix-cache hits, preemption in a
  small pool) equal transformers' ``generate`` for 32 tokens, up to where transformers' own top two
  are too close to call;
- the GGUF loads to the same weights as the safetensors folder.
"""

from __future__ import annotations

import pytest
import torch

VOCAB, WINDOW = 300, 8
SIZES = dict(
    vocab_size=VOCAB,
    hidden_size=64,
    intermediate_size=128,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=16,
    max_position_embeddings=256,
    bos_token_id=0,
    eos_token_id=1,
    pad_token_id=0,
)
#: margin (in logits) below which transformers' own greedy choice is a near tie
NEAR_TIE = 1e-3

pytestmark = pytest.mark.usefixtures("one_torch_thread")


def _hf_config(family: str):
    import transformers as tf

    sliding = ["sliding_attention", "full_attention", "sliding_attention"]
    if family == "qwen3":
        return tf.Qwen3Config(**SIZES, num_hidden_layers=2, tie_word_embeddings=False)
    if family == "mistral":
        return tf.MistralConfig(**SIZES, num_hidden_layers=2, sliding_window=WINDOW)
    if family == "ministral":
        return tf.MinistralConfig(**SIZES, num_hidden_layers=3, sliding_window=WINDOW, layer_types=sliding)
    if family == "llama3":
        rope = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0}
        rope |= {"original_max_position_embeddings": 32, "rope_theta": 5000.0}
        return tf.LlamaConfig(**SIZES, num_hidden_layers=2, rope_parameters=rope, tie_word_embeddings=True)
    if family == "gemma3":
        rope = {
            "full_attention": {"rope_type": "default", "rope_theta": 100000.0},
            "sliding_attention": {"rope_type": "default", "rope_theta": 1000.0},
        }
        return tf.Gemma3TextConfig(
            **SIZES,
            num_hidden_layers=3,
            sliding_window=WINDOW,
            layer_types=sliding,
            rope_parameters=rope,
            query_pre_attn_scalar=24,
        )
    if family == "gemma2":
        return tf.Gemma2Config(
            **SIZES,
            num_hidden_layers=2,
            sliding_window=WINDOW,
            attn_logit_softcapping=5.0,
            final_logit_softcapping=10.0,
            query_pre_attn_scalar=16,
        )
    if family == "phi3":
        rot = 8  # partial rotary: half of each head turns
        rope = {
            "rope_type": "longrope",
            "rope_theta": 10000.0,
            "partial_rotary_factor": 0.5,
            "short_factor": [1.0 + 0.1 * i for i in range(rot // 2)],
            "long_factor": [2.0 + 0.5 * i for i in range(rot // 2)],
            "original_max_position_embeddings": 64,
        }
        sizes = {k: v for k, v in SIZES.items() if k != "head_dim"}
        return tf.Phi3Config(**sizes, num_hidden_layers=2, rope_parameters=rope, tie_word_embeddings=False)
    raise AssertionError(family)


FAMILIES = ["qwen3", "gemma3", "gemma2", "mistral", "ministral", "phi3", "llama3"]


@pytest.fixture(scope="session")
def checkpoints(tmp_path_factory):
    """family -> (folder, the transformers model in float32), built once."""
    from transformers import AutoModelForCausalLM

    out = {}
    gen = torch.Generator().manual_seed(31)
    for family in FAMILIES:
        config = _hf_config(family)
        model = AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()
        offset = "gemma" in family  # Gemma's norms are (1 + weight)
        with torch.no_grad():
            for p in model.parameters():
                if p.dim() == 1:
                    p.copy_((0.0 if offset else 1.0) + 0.2 * torch.randn(p.shape, generator=gen))
                else:
                    p.copy_(torch.randn(p.shape, generator=gen) / p.shape[-1] ** 0.5)
            model.lm_head.weight.mul_(8.0)  # wide logit gaps: greedy is robust to summation order
        folder = tmp_path_factory.mktemp(family)
        model.save_pretrained(folder)
        out[family] = (folder, model)
    return out


def _astrai(folder) -> torch.nn.Module:
    from astrai.model import build_model, read_checkpoint

    config, weights, _, _ = read_checkpoint(str(folder), torch.float32)
    model = build_model(config, torch.float32, random_init=False)
    model.load_weights(weights)
    model.fuse_projections()
    return model


def _prompts(n: int, seed: int) -> list[list[int]]:
    gen = torch.Generator().manual_seed(seed)
    return [torch.randint(2, VOCAB, (int(length),), generator=gen).tolist() for length in (20, 33, 40)[:n]]


def _forward_all(model, ids: list[int], chunks: list[int]) -> torch.Tensor:
    """Logits of every position, the prompt fed in ``chunks`` (each over the ones before, cached)."""
    from astrai.kvcache import KVConfig, PagePool

    cfg = model.config
    pool = PagePool(
        cfg.num_hidden_layers,
        cfg.num_attention_heads,
        cfg.num_key_value_heads,
        cfg.head_dim,
        KVConfig(max_batch_size=1, max_seq_len=len(ids)),
        dtype=torch.float32,
    )
    row, out, start = pool.task_alloc(), [], 0
    for n in chunks:
        end = start + n
        pool.extend(row, end)
        kv = pool.bind_tasks([row], [n], [end])
        out.append(model(torch.tensor(ids[start:end]), torch.arange(start, end), kv, torch.arange(n)))
        start = end
    pool.task_free(row)
    return torch.cat(out)


@pytest.mark.parametrize("backend", ["torch_native", "cpu"])
@pytest.mark.parametrize("family", FAMILIES)
def test_logits_match_transformers(checkpoints, family, backend):
    from astrai.extension import attn_backend

    folder, hf = checkpoints[family]
    model = _astrai(folder)
    assert model.config.architecture == hf.config.model_type
    for ids in _prompts(2, seed=5):
        with torch.no_grad():
            want = hf(torch.tensor([ids])).logits[0]
        with attn_backend(backend):
            fresh = _forward_all(model, ids, [len(ids)])
            chunked = _forward_all(model, ids, [7, 1, len(ids) - 12, 4])
        scale = want.abs().max()
        torch.testing.assert_close(fresh, want, rtol=0, atol=2e-4 * scale)
        torch.testing.assert_close(chunked, want, rtol=0, atol=2e-4 * scale)


def _clear_prefix(hf, prompt: list[int], n: int) -> tuple[list[int], int]:
    """transformers' greedy tokens and how many of them lead by more than ``NEAR_TIE``, in a row."""
    with torch.no_grad():
        out = hf.generate(
            torch.tensor([prompt]),
            max_new_tokens=n,
            do_sample=False,
            output_logits=True,
            return_dict_in_generate=True,
            eos_token_id=None,
            pad_token_id=0,
        )
    tokens = out.sequences[0, len(prompt) :].tolist()
    clear = 0
    for logits in out.logits:
        top = logits[0].float().topk(2).values
        if float(top[0] - top[1]) < NEAR_TIE:
            break
        clear += 1
    return tokens, clear


@pytest.mark.parametrize("family", FAMILIES)
def test_greedy_matches_transformers_through_the_engine(checkpoints, make_engine, tiny_tokenizer, family):
    """Chunked prefill (16 tokens a step), prefix-cache hits (prompts sharing 24 tokens, pages of 4) and
    preemption (a pool of 176 tokens for 4 requests of up to 72). Where layers have a window of 8, their
    pages leave the pool as the window slides: there the pool has room for 48 positions of every
    layer and the chunks are of 4 tokens, so that the global layers' growth still preempts; a model
    of windowed layers only never outgrows what it was admitted with, so it waits instead."""
    from astrai.sampling import SamplingParams

    folder, hf = checkpoints[family]
    base = _prompts(3, seed=9)
    prompts = [*base, base[2][:24] + base[0][:16]]  # the last shares 24 tokens with the third
    model = _astrai(folder)
    windowed = any(model.config.windows)
    engine = make_engine(
        model,
        tiny_tokenizer,
        max_prefill_tokens=4 if windowed else 16,
        page_size=4,
        n_tokens=48 if windowed else 176,
        max_batch_size=4,
    )
    assert engine.pool.layout.trivial == (not windowed)
    params = SamplingParams(max_tokens=32, temperature=0.0, ignore_eos=True)
    results = [engine.submit(p, params) for p in prompts]
    for prompt, result in zip(prompts, results, strict=True):
        result.wait_completion()
        result.raise_for_error()
        want, clear = _clear_prefix(hf, prompt, 32)
        assert clear >= 8, f"transformers' greedy path is a near tie after {clear} tokens"
        assert result.output_ids[:clear] == want[:clear]
    assert results[3].cached_tokens >= 20  # the shared prefix's whole pages
    if engine.pool.layout.n_global:
        assert engine.scheduler.policy.counters["preemptions"] > 0
