"""L1: the CPU memory tier. Its entries live in the StorageManager's pool."""

from __future__ import annotations

import logging
import math
import threading
from typing import Callable, Sequence

import torch

from lmcache.v1.keys import CacheEngineKey
from lmcache.v1.memory_management import MemoryFormat, MemoryObj, PoolAllocator, PoolReservation, pool_bytes
from lmcache.v1.storage_backend.abstract_backend import StorageBackend
from lmcache.v1.storage_backend.cache_policy import EvictionPolicy
from lmcache.v1.storage_backend.resident_index import ResidentIndex, allocate_evicting
from lmcache.v1.tiers import Tier

logger = logging.getLogger(__name__)


def _in_use(obj: MemoryObj) -> bool:
    """Pinned, or someone besides the tier holds the object (evicting it would free nothing)."""
    return not obj.can_evict


class LocalCPUBackend(StorageBackend):
    """Keeps MemoryObjs resident in the CPU pool, evicting by a policy when full.

    Thread-safe; nothing here blocks on I/O. The tier holds one reference per resident
    object and drops it on eviction/removal. The entries are a :class:`ResidentIndex`:
    eviction is all or nothing (enough victims for the request, or none), skips pinned
    objects and objects someone else still references (``ref_count > 1``). With
    ``retain=False`` (config ``local_cpu: false``) the pool only stages data for lower
    tiers and nothing stays resident.
    """

    tier = Tier.CPU

    name = "LocalCPUBackend"

    def __init__(
        self,
        allocator: PoolAllocator,
        policy: EvictionPolicy,
        *,
        retain: bool = True,
        on_evict: Callable[[int], None] | None = None,
    ) -> None:
        self.allocator = allocator
        self.retain = retain
        self._on_evict = on_evict
        self._index: ResidentIndex[CacheEngineKey, MemoryObj] = ResidentIndex(policy, busy=_in_use)
        self._lock = threading.Lock()

    @property
    def policy(self) -> EvictionPolicy:
        """The eviction policy (orders keys only; read its ``victims()`` under no lock at your own risk)."""
        return self._index.policy

    @property
    def capacity(self) -> int:
        """Bytes of the pool."""
        return self.allocator.capacity

    # ------------------------------------------------------------------ allocation
    def allocate(self, shape: tuple[int, ...] | torch.Size, dtype: torch.dtype, fmt: MemoryFormat) -> MemoryObj | None:
        """A pool object (ref 1, caller owns it), evicting as needed; None if impossible.

        Eviction is atomic by bytes: victims that free enough pool bytes are picked
        first, or nothing is evicted. Should the freed space be fragmented (the pool's
        slabs), further entries are evicted one at a time until the object fits. The
        tier's lock is taken only when the pool is full."""
        obj = self.allocator.allocate(shape, dtype, fmt)
        if obj is not None:
            return obj
        dropped: list[CacheEngineKey] = []

        def drop(key: CacheEngineKey, victim: MemoryObj) -> None:
            self._release(victim)
            dropped.append(key)

        with self._lock:
            obj, evicted = allocate_evicting(self._index, self.allocator, shape, dtype, fmt, drop)
        if evicted and self._on_evict is not None:
            self._on_evict(evicted)
        self._notify("removed", dropped)
        return obj

    def reserve(
        self, shape: tuple[int, ...] | torch.Size, dtype: torch.dtype, fmt: MemoryFormat, count: int
    ) -> PoolReservation | None:
        """Pool bytes for ``count`` objects of one shape in one contiguous block
        (:meth:`PoolAllocator.reserve`), evicting as needed; None if impossible.

        Eviction is atomic by bytes, as in :meth:`allocate`. If the freed bytes are not
        contiguous, None is returned (nothing more is evicted): the caller falls back to
        :meth:`allocate` per object, which uses the bytes already freed."""
        res = self.allocator.reserve(shape, dtype, fmt, count)
        if res is not None:
            return res
        nbytes = math.prod(int(d) for d in shape) * dtype.itemsize
        need = pool_bytes(nbytes) * count
        if need > self.allocator.slab_bytes:
            return None
        dropped: list[CacheEngineKey] = []
        with self._lock:
            victims = self._index.make_room(need - self.allocator.free_bytes)
            if victims is None:
                return None
            for key, victim in victims:
                self._release(victim)
                dropped.append(key)
            res = self.allocator.reserve(shape, dtype, fmt, count)
        if dropped and self._on_evict is not None:
            self._on_evict(len(dropped))
        self._notify("removed", dropped)
        return res

    # ------------------------------------------------------------------ contract
    def contains(self, key: CacheEngineKey, pin: bool = False) -> bool:
        return self.batched_contains([key], pin) == 1

    def resident_flags(self, keys: Sequence[CacheEngineKey]) -> list[bool]:
        """For each key, whether this tier holds it (one lock hold; no pins, no recency change)."""
        with self._lock:
            return self._index.present(keys)

    def batched_contains(self, keys: Sequence[CacheEngineKey], pin: bool = False) -> int:
        if not pin:
            with self._lock:
                return self._index.prefix(keys)
        n = 0
        with self._lock:
            for key in keys:
                obj = self._index.get(key)
                if obj is None:
                    break
                if pin:
                    self._pin_locked(key, obj)
                n += 1
        return n

    def submit_put(self, key: CacheEngineKey, obj: MemoryObj) -> None:
        """Make ``obj`` resident (the tier takes its own reference). Synchronous."""
        self.admit_sequence([key], [obj])

    def batched_submit_put(self, keys: Sequence[CacheEngineKey], objs: Sequence[MemoryObj]) -> None:
        self.admit_sequence(keys, objs)

    def admit_sequence(self, keys: Sequence[CacheEngineKey], objs: Sequence[MemoryObj | None], *, give: bool = False) -> None:
        """One visit for the chunks of a sequence (``keys`` head first): resident keys are
        touched, new objects inserted (the tier takes its own reference), both from the
        tail to the head so the head is the most recent entry. ``None`` objects are
        skipped. With ``retain=False`` nothing is inserted. The listener is told about
        the inserted keys (``"stored"``), tail first.

        ``give=True``: the caller hands over its one reference of each (distinct) object
        instead, so nothing is counted up for what is inserted; the objects that are not
        inserted (key already resident, ``retain=False``) are released here. Either way
        the caller must not use or release them after the call."""
        leftover: list[MemoryObj] = []
        with self._lock:
            if not self.retain:
                self._index.touch_sequence(keys)
                inserted: list[CacheEngineKey] = []
            else:
                inserted = self._index.admit(keys, objs, MemoryObj.get_physical_size, None if give else MemoryObj.ref_count_up)
            if give and len(inserted) != len(objs):
                get = self._index.get
                leftover = [obj for key, obj in zip(keys, objs) if obj is not None and get(key) is not obj]
        for obj in leftover:
            obj.ref_count_down()
        self._notify("stored", inserted)

    def get_blocking(self, key: CacheEngineKey) -> MemoryObj | None:
        with self._lock:
            obj = self._index.get(key)
            if obj is None:
                return None
            obj.ref_count_up()
            self._index.touch(key)
            return obj

    def get_prefix(self, keys: Sequence[CacheEngineKey], *, touch: bool = False) -> list[MemoryObj]:
        """Objects of the leading resident ``keys`` (one reference each for the caller),
        in one lock hold. With ``touch`` the hits are recorded tail to head in the same
        hold; otherwise the caller reports them later (:meth:`admit_sequence`)."""
        out: list[MemoryObj] = []
        with self._lock:
            for key in keys:
                obj = self._index.get(key)
                if obj is None:
                    break
                obj.ref_count_up()
                out.append(obj)
            if touch:
                self._index.touch_sequence(keys[: len(out)])
        return out

    def touch(self, key: CacheEngineKey) -> None:
        """Record a hit without taking a reference."""
        with self._lock:
            self._index.touch(key)

    def touch_sequence(self, keys: Sequence[CacheEngineKey]) -> None:
        """Record hits for ``keys`` (head first) from the tail to the head, in one lock hold."""
        with self._lock:
            self._index.touch_sequence(keys)

    def remove(self, key: CacheEngineKey) -> bool:
        with self._lock:
            obj = self._index.pop(key)
        if obj is None:
            return False
        self._release(obj)
        self._notify("removed", [key])
        return True

    def unpin(self, key: CacheEngineKey) -> bool:
        with self._lock:
            obj = self._index.get(key)
            if obj is None:
                return False
            self._index.unpin(key)
            obj.unpin()
            return True

    def batched_unpin(self, keys: Sequence[CacheEngineKey]) -> None:
        """:meth:`unpin` for each key, in one lock hold."""
        with self._lock:
            for key in keys:
                obj = self._index.get(key)
                if obj is not None:
                    self._index.unpin(key)
                    obj.unpin()

    def pin_count(self, key: CacheEngineKey) -> int:
        """Pins held on ``key`` by lookups (0 if absent)."""
        with self._lock:
            return self._index.pins(key)

    def keys(self) -> list[CacheEngineKey]:
        with self._lock:
            return self._index.keys()

    def resident(self, key: CacheEngineKey) -> MemoryObj | None:
        """The resident object of ``key`` without taking a reference (introspection only:
        the tier may drop it at any time)."""
        with self._lock:
            return self._index.get(key)

    def resident_objects(self) -> dict[CacheEngineKey, MemoryObj]:
        """Snapshot of key -> resident object, no references taken (introspection only)."""
        with self._lock:
            return dict(self._index.items())

    def __len__(self) -> int:
        return len(self._index)

    def close(self) -> None:
        with self._lock:
            dropped = self._index.clear()
        for _, obj in dropped:
            self._release(obj)
        self.allocator.close()

    def _pin_locked(self, key: CacheEngineKey, obj: MemoryObj) -> None:
        self._index.pin(key)
        obj.pin()

    @staticmethod
    def _release(obj: MemoryObj) -> None:
        obj.ref_count_down()
