"""Lower-tier reads in flight, one per key: a reader of a key that is already being read
from disk or the remote tier joins that read instead of reading the entry a second time.

Two requests for the same prompt arriving together (a retried request, a popular
document) used to read each chunk from disk or Redis once per request while the first
read was still in flight. :class:`SharedReads` keeps the read of each key in a table
until it is settled: the reader's ``settle`` callback (the storage manager's promotion
into the CPU tier) runs *before* the key leaves the table, so a later reader either joins
the read or finds the entry in the CPU tier; it never reads the lower tier again.

Threads: :meth:`SharedReads.read` may be called from any thread and never blocks on I/O;
the read completes on the tier's reader thread (or inline, for a read that resolves at
once), where ``settle`` and every joined reader's future are resolved.

Ownership: the read's object comes with one reference (the tier's read allocates it);
one more is counted up for each joined reader *before* any future is resolved, so every
reader owns exactly one reference of the same object and releases it alone.
"""

from __future__ import annotations

import logging
import threading
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Callable, Generic, Hashable, TypeVar

from lmcache.v1.memory_management import MemoryObj
from lmcache.v1.tiers import Tier

logger = logging.getLogger(__name__)

__all__ = ["SharedReads"]

K = TypeVar("K", bound=Hashable)


@dataclass(slots=True)
class _Read:
    """One key's read in flight and the readers waiting for it."""

    waiters: list[tuple[Future, list[Tier] | None]] = field(default_factory=list)
    tiers: list[Tier] = field(default_factory=list)
    """Where the read found the entry (filled by the read itself)."""


class SharedReads(Generic[K]):
    """See the module docstring.

    ``start(key, tiers)`` begins the read of one key and returns its future (an object
    with one reference, or None for a miss), appending the tier that held it to
    ``tiers``. ``settle(key, obj)`` runs once per hit, before any reader is answered and
    while later readers of ``key`` still join this read. ``on_join()`` is called for each
    reader that joined a read already in flight (no second read of the tier).
    """

    def __init__(
        self,
        start: Callable[[K, list[Tier]], Future],
        settle: Callable[[K, MemoryObj], None],
        on_join: Callable[[], None] = lambda: None,
    ) -> None:
        self._start = start
        self._settle = settle
        self._on_join = on_join
        self._reads: dict[K, _Read] = {}
        self._lock = threading.Lock()

    def __len__(self) -> int:
        with self._lock:
            return len(self._reads)

    def read(self, key: K, source: list[Tier] | None = None) -> Future:
        """Future of ``key``'s entry (one reference for this caller) or None; a hit appends
        the tier that held it to ``source``."""
        out: Future = Future()
        with self._lock:
            pending = self._reads.get(key)
            first = pending is None
            if pending is None:
                pending = self._reads[key] = _Read()
            pending.waiters.append((out, source))
        if not first:
            self._on_join()
            return out
        try:
            inner = self._start(key, pending.tiers)
        except Exception as exc:  # noqa: BLE001 - a read that cannot start is a miss for every waiter
            logger.debug("lower-tier read of %s not started: %r", key, exc)
            inner = Future()
            inner.set_result(None)
        inner.add_done_callback(lambda fut: self._finish(key, pending, fut))
        return out

    def _finish(self, key: K, pending: _Read, fut: Future) -> None:
        obj = None
        if not fut.cancelled() and fut.exception() is None:
            obj = fut.result()
        if obj is not None:
            try:
                self._settle(key, obj)
            except Exception as exc:  # noqa: BLE001 - not promoted: the readers still get the entry
                logger.debug("settling the read of %s failed: %r", key, exc)
        with self._lock:
            if self._reads.get(key) is pending:
                del self._reads[key]
            waiters = list(pending.waiters)
        if obj is not None:
            for _ in waiters[1:]:
                obj.ref_count_up()
        for out, source in waiters:
            if obj is not None and source is not None:
                source.extend(pending.tiers)
            out.set_result(obj)
