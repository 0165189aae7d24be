"""StorageManager routing across tiers, with fake lower tiers implementing the backend ABC."""

from __future__ import annotations

import torch

from lmcache.utils import CacheEngineKey
from lmcache.v1.config import LMCacheEngineConfig
from lmcache.v1.memory_management import ALIGN, MemoryFormat, MemoryObj
from lmcache.v1.storage_backend.abstract_backend import StorageBackend
from lmcache.v1.storage_backend.storage_manager import StorageManager
from lmcache.v1.tiers import Tier

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


# ----------------------------------------------------------------------------- issue 12, item 3
def test_lower_tier_hits_are_promoted_in_one_l1_visit_tail_to_head():
    """A batched read of lower-tier hits: each hit is promoted into L1 as its read settles
    (a concurrent reader of the key then finds it there), and L1 then sees the whole result
    once, ordered so that the sequence's tail is evicted before its head."""
    disk = FakeTier("disk")
    sm = manager(disk)
    keys = [CacheEngineKey("m", 1, 0, i, "uint8") for i in range(3)]
    for i, k in enumerate(keys):
        disk.data[k] = bytes([i]) * ALIGN
    visits: list[int] = []
    admit = sm.local_cpu.admit_sequence
    sm.local_cpu.admit_sequence = lambda ks, objs: (visits.append(len(ks)), admit(ks, objs))[1]
    objs = sm.batched_get(keys)
    assert [int(o.byte_array[0]) for o in objs] == [0, 1, 2]
    assert sorted(visits) == [1, 1, 1, 3] and visits[-1] == 3, "each read settled, then the whole sequence"
    assert list(sm.local_cpu.policy.victims()) == list(reversed(keys))  # tail first
    for o in objs:
        o.ref_count_down()
    sm.close()


def test_batched_lookup_covers_every_layer_and_reports_its_pins():
    sm = manager()
    chunks = [CacheEngineKey("m", 1, 0, i, "uint8") for i in range(3)]
    per_layer = [[c.split_layers(2)[layer] for c in chunks] for layer in range(2)]
    for layer_list in per_layer:
        for key in layer_list[:2]:
            obj = sm.allocate((ALIGN,), torch.uint8, MemoryFormat.BINARY)
            sm.put(key, obj)
            obj.ref_count_down()
    sm.local_cpu.remove(per_layer[1][1])  # chunk 1 lacks layer 1
    res = sm.batched_lookup(per_layer, pin=True)
    assert res.hits == 1 and sm.batched_contains(chunks, num_layers=2) == 1
    assert set(res.pinned) == {per_layer[0][0], per_layer[0][1], per_layer[1][0]}
    assert all(sm.local_cpu.pin_count(k) == 1 for k in res.pinned)
    sm.batched_unpin(list(res.pinned))
    assert all(sm.local_cpu.pin_count(k) == 0 for k in res.pinned)
    sm.close()


def test_no_tier_imports_another_tier():
    import ast
    import pathlib

    import lmcache.v1.storage_backend as pkg

    root = pathlib.Path(pkg.__file__).parent
    tiers = {"local_cpu_backend", "local_disk_backend", "remote_backend"}
    for name in tiers:
        tree = ast.parse((root / f"{name}.py").read_text())
        imported = {
            n.module.rsplit(".", 1)[-1]
            for n in ast.walk(tree)
            if isinstance(n, ast.ImportFrom) and n.module and n.module.startswith("lmcache.v1.storage_backend")
        }
        assert not (imported & (tiers - {name})), f"{name} imports {imported & tiers}"


