"""Layer groups of sliding-window models in the KV pool: what a local layer keeps, and prefix hits.

A pool for layers with windows keeps a page per layer group (``astrai.kvcache.layout``); a windowed
group's pages go back once no later query of the request reaches them, and the radix cache only
gives a hit where every windowed page the first new query reads is still cached.
"""

from __future__ import annotations

import pytest

from astrai.kvcache import KVConfig, PagePool, assert_nothing_held, check_pool_invariants
from astrai.kvcache.layout import KVLayout

PS, WINDOW = 4, 8
#: the test model's layers: local, global, local (Gemma 3's pattern, shortened)
WINDOWS = (WINDOW, 0, WINDOW)


def gemma3_windows(n_layers: int, window: int = 512) -> list[int]:
    """Gemma 3's layers: five local (sliding window) to one global."""
    return [0 if (i + 1) % 6 == 0 else window for i in range(n_layers)]


def make_pool(n_tokens: int = 64, windows=WINDOWS, rows: int = 4, chunk: int = 4) -> PagePool:
    config = KVConfig(
        max_batch_size=rows, max_seq_len=128, page_size=PS, n_tokens=n_tokens, chunk_tokens=chunk
    )
    return PagePool(len(windows), 1, 1, 2, config, windows=windows)


def compute(pool: PagePool, row: int, start: int, end: int, tokens: list[int] | None = None) -> None:
    """Positions ``[start, end)`` of ``row`` as a step computes them: slots, the step's KVCache (which
    slides the windows), then the record of its complete pages; invariants after."""
    assert pool.extend(row, end)
    pool.bind_tasks([row], [end - start], [end])
    if tokens is not None:
        pool.record(row, tokens[:end])
    check_pool_invariants(pool)


def test_layouts_of_the_families():
    assert KVLayout.of([0] * 4) == KVLayout(4, (0,), ((0, 0), (0, 1), (0, 2), (0, 3)))
    assert KVLayout.of([0] * 4).trivial
    g270 = KVLayout.of(gemma3_windows(18))  # Gemma 3 270M: 3 global layers, 15 local
    assert (g270.group_size, g270.windows) == (3, (0, 512, 512, 512, 512, 512))
    assert [g270.slots[i] for i in (5, 11, 17, 0, 1, 16)] == [(0, 0), (0, 1), (0, 2), (1, 0), (1, 1), (5, 2)]
    g1b = KVLayout.of(gemma3_windows(26))  # Gemma 3 1B: 4 global, 22 local in 6 groups of 4, 2 slots unused
    assert (g1b.group_size, g1b.windows) == (4, (0,) + (512,) * 6)
    assert sorted(g1b.slots) == sorted(set(g1b.slots)) and len(g1b.slots) == 26
    assert KVLayout.of([4096] * 32) == KVLayout(32, (4096,), tuple((0, i) for i in range(32)))  # Mistral 7B
    with pytest.raises(ValueError):
        KVLayout.of([])


def test_a_window_past_the_context_is_no_window():
    config = KVConfig(max_batch_size=1, max_seq_len=64, page_size=PS, n_tokens=64)
    assert PagePool(3, 1, 1, 2, config, windows=(64, 0, 64)).layout.trivial
    assert not PagePool(3, 1, 1, 2, config, windows=(63, 0, 63)).layout.trivial
    contiguous = KVConfig(max_batch_size=1, max_seq_len=64)
    assert PagePool(3, 1, 1, 2, contiguous, windows=WINDOWS).layout.trivial


def test_gemma3_270m_keeps_its_global_layers_pages_and_a_window_of_the_rest():
    """KV bytes per position of context for Gemma 3 270M's geometry (18 layers, 1 KV head of 256,
    float32, pages of 16), one request of 4,096 positions: every layer keeps every position without
    layer groups (36,864 bytes a position); with them the 3 global layers do (6,144 bytes a
    position) and the 15 local ones their last 512 positions."""
    windows = gemma3_windows(18)
    config = KVConfig(max_batch_size=1, max_seq_len=8192, page_size=16, n_tokens=8192, chunk_tokens=512)
    held = {}
    for name, wins in (("every layer", ()), ("layer groups", windows)):
        pool = PagePool(18, 4, 1, 256, config, windows=wins)
        page_bytes = pool.storage.nbytes() // (pool.size // 16)
        row = pool.task_alloc()
        for start in range(0, 4096, 512):
            compute(pool, row, start, start + 512)
        pool.bind_tasks([row], [1], [4096])  # the next query is at 4,095: the window is [3584, 4096)
        held[name] = (pool.allocator.n_pages - pool.allocator.num_free) * page_bytes
        pool.task_free(row)
        assert_nothing_held(pool)
    assert held["every layer"] == 4096 * 36_864
    # 256 pages of the global group, 32 of each of the 5 local ones (positions 3,584 to 4,095)
    assert held["layer groups"] == (256 + 5 * 32) * 16 * 6_144
    assert held["layer groups"] // 4096 == 9_984  # 6,144 a position, plus the windows' 15 MiB


