"""RadixCache: exact, page-aligned prefix sharing over ref-counted pages, in separate namespaces.

A namespace (a tenant's API key, a request's ``cache_salt``: see docs/http-api.md, "Isolation") is a
tree of its own under its own root: a lookup in one never finds a page inserted in another, so no
client can learn from its time to first token whether another sent the same prefix. Namespace
``None`` is the shared tree of requests that name none.

Over 300 lines because the tree, the references it holds on the allocator's pages, locking and
least-recently-used eviction (of whole nodes, and of windowed layer groups' pages alone) keep one
set of invariants together (``astrai.kvcache.invariants``): split, each part would reach into the
others' state.
"""

from __future__ import annotations

import heapq
import logging
from collections.abc import Callable, Hashable, Iterator, Sequence

import numpy as np

from astrai.kvcache.allocator import Allocator

logger = logging.getLogger(__name__)


class RadixNode:
    """One complete page of the cache: an edge from ``parent`` labelled by the page's tokens.

    ``pages[g]`` is the page of layer group ``g`` (``astrai.kvcache.layout``) holding these
    positions; -1 where a windowed group's page was dropped (no later request may start its window
    on it). ``page`` is group 0's: the only one of a model without local layers."""

    __slots__ = (
        "key",
        "pages",
        "parent",
        "children",
        "depth",
        "last_access",
        "lock_count",
        "hash",
        "id",
        "namespace",
    )

    def __init__(
        self, key: tuple[int, ...], pages: list[int], parent: RadixNode | None, node_id: int
    ) -> None:
        self.key = key  # exact token tuple of this page (page_size ids)
        self.pages = pages  # page id of each layer group in the allocator; [-1] for the root
        self.parent = parent
        self.children: dict[tuple[int, ...], RadixNode] = {}
        self.depth = 0 if parent is None else parent.depth + 1  # pages from the root, root = 0
        self.last_access = 0
        # live requests whose deepest held radix page is this node or below it: while > 0 the
        # node cannot be evicted (it, or a page that hangs under it, is referenced).
        self.lock_count = 0
        # introspection only: lookups always compare ``key`` itself.
        self.hash = hash(key) if parent is None else hash((parent.hash, key))
        self.id = node_id
        self.namespace: Hashable = None if parent is None else parent.namespace  # the tree it belongs to

    @property
    def page(self) -> int:
        return self.pages[0]

    def token_path(self) -> tuple[int, ...]:
        """All tokens from the root down to and including this page."""
        keys = []
        node: RadixNode | None = self
        while node is not None and node.parent is not None:
            keys.append(node.key)
            node = node.parent
        return tuple(t for key in reversed(keys) for t in key)