def test_a_given_put_hands_over_the_callers_reference():
    """``batched_put(give=True)``: what L1 inserts keeps exactly the caller's reference
    (nothing counted up), a key already resident leaves the caller's object released,
    and the lower tiers take (and drop) references of their own before L1 gets its."""
    lower = FakeTier("disk")
    sm = manager(lower)
    keys = [CacheEngineKey("m", 1, 0, h, "uint8") for h in (1, 2, 3)]
    old = sm.allocate((ALIGN,), torch.uint8, MemoryFormat.BINARY)
    sm.put(keys[1], old)  # key 1 resident already, with its own object
    old.ref_count_down()
    used = sm.local_cpu.allocator.used_bytes
    objs = [sm.allocate((ALIGN,), torch.uint8, MemoryFormat.BINARY) for _ in keys]
    for i, obj in enumerate(objs):
        obj.byte_array.fill_(i)
    sm.batched_put(keys, objs, give=True)
    assert [o.ref_count for o in objs] == [1, 0, 1]  # the duplicate went back to the pool
    assert not objs[1].is_valid() and sm.local_cpu.allocator.used_bytes == used + 2 * ALIGN
    for key, want in zip(keys, (objs[0], old, objs[2])):
        got = sm.get(key)
        assert got is want
        got.ref_count_down()
    assert [lower.data[k][0] for k in keys] == [0, 1, 2]  # every tier saw the whole sequence
    for k in keys:
        sm.remove(k)
    assert sm.local_cpu.allocator.used_bytes == 0  # nothing leaked, nothing freed twice


def test_a_given_put_without_l1_retention_releases_everything():
    cfg = LMCacheEngineConfig.from_dict({"chunk_size": 16, "local_cpu": False})
    lower = FakeTier("disk")
    sm = StorageManager(cfg, lower_backends=[lower], pool_bytes=16 * ALIGN)
    lower.sm = sm
    obj = sm.allocate((ALIGN,), torch.uint8, MemoryFormat.BINARY)
    sm.batched_put([KEY], [obj], give=True)
    assert not obj.is_valid() and KEY in lower.data and sm.local_cpu.allocator.used_bytes == 0


def _ref_counts(sm: StorageManager, keys) -> list[int]:
    out = []
    for k in keys:
        obj = sm.local_cpu.get_blocking(k)
        out.append(-1 if obj is None else obj.get_ref_count() - 1)  # minus this probe's own reference
        if obj is not None:
            obj.ref_count_down()
    return out


def test_iter_prefix_yields_what_batched_get_returns_in_order_and_stops_at_a_miss():
    """The streamed read gives the same prefix as the batched read (L1 part first), one
    reference each for the caller, and cuts at the first miss (hits after it released)."""
    disk = FakeTier("disk")
    sm = manager(disk)
    keys = [CacheEngineKey("m", 1, 0, i, "uint8") for i in range(5)]
    for i, k in enumerate(keys):
        if i != 3:  # key 3 missing: the prefix is 0..2
            disk.data[k] = bytes([i]) * ALIGN
    sm.get(keys[0]).ref_count_down()  # key 0 promoted into L1
    tiers: list[Tier] = []
    batches = list(sm.iter_prefix(keys, sources=tiers))
    objs = [o for b in batches for o in b]
    assert [int(o.byte_array[0]) for o in objs] == [0, 1, 2]
    assert tiers == [Tier.CPU, disk.tier, disk.tier]  # where each yielded object was found
    assert len(batches[0]) == 1  # the L1 prefix (key 0) comes first, on its own
    assert list(sm.local_cpu.policy.victims())[-1] == keys[0]  # the head is the most recent
    for o in objs:
        o.ref_count_down()
    assert _ref_counts(sm, keys[:3]) == [1, 1, 1]  # only L1's own references are left
    sm.close()


def test_closing_iter_prefix_early_releases_the_reads_it_did_not_yield():
    disk = FakeTier("disk")
    sm = manager(disk)
    keys = [CacheEngineKey("m", 1, 0, i, "uint8") for i in range(4)]
    for i, k in enumerate(keys):
        disk.data[k] = bytes([i]) * ALIGN
    stream = sm.iter_prefix(keys)
    first = next(stream)
    stream.close()
    for o in first:
        o.ref_count_down()
    sm.flush(5)
    counts = _ref_counts(sm, keys)
    assert all(c in (-1, 1) for c in counts), counts  # promoted entries hold L1's reference only
    sm.close()
