"""RotaryEmbedding tables (plain, linear, llama3) and apply_rotary_emb (formula, autograd, dispatch)."""

from __future__ import annotations

import math

import pytest
import torch

from astrai.errors import AstraiError
from astrai.extension import RotaryEmbedding, apply_rotary_emb

LLAMA3 = {
    "rope_type": "llama3",
    "factor": 8.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 8192,
}


def table_angles(rope: RotaryEmbedding, pos: int) -> torch.Tensor:
    """The angle of each pair at `pos`, read back from the [cos, sin] table."""
    row = rope.freqs_cis[pos].double()
    return torch.atan2(row[:, 1], row[:, 0])


def test_table_matches_the_textbook_formula():
    rope = RotaryEmbedding(64, 300, theta=10000.0)
    assert rope.freqs_cis.shape == (300, 32, 2) and rope.freqs_cis.dtype == torch.float32
    assert "freqs_cis" not in rope.state_dict()  # non-persistent: never saved with weights
    for pos in (0, 1, 7, 299):
        for i in (0, 1, 15, 31):
            angle = pos * 10000.0 ** (-2 * i / 64)
            assert rope.freqs_cis[pos, i, 0].item() == pytest.approx(math.cos(angle), abs=1e-6)
            assert rope.freqs_cis[pos, i, 1].item() == pytest.approx(math.sin(angle), abs=1e-6)


def test_forward_indexes_the_table_by_position():
    rope = RotaryEmbedding(16, 50, theta=500.0)
    positions = torch.tensor([[0, 3, 49], [5, 5, 1]])
    out = rope(positions)
    assert out.shape == (2, 3, 8, 2)
    assert torch.equal(out[1, 2], rope.freqs_cis[1]) and torch.equal(out[0, 2], rope.freqs_cis[49])


def test_linear_scaling_stretches_positions():
    # Linear scaling by 4 turns position 4p into the unscaled position p.
    plain = RotaryEmbedding(32, 100)
    linear = RotaryEmbedding(32, 400, rope_scaling={"rope_type": "linear", "factor": 4.0})
    torch.testing.assert_close(linear.freqs_cis[::4], plain.freqs_cis, atol=1e-6, rtol=0)


def llama3_inv_freq_independent(dim: int, theta: float) -> torch.Tensor:
    """Meta's reference `apply_scaling` (llama-models), written out element by element."""
    out = []
    for i in range(0, dim, 2):
        freq = 1.0 / theta ** (i / dim)
        wavelen = 2 * math.pi / freq
        if wavelen < 8192 / 4.0:
            out.append(freq)
        elif wavelen > 8192 / 1.0:
            out.append(freq / 8.0)
        else:
            smooth = (8192 / wavelen - 1.0) / (4.0 - 1.0)
            out.append((1 - smooth) * freq / 8.0 + smooth * freq)
    return torch.tensor(out, dtype=torch.float64)


def test_llama3_scaling():
    rope = RotaryEmbedding(64, 2, theta=500000.0, rope_scaling=LLAMA3)
    got = table_angles(rope, 1)  # angle at position 1 is inv_freq itself (all < pi)
    want = llama3_inv_freq_independent(64, 500000.0)
    plain = table_angles(RotaryEmbedding(64, 2, theta=500000.0), 1)
    # All three bands occur: high frequencies kept, low ones divided by 8, the middle blended.
    ratio = got / plain
    assert ratio[0] == pytest.approx(1.0) and ratio[-1] == pytest.approx(1 / 8, rel=1e-4)
    assert ((ratio < 0.99) & (ratio > 0.13)).any()
    torch.testing.assert_close(got, want, rtol=1e-5, atol=0)


def test_llama3_scaling_matches_transformers():
    transformers = pytest.importorskip("transformers")
    rope_utils = pytest.importorskip("transformers.modeling_rope_utils")
    if "llama3" not in rope_utils.ROPE_INIT_FUNCTIONS:
        pytest.skip("this transformers has no llama3 rope init")
    config = transformers.LlamaConfig(
        hidden_size=256,
        num_attention_heads=4,
        head_dim=64,
        max_position_embeddings=131072,
        rope_parameters={"rope_theta": 500000.0, **LLAMA3},
    )
    hf_inv_freq, _ = rope_utils.ROPE_INIT_FUNCTIONS["llama3"](config, "cpu")
    rope = RotaryEmbedding(64, 2, theta=500000.0, rope_scaling=LLAMA3)
    torch.testing.assert_close(table_angles(rope, 1), hf_inv_freq.double(), rtol=1e-5, atol=0)


def test_bad_configurations_raise():
    with pytest.raises(AstraiError, match="yarn"):
        RotaryEmbedding(64, 8, rope_scaling={"rope_type": "dynamic", "factor": 2.0})
    with pytest.raises(AstraiError, match="even"):
        RotaryEmbedding(63, 8)


