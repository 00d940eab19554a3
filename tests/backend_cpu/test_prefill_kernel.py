"""``astrai_cpu::prefill_attention``: causal attention of fresh prompts, against float64 and SDPA."""

from __future__ import annotations

import dataclasses

import pytest
import torch
import torch.nn.functional as F
from astrai_core_test_fixtures import tiny_config

from astrai.extension import attn_backend
from astrai.kvcache import KVConfig, PagePool, assert_nothing_held
from astrai.model import build_model
from astrai.model.cpu_linear import prepack_linears

pytestmark = [
    pytest.mark.usefixtures("cpu_kernels"),
    pytest.mark.skipif(
        not torch.cpu._is_avx512_bf16_supported(),
        reason="the prefill kernel is built for AVX512-BF16; this CPU has none (SDPA runs instead)",
    ),
]


def qkv_slices(n, hq, hkv, d, seed):
    """q, k, v as the model hands them over: strided row views of one fused projection output."""
    gen = torch.Generator().manual_seed(seed)
    fused = (torch.randn(n, (hq + 2 * hkv) * d, generator=gen) * 2).bfloat16()
    q = fused[:, : hq * d].view(n, hq, d)
    k = fused[:, hq * d : (hq + hkv) * d].view(n, hkv, d)
    v = fused[:, (hq + hkv) * d :].view(n, hkv, d)
    return q, k, v


def sdpa(q, k, v, dtype):
    return F.scaled_dot_product_attention(
        *(x.to(dtype).transpose(0, 1)[None] for x in (q, k, v)),
        is_causal=True, scale=q.shape[-1] ** -0.5, enable_gqa=q.shape[1] != k.shape[1],
    )[0].transpose(0, 1)  # fmt: skip


@pytest.mark.parametrize(("hq", "hkv", "d"), [(9, 3, 64), (8, 2, 128), (4, 4, 64), (2, 1, 128)])
@pytest.mark.parametrize("n", [1, 7, 8, 9, 31, 32, 33, 100, 257])
def test_matches_float64_as_closely_as_sdpa(n, hq, hkv, d):
    q, k, v = qkv_slices(n, hq, hkv, d, seed=n * hq + d)
    want = sdpa(q, k, v, torch.float64)
    got = torch.ops.astrai_cpu.prefill_attention(q, k, v, d**-0.5)
    assert got.dtype == torch.bfloat16 and got.shape == (n, hq, d)
    err = (got.double() - want).abs().max().item()
    sdpa_err = (sdpa(q, k, v, torch.bfloat16).double() - want).abs().max().item()
    # both round the probabilities and the output to bf16; the sums' order differs
    assert err <= 1.5 * sdpa_err + 2e-3, (err, sdpa_err)


def test_a_row_never_sees_later_keys():
    """Causal and block-exact: the first m rows of a prompt are, bit for bit, the m-row prompt's."""
    q, k, v = qkv_slices(70, 9, 3, 64, seed=1)
    whole = torch.ops.astrai_cpu.prefill_attention(q, k, v, 0.125)
    for m in (1, 8, 13, 32, 33, 64):
        assert torch.equal(torch.ops.astrai_cpu.prefill_attention(q[:m], k[:m], v[:m], 0.125), whole[:m])


def test_refuses_what_it_does_not_compute():
    q, k, v = qkv_slices(4, 4, 2, 64, seed=0)
    with pytest.raises(RuntimeError, match="bf16 only"):
        torch.ops.astrai_cpu.prefill_attention(q.float(), k.float(), v.float(), 0.125)
    q32, k32, v32 = qkv_slices(4, 4, 2, 32, seed=0)
    with pytest.raises(RuntimeError, match="head dim 64 or 128"):
        torch.ops.astrai_cpu.prefill_attention(q32, k32, v32, 0.125)
    with pytest.raises(RuntimeError, match="multiple of Hkv"):
        torch.ops.astrai_cpu.prefill_attention(q[:, :3], k, v, 0.125)
    assert torch.ops.astrai_cpu.prefill_attention(q[:0], k[:0], v[:0], 0.125).shape == (0, 4, 64)


def test_model_prefill_on_the_kernel_matches_torch_native():
    """A bf16 model with head dim 64: a ragged step of fresh prompts under ``cpu`` (the kernel)
    and ``torch_native`` (SDPA) picks the same next tokens, with logits within bf16 noise."""
    cfg = dataclasses.replace(tiny_config(), hidden_size=256, num_attention_heads=4, num_key_value_heads=2, head_dim=64,
                              intermediate_size=512)  # fmt: skip
    model = build_model(cfg, torch.bfloat16)
    gen = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.copy_(1.0 + 0.2 * torch.randn(p.shape, generator=gen) if "norm" in name
                    else torch.randn(p.shape, generator=gen) * p.shape[-1] ** -0.5)  # fmt: skip
        model.lm_head.weight.mul_(8.0)  # wide logit gaps: the argmax is robust to bf16 rounding
    model.fuse_projections()
    prepack_linears(model)
    lens = [3, 40, 129, 17]
    prompts = [torch.randint(3, 250, (n,), generator=gen) for n in lens]
    logits = {}
    for backend in ("cpu", "torch_native"):
        pool = PagePool(cfg.num_hidden_layers, cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim,
                        KVConfig(max_batch_size=4, max_seq_len=256, page_size=16, n_tokens=1024), dtype=torch.bfloat16)  # fmt: skip
        rows = [pool.task_alloc() for _ in lens]
        for row, n in zip(rows, lens, strict=True):
            assert pool.extend(row, n)
        with attn_backend(backend):
            logits[backend] = model(torch.cat(prompts), torch.cat([torch.arange(n) for n in lens]),
                                    pool.bind_tasks(rows, lens, lens), torch.tensor(lens).cumsum(0) - 1)  # fmt: skip
        for row in rows:
            pool.task_free(row)
        assert_nothing_held(pool)
    assert torch.equal(logits["cpu"].argmax(-1), logits["torch_native"].argmax(-1))
    spread = (logits["cpu"] - logits["torch_native"]).abs().max()
    assert spread <= 0.02 * logits["torch_native"].abs().max(), spread
