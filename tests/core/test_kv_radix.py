"""RadixCache through PagePool: exact page matching, sharing, LRU eviction, re-recording."""

from __future__ import annotations

import pytest

from astrai.kvcache import KVConfig, PagePool, RadixCache, assert_nothing_held, check_pool_invariants

PS = 4
A = [1, 2, 3, 4]
B = [5, 6, 7, 8]
C = [9, 10, 11, 12]


def make_pool(n_pages: int = 16, rows: int = 4) -> PagePool:
    config = KVConfig(max_batch_size=rows, max_seq_len=64, page_size=PS, n_tokens=n_pages * PS)
    return PagePool(1, 1, 1, 2, config)


def cached_paths(pool: PagePool) -> set[tuple[int, ...]]:
    return {node.token_path() for node in pool.radix.iter_nodes()}


def run(
    pool: PagePool, tokens: list[int], *, share: bool = True, keep: bool = False, namespace: str | None = None
) -> int:
    """One request: match (if share), compute every token, record, free (unless keep); returns row."""
    row = pool.task_alloc()
    if share:
        pool.match_prefix(row, tokens, namespace)
    assert pool.extend(row, len(tokens))
    pool.record(row, tokens)
    check_pool_invariants(pool)
    if not keep:
        pool.task_free(row)
        check_pool_invariants(pool)
    return row


def probe(pool: PagePool, tokens: list[int], namespace: str | None = None) -> int:
    """Length the radix would give a new request for ``tokens`` (the probe leaves no trace)."""
    row = pool.task_alloc()
    n = pool.match_prefix(row, tokens, namespace)
    pool.task_free(row)
    return n


def test_radix_exists_only_when_paged_with_pages_and_prefix_caching():
    assert make_pool().radix is not None
    assert PagePool(1, 1, 1, 2, KVConfig(page_size=1, n_tokens=64)).radix is None
    assert PagePool(1, 1, 1, 2, KVConfig(page_size=4, n_tokens=64, prefix_caching=False)).radix is None
    assert PagePool(1, 1, 1, 2, KVConfig(page_size=4, max_seq_len=8, max_batch_size=2)).radix is None


def test_match_compares_exact_pages_under_the_same_parent():
    pool = make_pool()
    run(pool, A + B + [0])
    assert probe(pool, A + B + [0]) == 8
    assert probe(pool, A + [5, 6, 7, 0, 0]) == 4  # second page differs in one token
    assert probe(pool, C + B + [0]) == 0  # identical page B under another parent
    assert probe(pool, B + [0]) == 0


def test_colliding_hashes_never_make_a_match():
    # CPython hashes -1 and -2 alike, so these pages collide in hash but differ in tokens.
    page_x, page_y = (-1, 7, 7, 7), (-2, 7, 7, 7)
    assert hash(page_x) == hash(page_y)
    pool = make_pool()
    run(pool, list(page_x) + [0])
    (node,) = pool.radix.iter_nodes()
    assert node.hash == hash((pool.radix.root.hash, page_y))
    assert probe(pool, list(page_y) + [0]) == 0
    assert probe(pool, list(page_x) + [0]) == 4


def test_match_leaves_at_least_one_token_to_compute():
    pool = make_pool()
    run(pool, A + B)
    assert cached_paths(pool) == {tuple(A), tuple(A + B)}
    assert probe(pool, A + B) == 4  # a fully cached, page-aligned prompt still recomputes its last page
    assert probe(pool, A + B + [0]) == 8
    assert probe(pool, A[:3]) == 0


def test_only_complete_pages_enter_and_the_partial_page_is_freed_at_task_free():
    pool = make_pool(n_pages=8)
    row = run(pool, A + B + [1, 2], keep=True)
    assert cached_paths(pool) == {tuple(A), tuple(A + B)}
    partial_page = pool.req_pages(row)[2]
    assert pool.allocator.refcount[partial_page] == 1
    pool.task_free(row)
    assert pool.allocator.free_mask[partial_page]
    assert pool.allocator.num_free == 6
    assert pool.stats()["kv_tokens_cached"] == 8
    assert_nothing_held(pool)


