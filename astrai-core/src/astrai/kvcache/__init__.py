"""The KV system: storage, request-to-token table, page allocator, radix prefix cache, pool.

``PagePool`` orchestrates the layers and hands a ``KVCache`` to each forward step;
``check_pool_invariants`` and ``assert_nothing_held`` let tests verify it.
"""

from __future__ import annotations

from astrai.kvcache.allocator import Allocator
from astrai.kvcache.cache import KVCache
from astrai.kvcache.invariants import assert_nothing_held, check_pool_invariants
from astrai.kvcache.pool import KVConfig, PagePool
from astrai.kvcache.radix import RadixCache, RadixNode
from astrai.kvcache.req_to_token import ReqToTokenPool
from astrai.kvcache.storage import KVStorage

__all__ = [
    "Allocator",
    "KVCache",
    "KVConfig",
    "KVStorage",
    "PagePool",
    "RadixCache",
    "RadixNode",
    "ReqToTokenPool",
    "assert_nothing_held",
    "check_pool_invariants",
]
