"""PagePool: the KV system's top-level manager (storage, req_to_token, allocator, radix).

Over 300 lines because every change to a request's positions (admission, growth, speculative
drafts rolled back, release) goes through the one class that keeps them consistent.
"""

from __future__ import annotations

import logging
from collections.abc import Hashable, Sequence
from dataclasses import dataclass

import torch

from astrai.errors import CapacityExceeded
from astrai.kvcache.allocator import Allocator
from astrai.kvcache.cache import KVCache
from astrai.kvcache.radix import RadixCache, RadixNode
from astrai.kvcache.req_to_token import ReqToTokenPool
from astrai.kvcache.step import step_kv_cache
from astrai.kvcache.storage import KVStorage

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

    def __post_init__(self) -> None:
        if self.max_batch_size < 1 or self.max_seq_len < 1 or self.page_size < 1:
            raise ValueError(f"max_batch_size, max_seq_len and page_size must be >= 1: {self}")
        if self.n_tokens is not None and self.memory_budget_bytes is not None:
            raise ValueError("give either n_tokens or memory_budget_bytes, not both")
        for name in ("n_tokens", "memory_budget_bytes"):
            if getattr(self, name) is not None and getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")

    @property
    def paged(self) -> bool:
        return self.n_tokens is not None or self.memory_budget_bytes is not None

    def slots(self, n_layers: int, n_kv_heads: int, head_dim: int, dtype: torch.dtype) -> int:
        """Token slots of the pool this configuration gives (``PagePool.size``), before it exists."""
        if not self.paged:
            return self.max_batch_size * self.max_seq_len
        n_tokens = self.n_tokens
        if n_tokens is None:
            per_token = KVStorage.bytes_per_token(n_layers, n_kv_heads, head_dim, dtype)
            n_tokens = self.memory_budget_bytes // per_token
        return n_tokens // self.page_size * self.page_size

    def nbytes(self, n_layers: int, n_kv_heads: int, head_dim: int, dtype: torch.dtype) -> int:
        """Bytes a ``PagePool`` of this configuration allocates: K/V storage and the req_to_token table."""
        storage = self.slots(n_layers, n_kv_heads, head_dim, dtype) * KVStorage.bytes_per_token(
            n_layers, n_kv_heads, head_dim, dtype
        )
        return storage + self.max_batch_size * self.max_seq_len * 4  # req_to_token: int32


