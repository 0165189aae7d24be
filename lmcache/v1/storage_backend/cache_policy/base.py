"""The eviction-policy contract."""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import Hashable, Iterable, Iterator


class EvictionPolicy(ABC):
    """Orders keys for eviction. Called by one tier, under that tier's lock."""

    @abstractmethod
    def on_insert(self, key: Hashable) -> None:
        """A key became resident (inserting a resident key counts as a hit)."""

    @abstractmethod
    def on_hit(self, key: Hashable) -> None:
        """A resident key was read."""

    def on_hits(self, keys: Iterable[Hashable]) -> None:
        """:meth:`on_hit` for each of ``keys``, in order (one call for a batch of resident keys)."""
        for key in keys:
            self.on_hit(key)

    @abstractmethod
    def on_remove(self, key: Hashable) -> None:
        """A key left the tier (evicted or removed). Unknown keys are ignored."""

    @abstractmethod
    def victims(self) -> Iterator[Hashable]:
        """Resident keys, first to evict first. The tier must not mutate the policy while iterating."""

    @abstractmethod
    def __len__(self) -> int: ...