def test_matched_pages_are_shared_and_counted_once_per_holder():
    pool = make_pool()
    run(pool, A + B + [0])
    r1, r2 = pool.task_alloc(), pool.task_alloc()
    assert pool.match_prefix(r1, A + B + [3]) == 8
    assert pool.match_prefix(r2, A + [0]) == 4
    shared = pool.req_pages(r1)[0]
    assert pool.req_pages(r2) == (shared,)
    assert pool.allocator.refcount[shared] == 3  # radix + two requests
    assert pool.allocator.refcount[pool.req_pages(r1)[1]] == 2
    check_pool_invariants(pool)


@pytest.mark.parametrize("share", [True, False], ids=["rerecord_matched", "rerecord_private_copy"])
def test_rerecording_a_path_keeps_sibling_branches(share):
    pool = make_pool()
    run(pool, A + B + [0])
    run(pool, A + C + [0])
    pages_before = {node.token_path(): node.page for node in pool.radix.iter_nodes()}
    free_before = pool.allocator.num_free
    row = run(pool, A + B + [0], share=share, keep=True)
    # the cache keeps its own copies; siblings stay attached
    assert {node.token_path(): node.page for node in pool.radix.iter_nodes()} == pages_before
    assert probe(pool, A + B + [0]) == 8
    assert probe(pool, A + C + [0]) == 8
    pool.task_free(row)
    assert pool.allocator.num_free == free_before  # a private duplicate copy went back to the free list
    check_pool_invariants(pool)
    assert_nothing_held(pool)


def test_new_page_under_an_existing_page_extends_the_cached_path():
    pool = make_pool()
    run(pool, A + [0])
    row = run(pool, A + B + [0], share=False, keep=True)  # private A duplicates the cached A
    assert cached_paths(pool) == {tuple(A), tuple(A + B)}
    b_node = pool.radix.root.children[tuple(A)].children[tuple(B)]
    assert b_node.page == pool.req_pages(row)[1]
    # the cached A holds no live reference, but the live page below it pins it
    assert pool.radix.evictable_pages == 0
    assert pool.radix.evict(10) == 0
    pool.task_free(row)
    assert pool.radix.evictable_pages == 2
    assert probe(pool, A + B + [0]) == 8


def test_eviction_is_lru_over_leaves_and_exposes_parents():
    pool = make_pool(n_pages=8)
    run(pool, A + B + [0])  # pages A, A+B
    run(pool, C + [0])  # page C
    probe(pool, A + B + [0])  # A and A+B are now the most recently used
    assert pool.radix.evictable_pages == 3
    assert pool.radix.evict(1) == 1
    assert cached_paths(pool) == {tuple(A), tuple(A + B)}
    assert pool.radix.evict(1) == 1  # A+B is a leaf; A is not until A+B is gone
    assert cached_paths(pool) == {tuple(A)}
    assert pool.radix.evict(5) == 1
    assert cached_paths(pool) == set()
    assert pool.allocator.num_free == 8
    check_pool_invariants(pool)


def test_evicting_a_child_leaves_a_parent_that_a_request_holds():
    pool = make_pool(n_pages=8)
    run(pool, A + B + [0])
    holder = pool.task_alloc()
    assert pool.match_prefix(holder, A + [0]) == 4
    assert pool.radix.evictable_pages == 1
    assert pool.radix.evict(5) == 1  # only A+B; A is now a leaf but referenced
    assert cached_paths(pool) == {tuple(A)}
    assert pool.radix.evictable_leaves() == frozenset()
    check_pool_invariants(pool)
    pool.task_free(holder)
    assert pool.radix.evict(5) == 1
    assert pool.allocator.num_free == 8


