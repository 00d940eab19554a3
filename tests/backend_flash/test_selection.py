"""Capability checks with reasons, entry-point discovery, and the policy's fallback around flash."""

from __future__ import annotations

import importlib.util

import pytest
import torch
from flash_steps import make_pool, ragged_step, random_qkv

from astrai.errors import BackendUnavailable
from astrai.extension import attention, attn_backend, available_backends
from astrai.extension.backend.policy import BackendRegistry, load_attention_backends
from astrai.extension.backend.torch_native import TorchNativeBackend
from astrai_backend_flash import FlashAttnBackend

no_cuda = pytest.mark.skipif(
    torch.cuda.is_available(), reason="checks the reasons given on a machine without CUDA"
)


def step(dtype=torch.bfloat16, page_size=256, head_dim=64, seed=0):
    gen = torch.Generator().manual_seed(seed)
    pool = make_pool(page_size, 4096 // page_size, 2, head_dim, dtype, gen)
    kv, _ = ragged_step(pool, [3, 1], [0, 20], gen)
    q, k, v = random_qkv(kv, 4, gen, dtype)
    return q, k, v, kv


def test_discovered_through_its_entry_point_between_cuda_and_torch_native():
    loaded = load_attention_backends()
    assert loaded.classes["flash"] is FlashAttnBackend and "flash" not in loaded.failures
    # The ABC's documented order: cuda 10, flash 20, torch_native 100 (lower runs first).
    assert FlashAttnBackend.name == "flash" and 10 < FlashAttnBackend.priority < TorchNativeBackend.priority
    cuda = loaded.classes.get("cuda")
    if cuda is not None:
        assert cuda.priority < FlashAttnBackend.priority


@no_cuda
def test_unavailable_here_with_the_reason():
    ok, reason = FlashAttnBackend.is_available()
    assert not ok
    if importlib.util.find_spec("flash_attn") is None:
        assert reason.startswith("flash_attn does not import") and "astrai-backend-flash[flash]" in reason
    else:
        assert reason == "no CUDA device" or "flash_attn" in reason
    rows = {name: (avail, why) for name, avail, why in available_backends()}
    assert rows["flash"] == (False, reason)


@no_cuda
def test_explicit_selection_raises_and_automatic_falls_back():
    q, k, v, kv = step()
    with attn_backend("flash"), pytest.raises(BackendUnavailable, match="'flash' .* is unavailable: "):
        attention(q, k, v, 0, kv, 0.125)
    out = attention(q, k, v, 0, kv, 0.125)  # automatic: flash is skipped, a CPU backend runs
    assert set(kv.plan) in ({"cpu"}, {"torch_native"}) and out.shape == q.shape


@pytest.mark.usefixtures("flash_double")
class TestWithTheDouble:
    """flash_attn replaced by the CPU double: what supports() accepts and rejects, and why."""

    def test_available(self):
        assert FlashAttnBackend.is_available() == (True, "")

    def test_accepts_fp16_and_bf16_on_aligned_layouts(self):
        backend = FlashAttnBackend()
        for dtype, page in [(torch.bfloat16, 256), (torch.float16, 512)]:
            q, _, _, kv = step(dtype, page)
            assert backend.supports(q, kv) is None

    @pytest.mark.parametrize(
        ("dtype", "page_size", "head_dim", "reason"),
        [
            (torch.float32, 256, 64, "dtype torch.float32 not supported"),
            (
                torch.bfloat16,
                16,
                64,
                "KV page size 16 is not a multiple of flash-attn's paged block size 256",
            ),
            (torch.bfloat16, 128, 64, "KV page size 128 is not a multiple"),
            (torch.bfloat16, 256, 20, "head_dim 20 not supported"),
            (torch.bfloat16, 256, 264, "head_dim 264 not supported"),
        ],
        ids=["f32", "page16", "page128", "hd20", "hd264"],
    )
    def test_rejects_with_reason(self, dtype, page_size, head_dim, reason):
        q, _, _, kv = step(dtype, page_size, head_dim)
        assert reason in FlashAttnBackend().supports(q, kv)

    def test_rejects_other_devices_and_mismatched_pool(self):
        backend = FlashAttnBackend()
        q, _, _, kv = step()
        assert backend.supports(q.to("meta"), kv) == "device meta (flash-attn runs on cpu)"
        assert "KV pool dtype torch.bfloat16 differs" in backend.supports(q.half(), kv)

    def test_a_kv_cache_that_does_not_state_its_page_size_is_rejected(self):
        gen = torch.Generator().manual_seed(1)
        pool = make_pool(256, 8, 2, 64, torch.bfloat16, gen)
        row = pool.task_alloc()
        pool.extend(row, 5)
        kv = pool.bind_tasks([row], [5], [5])
        vars(kv).pop("page_size", None)  # as from a core whose KVCache has no page_size (or its default)
        q = torch.zeros(5, 4, 64, dtype=torch.bfloat16)
        assert "KV page size 1 is not a multiple" in FlashAttnBackend().supports(q, kv)

    def test_policy_falls_back_per_call_and_explicit_selection_raises(self):
        registry = BackendRegistry([TorchNativeBackend, FlashAttnBackend])
        q, k, v, kv = step()
        assert registry.select(q, kv).name == "flash"
        q16, _, _, kv16 = step(page_size=16)
        assert registry.select(q16, kv16).name == "torch_native"
        q32, _, _, kv32 = step(torch.float32)
        assert registry.select(q32, kv32).name == "torch_native"
        with (
            attn_backend("flash"),
            pytest.raises(BackendUnavailable, match="cannot run this call: KV page size 16"),
        ):
            registry.select(q16, kv16)
        with attn_backend("flash"):
            out = registry.attention(q, k, v, 0, kv, 0.125)
        assert set(kv.plan) == {"flash"} and out.shape == q.shape
