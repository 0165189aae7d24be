"""L1: the CPU memory tier. It owns the pool every tier allocates from."""

from __future__ import annotations

import logging
import threading
from typing import Callable

import torch

from lmcache.utils import CacheEngineKey
from lmcache.v1.memory_management import MemoryFormat, MemoryObj, PoolAllocator
from lmcache.v1.storage_backend.abstract_backend import StorageBackend
from lmcache.v1.storage_backend.cache_policy import EvictionPolicy

logger = logging.getLogger(__name__)


class LocalCPUBackend(StorageBackend):
    """Keeps MemoryObjs resident in the CPU pool, evicting by a policy when full.

    Thread-safe; nothing here blocks on I/O. The tier holds one reference per resident
    object and drops it on eviction/removal. Eviction skips pinned objects and objects
    someone else still references (``ref_count > 1``). With ``retain=False`` (config
    ``local_cpu: false``) the pool only stages data for lower tiers and nothing stays
    resident.
    """

    tier = "cpu"

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
        self.policy = policy
        self.retain = retain
        self._on_evict = on_evict
        self._objs: dict[CacheEngineKey, MemoryObj] = {}
        self._lock = threading.Lock()

    # ------------------------------------------------------------------ allocation
    def allocate(self, shape: tuple[int, ...] | torch.Size, dtype: torch.dtype, fmt: MemoryFormat) -> MemoryObj | None:
        """A pool object (ref 1, caller owns it), evicting as needed; None if impossible."""
        obj = self.allocator.allocate(shape, dtype, fmt)
        if obj is not None:
            return obj
        nbytes = int(torch.Size(shape).numel()) * torch.empty((), dtype=dtype).element_size()
        if not self.allocator.can_ever_fit(nbytes):
            return None
        evicted: list[CacheEngineKey] = []
        with self._lock:
            for key in self.policy.victims():
                victim = self._objs.get(key)
                if victim is None or victim.is_pinned or victim.ref_count > 1:
                    continue
                self._drop_locked(key)
                evicted.append(key)
                obj = self.allocator.allocate(shape, dtype, fmt)
                if obj is not None:
                    break
        if evicted and self._on_evict is not None:
            self._on_evict(len(evicted))
        self._notify("removed", evicted)
        return obj

    # ------------------------------------------------------------------ contract
    def contains(self, key: CacheEngineKey, pin: bool = False) -> bool:
        with self._lock:
            obj = self._objs.get(key)
            if obj is None:
                return False
            if pin:
                obj.pin()
            return True

    def batched_contains(self, keys, pin: bool = False) -> int:
        n = 0
        with self._lock:
            for key in keys:
                obj = self._objs.get(key)
                if obj is None:
                    break
                if pin:
                    obj.pin()
                n += 1
        return n

    def submit_put(self, key: CacheEngineKey, obj: MemoryObj) -> None:
        """Make ``obj`` resident (the tier takes its own reference). Synchronous."""
        if not self.retain:
            return
        with self._lock:
            old = self._objs.get(key)
            if old is not None:
                self.policy.on_hit(key)
                return
            obj.ref_count_up()
            self._objs[key] = obj
            self.policy.on_insert(key)
        self._notify("stored", [key])

    def get_blocking(self, key: CacheEngineKey) -> MemoryObj | None:
        with self._lock:
            obj = self._objs.get(key)
            if obj is None:
                return None
            obj.ref_count_up()
            self.policy.on_hit(key)
            return obj

    def touch(self, key: CacheEngineKey) -> None:
        """Record a hit without taking a reference."""
        with self._lock:
            if key in self._objs:
                self.policy.on_hit(key)

    def remove(self, key: CacheEngineKey) -> bool:
        with self._lock:
            if key not in self._objs:
                return False
            self._drop_locked(key)
        self._notify("removed", [key])
        return True

    def unpin(self, key: CacheEngineKey) -> bool:
        with self._lock:
            obj = self._objs.get(key)
            if obj is None:
                return False
            obj.unpin()
            return True

    def keys(self) -> list[CacheEngineKey]:
        with self._lock:
            return list(self._objs)

    def __len__(self) -> int:
        return len(self._objs)

    def close(self) -> None:
        with self._lock:
            for key in list(self._objs):
                self._drop_locked(key)
        self.allocator.close()

    def _drop_locked(self, key: CacheEngineKey) -> None:
        obj = self._objs.pop(key)
        self.policy.on_remove(key)
        obj.ref_count_down()
