"""PageSpill: a pool's link to its KV tiers (``astrai.kvcache.tier``): pages out on eviction, back on a hit.

``spill`` runs as the radix evicts a page (``RadixCache.on_evict``): the page's K and V of every
layer (and an int8 pool's scales) are copied into one byte payload, the tier's. ``restore`` runs
in ``PagePool.match_prefix`` past the radix's match: each next complete page of the prompt found
in a tier gets a fresh pool page, its bytes copied in, and a radix node (``RadixCache.attach``),
as if the request had prefilled it and left it in the cache; the first page missing ends it.
A pool whose layers are in several groups (sliding windows) keeps no tier: its pages of one
position are not one page.
"""

from __future__ import annotations

import hashlib
from collections.abc import Hashable, Sequence
from typing import TYPE_CHECKING

import numpy as np
import torch

from astrai.kvcache.tier import persistable

if TYPE_CHECKING:
    from astrai.kvcache.radix import RadixNode
    from astrai.kvcache.tier import KVTier


def _tokens(token_ids: Sequence[int], n: int) -> bytes:
    return np.asarray(token_ids[:n], dtype=np.int64).tobytes()


class PageSpill:
    """Copies ``pool``'s pages to and from ``tier`` (see the module doc)."""

    def __init__(self, pool, tier: KVTier) -> None:  # pool: the PagePool (which imports this module)
        if pool.radix is None or not pool.layout.trivial:
            raise ValueError("KV tiers need a paged pool with prefix caching and one layer group")
        self.pool, self.tier = pool, tier
        storage = pool.storage
        self._parts = [
            t for t in (storage.k_buffer, storage.v_buffer, storage.k_scale, storage.v_scale) if t is not None
        ]
        ps = pool.page_size
        self._sizes = [t[:, :ps].numel() * t.element_size() for t in self._parts]
        self.page_bytes = sum(self._sizes)
        pool.radix.on_evict = self.spill

    def _slots(self, page: int) -> slice:
        ps = self.pool.page_size
        return slice(page * ps, (page + 1) * ps)

    def _payload(self, node: RadixNode) -> tuple[bytes, torch.Tensor]:
        """``node``'s key and its page's bytes, copied out of the pool."""
        h = hashlib.blake2b(repr(node.namespace).encode(), digest_size=16)
        h.update(np.asarray(node.token_path(), dtype=np.int64).tobytes())
        s = self._slots(node.page)
        return h.digest(), torch.cat([t[:, s].contiguous().view(-1).view(torch.uint8) for t in self._parts])

    def spill(self, node: RadixNode) -> None:
        """Copy ``node``'s page out to the tier (pages of a LoRA adapter's namespace stay out)."""
        if persistable(node.namespace):
            self.tier.put(*self._payload(node))

    def save_all(self) -> int:
        """Every page the radix still caches to the disk tier (an engine's shutdown, its scheduler
        stopped: a restart finds them); returns the pages queued."""
        if self.tier.disk is None or not self.tier.disk.enabled:
            return 0
        nodes = [n for n in self.pool.radix.iter_nodes() if persistable(n.namespace)]
        for node in nodes:
            self.tier.save(*self._payload(node))
        return len(nodes)

    def _load(self, page: int, payload: torch.Tensor) -> None:
        s, at = self._slots(page), 0
        for t, n in zip(self._parts, self._sizes, strict=True):
            view = t[:, s]
            view.copy_(payload[at : at + n].view(t.dtype).view(view.shape))
            at += n

    def restore(
        self, token_ids: Sequence[int], nodes: list[RadixNode], max_pages: int, namespace: Hashable
    ) -> list[RadixNode]:
        """The radix nodes of the prompt's pages after ``nodes`` (its match) loaded back from the
        tier, in order, as far as the tier and the pool's free (or evictable) pages go."""
        if not persistable(namespace) or len(nodes) >= max_pages:
            return []
        radix, alloc, ps = self.pool.radix, self.pool.allocator, self.pool.page_size
        h = hashlib.blake2b(repr(namespace).encode(), digest_size=16)
        h.update(_tokens(token_ids, len(nodes) * ps))
        parent = nodes[-1] if nodes else None
        if parent is not None:  # the matched path stays while pages are freed for the loaded ones
            radix.lock(parent)
        restored: list[RadixNode] = []
        for i in range(len(nodes), max_pages):
            key = tuple(int(t) for t in token_ids[i * ps : (i + 1) * ps])
            h.update(np.asarray(key, dtype=np.int64).tobytes())
            payload = self.tier.get(h.copy().digest())
            if payload is None or payload.numel() != self.page_bytes:
                break
            if alloc.num_free == 0 and not (radix.evictable_pages and radix.evict(1)):
                break
            page = alloc.alloc(1)[0]
            self._load(page, payload)
            node = radix.attach(parent, key, page, namespace)
            alloc.decref([page])  # the radix's reference alone keeps it, as for a recorded page
            radix.lock(node)
            if parent is not None:
                radix.unlock(parent)
            parent = node
            restored.append(node)
        if parent is not None:
            radix.unlock(parent)
        return restored