def rotate_real(x: torch.Tensor, freqs: torch.Tensor) -> torch.Tensor:
    """Interleaved-pair rotation in real arithmetic: (a, b) -> (a cos - b sin, a sin + b cos)."""
    a, b = x[..., 0::2].float(), x[..., 1::2].float()
    cos, sin = freqs[..., 0].unsqueeze(-2), freqs[..., 1].unsqueeze(-2)  # broadcast over heads
    return torch.stack([a * cos - b * sin, a * sin + b * cos], dim=-1).flatten(-2)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["f32", "bf16"])
def test_apply_rotary_emb_matches_real_formula(dtype):
    gen = torch.Generator().manual_seed(0)
    rope = RotaryEmbedding(64, 64)
    x = torch.randn(2, 5, 3, 64, generator=gen).to(dtype)
    freqs = rope(torch.randint(0, 64, (2, 5), generator=gen))
    out = apply_rotary_emb(x, freqs)
    assert out.shape == x.shape and out.dtype == dtype
    # The computation is in float32 either way; bf16 differs only by the final rounding.
    tol = {"atol": 1e-6, "rtol": 1e-6} if dtype == torch.float32 else {"atol": 1e-2, "rtol": 8e-3}
    torch.testing.assert_close(out.float(), rotate_real(x, freqs), **tol)


def test_rotary_preserves_relative_position():
    # <rot(q, m), rot(k, n)> depends on m - n only: the reason RoPE encodes relative position.
    gen = torch.Generator().manual_seed(1)
    rope = RotaryEmbedding(32, 64)
    q, k = torch.randn(1, 1, 1, 32, generator=gen), torch.randn(1, 1, 1, 32, generator=gen)

    def score(m, n):
        return (
            apply_rotary_emb(q, rope(torch.tensor([[m]]))) * apply_rotary_emb(k, rope(torch.tensor([[n]])))
        ).sum()

    torch.testing.assert_close(score(10, 3), score(40, 33), atol=1e-5, rtol=1e-5)


def test_backward_matches_real_formula():
    gen = torch.Generator().manual_seed(2)
    freqs = RotaryEmbedding(16, 32)(torch.randint(0, 32, (2, 4), generator=gen))
    weight = torch.randn(2, 4, 2, 16, generator=gen)
    x1 = torch.randn(2, 4, 2, 16, generator=gen, requires_grad=True)
    x2 = x1.detach().clone().requires_grad_(True)
    (apply_rotary_emb(x1, freqs) * weight).sum().backward()
    (rotate_real(x2, freqs) * weight).sum().backward()
    torch.testing.assert_close(x1.grad, x2.grad, atol=1e-6, rtol=1e-6)


def recording_kernel(calls, value):
    """A rotary kernel that records the dtypes it is given and fills its output with ``value``."""

    def kernel(x, freqs):
        calls.append(x.dtype)
        return torch.full_like(x, value)

    return kernel


def test_dispatch_uses_kernel_only_for_bf16_inference(kernel_registry):
    calls = []
    kernel_registry({"cpu": {"rotary": recording_kernel(calls, 7.0)}})  # a CPU kernel standing in for CUDA's
    freqs = RotaryEmbedding(8, 4)(torch.zeros(1, 2, dtype=torch.long))
    x16, x32 = torch.ones(1, 2, 1, 8, dtype=torch.bfloat16), torch.ones(1, 2, 1, 8)
    with torch.no_grad():
        assert (apply_rotary_emb(x16, freqs) == 7).all()  # bf16, kernel's device, no grad: kernel
        assert torch.equal(apply_rotary_emb(x32, freqs), x32)  # f32: torch path (angle 0 = identity)
    assert torch.equal(apply_rotary_emb(x16, freqs), x16)  # grad enabled: torch path
    assert calls == [torch.bfloat16]


def test_dispatch_takes_the_kernel_of_the_tensors_device_type(kernel_registry):
    freqs = RotaryEmbedding(8, 4)(torch.zeros(1, 2, dtype=torch.long))
    x = torch.ones(1, 2, 1, 8, dtype=torch.bfloat16)
    calls = []
    cpu, cuda = recording_kernel(calls, 7.0), recording_kernel(calls, 5.0)
    kernel_registry({"cpu": {"rotary": cpu}, "cuda": {"rotary": cuda}})
    with torch.no_grad():
        assert (apply_rotary_emb(x, freqs) == 7).all()  # a CUDA kernel leaves the CPU one in place
    kernel_registry({"cuda": {"rotary": cuda}})
    with torch.no_grad():
        assert torch.equal(apply_rotary_emb(x, freqs), x)  # CPU tensor, no CPU kernel: torch path
    assert calls == [torch.bfloat16]