def test_extend_evicts_only_what_it_needs_and_never_a_referenced_page():
    pool = make_pool(n_pages=6)
    run(pool, A + [0])
    run(pool, C + [0])
    holder = pool.task_alloc()
    assert pool.match_prefix(holder, A + [0]) == 4
    held_page = pool.req_pages(holder)[0]
    assert pool.allocator.num_free == 4 and pool.radix.evictable_pages == 1
    row = pool.task_alloc()
    assert pool.available_tokens() == 5 * PS
    assert not pool.extend(row, 6 * PS)  # would need the page the holder references
    assert cached_paths(pool) == {tuple(A), tuple(C)}
    assert pool.req_len(row) == 0
    assert pool.extend(row, 5 * PS)
    assert cached_paths(pool) == {tuple(A)}
    assert pool.radix.node_of_page(held_page) is not None
    check_pool_invariants(pool)


def test_extend_evicts_exactly_the_shortfall_in_lru_order():
    pool = make_pool(n_pages=8)
    for tokens in (A + [0], B + [0], C + [0]):
        run(pool, tokens)
    probe(pool, A + [0])  # B is now the least recently used
    row = pool.task_alloc()
    assert pool.allocator.num_free == 5
    assert pool.extend(row, 6 * PS)
    assert cached_paths(pool) == {tuple(A), tuple(C)}
    assert pool.extend(row, 7 * PS)
    assert cached_paths(pool) == {tuple(A)}
    check_pool_invariants(pool)


def test_record_beyond_the_request_positions_is_rejected():
    pool = make_pool()
    row = pool.task_alloc()
    pool.extend(row, 4)
    with pytest.raises(ValueError):
        pool.record(row, A + B)
    check_pool_invariants(pool)


def test_record_without_radix_is_a_noop():
    pool = PagePool(1, 1, 1, 2, KVConfig(page_size=4, n_tokens=64, prefix_caching=False))
    row = pool.task_alloc()
    pool.extend(row, 9)
    pool.record(row, list(range(9)))
    assert pool.match_prefix(pool.task_alloc(), list(range(9))) == 0
    pool.task_free(row)
    assert pool.stats()["kv_tokens_cached"] == 0


def test_insert_rejects_a_page_already_cached_under_another_prefix():
    pool = make_pool()
    row = run(pool, A + [0], keep=True)
    page = pool.req_pages(row)[0]
    radix: RadixCache = pool.radix
    with pytest.raises(ValueError):
        radix.insert(C, [page], pool.req_lock(row))
    assert cached_paths(pool) == {tuple(A)}
    check_pool_invariants(pool)


def test_namespaces_never_share_a_page():
    """A tenant's (or a cache_salt's) pages are found only in its own namespace; the same tokens
    recorded in two namespaces are two copies, each evictable on its own."""
    pool = make_pool()
    run(pool, A + B + [0], namespace="tenant-a")
    assert probe(pool, A + B + [0], "tenant-a") == 8
    assert probe(pool, A + B + [0], "tenant-b") == 0
    assert probe(pool, A + B + [0]) == 0  # the shared namespace of requests that name none
    run(pool, A + B + [0])
    run(pool, A + [0], namespace="tenant-b")
    assert probe(pool, A + B + [0]) == 8 and probe(pool, A + B + [0], "tenant-b") == 4
    assert pool.radix.num_pages == 5 and pool.radix.namespaces == 3
    live = run(pool, A + B + C + [0], namespace="tenant-a", keep=True)  # holds tenant-a's A, B
    assert pool.req_namespace(live) == "tenant-a"
    assert pool.req_lock(live).namespace == "tenant-a"
    pool.task_free(live)
    check_pool_invariants(pool)


def test_an_evicted_namespace_leaves_no_root_behind():
    pool = make_pool(n_pages=4, rows=2)
    for i in range(6):  # each namespace's page pushes out an older one
        run(pool, A + [0], namespace=f"salt-{i}")
    assert pool.radix.namespaces == 1 + pool.radix.num_pages  # the shared root, and one per namespace left
    assert pool.radix.root_of("salt-0") is None and probe(pool, A + [0], "salt-0") == 0
    assert probe(pool, A + [0], "salt-5") == 4
    cached = pool.radix.num_pages
    assert pool.radix.evict(pool.allocator.n_pages) == cached
    check_pool_invariants(pool)
    assert pool.radix.namespaces == 1 and pool.radix.root_of(None) is pool.radix.root
