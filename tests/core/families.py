"""The tiny random checkpoint of every model family astrai serves, built from transformers' own config
classes (the oracle's), and what the family tests share: prompts, a forward over the paged cache,
loading through astrai's normal path, and transformers' greedy tokens with their clear prefix.

Two to six layers, a sliding window of 8 positions where the family has windows, so that the test
prompts of 20-40 tokens reach past it. Gemma 3 has six layers in transformers' default pattern (five
local, one global), the only pattern a GGUF file written by llama.cpp's converter can express.
"""

from __future__ import annotations

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

FAMILIES = ["qwen3", "gemma3", "gemma2", "mistral", "ministral", "phi3", "llama3"]
#: mixture-of-experts families (Qwen2-MoE with its shared expert)
MOE_FAMILIES = ["qwen3_moe", "mixtral", "qwen2_moe"]


def hf_config(family: str):
    """transformers' config of ``family``'s tiny checkpoint."""
    import transformers as tf

    sliding = ["sliding_attention", "full_attention", "sliding_attention"]
    if family == "qwen3":
        return tf.Qwen3Config(**SIZES, num_hidden_layers=2, tie_word_embeddings=False)
    if family == "qwen3_moe":  # every layer sparse, as Qwen3-30B-A3B (and all llama.cpp can write)
        moe = dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32, norm_topk_prob=True)
        return tf.Qwen3MoeConfig(**SIZES, num_hidden_layers=2, **moe)
    if family == "qwen2_moe":  # routed experts (weights not renormalised) beside a shared expert
        moe = dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32, norm_topk_prob=False)
        return tf.Qwen2MoeConfig(**SIZES, num_hidden_layers=2, shared_expert_intermediate_size=96, **moe)
    if family == "mixtral":
        return tf.MixtralConfig(**SIZES, num_hidden_layers=2, num_local_experts=4, num_experts_per_tok=2)
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
            num_hidden_layers=6,  # the default layer_types: five local layers, then a global one
            sliding_window=WINDOW,
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


def build_checkpoints(tmp_path_factory) -> dict:
    """family -> (safetensors folder, the transformers model in float32)."""
    from transformers import AutoModelForCausalLM

    out = {}
    gen = torch.Generator().manual_seed(31)
    for family in FAMILIES + MOE_FAMILIES:
        model = AutoModelForCausalLM.from_config(hf_config(family), dtype=torch.float32).eval()
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


def load_astrai(path, quantized: bool = False, dtype: torch.dtype = torch.float32) -> torch.nn.Module:
    """The model (float32 unless ``dtype``) of a checkpoint folder or GGUF file, as astrai's loader
    builds it; ``quantized``: a GGUF file's quantized weights stay quantized (``astrai.model.quant``)."""
    from astrai.model import build_model, read_checkpoint
    from astrai.model.quant import install_quantized

    config, weights, _, _ = read_checkpoint(str(path), dtype, quantized=quantized)
    model = build_model(config, dtype, random_init=False)
    if quantized:
        weights = install_quantized(model, weights, dtype)
    model.load_weights(weights)
    model.fuse_projections()
    return model


def prompts(n: int, seed: int) -> list[list[int]]:
    gen = torch.Generator().manual_seed(seed)
    return [torch.randint(2, VOCAB, (int(length),), generator=gen).tolist() for length in (20, 33, 40)[:n]]


def forward_all(model, ids: list[int], chunks: list[int]) -> torch.Tensor:
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


def clear_prefix(hf, prompt: list[int], n: int) -> tuple[list[int], int]:
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
