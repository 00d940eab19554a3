"""The real flash-attn kernels on a GPU against TorchNativeBackend: what the CPU double cannot show.

Skips cleanly without CUDA or flash_attn. On a GPU it checks that flash-attn really reads the pool
through the block table, appends at ``cache_seqlens`` in place, and aligns causal masks as its
docstrings say (which the double was written from).
"""

from __future__ import annotations

import importlib.util

import pytest
import torch
from flash_steps import compare_with_torch_native, make_pool, ragged_step, scatter

from astrai_backend_flash import FlashAttnBackend

pytestmark = [
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
    pytest.mark.skipif(importlib.util.find_spec("flash_attn") is None, reason="needs flash_attn installed"),
]


def test_available_on_this_gpu():
    ok, reason = FlashAttnBackend.is_available()
    major, _ = torch.cuda.get_device_capability()
    assert ok == (major >= 8), reason


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
@pytest.mark.parametrize("head_dim", [64, 128])
def test_kernels_match_torch_native(dtype, head_dim):
    gen = torch.Generator().manual_seed(head_dim)
    pool = make_pool(256, 64, 2, head_dim, dtype, gen, device="cuda")
    scatter(pool, gen)
    backend = FlashAttnBackend()
    steps = [  # (q_lens, prefix_lens, hits): mixed with prefix hits, pure decode, fresh prompts
        ([1, 37, 1, 300, 5, 64], [900, 0, 3, 256, 255, 512], (3, 5)),
        ([1] * 5, [0, 255, 256, 700, 17], ()),
        ([40, 1, 260], [0, 0, 0], ()),
    ]
    modes = []
    for q_lens, prefix_lens, hits in steps:
        kv, rows = ragged_step(pool, q_lens, prefix_lens, gen, hits)
        compare_with_torch_native(backend, kv, 6, gen)
        modes.append(kv.plan["flash"].mode)
        for row in rows:
            pool.task_free(row)
    assert modes == ["paged", "decode", "fresh"]


@pytest.mark.parametrize(
    ("window", "softcap"), [(100, 0.0), (1, 0.0), (300, 2.0)], ids=["w100", "w1", "w300-cap2"]
)
def test_window_and_softcap_match_torch_native(window, softcap):
    """flash-attn's window_size=(window - 1, 0) and softcap, in each mode, as torch_native's window and
    soft-cap (the double was written from their docstrings)."""
    gen = torch.Generator().manual_seed(window)
    pool = make_pool(256, 64, 2, 128, torch.bfloat16, gen, device="cuda")
    scatter(pool, gen)
    backend = FlashAttnBackend()
    steps = [
        ([1, 37, 1, 300, 5, 64], [900, 0, 3, 256, 255, 512], (3, 5)),
        ([1] * 5, [0, 255, 256, 700, 17], ()),
        ([40, 1, 260], [0, 0, 0], ()),
    ]
    for q_lens, prefix_lens, hits in steps:
        kv, rows = ragged_step(pool, q_lens, prefix_lens, gen, hits)
        compare_with_torch_native(backend, kv, 6, gen, window=window, softcap=softcap)
        for row in rows:
            pool.task_free(row)
