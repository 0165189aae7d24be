"""First in, first out."""

from __future__ import annotations

from collections import OrderedDict
from typing import Hashable, Iterator

from lmcache.v1.storage_backend.cache_policy.base import EvictionPolicy


class FIFOPolicy(EvictionPolicy):
    """Evicts in insertion order; hits do not matter."""

    def __init__(self) -> None:
        self._order: OrderedDict[Hashable, None] = OrderedDict()

    def on_insert(self, key: Hashable) -> None:
        self._order.setdefault(key, None)

    def on_hit(self, key: Hashable) -> None:
        pass

    def on_remove(self, key: Hashable) -> None:
        self._order.pop(key, None)

    def victims(self) -> Iterator[Hashable]:
        return iter(list(self._order))

    def __len__(self) -> int:
        return len(self._order)
