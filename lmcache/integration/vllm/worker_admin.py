"""What the admin API asks of one worker's engine, over its lookup socket: per-tier
lookups, clearing the local tiers, and pins with a time limit.

Threads: every method is called from a lookup-server thread (one per connection) and
only uses the engine's thread-safe lookup path, its tiers' thread-safe ``keys``/
``remove`` and the storage manager's unpin. Unpins after a pin's ttl run on a
``threading.Timer`` thread. Nothing here moves KV bytes.
"""

from __future__ import annotations

import logging
import threading
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


class WorkerAdmin:
    """Admin operations on ``engine`` (see the module docstring).

    ``on_unpin(pin_id)`` (tests, tools) is called on the timer thread after a pin's
    ttl has passed and its entries were unpinned. :meth:`close` cancels the timers and
    releases every pin still held."""

    def __init__(self, engine: LMCacheEngine, on_unpin: Callable[[str], None] | None = None) -> None:
        self.engine = engine
        self.on_unpin = on_unpin
        self._timers: dict[str, threading.Timer] = {}
        self._lock = threading.Lock()
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
        (0 < ttl <= :data:`MAX_PIN_TTL_S`); ``{"pin_id": id, "pinned_tokens": n}``."""
        if not isinstance(ttl, (int, float)) or isinstance(ttl, bool) or not 0 < ttl <= MAX_PIN_TTL_S:
            raise ValueError(f"ttl={ttl!r}: expected seconds in (0, {MAX_PIN_TTL_S:g}]")
        allowed = {k: v for k, v in extras.items() if k in KEY_EXTRA_NAMES}
        pin_id = f"admin-pin-{uuid.uuid4().hex}"
        with self._lock:
            if self._closed:
                raise RuntimeError("the worker is closing")
            hit = self.engine.lookup(tokens, search_range="LocalCPUBackend", pin=True, lookup_id=pin_id, **allowed)
            timer = threading.Timer(float(ttl), self._expire, args=(pin_id,))
            timer.daemon = True
            timer.name = "lmcache-admin-unpin"
            self._timers[pin_id] = timer
            timer.start()
        logger.info("lmcache admin: pinned %d tokens in the CPU tier for %gs (%s)", hit, ttl, pin_id)
        return {"pin_id": pin_id, "pinned_tokens": hit, "ttl": ttl}

    def _expire(self, pin_id: str) -> None:
        with self._lock:
            if self._timers.pop(pin_id, None) is None:
                return
        self.engine.lookup_unpin(pin_id)
        if self.on_unpin is not None:
            self.on_unpin(pin_id)

    def close(self) -> None:
        """Cancel the timers and release the pins still held. Idempotent."""
        with self._lock:
            self._closed = True
            timers, self._timers = self._timers, {}
        for pin_id, timer in timers.items():
            timer.cancel()
            if not self.engine.closed:
                self.engine.lookup_unpin(pin_id)
