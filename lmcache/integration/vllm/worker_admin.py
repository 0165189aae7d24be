"""What the admin API asks of one worker's engine, over its lookup socket: per-tier
lookups, clearing the local tiers, and pins with a time limit that can be released early.

Threads: every method is called from a lookup-server thread (one per connection) and
only uses the engine's thread-safe lookup path, its tiers' thread-safe ``keys``/
``remove`` and the storage manager's unpin. Unpins after a pin's ttl run on one
expiry thread per worker. Nothing here moves KV bytes.

Bounds (docs/admin.md): a pin lasts at most :data:`MAX_PIN_TTL_S` seconds and a worker
holds at most :data:`MAX_ACTIVE_PINS` admin pins at once, so whoever may use the admin
API can tie up CPU memory only for a bounded time and amount.
"""

from __future__ import annotations

import heapq
import logging
import re
import threading
import time
import uuid
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from lmcache.v1.cache_engine import LMCacheEngine
from lmcache.v1.request import KEY_EXTRA_NAMES
from lmcache.v1.tiers import Tier

logger = logging.getLogger(__name__)

LOCAL_TIERS = (Tier.CPU, Tier.DISK)
MAX_PIN_TTL_S = 3600.0
"""Longest admin pin, in seconds (the admin API's ``/pin`` ``ttl`` is bounded by it)."""
MAX_ACTIVE_PINS = 256
"""Admin pins one worker holds at once; a further ``/pin`` is refused until some expire or are unpinned."""
PIN_ID_RE = re.compile(r"admin-pin-[0-9a-f]{32}")
"""What a pin id looks like (``/unpin`` accepts nothing else)."""


