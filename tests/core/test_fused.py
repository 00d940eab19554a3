"""astrai.extension.fused: the kernels loaded backends lend per device type, and the PyTorch
formulations the ops fall back to."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from astrai.errors import PluginError
from astrai.extension import fused
from astrai.extension.backend.policy import BackendRegistry
from astrai.extension.backend.torch_native import TorchNativeBackend


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["f32", "bf16"])
def test_without_kernels_the_ops_are_the_pytorch_formulation(dtype, kernel_registry):
    kernel_registry()
    gen = torch.Generator().manual_seed(0)
    x, r = (torch.randn(3, 64, generator=gen).to(dtype) for _ in range(2))
    w = torch.randn(64, generator=gen).to(dtype)
    norm = F.rms_norm(x, (64,), eps=1e-5) * w
    assert torch.equal(fused.rms_norm(x, w, 1e-5), norm)
    s, n = fused.add_rms_norm(x, r, w, 1e-5)
    assert torch.equal(s, x + r) and torch.equal(n, F.rms_norm(x + r, (64,), eps=1e-5) * w)
    gate_up = torch.randn(3, 128, generator=gen).to(dtype)
    assert torch.equal(fused.silu_and_mul(gate_up), F.silu(gate_up[:, :64]) * gate_up[:, 64:])


def test_a_kernel_runs_only_on_its_device_type_and_without_grad(kernel_registry):
    calls = []
    kernel_registry(
        {"cpu": {"silu_and_mul": lambda x: calls.append(x) or x[:, :2]}, "cuda": {"silu_and_mul": id}}
    )
    x = torch.ones(1, 4)
    with torch.no_grad():
        assert fused.silu_and_mul(x).shape == (1, 2) and len(calls) == 1
    assert torch.equal(fused.silu_and_mul(x), F.silu(x[:, :2]) * x[:, 2:])  # grad enabled: PyTorch
    assert len(calls) == 1
    kernel_registry({"cuda": {"silu_and_mul": id}})  # a CUDA kernel only
    with torch.no_grad():
        assert torch.equal(fused.silu_and_mul(x), F.silu(x[:, :2]) * x[:, 2:])
    assert fused.kernel_for("silu_and_mul", torch.ones(1, device="meta")) is None  # meta: none lent


def test_no_registry_no_kernels(monkeypatch):
    """Before a registry is discovered no backend is loaded: the lookup discovers none."""
    from astrai.extension.backend import policy

    monkeypatch.setattr(policy, "_registry", None)
    with torch.no_grad():
        assert fused.kernel_for("rms_norm", torch.ones(1)) is None
    assert policy.current_registry() is None


def test_the_preferred_backend_wins_and_each_is_asked_once_per_device_type(kernel_registry):
    first, second = (lambda x, w, eps: x), (lambda x, w, eps: w)
    registry = kernel_registry(
        {"cpu": {"rms_norm": first}}, {"cpu": {"rms_norm": second, "silu_and_mul": id}}
    )
    assert registry.kernels.get("rms_norm", "cpu") is first  # lender0 (priority 90) over lender1 (91)
    assert registry.kernels.get("silu_and_mul", "cpu") is id  # what only lender1 lends
    asked = []

    class Counting(TorchNativeBackend):
        name, priority = "counting", 80

        def kernels(self, device_type):
            asked.append(device_type)
            return {"rms_norm": second} if device_type == "cpu" else {}

    registry = BackendRegistry([TorchNativeBackend, Counting])
    assert registry.kernels.get("rms_norm", "cpu") is None and asked == []  # nothing loaded yet
    registry.load()
    for _ in range(3):
        assert registry.kernels.get("rms_norm", "cpu") is second
        assert registry.kernels.get("rms_norm", "meta") is None
    assert asked == ["cpu", "meta"]


def test_unknown_op_is_refused_naming_the_backend(kernel_registry):
    registry = kernel_registry({"cpu": {"gelu": id}})
    with pytest.raises(PluginError, match=r"'lender0' lends kernels for unknown ops \['gelu'\]"):
        registry.kernels.get("rms_norm", "cpu")


def test_packed_linear_gives_a_linear_kernel_what_it_takes_and_the_rest_to_onednn(kernel_registry):
    from astrai.model.cpu_linear import PackedLinear, prepack_supported

    if not prepack_supported("cpu", torch.bfloat16):
        pytest.skip("oneDNN packed bf16 linears need AVX512-BF16 or AMX")
    lin = PackedLinear(torch.nn.Linear(64, 8, bias=False).bfloat16())

    class Recording:
        max_rows = 2

        def __init__(self):
            self.packs, self.calls = 0, []

        def pack(self, weight):
            self.packs += 1
            return weight.clone()

        def __call__(self, x, packed, bias):
            self.calls.append(x.shape[0])
            return F.linear(x, packed, bias)

    kernel = Recording()
    kernel_registry({"cpu": {"linear": kernel}})
    with torch.inference_mode():
        x = torch.randn(3, 64).bfloat16()
        assert torch.equal(lin(x[:1]), F.linear(x[:1], lin.weight))
        lin(x[:2])
        assert lin._onednn is None  # no input went to oneDNN yet: no copy of the weight in its layout
        lin(x)  # more rows than max_rows: oneDNN, packed now
        assert lin._onednn is not None
        kernel.max_rows = None  # any number
        lin(x.view(1, 3, 64))  # [batch, tokens, features] inputs are flattened for it
    assert kernel.calls == [1, 2, 3] and kernel.packs == 1  # packed once, on first use


def test_the_model_offers_each_step_to_decoder_layers_and_runs_its_layers_on_none(
    tiny_model, kernel_registry
):
    from astrai.kvcache import KVConfig, PagePool

    cfg = tiny_model.config
    pool = PagePool(
        cfg.num_hidden_layers,
        cfg.num_attention_heads,
        cfg.num_key_value_heads,
        cfg.head_dim,
        KVConfig(max_batch_size=1, max_seq_len=16),
    )
    row = pool.task_alloc()
    pool.extend(row, 3)

    def step():
        kv = pool.bind_tasks([row], [3], [3])
        return tiny_model(torch.tensor([5, 6, 7]), torch.arange(3), kv, torch.tensor([2]))

    kernel_registry()
    layers = step()
    seen = []
    kernel_registry({"cpu": {"decoder_layers": lambda *args: seen.append(args) and None}})
    assert torch.equal(step(), layers)  # declined: the layers ran
    model, x, freqs, kv = seen[0]
    # the model's RoPE table, then its local layers' (the same one for a model without)
    assert model is tiny_model and x.shape == (3, cfg.hidden_size) and len(freqs) == 2
    assert all(f.shape == (1, 3, cfg.head_dim // 2, 2) for f in freqs) and torch.equal(freqs[0], freqs[1])
    assert kv.num_tokens == 3
    kernel_registry({"cpu": {"decoder_layers": lambda model, x, *_: torch.zeros_like(x)}})
    taken = step()  # its hidden states replace the layers': the final norm of zeros is zeros
    assert torch.equal(taken, tiny_model.lm_head(torch.zeros(1, cfg.hidden_size)).float())
    pool.task_free(row)
