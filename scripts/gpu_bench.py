"""Micro-benchmarks of attention backends on a GPU, used by gpu_check.py (importable, no side effects).

Each backend runs through ``AttentionBackend.forward`` on a hand-built step whose pool is
laid out in pages of 16 slots in random order (as the engine's paged pool leaves it).
Times come from CUDA events around 50 calls replayed from a CUDA graph (no Python or
launch overhead), or around an eager loop where a backend cannot be captured.
"""

from __future__ import annotations

import math

import torch

from astrai.kvcache.cache import KVCache
from astrai_backend_cuda.plan import DECODE_MAX_SPLITS, PREFILL_Q_TILE

PAGE = 16
ITERS = 50


def paged_step(
    q_lens, seq_lens, n_heads, n_kv, head_dim, dtype=torch.bfloat16, seed=0, device="cuda"
) -> tuple:
    """``(kv, q, k, v)`` for one layer: requests' positions in 16-slot pages, pages in random order."""
    dev = torch.device(device)
    gen = torch.Generator(device=dev).manual_seed(seed)
    b = len(seq_lens)
    pages_per = math.ceil(max(seq_lens) / PAGE)
    n_pages = b * pages_per + 1
    pages = torch.randperm(n_pages - 1, device=dev, generator=gen) + 1  # page 0 stays unused
    req_to_token = (pages.view(b, pages_per, 1) * PAGE + torch.arange(PAGE, device=dev)).view(b, -1).int()
    size = n_pages * PAGE
    tiles = [(i, t) for i, n in enumerate(q_lens) for t in range(math.ceil(n / PREFILL_Q_TILE))]
    out_loc = torch.cat(
        [req_to_token[i, s - n : s] for i, (n, s) in enumerate(zip(q_lens, seq_lens, strict=True))]
    )
    t = sum(q_lens)

    def rand(*shape):
        return torch.randn(shape, device=dev, generator=gen, dtype=torch.float32).to(dtype)

    kv = KVCache(
        k_buffer=rand(1, size, n_kv, head_dim),
        v_buffer=rand(1, size, n_kv, head_dim),
        req_to_token=req_to_token,
        req_pool_indices=torch.arange(b, device=dev),
        seq_lens=torch.tensor(seq_lens, device=dev),
        out_cache_loc=out_loc.long(),
        max_len=max(seq_lens),
        kv_indptr=torch.tensor([0, *seq_lens], device=dev).cumsum(0).int(),
        qo_indptr=torch.tensor([0, *q_lens], device=dev).cumsum(0).int(),
        q_tile_to_batch=torch.tensor([i for i, _ in tiles], device=dev, dtype=torch.int32),
        q_tile_to_index=torch.tensor([j for _, j in tiles], device=dev, dtype=torch.int32),
        decode_o_part=torch.empty(b, n_heads, DECODE_MAX_SPLITS, head_dim, device=dev),
        decode_ml_part=torch.empty(b, n_heads, DECODE_MAX_SPLITS, device=dev),
        decode_out=torch.empty(b, n_heads, head_dim, device=dev, dtype=dtype),
        max_q_len=max(q_lens),
        num_tokens=t,
        q_lens_host=tuple(q_lens),
        seq_lens_host=tuple(seq_lens),
    )
    return kv, rand(t, n_heads, head_dim), rand(t, n_kv, head_dim), rand(t, n_kv, head_dim)


def time_forward(backend, kv, q, k, v) -> tuple[float, str]:
    """Seconds per ``backend.forward`` call, and ``"graph"`` or ``"eager"`` (how it was timed)."""
    scale = q.shape[-1] ** -0.5

    def call():
        backend.forward(q, k, v, 0, kv, scale)

    call()  # warm-up: kernels loaded, per-step plan built and cached in kv.plan
    torch.cuda.synchronize()
    run, mode = call, "eager"
    try:
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            for _ in range(ITERS):
                call()
        run, mode = graph.replay, "graph"
    except Exception:  # not capturable (host sync, allocation pattern): time the eager loop
        torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    best = math.inf
    for _ in range(3):
        start.record()
        if mode == "graph":
            run()
        else:
            for _ in range(ITERS):
                run()
        end.record()
        end.synchronize()
        best = min(best, start.elapsed_time(end) / 1e3 / ITERS)
    return best, mode


def copy_bandwidth(n_bytes: int = 2 << 30) -> float:
    """Device-to-device copy bandwidth in bytes/s (bytes read plus bytes written)."""
    x = torch.empty(n_bytes, dtype=torch.uint8, device="cuda")
    y = torch.empty_like(x)
    y.copy_(x)
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    best = math.inf
    for _ in range(5):
        start.record()
        y.copy_(x)
        end.record()
        end.synchronize()
        best = min(best, start.elapsed_time(end) / 1e3)
    del x, y
    return 2 * n_bytes / best


def decode_bench(backend, batch, ctx, n_heads, n_kv, head_dim) -> dict:
    """One decode step at ``batch`` x ``ctx``: time and achieved K/V read bandwidth."""
    kv, q, k, v = paged_step([1] * batch, [ctx] * batch, n_heads, n_kv, head_dim)
    seconds, mode = time_forward(backend, kv, q, k, v)
    kv_bytes = 2 * batch * ctx * n_kv * head_dim * kv.k_buffer.element_size()
    return {
        "time_us": seconds * 1e6,
        "kv_bytes": kv_bytes,
        "bandwidth_GBps": kv_bytes / seconds / 1e9,
        "timing": mode,
    }


def prefill_bench(backend, q_lens, prefix_lens, n_heads, n_kv, head_dim) -> dict:
    """One ragged prefill step: time and TFLOP/s (4 * Hq * D flops per visible (query, key) pair)."""
    seq = [p + q for p, q in zip(prefix_lens, q_lens, strict=True)]
    kv, q, k, v = paged_step(q_lens, seq, n_heads, n_kv, head_dim)
    seconds, mode = time_forward(backend, kv, q, k, v)
    pairs = sum(n * p + n * (n + 1) // 2 for n, p in zip(q_lens, prefix_lens, strict=True))
    flops = 4 * n_heads * head_dim * pairs
    return {"time_us": seconds * 1e6, "tflops": flops / seconds / 1e12, "timing": mode}