def test_a_windowed_group_keeps_its_window_as_the_request_grows():
    pool = make_pool()
    row = pool.task_alloc()
    for end in range(4, 44, 4):
        compute(pool, row, end - 4, end)
        first = max(0, end - 4 - WINDOW + 1) // PS  # the first page this step's queries read
        for group in (1, 2):  # the local layers' groups (group 0: the global layer)
            pages = pool.req_pages(row, group)
            assert all(p < 0 for p in pages[:first]) and all(p >= 0 for p in pages[first:])
        assert all(p >= 0 for p in pool.req_pages(row, 0))
    assert pool.context_limit == 128
    pool.task_free(row)
    assert_nothing_held(pool)


def test_speculative_rollback_never_reaches_below_the_window():
    pool = make_pool()
    row = pool.task_alloc()
    compute(pool, row, 0, 20)
    assert pool.extend(row, 24)  # a decode token and three drafts
    pool.bind_tasks([row], [4], [24])
    pool.truncate(row, 21)  # all drafts rejected: the next query is at 21, reading from 14
    check_pool_invariants(pool)
    assert all(p >= 0 for p in pool.req_pages(row, 1)[14 // PS :])
    pool.task_free(row)
    assert_nothing_held(pool)


def test_a_prefix_hit_needs_every_windowed_page_its_first_query_reads():
    pool = make_pool(n_tokens=128)
    prompt = list(range(100, 140))  # 40 tokens, 10 complete pages
    row = pool.task_alloc()
    for end in range(8, 48, 8):
        compute(pool, row, end - 8, end, prompt)
    pool.task_free(row)
    check_pool_invariants(pool)

    def probe(tokens: list[int]) -> int:
        r = pool.task_alloc()
        n = pool.match_prefix(r, tokens)
        check_pool_invariants(pool)
        pool.task_free(r)
        return n

    assert probe([*prompt, 1]) == 40
    # every page is cached and held by the radix alone: the oldest windowed pages go first
    cached = pool.radix.evictable_pages
    assert pool.radix.evict(14) == 14  # the local groups' pages of positions 0 to 27 (pages 0 to 6)
    check_pool_invariants(pool)
    assert pool.radix.evictable_pages == cached - 14
    assert probe([*prompt, 1]) == 40  # a query at 40 reads from 33: pages 8 and 9, still cached
    assert probe(prompt[:37]) == 36  # a query at 36 reads from 29: pages 7 and 8
    assert probe(prompt[:33]) == 0  # a hit of 32 would read from 25 (page 6): none shorter is whole
    assert probe(prompt[:5]) == 0  # page 0's windowed pages went: no hit at all
    # the global group's pages stay until their node goes; a later request that computes the
    # windowed pages again gives them back to the nodes that lost them
    row = pool.task_alloc()
    compute(pool, row, 0, 20, prompt)
    pool.task_free(row)
    assert probe(prompt[:9]) == 8
    assert_nothing_held(pool)


def test_eviction_takes_the_windowed_pages_of_a_running_requests_past_first():
    pool = make_pool(n_tokens=32)  # 24 pages
    long, other = list(range(100, 140)), list(range(200, 216))
    row = pool.task_alloc()
    for end in range(4, 44, 4):
        compute(pool, row, end - 4, end, long)
    # 10 global pages held, 2 x 3 windowed pages held (positions 28 to 39), the 8 other pages its
    # windowed past, cached (older ones went to make room as it grew): the request's path is locked,
    # yet that past can go
    assert pool.req_pages(row, 1)[:7] == (-1,) * 7
    assert pool.allocator.num_free == 0 and pool.radix.evictable_pages == 8
    second = pool.task_alloc()
    assert not pool.extend(second, 12)  # 3 pages of positions: 9 pages
    assert pool.extend(second, 8)  # 6 pages: 6 of the cached windowed ones go
    check_pool_invariants(pool)
    assert pool.radix.evictable_pages == 2
    pool.record(second, other[:8])
    for r in (row, second):
        pool.task_free(r)
    check_pool_invariants(pool)
    assert_nothing_held(pool)


def test_a_pool_of_windowed_layers_only():
    pool = make_pool(n_tokens=16, windows=(WINDOW, WINDOW))  # one group, 4 pages
    prompt = list(range(100, 164))
    row = pool.task_alloc()
    assert pool.can_ever_fit(128) and pool.context_limit == 128
    for end in range(4, 68, 4):  # 64 positions in a pool of 16 slots
        compute(pool, row, end - 4, end, prompt)
    pool.task_free(row)
    check_pool_invariants(pool)
    r = pool.task_alloc()
    assert pool.match_prefix(r, [*prompt, 1]) == 64
    pool.task_free(r)
    assert_nothing_held(pool)