class WorkerAdmin:
    """Admin operations on ``engine`` (see the module docstring).

    Pins expire on one daemon thread (started with the first pin), earliest deadline
    first; at most :data:`MAX_ACTIVE_PINS` pins are held at once (a further pin is
    answered with ``refused``, see :meth:`pin`). :meth:`unpin` releases pins early.
    ``on_unpin(pin_id)`` (tests, tools) is called on the expiry thread after a pin's ttl
    has passed and its entries were unpinned. :meth:`close` stops the thread and
    releases every pin still held."""

    def __init__(self, engine: LMCacheEngine, on_unpin: Callable[[str], None] | None = None) -> None:
        self.engine = engine
        self.on_unpin = on_unpin
        self._deadlines: list[tuple[float, str]] = []  # heap; entries of released pins are skipped
        self._pins: dict[str, float] = {}  # pin id -> deadline: the pins held
        self._cv = threading.Condition()
        self._thread: threading.Thread | None = None
        self._closed = False

    def _local_backends(self) -> list[Any]:
        return [b for b in self.engine.storage_manager.backends if b.tier in LOCAL_TIERS]

    @property
    def active_pins(self) -> int:
        """Admin pins held now."""
        with self._cv:
            return len(self._pins)

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

    def clear(self, unpin: bool = False) -> dict[str, int]:
        """Remove every unpinned entry of the local tiers; ``{"<tier>_removed": n, "pinned_kept": n}``
        (and ``"unpinned": n`` with ``unpin``).

        With ``unpin`` every admin pin is released first (:meth:`unpin`), so the entries
        they held are removed too. Entries pinned otherwise (a scheduler lookup about to
        load them) are always kept: removing them would pull KV from under a load."""
        if not isinstance(unpin, bool):
            raise TypeError(f"unpin={unpin!r}: expected a bool")
        out: dict[str, int] = {"pinned_kept": 0}
        if unpin:
            out["unpinned"] = len(self.unpin(None)["unpinned"])
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
        (0 < ttl <= :data:`MAX_PIN_TTL_S`); ``{"pin_id": id, "pinned_tokens": n, "ttl": ttl}``.

        With :data:`MAX_ACTIVE_PINS` pins held nothing is pinned and the answer is
        ``{"pin_id": None, "pinned_tokens": 0, "ttl": ttl, "refused": "<why>"}`` (the
        caller's limit, not a failure of the worker)."""
        if not isinstance(ttl, (int, float)) or isinstance(ttl, bool) or not 0 < ttl <= MAX_PIN_TTL_S:
            raise ValueError(f"ttl={ttl!r}: expected seconds in (0, {MAX_PIN_TTL_S:g}]")
        allowed = {k: v for k, v in extras.items() if k in KEY_EXTRA_NAMES}
        pin_id = f"admin-pin-{uuid.uuid4().hex}"
        with self._cv:
            if self._closed:
                raise RuntimeError("the worker is closing")
            if len(self._pins) >= MAX_ACTIVE_PINS:
                return {"pin_id": None, "pinned_tokens": 0, "ttl": ttl,
                        "refused": f"pin: {len(self._pins)} pins already held by this worker (at most "
                                   f"{MAX_ACTIVE_PINS}); wait for some to expire or release them with /unpin"}
            hit = self.engine.lookup(tokens, search_range="LocalCPUBackend", pin=True, lookup_id=pin_id, **allowed)
            deadline = time.monotonic() + float(ttl)
            self._pins[pin_id] = deadline
            heapq.heappush(self._deadlines, (deadline, pin_id))
            if self._thread is None:
                self._thread = threading.Thread(target=self._expire_loop, name="lmcache-admin-unpin", daemon=True)
                self._thread.start()
            self._cv.notify()
        logger.info("lmcache admin: pinned %d tokens in the CPU tier for %gs (%s)", hit, ttl, pin_id)
        return {"pin_id": pin_id, "pinned_tokens": hit, "ttl": ttl}

    def unpin(self, pin_ids: Sequence[str] | None) -> dict[str, list[str]]:
        """Release the admin pins ``pin_ids`` (None: every admin pin of this worker) now;
        ``{"unpinned": [ids released], "unknown": [ids not held here]}``. An id that is not
        a string of the pin-id form is a TypeError/ValueError naming it. Idempotent: a
        pin that expired or was released is ``unknown``."""
        if pin_ids is not None:
            if not isinstance(pin_ids, (list, tuple)) or len(pin_ids) > 16 * MAX_ACTIVE_PINS:
                raise TypeError(f"pin_ids: expected a list of at most {16 * MAX_ACTIVE_PINS} pin ids or None")
            for i, pid in enumerate(pin_ids):
                if not isinstance(pid, str) or not PIN_ID_RE.fullmatch(pid):
                    raise ValueError(f"pin_ids[{i}]={str(pid)[:80]!r}: expected a pin id from /pin "
                                     "('admin-pin-' and 32 hex digits)")
        released: list[str] = []
        unknown: list[str] = []
        with self._cv:
            wanted = list(self._pins) if pin_ids is None else list(dict.fromkeys(pin_ids))
            for pid in wanted:
                if self._pins.pop(pid, None) is None:
                    unknown.append(pid)
                else:
                    released.append(pid)
            if len(self._deadlines) > 4 * MAX_ACTIVE_PINS:  # drop the entries of released pins
                self._deadlines = [(d, pid) for pid, d in self._pins.items()]
                heapq.heapify(self._deadlines)
        for pid in released:  # outside the lock: the expiry thread no longer knows these ids
            self.engine.lookup_unpin(pid)
        if released:
            logger.info("lmcache admin: released %d pins early", len(released))
        return {"unpinned": released, "unknown": unknown}

    def _expire_loop(self) -> None:
        while True:
            with self._cv:
                while not self._closed and (not self._deadlines or self._deadlines[0][0] > time.monotonic()):
                    timeout = self._deadlines[0][0] - time.monotonic() if self._deadlines else None
                    self._cv.wait(timeout)
                if self._closed:
                    return
                deadline, pin_id = heapq.heappop(self._deadlines)
                if self._pins.get(pin_id) != deadline:
                    continue  # released early by unpin()
                del self._pins[pin_id]
            self.engine.lookup_unpin(pin_id)
            if self.on_unpin is not None:
                self.on_unpin(pin_id)

    def close(self) -> None:
        """Stop the expiry thread and release the pins still held. Idempotent."""
        with self._cv:
            self._closed = True
            held, self._pins, self._deadlines = list(self._pins), {}, []
            thread = self._thread
            self._cv.notify_all()
        if thread is not None:
            thread.join()
        if not self.engine.closed:
            for pin_id in held:
                self.engine.lookup_unpin(pin_id)
