"""What the admin API asks of one worker's engine, over its lookup socket: per-tier
lookups, clearing the local tiers, and pins with a time limit.

Threads: every method is called from a lookup-server thread (one per connection) and
only uses the engine's thread-safe lookup path, its tiers' thread-safe ``keys``/
``remove`` and the storage manager's unpin. Unpins after a pin's ttl run on one
expiry thread per worker. Nothing here moves KV bytes.
"""

from __future__ import annotations

import heapq
import logging
import threading
import time
import uuid
from collections.abc import Callable
from typing import Any

import numpy as np

from lmcache.v1.cache_engine import LMCacheEngine
from lmcache.v1.request import KEY_EXTRA_NAMES
from lmcache.v1.tiers import Tier

logger = logging.getLogger(__name__)

LOCAL_TIERS = (Tier.CPU, Tier.DISK)
MAX_PIN_TTL_S = 24 * 3600.0
MAX_ACTIVE_PINS = 4096


class WorkerAdmin:
    """Admin operations on ``engine`` (see the module docstring).

    Pins expire on one daemon thread (started with the first pin), earliest deadline
    first; at most :data:`MAX_ACTIVE_PINS` pins are held at once (a further pin is a
    ValueError). ``on_unpin(pin_id)`` (tests, tools) is called on that thread after a
    pin's ttl has passed and its entries were unpinned. :meth:`close` stops the thread
    and releases every pin still held."""

    def __init__(self, engine: LMCacheEngine, on_unpin: Callable[[str], None] | None = None) -> None:
        self.engine = engine
        self.on_unpin = on_unpin
        self._deadlines: list[tuple[float, str]] = []  # heap
        self._cv = threading.Condition()
        self._thread: threading.Thread | None = None
        self._closed = False

    def _local_backends(self) -> list[Any]:
        return [b for b in self.engine.storage_manager.backends if b.tier in LOCAL_TIERS]

    def tier_hits(self, tokens: np.ndarray, extras: dict[str, Any]) -> dict[str, int]:
        """Leading cached tokens of ``tokens`` in each local tier alone (whole chunks, and a
        cached partial last chunk). Not counted in the engine's lookup statistics."""
        allowed = {k: v for k, v in extras.items() if k in KEY_EXTRA_NAMES}
        pk = self.engine.prefix_keys(tokens, **allowed)
        out = {}
        for backend in self._local_backends():
            found = self.engine.transfer.lookup(pk.keys, False, frozenset({backend.name})).hits
            out[str(backend.tier)] = pk.end(found)
        return out

    def clear(self) -> dict[str, int]:
        """Remove every unpinned entry of the local tiers; ``{"<tier>_removed": n, "pinned_kept": n}``.

        Pinned CPU entries (a scheduler lookup about to load them, or an admin pin) are
        kept: removing them would pull KV from under a load."""
        out: dict[str, int] = {"pinned_kept": 0}
        for backend in self._local_backends():
            removed = 0
            for key in backend.keys():
                if backend.tier == Tier.CPU and backend.pin_count(key):
                    out["pinned_kept"] += 1
                    continue
                removed += bool(backend.remove(key))
            out[f"{backend.tier}_removed"] = removed
        logger.info("lmcache admin: cleared the local tiers (%s)", out)
        return out

    def pin(self, tokens: np.ndarray, ttl: float, extras: dict[str, Any]) -> dict[str, Any]:
        """Pin the leading chunks of ``tokens`` found in the CPU tier for ``ttl`` seconds
        (0 < ttl <= :data:`MAX_PIN_TTL_S`); ``{"pin_id": id, "pinned_tokens": n, "ttl": ttl}``."""
        if not isinstance(ttl, (int, float)) or isinstance(ttl, bool) or not 0 < ttl <= MAX_PIN_TTL_S:
            raise ValueError(f"ttl={ttl!r}: expected seconds in (0, {MAX_PIN_TTL_S:g}]")
        allowed = {k: v for k, v in extras.items() if k in KEY_EXTRA_NAMES}
        pin_id = f"admin-pin-{uuid.uuid4().hex}"
        with self._cv:
            if self._closed:
                raise RuntimeError("the worker is closing")
            if len(self._deadlines) >= MAX_ACTIVE_PINS:
                raise ValueError(f"pin: {MAX_ACTIVE_PINS} pins already held by this worker; wait for some to expire")
            hit = self.engine.lookup(tokens, search_range="LocalCPUBackend", pin=True, lookup_id=pin_id, **allowed)
            heapq.heappush(self._deadlines, (time.monotonic() + float(ttl), pin_id))
            if self._thread is None:
                self._thread = threading.Thread(target=self._expire_loop, name="lmcache-admin-unpin", daemon=True)
                self._thread.start()
            self._cv.notify()
        logger.info("lmcache admin: pinned %d tokens in the CPU tier for %gs (%s)", hit, ttl, pin_id)
        return {"pin_id": pin_id, "pinned_tokens": hit, "ttl": ttl}

    def _expire_loop(self) -> None:
        while True:
            with self._cv:
                while not self._closed and (not self._deadlines or self._deadlines[0][0] > time.monotonic()):
                    timeout = self._deadlines[0][0] - time.monotonic() if self._deadlines else None
                    self._cv.wait(timeout)
                if self._closed:
                    return
                _, pin_id = heapq.heappop(self._deadlines)
            self.engine.lookup_unpin(pin_id)
            if self.on_unpin is not None:
                self.on_unpin(pin_id)

    def close(self) -> None:
        """Stop the expiry thread and release the pins still held. Idempotent."""
        with self._cv:
            self._closed = True
            held, self._deadlines = self._deadlines, []
            thread = self._thread
            self._cv.notify_all()
        if thread is not None:
            thread.join()
        if not self.engine.closed:
            for _, pin_id in held:
                self.engine.lookup_unpin(pin_id)