class RadixCache:
    """Complete token pages indexed as a tree of exact token tuples (paged mode, page_size > 1).

    Each non-root node holds one page (per layer group) and one reference on it (the radix's own).
    A child is found under its parent by the exact tuple of the page's tokens, so an
    identical page is reused only under the identical prefix.

    Eviction is LRU over leaves whose ``lock_count`` is 0, i.e. pages that no live
    request references, directly or through a page below them; such a page has
    refcount 1. Evicting a leaf may turn its parent into an evictable leaf.
    Without windowed groups, ``evictable_pages`` counts every node with ``lock_count == 0``:
    repeated leaf eviction can reclaim exactly that many pages.

    Locking is the caller's duty (PagePool): after taking references on pages of a
    path it calls ``lock`` on the deepest of them, and ``unlock`` when dropping them.

    Layer groups (``windows``, one per group, 0: global; see ``astrai.kvcache.layout``): a node
    holds a page per group. A windowed group's page held by the radix alone can go on its own,
    even on a locked path (the requests that locked it have moved their window past it): it is
    watched in the allocator (``Allocator.watched_single``), and eviction drops such pages and
    evictable leaves in one least-recently-used order. ``evictable_pages`` counts both: the global
    pages of unlocked nodes and the windowed pages only the radix holds.
    """

    def __init__(self, page_size: int, allocator: Allocator, windows: tuple[int, ...] = (0,)) -> None:
        if page_size < 1:
            raise ValueError(f"page_size must be >= 1, got {page_size}")
        self.page_size = page_size
        self.allocator = allocator
        self.windows = tuple(windows)
        self._global = sum(1 for w in self.windows if not w)  # pages an unlocked node frees for sure
        self.root = RadixNode((), [-1], None, 0)  # the shared namespace's (None)
        # a root per namespace; a namespace's root goes once its last page is evicted
        self._roots: dict[Hashable, RadixNode] = {None: self.root}
        self._next_id = 1
        self._tick = 0
        self._node_of_page: dict[int, RadixNode] = {}
        #: bool [n_pages]: True where the radix holds a reference on the page
        self.page_mask = np.zeros(allocator.n_pages, dtype=np.bool_)
        self._unlocked = 0  # non-root nodes with lock_count 0
        self._evictable_leaves: set[RadixNode] = set()
        # lazy min-heap of (last_access, id, node); an entry is stale unless the node is still an
        # evictable leaf with that last_access. Keeps eviction O(k log n), not a scan of the tree.
        self._heap: list[tuple[int, int, RadixNode]] = []
        #: called with each node about to be evicted, its path still attached (``astrai.kvcache.spill``
        #: copies its page out to the KV tiers); None: nothing is kept
        self.on_evict: Callable[[RadixNode], None] | None = None

    # ----------------------------------------------------------------- queries
    @property
    def evictable_pages(self) -> int:
        """Pages repeated ``evict`` can reclaim now (see the class doc)."""
        return self._unlocked * self._global + self.allocator.watched_single

    @property
    def num_pages(self) -> int:
        return len(self._node_of_page)

    def node_of_page(self, page: int) -> RadixNode | None:
        return self._node_of_page.get(page)

    def evictable_leaves(self) -> frozenset[RadixNode]:
        return frozenset(self._evictable_leaves)

    @property
    def namespaces(self) -> int:
        """Namespaces with at least one cached page (the shared one counts always)."""
        return len(self._roots)

    def root_of(self, namespace: Hashable) -> RadixNode | None:
        """The root of ``namespace``'s tree (None: it holds no page)."""
        return self._roots.get(namespace)

    def iter_nodes(self) -> Iterator[RadixNode]:
        """Every non-root node of every namespace, parents before children."""
        stack = [child for root in self._roots.values() for child in root.children.values()]
        while stack:
            node = stack.pop()
            yield node
            stack.extend(node.children.values())

    def _key(self, token_ids: Sequence[int], i: int) -> tuple[int, ...]:
        ps = self.page_size
        return tuple(int(t) for t in token_ids[i * ps : (i + 1) * ps])

    def _touch(self, path: list[RadixNode]) -> None:
        self._tick += 1
        for node in path:
            node.last_access = self._tick
            if node in self._evictable_leaves:
                heapq.heappush(self._heap, (node.last_access, node.id, node))

    def match(self, token_ids: Sequence[int], max_pages: int, namespace: Hashable = None) -> list[RadixNode]:
        """Nodes of the longest prefix of ``token_ids`` cached in ``namespace``, at most ``max_pages`` pages.

        Pure lookup plus an LRU touch; takes no reference and no lock.
        """
        max_pages = min(max_pages, len(token_ids) // self.page_size)
        path: list[RadixNode] = []
        node = self._roots.get(namespace)
        if node is None:
            return path
        for i in range(max_pages):
            child = node.children.get(self._key(token_ids, i))
            if child is None:
                break
            path.append(child)
            node = child
        self._touch(path)
        return path

    # ----------------------------------------------------------------- insertion
    def insert(
        self,
        token_ids: Sequence[int],
        pages: Sequence[int],
        lock: RadixNode | None,
        namespace: Hashable = None,
        more: Sequence[Sequence[int]] = (),
    ) -> RadixNode | None:
        """Insert the complete pages of one request into ``namespace``'s tree; returns its new lock node.

        ``pages[i]`` is the request's page holding tokens ``token_ids[i*ps:(i+1)*ps]``
        (``len(pages)`` complete pages; any partial tail of ``token_ids`` is ignored); ``more``, the
        pages of the other layer groups, in group order (-1 where a windowed group's page went).
        ``lock`` is the request's current lock node (deepest radix page it holds) or None.

        Existing nodes are kept: where the cache already has the page, the request's
        own copy stays private (it frees it at task_free) and siblings are untouched; a windowed
        page the node had lost is taken from the request. New nodes get the radix's reference.
        Raises ValueError, before any change, if the request's pages disagree with the tree (a
        page cached at another place).
        """
        ps = self.page_size
        groups = [pages, *more]
        if len(groups) != len(self.windows):
            raise ValueError(f"{len(groups)} page lists for {len(self.windows)} layer groups")
        n = min(min(len(g) for g in groups), len(token_ids) // ps)
        keys = [self._key(token_ids, i) for i in range(n)]
        root = self._roots.get(namespace)
        if root is None:
            if n == 0:
                return lock
            root = RadixNode((), [-1], None, 0)
            root.hash, root.namespace = hash(("namespace", namespace)), namespace
        # validation pass: read-only, so a bad call changes nothing.
        node = root
        for i in range(n):
            child = node.children.get(keys[i]) if node is not None else None
            for g, group in enumerate(groups):
                page = int(group[i])
                if page < 0:
                    if not self.windows[g]:
                        raise ValueError(f"no page of global layer group {g} at position {i * ps}")
                    continue
                owner = self._node_of_page.get(page)
                if owner is not None and (owner is not child or child.pages[g] != page):
                    raise ValueError(f"page {page} is cached under another prefix than position {i * ps}")
            node = child
        self._roots[namespace] = root
        deepest = lock
        path: list[RadixNode] = []
        node = root
        for i in range(n):
            mine = [int(group[i]) for group in groups]
            child = node.children.get(keys[i])
            if child is None:
                child = RadixNode(keys[i], mine, node, self._next_id)
                self._next_id += 1
                node.children[keys[i]] = child
                self._evictable_leaves.discard(node)
                self._hold(child, [g for g, page in enumerate(mine) if page >= 0])
                self._unlocked += 1  # lock_count 0 until the lock below
            else:  # a windowed page the node lost, the request still has
                lost = [g for g, page in enumerate(mine) if page >= 0 and child.pages[g] < 0]
                for g in lost:
                    child.pages[g] = mine[g]
                self._hold(child, lost)
            if (deepest is None or child.depth > deepest.depth) and any(
                page >= 0 and page == have for page, have in zip(mine, child.pages, strict=True)
            ):
                deepest = child
            path.append(child)
            node = child
        if deepest is not lock:
            self.lock(deepest)  # lock before unlock: the shared part never looks evictable
            if lock is not None:
                self.unlock(lock)
        self._touch(path)
        return deepest

    def attach(
        self, parent: RadixNode | None, key: tuple[int, ...], page: int, namespace: Hashable
    ) -> RadixNode:
        """A new leaf for ``page`` (one layer group), holding the tokens ``key``, under ``parent`` (None:
        ``namespace``'s root): a page loaded back from a KV tier. The radix takes its own reference;
        the caller's stays the caller's."""
        if parent is None:
            parent = self._roots.get(namespace)
            if parent is None:
                parent = RadixNode((), [-1], None, 0)
                parent.hash, parent.namespace = hash(("namespace", namespace)), namespace
                self._roots[namespace] = parent
        if key in parent.children or len(self.windows) != 1:
            raise ValueError("attach: the page is cached already, or the pool has layer groups")
        child = RadixNode(key, [page], parent, self._next_id)
        self._next_id += 1
        parent.children[key] = child
        self._evictable_leaves.discard(parent)
        self._hold(child, [0])
        self._unlocked += 1
        self._touch([child])
        self._refresh(child)
        return child

    def _hold(self, node: RadixNode, groups: list[int]) -> None:
        """Take the radix's reference on ``node``'s pages of ``groups`` (watching the windowed ones)."""
        pages = [node.pages[g] for g in groups]
        if not pages:
            return
        for page in pages:
            self._node_of_page[page] = node
        self.page_mask[pages] = True
        self.allocator.incref(pages)
        self.allocator.watch([node.pages[g] for g in groups if self.windows[g]], True)

    def _release(self, node: RadixNode, groups: list[int]) -> int:
        """Drop the radix's reference on ``node``'s pages of ``groups``; returns the pages freed."""
        pages = [node.pages[g] for g in groups if node.pages[g] >= 0]
        if not pages:
            return 0
        self.allocator.watch([node.pages[g] for g in groups if self.windows[g] and node.pages[g] >= 0], False)
        for g in groups:
            node.pages[g] = -1 if self.windows[g] else node.pages[g]
        for page in pages:
            del self._node_of_page[page]
        self.page_mask[pages] = False
        return len(self.allocator.decref(pages))

    # ----------------------------------------------------------------- locking
    def lock(self, node: RadixNode) -> None:
        """Protect ``node`` and its ancestors from eviction (one more live holder below them)."""
        while node.parent is not None:
            node.lock_count += 1
            if node.lock_count == 1:
                self._unlocked -= 1
                self._evictable_leaves.discard(node)
            node = node.parent

    def unlock(self, node: RadixNode) -> None:
        """Undo one ``lock(node)``."""
        while node.parent is not None:
            if node.lock_count <= 0:
                raise RuntimeError(f"unlock of unlocked radix node at depth {node.depth}")
            node.lock_count -= 1
            if node.lock_count == 0:
                self._unlocked += 1
                self._refresh(node)
            node = node.parent

    def _refresh(self, node: RadixNode) -> None:
        if node.parent is None:
            return
        if not node.children and node.lock_count == 0:
            if node not in self._evictable_leaves:
                self._evictable_leaves.add(node)
                heapq.heappush(self._heap, (node.last_access, node.id, node))
        else:
            self._evictable_leaves.discard(node)

    # ----------------------------------------------------------------- eviction
    def evict(self, n_pages: int) -> int:
        """Free up to ``n_pages`` pages, least recently used first; returns pages freed.

        Candidates are evictable leaves (every page of the node goes) and, with windowed layer
        groups, windowed pages only the radix holds (that page alone goes; the node stays).
        """
        freed = 0
        dropped = self._droppable() if self._global < len(self.windows) else []
        at = 0
        while freed < n_pages:
            leaf = self._peek_lru()
            while at < len(dropped) and not self._still_droppable(dropped[at][2]):
                at += 1
            if at < len(dropped) and (leaf is None or dropped[at][0] <= leaf.last_access):
                page = dropped[at][2]
                node = self._node_of_page[page]
                freed += self._release(node, [node.pages.index(page)])
                at += 1
                continue
            if leaf is None:
                break
            self._evictable_leaves.remove(leaf)
            freed += self._evict_node(leaf)
        if len(self._heap) > 2 * len(self._evictable_leaves) + 64:
            self._heap = [(n.last_access, n.id, n) for n in self._evictable_leaves]
            heapq.heapify(self._heap)
        if freed:
            logger.debug("radix evicted %d page(s), %d evictable left", freed, self.evictable_pages)
        return freed

    def drop(self, namespaces: Callable[[Hashable], bool]) -> int:
        """Free every page no live request holds in the namespaces ``namespaces`` says yes to (a LoRA
        adapter that is gone); returns pages freed. Locked pages stay (LRU eviction takes them later)."""
        freed = 0
        while True:
            leaves = [n for n in self._evictable_leaves if namespaces(n.namespace)]
            if not leaves:
                return freed
            for leaf in leaves:
                self._evictable_leaves.discard(leaf)
                freed += self._evict_node(leaf)

    def _evict_node(self, node: RadixNode) -> int:
        parent = node.parent
        assert parent is not None  # only non-root nodes are ever evictable leaves
        if self.on_evict is not None:
            self.on_evict(node)
        del parent.children[node.key]
        node.parent = None
        self._unlocked -= 1
        held = [g for g, page in enumerate(node.pages) if page >= 0]
        freed = self._release(node, held)
        if freed < self._global:
            raise RuntimeError(f"evicted radix node of pages {node.pages} is still referenced")
        self._refresh(parent)
        if parent.parent is None and not parent.children and parent is not self.root:
            del self._roots[parent.namespace]  # an empty namespace keeps no root
        return freed

    def _droppable(self) -> list[tuple[int, int, int]]:
        """``(last_access, node id, page)`` of the windowed pages only the radix holds, oldest first."""
        alloc = self.allocator
        pages = np.flatnonzero(alloc.watched & (alloc.refcount == 1)).tolist()
        nodes = [self._node_of_page[p] for p in pages]
        return sorted((n.last_access, n.id, p) for n, p in zip(nodes, pages, strict=True))

    def _still_droppable(self, page: int) -> bool:
        return bool(self.allocator.watched[page]) and int(self.allocator.refcount[page]) == 1

    def _peek_lru(self) -> RadixNode | None:
        """The least recently used evictable leaf (left in place), stale heap entries dropped."""
        while self._heap:
            last_access, _, node = self._heap[0]
            if node in self._evictable_leaves and node.last_access == last_access:
                return node
            heapq.heappop(self._heap)
        return None
