"""Consistency checks of a PagePool, for tests: run after every step that touches the KV system."""

from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np
import torch

if TYPE_CHECKING:
    from astrai.kvcache.pool import PagePool
    from astrai.kvcache.radix import RadixNode


def _fail(msg: str) -> None:
    raise AssertionError(f"KV pool invariant violated: {msg}")


def _check_rows(pool: PagePool) -> list[int]:
    rtp = pool.req_to_token_pool
    live = rtp.live_rows()
    free = rtp.free_rows()
    if len(set(free)) != len(free) or sorted(free + live) != list(range(rtp.num_reqs)):
        _fail(f"request rows are not split into live {live} and free {sorted(free)}")
    for row in range(rtp.num_reqs):
        if not 0 <= rtp.lens[row] <= pool.max_ctx_len or (row not in live and rtp.lens[row]):
            _fail(f"row {row} has length {rtp.lens[row]}")
    return live


def _check_contiguous(pool: PagePool) -> None:
    s = pool.max_ctx_len
    expected = torch.arange(pool.req_to_token_pool.num_reqs * s, dtype=torch.int64).view(-1, s)
    if not torch.equal(pool.req_to_token.cpu().to(torch.int64), expected):
        _fail("contiguous req_to_token is not the linear map row * max_seq_len + pos")


def _check_radix(pool: PagePool, live: list[int], holders: np.ndarray) -> None:
    radix = pool.radix
    refcount = pool.allocator.refcount
    nodes = list(radix.iter_nodes())
    mask = np.zeros_like(radix.page_mask)
    for node in nodes:
        parent = node.parent
        if parent is None or parent.children.get(node.key) is not node:
            _fail(f"radix node of page {node.page} is not its parent's child under its key")
        if node.depth != parent.depth + 1 or len(node.key) != pool.page_size:
            _fail(f"radix node of page {node.page}: depth {node.depth}, key {node.key}")
        if node.namespace != parent.namespace:
            _fail(
                f"radix node of page {node.page} is in namespace {node.namespace!r}, "
                f"its parent in {parent.namespace!r}"
            )
        if radix.node_of_page(node.page) is not node or mask[node.page]:
            _fail(f"page {node.page} is indexed twice or not at its node")
        mask[node.page] = True
    if radix.num_pages != len(nodes) or not np.array_equal(mask, radix.page_mask):
        _fail("radix page index disagrees with the tree")
    # every live request pins the root path of its deepest held radix page.
    locks: dict[RadixNode, int] = {}
    for row in live:
        pages = pool.req_pages(row)
        held = [i for i, p in enumerate(pages) if mask[p]]
        lock = pool.req_lock(row)
        if not held:
            if lock is not None:
                _fail(f"row {row} locks a radix node but holds no radix page")
            continue
        if lock is None or lock.page != pages[held[-1]]:
            _fail(f"row {row}: lock is not its deepest held radix page")
        if lock.namespace != pool.req_namespace(row):  # a page never serves another namespace
            _fail(
                f"row {row} of namespace {pool.req_namespace(row)!r} "
                f"holds pages of namespace {lock.namespace!r}"
            )
        path = []
        node = lock
        while node.parent is not None:
            path.append(node)
            locks[node] = locks.get(node, 0) + 1
            node = node.parent
        on_path = {n.page: n.depth for n in path}
        for i in held:
            if on_path.get(pages[i]) != i + 1:
                _fail(f"row {row}: radix page {pages[i]} at position {i * pool.page_size} is off its path")
    evictable = 0
    for node in nodes:
        if node.lock_count != locks.get(node, 0):
            _fail(
                f"radix node of page {node.page}: lock_count {node.lock_count}, expected {locks.get(node, 0)}"
            )
        if node.lock_count == 0:
            evictable += 1
            if refcount[node.page] != 1:
                _fail(f"unpinned radix page {node.page} has refcount {refcount[node.page]}")
    if evictable != radix.evictable_pages:
        _fail(f"evictable_pages {radix.evictable_pages}, counted {evictable}")
    for namespace in {n.namespace for n in nodes} | {None}:
        root = radix.root_of(namespace)
        if root is None or root.parent is not None or root.namespace != namespace:
            _fail(f"namespace {namespace!r} has no root of its own")
    leaves = {n for n in nodes if not n.children and n.lock_count == 0}
    if leaves != set(radix.evictable_leaves()):
        _fail("evictable leaf set disagrees with the tree")


