"""Thread-safe counters that tests and users read (never parsed from logs)."""

from __future__ import annotations

import dataclasses
import threading
from dataclasses import dataclass, field


@dataclass(slots=True)
class CacheStats:
    """Counters of one engine. Read with :meth:`snapshot`; update with :meth:`add`."""

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
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False, compare=False)

    def add(self, **deltas: int) -> None:
        with self._lock:
            for name, delta in deltas.items():
                setattr(self, name, getattr(self, name) + delta)

    def snapshot(self) -> dict[str, int]:
        with self._lock:
            return {f.name: getattr(self, f.name) for f in dataclasses.fields(self) if not f.name.startswith("_")}
