"""Least frequently used, ties broken by least recent use."""

from __future__ import annotations

from collections import OrderedDict
from typing import Hashable, Iterator

from lmcache.v1.storage_backend.cache_policy.base import EvictionPolicy


class LFUPolicy(EvictionPolicy):
    """Evicts the key with the fewest hits; among equals the least recently used.

    O(1) updates: keys live in per-count buckets, each an LRU-ordered dict.
    """

    def __init__(self) -> None:
        self._count: dict[Hashable, int] = {}
        self._buckets: dict[int, OrderedDict[Hashable, None]] = {}

    def _move(self, key: Hashable, old: int | None, new: int) -> None:
        if old is not None:
            bucket = self._buckets[old]
            del bucket[key]
            if not bucket:
                del self._buckets[old]
        self._buckets.setdefault(new, OrderedDict())[key] = None
        self._count[key] = new

    def on_insert(self, key: Hashable) -> None:
        old = self._count.get(key)
        self._move(key, old, 1 if old is None else old + 1)

    def on_hit(self, key: Hashable) -> None:
        old = self._count.get(key)
        if old is not None:
            self._move(key, old, old + 1)

    def on_remove(self, key: Hashable) -> None:
        old = self._count.pop(key, None)
        if old is not None:
            bucket = self._buckets[old]
            del bucket[key]
            if not bucket:
                del self._buckets[old]

    def victims(self) -> Iterator[Hashable]:
        out: list[Hashable] = []
        for count in sorted(self._buckets):
            out.extend(self._buckets[count])
        return iter(out)

    def __len__(self) -> int:
        return len(self._count)
