"""PagePool: the KV system's top-level manager (storage, req_to_token, allocator, radix).

Over 300 lines because every change to a request's positions (admission, growth, speculative
drafts rolled back, release) goes through the one class that keeps them consistent.
"""

from __future__ import annotations

import logging
from collections.abc import Hashable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from astrai.errors import CapacityExceeded
from astrai.kvcache.allocator import Allocator
from astrai.kvcache.cache import KVCache
from astrai.kvcache.layout import KVLayout
from astrai.kvcache.quant import check_kv_dtype
from astrai.kvcache.radix import RadixCache, RadixNode
from astrai.kvcache.req_to_token import ReqToTokenPool
from astrai.kvcache.spill import PageSpill
from astrai.kvcache.step import step_kv_cache
from astrai.kvcache.storage import KVStorage

if TYPE_CHECKING:
    from astrai.kvcache.tier import KVTier

logger = logging.getLogger(__name__)


@dataclass
class KVConfig:
    """How the KV pool is sized. Contiguous mode when neither n_tokens nor memory_budget_bytes is set.

    Raises ValueError on a non-positive size or when both paged sizes are given.
    """

    max_batch_size: int = 16  # rows of req_to_token (concurrent requests)
    max_seq_len: int = 2048  # max context per request (columns of req_to_token)
    page_size: int = 1
    n_tokens: int | None = None  # paged pool size in token slots (floored to whole pages)
    memory_budget_bytes: int | None = None  # alternative to n_tokens: K+V bytes over all layers
    prefix_caching: bool = True  # radix cache; only effective when paged and page_size > 1
    # the most positions a request computes in one step (the engine's max_prefill_tokens): what a
    # windowed layer group holds beyond its window, for the pool's estimates (``KVLayout.pages``)
    chunk_tokens: int = 1
    # what K and V are kept in (``astrai.kvcache.quant``): "auto" (the model's dtype) or "int8"
    kinds: tuple[str, str] = ("auto", "auto")

    def __post_init__(self) -> None:
        if self.max_batch_size < 1 or self.max_seq_len < 1 or self.page_size < 1:
            raise ValueError(f"max_batch_size, max_seq_len and page_size must be >= 1: {self}")
        if self.n_tokens is not None and self.memory_budget_bytes is not None:
            raise ValueError("give either n_tokens or memory_budget_bytes, not both")
        self.kinds = tuple(check_kv_dtype(kind) for kind in self.kinds)
        for name in ("n_tokens", "memory_budget_bytes"):
            if getattr(self, name) is not None and getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")

    @property
    def paged(self) -> bool:
        return self.n_tokens is not None or self.memory_budget_bytes is not None

    def layout(self, n_layers: int, windows: Sequence[int] = ()) -> KVLayout:
        """The layer groups of a pool of this configuration (``astrai.kvcache.layout``): by the layers'
        ``windows`` when paged (a window reaching the whole context is none), else one group."""
        wins = [w if 0 < w < self.max_seq_len else 0 for w in windows] if self.paged else []
        return KVLayout.of(wins if any(wins) else [0] * n_layers)

    def slots(
        self, n_layers: int, n_kv_heads: int, head_dim: int, dtype: torch.dtype, windows: Sequence[int] = ()
    ) -> int:
        """Slots of the pool this configuration gives (``PagePool.size``), before it exists: token
        slots; with layer groups, each holds one position of one group's layers."""
        if not self.paged:
            return self.max_batch_size * self.max_seq_len
        layout = self.layout(n_layers, windows)
        if self.n_tokens is not None:  # positions of every layer: as many pages for each group
            return self.n_tokens // self.page_size * layout.n_groups * self.page_size
        per_page = self.page_size * KVStorage.bytes_per_token(
            layout.group_size, n_kv_heads, head_dim, dtype, self.kinds
        )
        return self.memory_budget_bytes // per_page * self.page_size

    def nbytes(
        self, n_layers: int, n_kv_heads: int, head_dim: int, dtype: torch.dtype, windows: Sequence[int] = ()
    ) -> int:
        """Bytes a ``PagePool`` of this configuration allocates: K/V storage and the req_to_token tables."""
        layout = self.layout(n_layers, windows)
        storage = self.slots(n_layers, n_kv_heads, head_dim, dtype, windows) * KVStorage.bytes_per_token(
            layout.group_size, n_kv_heads, head_dim, dtype, self.kinds
        )
        return storage + layout.n_groups * self.max_batch_size * self.max_seq_len * 4  # int32 tables


