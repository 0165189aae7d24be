"""Eviction policies: objects that only order keys. They never touch memory or tiers.

A tier tells its policy what happened (``on_insert``, ``on_hit``, ``on_remove``) and asks
it for candidates in eviction order (``victims``); the tier skips candidates it cannot
evict (pinned or in use). Policies are not thread-safe: the owning tier calls them under
its own lock.

Tail-before-head: tiers insert and touch the chunks of one request from the last chunk
to the first, so under every policy the head of a sequence is newer than its tail and
the tail goes first. With chained keys a lost head makes the tail unreachable anyway.
"""

from __future__ import annotations

from lmcache.v1.storage_backend.cache_policy.base import EvictionPolicy
from lmcache.v1.storage_backend.cache_policy.fifo import FIFOPolicy
from lmcache.v1.storage_backend.cache_policy.lfu import LFUPolicy
from lmcache.v1.storage_backend.cache_policy.lru import LRUPolicy
from lmcache.v1.storage_backend.cache_policy.mru import MRUPolicy

_POLICIES: dict[str, type[EvictionPolicy]] = {"LRU": LRUPolicy, "FIFO": FIFOPolicy, "LFU": LFUPolicy, "MRU": MRUPolicy}


def make_policy(name: str) -> EvictionPolicy:
    """A new policy object by config name (LRU, FIFO, LFU, MRU); ValueError otherwise."""
    try:
        return _POLICIES[name.upper()]()
    except KeyError:
        raise ValueError(f"cache_policy={name!r}: expected one of {', '.join(_POLICIES)}") from None


__all__ = ["EvictionPolicy", "FIFOPolicy", "LFUPolicy", "LRUPolicy", "MRUPolicy", "make_policy"]