def check_pool_invariants(pool: PagePool) -> None:
    """Raise AssertionError describing the first inconsistency found in ``pool``.

    Checks: rows split into live and free; paged: refcount of every page equals the
    live requests holding it plus one if the radix does, the free bitmask and free
    list equal ``refcount == 0``, live rows' ``req_to_token`` entries equal their
    pages' slots (so none points at a free page), radix parent/child links, locks and
    evictable counts, and stats() token counts. Contiguous: the linear map.
    """
    live = _check_rows(pool)
    if not pool.paged:
        _check_contiguous(pool)
        return
    alloc = pool.allocator
    ps = pool.page_size
    holders = np.zeros(alloc.n_pages, dtype=np.int64)
    table = pool.req_to_token.cpu().to(torch.int64)
    for row in live:
        pages = pool.req_pages(row)
        n = pool.req_len(row)
        if len(set(pages)) != len(pages) or len(pages) != -(-n // ps):
            _fail(f"row {row}: {len(pages)} pages {pages} for {n} positions")
        if pages:
            holders[list(pages)] += 1
            slots = (torch.tensor(pages).unsqueeze(1) * ps + torch.arange(ps)).reshape(-1)
            upto = min(len(pages) * ps, pool.max_ctx_len)
            if not torch.equal(table[row, :upto], slots[:upto]):
                _fail(f"row {row}: req_to_token disagrees with its pages {pages}")
    radix_mask = pool.radix.page_mask if pool.radix is not None else np.zeros(alloc.n_pages, np.bool_)
    expected = holders + radix_mask
    if not np.array_equal(alloc.refcount, expected):
        bad = np.flatnonzero(alloc.refcount != expected).tolist()
        _fail(f"refcount != holders for pages {bad}: {alloc.refcount[bad]} vs {expected[bad]}")
    free = alloc.free_pages()
    if not np.array_equal(alloc.free_mask, expected == 0):
        _fail("free bitmask disagrees with refcount == 0")
    if len(set(free)) != len(free) or sorted(free) != np.flatnonzero(alloc.free_mask).tolist():
        _fail("free page list disagrees with the free bitmask")
    if pool.radix is not None:
        _check_radix(pool, live, holders)
    stats = pool.stats()
    # a radix page is reclaimable ("cached") unless a live request holds it or holds a radix
    # page below it (its path is pinned); everything else allocated is in use
    pinned = np.zeros(alloc.n_pages, dtype=np.bool_)
    if pool.radix is not None:
        for page in np.flatnonzero(radix_mask & (holders > 0)).tolist():
            node = pool.radix.node_of_page(page)
            while node is not None and node.page >= 0 and not pinned[node.page]:
                pinned[node.page] = True
                node = node.parent
    cached = int((radix_mask & ~pinned & (holders == 0)).sum()) * ps
    in_use = int(((holders > 0) | pinned).sum()) * ps
    if (stats["kv_tokens_cached"], stats["kv_tokens_in_use"]) != (cached, in_use):
        _fail(f"stats {stats} but in_use {in_use}, cached {cached}")
    if in_use + cached + len(free) * ps != stats["kv_tokens_total"] or stats["kv_tokens_total"] != pool.size:
        _fail(f"stats {stats} do not add up with {len(free)} free pages")


def assert_nothing_held(pool: PagePool) -> None:
    """Raise AssertionError unless no row is live and every page is free or held only by the radix."""
    live = pool.req_to_token_pool.live_rows()
    if live:
        _fail(f"rows {live} are still live")
    if not pool.paged:
        return
    refcount = pool.allocator.refcount
    radix_mask = pool.radix.page_mask if pool.radix is not None else np.zeros_like(pool.allocator.free_mask)
    held = np.flatnonzero((refcount != 0) & ~(radix_mask & (refcount == 1))).tolist()
    if held:
        _fail(
            f"pages {held} are held by something other than the radix (refcounts {refcount[held].tolist()})"
        )
