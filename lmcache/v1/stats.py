"""Thread-safe counters that tests and users read (never parsed from logs)."""

from __future__ import annotations

import dataclasses
import threading
from dataclasses import dataclass, field


@dataclass(slots=True)
class Counters:
    """Base of every counter set: integer fields, updated under one lock.

    Subclasses declare their counters as ``int`` fields with default 0.
    """

    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False, compare=False)

    def add(self, **deltas: int) -> None:
        """Add each ``name=delta`` atomically."""
        with self._lock:
            for name, delta in deltas.items():
                setattr(self, name, getattr(self, name) + delta)

    def snapshot(self) -> dict[str, int]:
        """A consistent copy of all counters."""
        with self._lock:
            return {f.name: getattr(self, f.name) for f in dataclasses.fields(self) if not f.name.startswith("_")}


@dataclass(slots=True)
class CacheStats(Counters):
    """Counters of one KV engine."""

    store_requests: int = 0
    stored_tokens: int = 0
    store_skipped_chunks: int = 0
    """Chunks not stored because the pool had no room even after eviction."""
    retrieve_requests: int = 0
    requested_tokens: int = 0
    hit_tokens: int = 0
    lookup_requests: int = 0
    lookup_tokens: int = 0
    lookup_hit_tokens: int = 0
    evictions: int = 0
    load_errors: int = 0
    corrupt_entries: int = 0
    """Stored entries that did not fit the request's layout (shape/dtype/format): served as
    misses and removed from every tier."""
