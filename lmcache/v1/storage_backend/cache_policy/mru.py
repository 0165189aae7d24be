"""Most recently used."""

from __future__ import annotations

from typing import Hashable, Iterator

from lmcache.v1.storage_backend.cache_policy.lru import LRUPolicy


class MRUPolicy(LRUPolicy):
    """Evicts the key whose last insert or hit is newest (LRU's order, read backwards).

    Suits scans larger than the tier: the oldest entries stay and keep hitting. Note
    that tiers insert a sequence tail first, so under MRU the head of the newest
    sequence goes first (and with chained keys its tail becomes unreachable).
    """

    def victims(self) -> Iterator[Hashable]:
        return iter(list(reversed(self._order)))