class PagePool:
    """Owns the KV buffers and decides which slots each request's positions use.

    Contiguous mode: ``max_batch_size * max_seq_len`` slots, ``slot = row * max_seq_len + pos``,
    nothing is allocated after construction. Paged mode: a shared pool of
    ``size // page_size`` pages, allocated on demand and ref-counted; position ``pos``
    of a request lives at ``page * page_size + pos % page_size`` where ``page`` is its
    ``pos // page_size``-th page. With page_size > 1 and prefix_caching, a RadixCache
    shares complete pages between requests.

    Layer groups (``windows``: each layer's sliding window, 0 for none; see
    ``astrai.kvcache.layout``): each page holds one group's layers, a request holds a page per
    group for each ``page_size`` positions, and a windowed group's pages that every later query
    of the request is past go back to the pool (``slide``, at each step's ``bind_tasks``). Sizes
    and capacities (``size``, ``available_tokens``, ``round_up``) then count slots of such pages.

    Host-side only (no device sync) except the small index copies extend() and
    bind_tasks() make. Not thread-safe: one scheduler thread drives it.
    """

    def __init__(
        self,
        n_layers: int,
        n_heads: int,
        n_kv_heads: int,
        head_dim: int,
        config: KVConfig,
        dtype: torch.dtype = torch.float32,
        device: torch.device | str = "cpu",
        windows: Sequence[int] = (),
    ) -> None:
        self.config = config
        self.layout = layout = config.layout(n_layers, windows)
        self._windowed = [g for g, w in enumerate(layout.windows) if w]
        self.n_layers, self.n_heads, self.n_kv_heads, self.head_dim = n_layers, n_heads, n_kv_heads, head_dim
        self.dtype = dtype
        self.device = torch.device(device)
        self.max_ctx_len = config.max_seq_len
        self.paged = config.paged
        self.page_size = config.page_size
        self.allocator: Allocator | None = None
        self.radix: RadixCache | None = None
        if self.paged:
            n_pages = config.slots(n_layers, n_kv_heads, head_dim, dtype, windows) // self.page_size
            if n_pages < layout.n_groups:
                raise ValueError(f"KV pool of {config} holds no page of {self.page_size} positions")
            self.size = n_pages * self.page_size
            self.allocator = Allocator(n_pages)
            if self.page_size > 1 and config.prefix_caching:
                self.radix = RadixCache(self.page_size, self.allocator, layout.windows)
            self.req_to_token_pool = ReqToTokenPool(
                config.max_batch_size, self.max_ctx_len, self.device, groups=layout.n_groups
            )
        else:
            self.size = config.max_batch_size * config.max_seq_len
            self.req_to_token_pool = ReqToTokenPool(
                config.max_batch_size, self.max_ctx_len, self.device, linear_stride=config.max_seq_len
            )
        self.storage = KVStorage(
            layout.group_size, self.size, n_kv_heads, head_dim, dtype, self.device, config.kinds
        )
        rows = config.max_batch_size
        self._pages = self.req_to_token_pool.pages  # paged: each row's page ids in position order
        self._gpages = self.req_to_token_pool.group_pages  # the same, per layer group
        # per windowed group and row: pages before this index went back (slide)
        self._slid: dict[int, list[int]] = {g: [0] * rows for g in self._windowed}
        self._locks: list[RadixNode | None] = [None] * rows  # deepest radix node each row holds
        self._namespaces: list[Hashable] = [
            None
        ] * rows  # the radix namespace each row matches and records in
        self.spill: PageSpill | None = None  # its KV tiers (attach_tier)
        mode = ("paged, radix" if self.radix else "paged") if self.paged else "contiguous"
        if config.kinds != ("auto", "auto"):
            mode += f", K {config.kinds[0]}, V {config.kinds[1]}"
        if not layout.trivial:
            mode += f", {layout.n_groups} layer groups of {layout.group_size}, windows {layout.windows}"
        logger.info(
            "KV pool (%s): %d slots, page_size %d, %.1f MiB",
            mode,
            self.size,
            self.page_size,
            self.storage.nbytes() / 2**20,
        )

    def attach_tier(self, tier: KVTier) -> None:
        """Send the pages the radix evicts to ``tier`` and load prompts' pages back from it
        (``astrai.kvcache.spill``); ValueError for a pool without prefix caching or with layer groups."""
        self.spill = PageSpill(self, tier)

    # ----------------------------------------------------------------- views
    @property
    def k_buffer(self) -> torch.Tensor:
        return self.storage.k_buffer

    @property
    def v_buffer(self) -> torch.Tensor:
        return self.storage.v_buffer

    @property
    def req_to_token(self) -> torch.Tensor:
        return self.req_to_token_pool.req_to_token

    def req_len(self, req_idx: int) -> int:
        """Positions of the request that currently have slots."""
        self.req_to_token_pool.require_live(req_idx)
        return self.req_to_token_pool.lens[req_idx]

    def req_pages(self, req_idx: int, group: int = 0) -> tuple[int, ...]:
        """Paged mode: the request's page ids of layer ``group`` in position order (empty in contiguous
        mode; -1 where a windowed group's page went back)."""
        self.req_to_token_pool.require_live(req_idx)
        return tuple(self._gpages[group][req_idx])

    def req_lock(self, req_idx: int) -> RadixNode | None:
        """The deepest radix node the request holds (it pins that node's root path), or None."""
        return self._locks[req_idx]

    def req_namespace(self, req_idx: int) -> Hashable:
        """The radix namespace the request matched its prefix in (and records its pages in)."""
        return self._namespaces[req_idx]

    # ----------------------------------------------------------------- request lifecycle
    def task_alloc(self) -> int:
        """A free req_to_token row with no positions; raises CapacityExceeded if none is free."""
        return self.req_to_token_pool.alloc()

    def match_prefix(self, req_idx: int, token_ids: Sequence[int], namespace: Hashable = None) -> int:
        """Share the longest complete-page prefix of ``token_ids[:-1]`` cached in ``namespace``; returns
        its length. The row's later ``record`` calls insert into that namespace.

        The request takes a reference on each matched page and its positions
        ``[0, n)`` map to them. Must be called before any extend (ValueError otherwise).
        """
        self.req_to_token_pool.require_live(req_idx)
        if self.req_to_token_pool.lens[req_idx] or self._pages[req_idx]:
            raise ValueError(f"match_prefix on row {req_idx}, which already has positions")
        self._namespaces[req_idx] = namespace
        if self.radix is None or len(token_ids) < 2:
            return 0
        # token_ids[:-1]: at least one token is left to compute, so no write lands in a shared page.
        max_pages = (len(token_ids) - 1) // self.page_size
        nodes = self.radix.match(token_ids, max_pages, namespace)
        if self.spill is not None:  # the pages after the match that a KV tier holds, loaded back
            nodes += self.spill.restore(token_ids, nodes, max_pages, namespace)
        nodes = nodes[: self._usable(nodes)]
        if not nodes:
            return 0
        n = len(nodes) * self.page_size
        held = []
        for g, window in enumerate(self.layout.windows):
            first = self._window_page(n, window)  # a windowed group's pages before it: not needed
            pages = [-1] * first + [node.pages[g] for node in nodes[first:]]
            held += pages[first:]
            self.req_to_token_pool.append_pages(req_idx, pages, self.page_size, g)
            if window:
                self._slid[g][req_idx] = first
        self.allocator.incref(held)
        self.radix.lock(nodes[-1])
        self._locks[req_idx] = nodes[-1]
        self.req_to_token_pool.lens[req_idx] = n
        return n

    def _window_page(self, position: int, window: int) -> int:
        """The first page a query at ``position`` reads in a group of ``window`` (0: all)."""
        return max(0, position - window + 1) // self.page_size if window else 0

    def _usable(self, nodes: list[RadixNode]) -> int:
        """How many of the matched ``nodes`` a request can start after: the most that leave every
        windowed group's pages of the first query's window in the cache."""
        for h in range(len(nodes), 0, -1):
            n = h * self.page_size
            if all(
                node.pages[g] >= 0
                for g in self._windowed
                for node in nodes[self._window_page(n, self.layout.windows[g]) : h]
            ):
                return h
        return 0

    def slide(self, req_idx: int, position: int) -> None:
        """The request's next query is at ``position`` or later: its windowed groups' pages that no such
        query reads go back (the radix may keep them). A no-op without windowed groups."""
        drop = []
        for g in self._windowed:
            slid, upto = self._slid[g], self._window_page(position, self.layout.windows[g])
            pages = self._gpages[g][req_idx]
            for i in range(slid[req_idx], min(upto, len(pages))):
                if pages[i] >= 0:
                    drop.append(pages[i])
                    pages[i] = -1
            slid[req_idx] = max(slid[req_idx], upto)
        if drop:
            self.allocator.decref(drop)

    def extend(self, req_idx: int, new_len: int) -> bool:
        """Give positions ``[0, new_len)`` slots; False (nothing changed) if the pool cannot now.

        Evicts least recently used cache-only radix pages when the free pages fall
        short. Raises CapacityExceeded when ``new_len > max_ctx_len``.
        """
        self.req_to_token_pool.require_live(req_idx)
        if new_len > self.max_ctx_len:
            raise CapacityExceeded(f"{new_len} positions exceed max_seq_len {self.max_ctx_len}")
        lens = self.req_to_token_pool.lens
        if new_len <= lens[req_idx]:
            return True
        if self.paged:
            pages = self._pages[req_idx]
            need = -(-new_len // self.page_size) - len(pages)  # per group: their lists keep in step
            if need > 0:
                groups = self.layout.n_groups
                short = need * groups - self.allocator.num_free
                if short > 0:
                    if self.radix is None or self.radix.evictable_pages < short:
                        return False
                    self.radix.evict(short)
                new = self.allocator.alloc(need * groups)
                for g in range(groups):
                    self.req_to_token_pool.append_pages(
                        req_idx, new[g * need : (g + 1) * need], self.page_size, g
                    )
        lens[req_idx] = new_len
        return True

    def spare(self, req_idx: int) -> int:
        """Positions the request could gain now without evicting cached pages: the rest of its last
        page and the free pages (contiguous: up to ``max_seq_len``)."""
        have = self.req_len(req_idx)
        if not self.paged:
            return self.max_ctx_len - have
        page = self.page_size
        more = self.allocator.num_free // self.layout.n_groups * page  # each page of positions: one per group
        return min(-(-have // page) * page - have + more, self.max_ctx_len - have)

    def truncate(self, req_idx: int, new_len: int) -> None:
        """Keep positions ``[0, new_len)`` only: the pages past them go back (a speculative draft's
        rejected tokens). Those pages must be the request's own, never recorded in the radix:
        positions past what the request computed are never recorded, so they are."""
        self.req_to_token_pool.require_live(req_idx)
        lens = self.req_to_token_pool.lens
        if new_len >= lens[req_idx]:
            return
        if new_len < 0:
            raise ValueError(f"cannot truncate row {req_idx} to {new_len} positions")
        if self.paged:
            keep = -(-new_len // self.page_size)
            dropped = [p for group in self._gpages for p in group[req_idx][keep:] if p >= 0]
            if self.radix is not None and any(self.radix.node_of_page(p) is not None for p in dropped):
                raise ValueError(f"row {req_idx}: truncating to {new_len} would drop pages the radix holds")
            for group in self._gpages:
                del group[req_idx][keep:]
            for slid in self._slid.values():
                slid[req_idx] = min(slid[req_idx], keep)
            self.allocator.decref(dropped)
        lens[req_idx] = new_len

    def record(self, req_idx: int, token_ids: Sequence[int]) -> None:
        """Insert the complete pages of ``token_ids`` (KV materialized at positions 0..len-1).

        No-op without a radix. Raises ValueError if ``token_ids`` is longer than the
        request's positions, or disagrees with the cached pages it holds.
        """
        self.req_to_token_pool.require_live(req_idx)
        if len(token_ids) > self.req_to_token_pool.lens[req_idx]:
            raise ValueError(
                f"record of {len(token_ids)} tokens on row {req_idx} with {self.req_len(req_idx)} positions"
            )
        if self.radix is None:
            return
        n = len(token_ids) // self.page_size
        if n:
            groups = [pages[req_idx][:n] for pages in self._gpages]
            self._locks[req_idx] = self.radix.insert(
                token_ids, groups[0], self._locks[req_idx], self._namespaces[req_idx], groups[1:]
            )

    def task_free(self, req_idx: int) -> None:
        """Drop the request's page references and release its row (ValueError if not live)."""
        self.req_to_token_pool.require_live(req_idx)
        if self.paged:
            lock = self._locks[req_idx]
            if lock is not None:
                self.radix.unlock(lock)
                self._locks[req_idx] = None
            self.allocator.decref([p for group in self._gpages for p in group[req_idx] if p >= 0])
            for slid in self._slid.values():
                slid[req_idx] = 0
        self._namespaces[req_idx] = None
        self.req_to_token_pool.free(req_idx)

    # ----------------------------------------------------------------- capacity
    def available_tokens(self) -> int:
        """Token slots extend() could obtain now.

        Paged: (free + evictable pages) * page_size. Contiguous: slots not yet given to a
        live request's positions (each request may still only grow to max_seq_len).
        """
        if self.paged:
            evictable = self.radix.evictable_pages if self.radix is not None else 0
            return (self.allocator.num_free + evictable) * self.page_size
        return self.size - self._live_positions()

    def round_up(self, n_tokens: int) -> int:
        """The slots a request of ``n_tokens`` positions takes at most: whole pages (with layer groups,
        a page per group of each ``page_size`` positions, a windowed group's up to its window:
        ``KVLayout.pages``); contiguous: ``n_tokens``."""
        if not self.paged:
            return n_tokens
        return self.layout.pages(n_tokens, self.page_size, self.config.chunk_tokens) * self.page_size

    def common_pages(self, a: list[int], b: list[int]) -> int:
        """Complete pages that ``a[:-1]`` (what a prefix match may cover) and ``b`` share from the start."""
        page = self.page_size
        lo, hi = 0, min(len(a) - 1, len(b)) // page
        while lo < hi:  # binary search on slice equality: C-speed comparisons, log(pages) of them
            mid = (lo + hi + 1) // 2
            if a[: mid * page] == b[: mid * page]:
                lo = mid
            else:
                hi = mid - 1
        return lo

    def grow(self, req_idx: int, want: int) -> int:
        """Extend the request towards ``want`` positions, as far as the pool allows now.

        Returns the positions it has slots for afterwards: ``want``, or less (as many as the
        free and evictable pages give), or its length before the call when nothing could be had.
        """
        if self.extend(req_idx, want):
            return want
        have = self.req_len(req_idx)
        if self.paged:  # each page of positions more takes a page per group
            page = self.page_size
            cap = -(-have // page) * page + self.available_tokens() // page // self.layout.n_groups * page
        else:
            cap = have + self.available_tokens()
        cap = min(want, cap)
        return cap if cap > have and self.extend(req_idx, cap) else have

    def _live_positions(self) -> int:
        pool = self.req_to_token_pool
        return sum(pool.lens[r] for r in pool.live_rows())

    @property
    def context_limit(self) -> int:
        """Positions one request may hold (prompt plus generated): ``max_seq_len``, capped by the pool."""
        if not self.paged:
            return min(self.max_ctx_len, self.size)
        n_pages = self.size // self.page_size
        return min(self.max_ctx_len, self.layout.positions(n_pages, self.page_size, self.config.chunk_tokens))

    def can_ever_fit(self, n_tokens: int) -> bool:
        """Whether one request of ``n_tokens`` positions fits max_seq_len and the empty pool."""
        if n_tokens > self.max_ctx_len:
            return False
        return self.round_up(n_tokens) <= self.size

    def stats(self) -> dict:
        """``kv_tokens_total`` (slots), ``kv_tokens_cached`` (slots of pages only the radix keeps,
        i.e. what eviction could reclaim now), ``kv_tokens_in_use`` (every other allocated slot:
        pages live requests reference or pin through their cached path; contiguous: their positions).
        ``in_use + cached + free == total``. What a slot holds: ``kv_cache_dtype_k`` and ``_v`` (the
        buffers' dtypes: int8 for a quantized cache) and ``kv_bytes_per_token`` (a slot's bytes over
        all its layers, scales included)."""
        storage = self.storage
        kinds = {
            "kv_cache_dtype_k": str(storage.k_buffer.dtype).removeprefix("torch."),
            "kv_cache_dtype_v": str(storage.v_buffer.dtype).removeprefix("torch."),
            "kv_bytes_per_token": KVStorage.bytes_per_token(
                storage.n_layers, storage.n_kv_heads, storage.head_dim, storage.dtype, storage.kinds
            ),
        }
        if not self.paged:
            return {
                "kv_tokens_total": self.size,
                "kv_tokens_in_use": self._live_positions(),
                "kv_tokens_cached": 0,
                **kinds,
            }
        cached = self.radix.evictable_pages if self.radix is not None else 0
        in_use = self.allocator.n_pages - self.allocator.num_free - cached
        if self.spill is not None:
            kinds |= self.spill.tier.stats()
        return {
            "kv_tokens_total": self.size,
            "kv_tokens_in_use": in_use * self.page_size,
            "kv_tokens_cached": cached * self.page_size,
            **kinds,
        }

    # ----------------------------------------------------------------- per step
    def bind_tasks(
        self, req_indices: Sequence[int], q_lens: Sequence[int], seq_lens: Sequence[int]
    ) -> KVCache:
        """Build this step's KVCache (``plan`` empty, no backend) with one host-to-device copy per dtype.

        Request ``i`` (row ``req_indices[i]``) brings ``q_lens[i] >= 1`` tokens at positions
        ``[seq_lens[i] - q_lens[i], seq_lens[i])``, which must already have slots.
        Raises ValueError on an empty batch, mismatched lengths, a repeated or
        non-live row, ``q_len`` outside ``[1, seq_len]``, or a position without a slot.
        """
        page_size = self.page_size if self.paged else self.max_ctx_len
        if self._windowed:  # the pages no query of this step or later reads go back first
            for row, q, s in zip(req_indices, q_lens, seq_lens, strict=True):
                if self.req_to_token_pool.is_live(row) and 1 <= q <= s:
                    self.slide(row, s - q)
        layout = None if self.layout.trivial else self.layout
        return step_kv_cache(
            self.req_to_token_pool, self.storage, page_size, req_indices, q_lens, seq_lens, layout
        )
