"""StorageManager routing across tiers, with fake lower tiers implementing the backend ABC."""

from __future__ import annotations

import torch

from lmcache.utils import CacheEngineKey
from lmcache.v1.config import LMCacheEngineConfig
from lmcache.v1.memory_management import ALIGN, MemoryFormat, MemoryObj
from lmcache.v1.storage_backend.abstract_backend import StorageBackend
from lmcache.v1.storage_backend.storage_manager import StorageManager

KEY = CacheEngineKey("m", 1, 0, 7, "uint8")


class FakeTier(StorageBackend):
    """Holds bytes per key; counts calls; reads allocate from the manager's pool."""

    def __init__(self, name: str) -> None:
        self.name = name
        self.data: dict[CacheEngineKey, bytes] = {}
        self.calls: list[str] = []
        self.sm: StorageManager | None = None

    def contains(self, key, pin=False):
        self.calls.append("contains")
        return key in self.data

    def submit_put(self, key, obj):
        self.calls.append("put")
        self.data[key] = bytes(obj.byte_array.numpy())

    def get_blocking(self, key):
        self.calls.append("get")
        raw = self.data.get(key)
        if raw is None:
            return None
        obj = self.sm.allocate((len(raw),), torch.uint8, MemoryFormat.BINARY)
        obj.byte_array.copy_(torch.frombuffer(bytearray(raw), dtype=torch.uint8))
        return obj

    def remove(self, key):
        return self.data.pop(key, None) is not None

    def close(self):
        pass


def manager(*tiers: FakeTier) -> StorageManager:
    cfg = LMCacheEngineConfig.from_dict({"chunk_size": 16})
    sm = StorageManager(cfg, lower_backends=list(tiers), pool_bytes=16 * ALIGN)
    for t in tiers:
        t.sm = sm
    return sm


def test_non_blocking_get_reads_lower_tiers_in_order_and_promotes():
    disk, remote = FakeTier("disk"), FakeTier("remote")
    sm = manager(disk, remote)
    remote.data[KEY] = bytes([5]) * ALIGN
    obj: MemoryObj = sm.get_non_blocking(KEY).result()
    assert obj is not None and bool((obj.tensor == 5).all())
    # each tier answered with one read; no separate existence round trip
    assert disk.calls == ["get"] and remote.calls == ["get"]
    assert sm.is_resident(KEY)  # promoted into L1
    obj.ref_count_down()
    again = sm.get_non_blocking(KEY).result()
    assert again is obj and remote.calls == ["get"]  # L1 hit: no tier asked
    again.ref_count_down()
    sm.close()


def test_non_blocking_get_miss_everywhere():
    disk = FakeTier("disk")
    sm = manager(disk)
    assert sm.get_non_blocking(KEY).result() is None
    assert disk.calls == ["get"] and sm.allocator.used_bytes == 0
    sm.close()
