"""Most recently used."""

from __future__ import annotations

from collections import OrderedDict
from typing import Hashable, Iterator

from lmcache.v1.storage_backend.cache_policy.base import EvictionPolicy


class MRUPolicy(EvictionPolicy):
    """Evicts the key whose last insert or hit is newest.

    Suits scans larger than the tier: the oldest entries stay and keep hitting. Note
    that tiers insert a sequence tail first, so under MRU the head of the newest
    sequence goes first (and with chained keys its tail becomes unreachable).
    """

    def __init__(self) -> None:
        self._order: OrderedDict[Hashable, None] = OrderedDict()

    def on_insert(self, key: Hashable) -> None:
        self._order[key] = None
        self._order.move_to_end(key)

    def on_hit(self, key: Hashable) -> None:
        if key in self._order:
            self._order.move_to_end(key)

    def on_remove(self, key: Hashable) -> None:
        self._order.pop(key, None)

    def victims(self) -> Iterator[Hashable]:
        return iter(list(reversed(self._order)))

    def __len__(self) -> int:
        return len(self._order)
