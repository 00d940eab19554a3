"""FlashAttnBackend end to end on CPU through the flash-attn double, against TorchNativeBackend."""

from __future__ import annotations

import flash_double
import pytest
import torch
from flash_steps import compare_with_torch_native, make_pool, ragged_step, random_qkv, scatter

from astrai_backend_flash import FlashAttnBackend
from astrai_backend_flash.backend import layer_options

pytestmark = pytest.mark.usefixtures("flash_double")


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
@pytest.mark.parametrize("group", [1, 3], ids=["mha", "gqa3"])
@pytest.mark.parametrize("page_size", [256, 512])
def test_mixed_ragged_batch_with_prefix_hits(dtype, group, page_size):
    gen = torch.Generator().manual_seed(page_size + group)
    pool = make_pool(page_size, 64 * 256 // page_size, 2, 64, dtype, gen)
    scatter(pool, gen)
    q_lens = [1, 37, 1, 300, 5, 1, 64, 2]
    prefix = [900, 0, 3, page_size, 255, 256, 2 * page_size, 700]
    kv, _ = ragged_step(pool, q_lens, prefix, gen, hits=(3, 6))
    compare_with_torch_native(FlashAttnBackend(), kv, 2 * group, gen)
    assert kv.plan["flash"].mode == "paged"


@pytest.mark.parametrize("seed", range(3))
def test_random_ragged_batches(seed):
    gen = torch.Generator().manual_seed(100 + seed)
    pool = make_pool(256, 80, 2, 128, torch.bfloat16, gen)
    scatter(pool, gen)
    n = int(torch.randint(2, 9, (1,), generator=gen))
    q_lens = torch.randint(1, 200, (n,), generator=gen).tolist()
    prefix = torch.randint(0, 600, (n,), generator=gen).tolist()
    hits = (0,) if n > 2 else ()
    if hits:
        prefix[0] = 256
    kv, _ = ragged_step(pool, q_lens, prefix, gen, hits)
    compare_with_torch_native(FlashAttnBackend(), kv, 4, gen)


@pytest.mark.parametrize("group", [1, 3], ids=["mha", "gqa3"])
def test_decode_appends_through_the_block_table(group):
    gen = torch.Generator().manual_seed(11)
    pool = make_pool(256, 40, 2, 64, torch.bfloat16, gen)
    scatter(pool, gen)
    kv, _ = ragged_step(pool, [1] * 6, [0, 255, 256, 511, 900, 17], gen, hits=(2,))
    # The pools must agree exactly after each layer: flash-attn's append landed at out_cache_loc.
    compare_with_torch_native(FlashAttnBackend(), kv, 2 * group, gen)
    assert kv.plan["flash"].mode == "decode"


def test_fresh_prompts():
    gen = torch.Generator().manual_seed(12)
    pool = make_pool(256, 16, 1, 64, torch.float16, gen)
    kv, _ = ragged_step(pool, [40, 1, 260], [0, 0, 0], gen)
    compare_with_torch_native(FlashAttnBackend(), kv, 3, gen)
    assert kv.plan["flash"].mode == "fresh"


def test_contiguous_pool_with_rows_a_multiple_of_the_block():
    gen = torch.Generator().manual_seed(13)
    pool = make_pool(1, 0, 2, 64, torch.bfloat16, gen, paged=False, max_seq_len=768)
    kv, _ = ragged_step(pool, [3, 1, 100], [500, 700, 0], gen)
    compare_with_torch_native(FlashAttnBackend(), kv, 4, gen)


def test_plan_built_once_per_step():
    gen = torch.Generator().manual_seed(14)
    pool = make_pool(256, 16, 2, 64, torch.bfloat16, gen)
    kv, _ = ragged_step(pool, [1, 9], [300, 10], gen)
    backend = FlashAttnBackend()
    q, k, v = random_qkv(kv, 2, gen, torch.bfloat16)
    backend.forward(q, k, v, 0, kv, 0.125)
    plan = kv.plan["flash"]
    backend.forward(q, k, v, 1, kv, 0.125)
    assert kv.plan["flash"] is plan and set(kv.plan) == {"flash"}


def test_a_row_that_sees_only_itself_outputs_its_value():
    gen = torch.Generator().manual_seed(15)
    pool = make_pool(256, 8, 1, 64, torch.bfloat16, gen)
    kv, _ = ragged_step(pool, [1, 5], [0, 0], gen)
    q, k, v = random_qkv(kv, 2, gen, torch.bfloat16)
    out = FlashAttnBackend().forward(q, k, v, 0, kv, 0.125)
    torch.testing.assert_close(out[0], v[0].expand(2, 64))


# id: (q_lens, prefix_lens, hits, window, softcap): each of the backend's modes with sliding windows
# (of one position, inside a page, across flash-attn's 256-position blocks) and soft-capped scores
WINDOWED = {
    "decode-window-100": ([1] * 5, [0, 255, 256, 700, 17], (2,), 100, 0.0),
    "decode-window-1-softcap": ([1] * 3, [300, 5, 0], (), 1, 2.0),
    "fresh-window-40": ([40, 1, 260], [0, 0, 0], (), 40, 0.0),
    "fresh-softcap": ([40, 1, 260], [0, 0, 0], (), 0, 1.5),
    "paged-window-300-prefix-hits": ([1, 37, 1, 300, 5, 64], [900, 0, 3, 256, 255, 512], (3, 5), 300, 0.0),
    "paged-window-8-softcap": ([1, 37, 200, 9], [600, 0, 256, 40], (2,), 8, 3.0),
}


@pytest.mark.parametrize("case", list(WINDOWED.values()), ids=list(WINDOWED))
def test_windowed_and_softcapped_layers_match_torch_native(case):
    q_lens, prefix, hits, window, softcap = case
    gen = torch.Generator().manual_seed(len(q_lens) + window)
    pool = make_pool(256, 48, 2, 64, torch.bfloat16, gen)
    scatter(pool, gen)
    kv, _ = ragged_step(pool, q_lens, prefix, gen, hits)
    compare_with_torch_native(FlashAttnBackend(), kv, 4, gen, window=window, softcap=softcap)
    mode = "decode" if max(q_lens) == 1 else "fresh" if not any(prefix) else "paged"
    assert kv.plan["flash"].mode == mode


def test_layer_options_are_flash_attn_keywords():
    assert layer_options(0, 0.0) == {}  # a plain layer calls flash-attn exactly as before
    assert layer_options(4096, 0.0) == {"window_size": (4095, 0)}  # itself and 4095 before it
    assert layer_options(1, 50.0) == {"window_size": (0, 0), "softcap": 50.0}
    assert FlashAttnBackend.features == {"window", "softcap"}


def test_double_windows_as_flash_attn_documents():
    """Query ``i`` of ``n_q`` sees keys ``i + n_k - n_q - left .. i + n_k - n_q`` (causal): with equal
    scores its output is the mean of those keys' one-hot values."""
    n_q, n_k, left = 3, 7, 2
    q = torch.zeros(n_q, 1, 8, dtype=torch.bfloat16)
    k = torch.zeros(n_k, 1, 8, dtype=torch.bfloat16)
    v = torch.eye(n_k, 8, dtype=torch.bfloat16)[:, None, :]
    cu_q, cu_k = torch.tensor([0, n_q], dtype=torch.int32), torch.tensor([0, n_k], dtype=torch.int32)
    out = flash_double.flash_attn_varlen_func(
        q, k, v, cu_q, cu_k, n_q, n_k, causal=True, window_size=(left, 0)
    )
    for i in range(n_q):
        seen = range(i + n_k - n_q - left, i + n_k - n_q + 1)
        want = torch.zeros(8)
        want[list(seen)] = 1 / len(seen)
        torch.testing.assert_close(out[i, 0].float(), want, atol=1e-2, rtol=0)
