"""KVTier: where the prefix cache's evicted pages go, so that a later hit loads them back.

A radix page evicted from the pool (``RadixCache.on_evict``) is copied out (every layer's K and V
of its ``page_size`` positions, an int8 cache's scales too) into a bounded host-RAM tier and,
with a directory, written to disk by a background thread (``astrai.kvcache.disk``); the step that
evicted it never waits for a disk. ``PagePool.match_prefix`` looks the pages past its radix match
up here, RAM first, and loads those it finds into fresh pool pages (``astrai.kvcache.spill``):
the request then prefills only what neither held. Both tiers are least-recently-used within
their bounds; at shutdown the pages still cached go to the disk too, for the next start.

A page is known by its ``key``: a digest of its namespace and of every token from the start of
the prompt to its end, so a page is found again only under the same prefix, in the same tenant
namespace and ``cache_salt`` (``astrai.kvcache.radix``); pages of other namespaces (a LoRA
adapter's, whose ids live as long as the process) stay out of the tiers.
"""

from __future__ import annotations

import hashlib
from collections import OrderedDict
from collections.abc import Hashable, Iterable
from typing import TYPE_CHECKING

import numpy as np

from astrai.kvcache.disk import MARKER, DiskTier

if TYPE_CHECKING:
    import torch

__all__ = ["MARKER", "DiskTier", "KVTier", "page_keys", "persistable"]


def persistable(namespace: Hashable) -> bool:
    """Whether pages of ``namespace`` may go to the tiers: the shared one and a tenant's (a string)."""
    return namespace is None or isinstance(namespace, str)


def page_keys(namespace: str | None, token_ids: Iterable[int], page_size: int, n_pages: int) -> list[bytes]:
    """The keys of the first ``n_pages`` complete pages of ``token_ids`` in ``namespace``: page ``i``'s
    is the digest of the namespace and tokens ``[0, (i + 1) * page_size)``."""
    ids = (
        np.fromiter(token_ids, dtype=np.int64, count=n_pages * page_size)
        if n_pages
        else np.empty(0, np.int64)
    )
    h = hashlib.blake2b(repr(namespace).encode(), digest_size=16)
    keys = []
    for i in range(n_pages):
        h.update(ids[i * page_size : (i + 1) * page_size].tobytes())
        keys.append(h.copy().digest())
    return keys


class KVTier:
    """The host-RAM tier (``host_bytes``, LRU) over an optional ``DiskTier``: ``put`` a page evicted
    from the pool, ``get`` it back. Used by the pool's scheduler thread alone (the disk tier's
    thread only writes)."""

    def __init__(self, host_bytes: int, disk: DiskTier | None = None) -> None:
        self.host_bytes, self.disk = host_bytes, disk
        self._host: OrderedDict[bytes, torch.Tensor] = OrderedDict()
        self._held = 0
        self.counters = {"spilled": 0, "host_hits": 0, "disk_hits": 0}

    def put(self, key: bytes, payload: torch.Tensor) -> None:
        self.counters["spilled"] += 1
        if self.disk is not None:
            self.disk.put(key, payload)
        if payload.numel() > self.host_bytes:
            return
        if key in self._host:
            self._host.move_to_end(key)
            return
        self._host[key] = payload
        self._held += payload.numel()
        while self._held > self.host_bytes:
            _, old = self._host.popitem(last=False)
            self._held -= old.numel()

    def save(self, key: bytes, payload: torch.Tensor) -> None:
        """A page still cached at shutdown: to the disk tier alone, waiting for room in its queue."""
        if self.disk is not None:
            self.disk.put(key, payload, wait=True)

    def get(self, key: bytes) -> torch.Tensor | None:
        payload = self._host.get(key)
        if payload is not None:
            self._host.move_to_end(key)
            self.counters["host_hits"] += 1
            return payload
        payload = self.disk.get(key) if self.disk is not None else None
        if payload is not None:
            self.counters["disk_hits"] += 1
        return payload

    def stats(self) -> dict:
        """The tiers' figures for ``PagePool.stats``: pages and bytes held, pages spilled, hits."""
        disk = self.disk.stats() if self.disk is not None and self.disk.enabled else (0, 0)
        return {
            "kv_tier_host_pages": len(self._host),
            "kv_tier_host_bytes": self._held,
            "kv_tier_disk_pages": disk[0],
            "kv_tier_disk_bytes": disk[1],
            "kv_tier_spilled_pages": self.counters["spilled"],
            "kv_tier_host_hit_pages": self.counters["host_hits"],
            "kv_tier_disk_hit_pages": self.counters["disk_hits"],
        }

    def close(self) -> None:
        if self.disk is not None:
            self.disk.close()
