"""Allocator: ref-counted pages over a free bitmask (paged mode only)."""

from __future__ import annotations

import logging
from collections.abc import Sequence

import numpy as np

logger = logging.getLogger(__name__)


class Allocator:
    """Hands out pages of the paged pool and counts who holds each one.

    Page ``p`` owns token slots ``p * page_size .. p * page_size + page_size - 1``;
    the allocator itself only deals in page ids ``0 .. n_pages - 1``.

    State, all host-side:

    - ``refcount`` int32 ``[n_pages]``: holders of each page (one per live request
      whose ``req_to_token`` row uses it, plus one if the radix cache holds it).
    - ``free_mask`` bool ``[n_pages]``: the free bitmask, True exactly where
      ``refcount == 0``.
    - a stack of the free page ids, so ``alloc(k)`` costs O(k) instead of a scan of
      the bitmask (the scheduler allocates every step).

    - ``watched`` bool ``[n_pages]`` and ``watched_single``: pages someone asked to watch (the radix,
      for the windowed-group pages it caches) and how many of them have refcount 1, kept as
      references change, so that counting what eviction could reclaim costs nothing.

    Misuse that would corrupt the pool (decref of a free page, incref of a free
    page) raises RuntimeError and leaves the state unchanged: those are bugs of
    the caller, never user input.
    """

    def __init__(self, n_pages: int) -> None:
        if n_pages < 1:
            raise ValueError(f"n_pages must be >= 1, got {n_pages}")
        self.n_pages = n_pages
        self.refcount = np.zeros(n_pages, dtype=np.int32)
        self.free_mask = np.ones(n_pages, dtype=np.bool_)
        # reversed so that pops hand out low page ids first.
        self._free_stack: list[int] = list(range(n_pages - 1, -1, -1))
        self.watched = np.zeros(n_pages, dtype=np.bool_)
        self.watched_single = 0

    @property
    def num_free(self) -> int:
        """Pages with refcount 0."""
        return len(self._free_stack)

    def free_pages(self) -> list[int]:
        """A copy of the free stack (for invariant checks)."""
        return list(self._free_stack)

    def alloc(self, n: int) -> list[int] | None:
        """Take ``n`` free pages, each with refcount 1; None (nothing changed) if fewer are free."""
        if n < 0:
            raise ValueError(f"cannot allocate {n} pages")
        if n > len(self._free_stack):
            return None
        if n == 0:
            return []
        pages = self._free_stack[-n:]
        del self._free_stack[-n:]
        pages.reverse()
        idx = np.asarray(pages, dtype=np.int64)
        self.free_mask[idx] = False
        self.refcount[idx] = 1
        return pages

    def incref(self, pages: Sequence[int]) -> None:
        """Add one holder to each listed page (a page listed twice gains two). Pages must be in use."""
        idx = np.asarray(pages, dtype=np.int64)
        if idx.size == 0:
            return
        if self.free_mask[idx].any():
            bad = idx[self.free_mask[idx]].tolist()
            raise RuntimeError(f"incref of free page(s) {bad}")
        single = self._single(idx)
        np.add.at(self.refcount, idx, 1)
        self.watched_single += self._single(idx) - single

    def watch(self, pages: Sequence[int], on: bool) -> None:
        """Start (``on``) or stop counting ``pages`` (in use, each listed once) in ``watched_single``."""
        idx = np.asarray(pages, dtype=np.int64)
        if idx.size == 0:
            return
        if (self.watched[idx] == on).any():
            raise RuntimeError(f"pages {idx.tolist()} are {'already' if on else 'not'} watched")
        single = int((self.refcount[idx] == 1).sum())
        self.watched[idx] = on
        self.watched_single += single if on else -single

    def _single(self, idx: np.ndarray) -> int:
        """Watched pages among ``idx`` (counted once each) with refcount 1."""
        if not self.watched[idx].any():
            return 0
        u = np.unique(idx)
        return int((self.watched[u] & (self.refcount[u] == 1)).sum())

    def decref(self, pages: Sequence[int]) -> list[int]:
        """Drop one holder from each listed page; returns the pages that became free."""
        idx = np.asarray(pages, dtype=np.int64)
        if idx.size == 0:
            return []
        single = self._single(idx)
        np.subtract.at(self.refcount, idx, 1)
        after = self.refcount[idx]
        if (after < 0).any():
            np.add.at(self.refcount, idx, 1)  # undo: the caller's bug must not corrupt the pool
            raise RuntimeError(f"double free of page(s) {idx[after < 0].tolist()}")
        self.watched_single += self._single(idx) - single
        freed = np.unique(idx[after == 0])
        if freed.size:
            if self.watched[freed].any():
                raise RuntimeError(f"watched page(s) {freed[self.watched[freed]].tolist()} were freed")
            self.free_mask[freed] = True
            self._free_stack.extend(freed.tolist())
        return freed.tolist()
