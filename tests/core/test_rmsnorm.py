"""RMSNorm rounds exactly where HF's LlamaRMSNorm does, in every dtype."""

from __future__ import annotations

import pytest
import torch

from astrai.model.llama import RMSNorm


def _hf_rmsnorm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """transformers' LlamaRMSNorm.forward, written out: float32 statistics, one rounding, then the weight."""
    h = x.to(torch.float32)
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
    return weight * h.to(x.dtype)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_rmsnorm_matches_the_hf_formulation_bit_for_bit(dtype, kernel_registry):
    # the PyTorch formulation; a plugin's fused kernel (tests/backend_cpu) sums in another order
    kernel_registry()
    gen = torch.Generator().manual_seed(0)
    # rows of very different scales: a bf16 mean of squares would lose them, float32 does not
    x = (torch.randn(33, 576, generator=gen) * torch.logspace(-3, 3, 33)[:, None]).to(dtype)
    norm = RMSNorm(576, eps=1e-5).to(dtype)
    with torch.no_grad():
        norm.weight.copy_(torch.rand(576, generator=gen) + 0.5)
        got = norm(x)
    assert got.dtype == dtype
    assert torch.equal(got, _hf_rmsnorm(x, norm.weight, 1e-5))