class PagePool:
    """Owns the KV buffers and decides which slots each request's positions use.

    Contiguous mode: ``max_batch_size * max_seq_len`` slots, ``slot = row * max_seq_len + pos``,
    nothing is allocated after construction. Paged mode: a shared pool of
    ``size // page_size`` pages, allocated on demand and ref-counted; position ``pos``
    of a request lives at ``page * page_size + pos % page_size`` where ``page`` is its
    ``pos // page_size``-th page. With page_size > 1 and prefix_caching, a RadixCache
    shares complete pages between requests.

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
    ) -> None:
        self.config = config
        self.n_layers, self.n_heads, self.n_kv_heads, self.head_dim = n_layers, n_heads, n_kv_heads, head_dim
        self.dtype = dtype
        self.device = torch.device(device)
        self.max_ctx_len = config.max_seq_len
        self.paged = config.paged
        self.page_size = config.page_size
        self.allocator: Allocator | None = None
        self.radix: RadixCache | None = None
        if self.paged:
            n_tokens = config.n_tokens
            if n_tokens is None:
                per_token = KVStorage.bytes_per_token(n_layers, n_kv_heads, head_dim, dtype)
                n_tokens = config.memory_budget_bytes // per_token
            n_pages = n_tokens // self.page_size
            if n_pages < 1:
                raise ValueError(f"KV pool of {n_tokens} tokens holds no page of {self.page_size}")
            self.size = n_pages * self.page_size
            self.allocator = Allocator(n_pages)
            if self.page_size > 1 and config.prefix_caching:
                self.radix = RadixCache(self.page_size, self.allocator)
            self.req_to_token_pool = ReqToTokenPool(config.max_batch_size, self.max_ctx_len, self.device)
        else:
            self.size = config.max_batch_size * config.max_seq_len
            self.req_to_token_pool = ReqToTokenPool(
                config.max_batch_size, self.max_ctx_len, self.device, linear_stride=config.max_seq_len
            )
        self.storage = KVStorage(n_layers, self.size, n_kv_heads, head_dim, dtype, self.device)
        rows = config.max_batch_size
        self._pages = self.req_to_token_pool.pages  # paged: each row's page ids in position order
        self._locks: list[RadixNode | None] = [None] * rows  # deepest radix node each row holds
        self._namespaces: list[Hashable] = [
            None
        ] * rows  # the radix namespace each row matches and records in
        mode = ("paged, radix" if self.radix else "paged") if self.paged else "contiguous"
        logger.info(
            "KV pool (%s): %d slots, page_size %d, %.1f MiB",
            mode,
            self.size,
            self.page_size,
            self.storage.nbytes() / 2**20,
        )

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

    def req_pages(self, req_idx: int) -> tuple[int, ...]:
        """Paged mode: the request's page ids in position order (empty in contiguous mode)."""
        self.req_to_token_pool.require_live(req_idx)
        return tuple(self._pages[req_idx])

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
        nodes = self.radix.match(token_ids, (len(token_ids) - 1) // self.page_size, namespace)
        if not nodes:
            return 0
        pages = [node.page for node in nodes]
        self.allocator.incref(pages)
        self.radix.lock(nodes[-1])
        self._locks[req_idx] = nodes[-1]
        self.req_to_token_pool.append_pages(req_idx, pages, self.page_size)
        n = len(pages) * self.page_size
        self.req_to_token_pool.lens[req_idx] = n
        return n

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
            need = -(-new_len // self.page_size) - len(pages)
            if need > 0:
                short = need - self.allocator.num_free
                if short > 0:
                    if self.radix is None or self.radix.evictable_pages < short:
                        return False
                    self.radix.evict(short)
                self.req_to_token_pool.append_pages(req_idx, self.allocator.alloc(need), self.page_size)
        lens[req_idx] = new_len
        return True

    def spare(self, req_idx: int) -> int:
        """Positions the request could gain now without evicting cached pages: the rest of its last
        page and the free pages (contiguous: up to ``max_seq_len``)."""
        have = self.req_len(req_idx)
        if not self.paged:
            return self.max_ctx_len - have
        return min(
            self.round_up(have) - have + self.allocator.num_free * self.page_size, self.max_ctx_len - have
        )

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
            pages, keep = self._pages[req_idx], -(-new_len // self.page_size)
            dropped = pages[keep:]
            if self.radix is not None and any(self.radix.node_of_page(p) is not None for p in dropped):
                raise ValueError(f"row {req_idx}: truncating to {new_len} would drop pages the radix holds")
            del pages[keep:]
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
            self._locks[req_idx] = self.radix.insert(
                token_ids, self._pages[req_idx][:n], self._locks[req_idx], self._namespaces[req_idx]
            )

    def task_free(self, req_idx: int) -> None:
        """Drop the request's page references and release its row (ValueError if not live)."""
        self.req_to_token_pool.require_live(req_idx)
        if self.paged:
            lock = self._locks[req_idx]
            if lock is not None:
                self.radix.unlock(lock)
                self._locks[req_idx] = None
            self.allocator.decref(self._pages[req_idx])
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
        """``n_tokens`` rounded up to whole pages: the slots that many positions take
        (contiguous: ``n_tokens``)."""
        ps = self.page_size if self.paged else 1
        return -(-n_tokens // ps) * ps

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
        cap = min(want, self.round_up(have) + self.available_tokens())
        return cap if cap > have and self.extend(req_idx, cap) else have

    def _live_positions(self) -> int:
        pool = self.req_to_token_pool
        return sum(pool.lens[r] for r in pool.live_rows())

    @property
    def context_limit(self) -> int:
        """Positions one request may hold (prompt plus generated): ``max_seq_len``, capped by the pool."""
        return min(self.max_ctx_len, self.size)

    def can_ever_fit(self, n_tokens: int) -> bool:
        """Whether one request of ``n_tokens`` positions fits max_seq_len and the empty pool."""
        if n_tokens > self.max_ctx_len:
            return False
        return -(-n_tokens // self.page_size) * self.page_size <= self.size

    def stats(self) -> dict:
        """``kv_tokens_total`` (slots), ``kv_tokens_cached`` (slots of pages only the radix keeps,
        i.e. what eviction could reclaim now), ``kv_tokens_in_use`` (every other allocated slot:
        pages live requests reference or pin through their cached path; contiguous: their positions).
        ``in_use + cached + free == total``."""
        if not self.paged:
            return {
                "kv_tokens_total": self.size,
                "kv_tokens_in_use": self._live_positions(),
                "kv_tokens_cached": 0,
            }
        cached = self.radix.evictable_pages if self.radix is not None else 0
        in_use = self.allocator.n_pages - self.allocator.num_free - cached
        return {
            "kv_tokens_total": self.size,
            "kv_tokens_in_use": in_use * self.page_size,
            "kv_tokens_cached": cached * self.page_size,
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
        return step_kv_cache(self.req_to_token_pool, self.storage, page_size, req_indices, q_lens, seq_lens)
