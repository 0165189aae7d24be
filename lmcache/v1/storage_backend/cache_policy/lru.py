"""Least recently used."""

from __future__ import annotations

from collections import OrderedDict
from typing import Hashable, Iterable, Iterator

from lmcache.v1.storage_backend.cache_policy.base import EvictionPolicy


class LRUPolicy(EvictionPolicy):
    """Evicts the key whose last insert or hit is oldest."""

    def __init__(self) -> None:
        self._order: OrderedDict[Hashable, None] = OrderedDict()

    def on_insert(self, key: Hashable) -> None:
        self._order[key] = None
        self._order.move_to_end(key)

    def on_hit(self, key: Hashable) -> None:
        if key in self._order:
            self._order.move_to_end(key)

    def on_hits(self, keys: Iterable[Hashable]) -> None:
        order = self._order
        move = order.move_to_end
        for key in keys:
            if key in order:
                move(key)

    def on_remove(self, key: Hashable) -> None:
        self._order.pop(key, None)

    def victims(self) -> Iterator[Hashable]:
        return iter(list(self._order))

    def __len__(self) -> int:
        return len(self._order)
