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
        for page in node.pages:
            if page < 0:
                continue
            if radix.node_of_page(page) is not node or mask[page]:
                _fail(f"page {page} is indexed twice or not at its node")
            mask[page] = True
    if radix.num_pages != int(mask.sum()) or not np.array_equal(mask, radix.page_mask):
        _fail("radix page index disagrees with the tree")
    # every live request pins the root path of its deepest held radix page.
    locks: dict[RadixNode, int] = {}
    windows = pool.layout.windows
    for row in live:
        groups = [pool.req_pages(row, g) for g in range(len(windows))]
        # positions where the row holds a page the radix holds too
        held = [i for i in range(len(groups[0])) if any(pages[i] >= 0 and mask[pages[i]] for pages in groups)]
        lock = pool.req_lock(row)
        # the lock: the row's deepest held radix page's node, or below it on the row's path where a
        # windowed group's pages it held there went back (``PagePool.slide``)
        if lock is not None and lock.depth > len(groups[0]):
            _fail(f"row {row} locks a radix node past its positions")
        if not held:
            if lock is not None and not any(windows):
                _fail(f"row {row} locks a radix node but holds no radix page")
            continue
        if lock is None or lock.depth < held[-1] + 1 or (lock.depth != held[-1] + 1 and not any(windows)):
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
        path.reverse()
        for i in held:
            for g, pages in enumerate(groups):
                if pages[i] >= 0 and mask[pages[i]] and path[i].pages[g] != pages[i]:
                    _fail(
                        f"row {row}: radix page {pages[i]} at position {i * pool.page_size} is off its path"
                    )
    n_global = sum(1 for w in windows if not w)
    watched = pool.allocator.watched
    evictable = int((watched & (refcount == 1)).sum())
    for node in nodes:
        if node.lock_count != locks.get(node, 0):
            _fail(
                f"radix node of pages {node.pages}: lock_count {node.lock_count}, expected {locks.get(node, 0)}"
            )
        for g, page in enumerate(node.pages):
            if (page < 0 and not windows[g]) or (page >= 0 and bool(watched[page]) != bool(windows[g])):
                _fail(f"radix node of pages {node.pages}: group {g}'s page is missing or misfiled")
        if node.lock_count == 0:
            evictable += n_global
            for page in node.pages:
                if page >= 0 and refcount[page] != 1:
                    _fail(f"unpinned radix page {page} has refcount {refcount[page]}")
    if evictable != radix.evictable_pages:
        _fail(f"evictable_pages {radix.evictable_pages}, counted {evictable}")
    if not np.array_equal(
        watched, radix.page_mask & np.isin(np.arange(len(watched)), _windowed(pool, nodes))
    ):
        _fail("the allocator watches other pages than the radix's windowed ones")
    for namespace in {n.namespace for n in nodes} | {None}:
        root = radix.root_of(namespace)
        if root is None or root.parent is not None or root.namespace != namespace:
            _fail(f"namespace {namespace!r} has no root of its own")
    leaves = {n for n in nodes if not n.children and n.lock_count == 0}
    if leaves != set(radix.evictable_leaves()):
        _fail("evictable leaf set disagrees with the tree")


def _windowed(pool: PagePool, nodes: list[RadixNode]) -> list[int]:
    """The windowed groups' pages the radix's ``nodes`` hold."""
    windows = pool.layout.windows
    return [page for node in nodes for g, page in enumerate(node.pages) if windows[g] and page >= 0]


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
    windows = pool.layout.windows
    holders = np.zeros(alloc.n_pages, dtype=np.int64)
    tables = [t.cpu().to(torch.int64) for t in pool.req_to_token_pool.tables]
    for row in live:
        n = pool.req_len(row)
        mine: list[int] = []
        for g, table in enumerate(tables):
            pages = pool.req_pages(row, g)
            if len(pages) != -(-n // ps):
                _fail(f"row {row}: {len(pages)} pages {pages} of group {g} for {n} positions")
            kept = [i for i, p in enumerate(pages) if p >= 0]
            if not windows[g] and len(kept) != len(pages):
                _fail(f"row {row}: global layer group {g} lacks pages: {pages}")
            if kept and kept != list(range(kept[0], len(pages))):
                _fail(f"row {row}: group {g} dropped pages inside its window: {pages}")
            mine += [pages[i] for i in kept]
            for i in kept:
                slots = torch.arange(pages[i] * ps, (pages[i] + 1) * ps)
                upto = min((i + 1) * ps, pool.max_ctx_len) - i * ps
                if upto > 0 and not torch.equal(table[row, i * ps : i * ps + upto], slots[:upto]):
                    _fail(f"row {row}: req_to_token of group {g} disagrees with its pages {pages}")
        if len(set(mine)) != len(mine):
            _fail(f"row {row} holds a page twice: {mine}")
        if mine:
            holders[mine] += 1
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
    # a radix page is reclaimable ("cached") when nothing but the radix holds it and, for a
    # global group's page, no live request holds a radix page at or below its node (its path is
    # pinned); everything else allocated is in use
    cached = 0
    if pool.radix is not None:
        pinned: set[int] = set()
        for page in np.flatnonzero(radix_mask & (holders > 0)).tolist():
            node = pool.radix.node_of_page(page)
            while node is not None and node.parent is not None and node.id not in pinned:
                pinned.add(node.id)
                node = node.parent
        for node in pool.radix.iter_nodes():
            for g, page in enumerate(node.pages):
                if page >= 0 and holders[page] == 0 and (windows[g] or node.id not in pinned):
                    cached += 1
    in_use = alloc.n_pages - len(free) - cached
    if (stats["kv_tokens_cached"], stats["kv_tokens_in_use"]) != (cached * ps, in_use * ps):
        _fail(f"stats {stats} but in_use {in_use * ps}, cached {cached * ps}")
    if (in_use + cached + len(free)) * ps != stats["kv_tokens_total"] or stats[
        "kv_tokens_total"
    ] != pool.size:
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
