"""StorageManager.allocate_many: batched pool objects for a store (property-based)."""

from __future__ import annotations

import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from lmcache.utils import CacheEngineKey
from lmcache.v1.config import LMCacheEngineConfig
from lmcache.v1.memory_management import ALIGN, MemoryFormat
from lmcache.v1.storage_backend.storage_manager import StorageManager
from lmcache.v1.transfer import release

PAGES = 16
FMT = MemoryFormat.KV_2LTD


def manager() -> StorageManager:
    return StorageManager(LMCacheEngineConfig.from_dict({"chunk_size": 16}), pool_bytes=PAGES * ALIGN)


def key(i: int) -> CacheEngineKey:
    return CacheEngineKey("m", 1, 0, i, "uint8")


@settings(max_examples=80, deadline=None)
@given(
    before=st.lists(st.tuples(st.integers(1, 3), st.booleans(), st.booleans()), max_size=10),
    pages=st.integers(1, 3),
    count=st.integers(1, 12),
)
def test_allocate_many_gives_a_prefix_of_disjoint_objects(before, pages, count):
    """Whatever the pool holds (resident entries to evict, objects the caller still holds,
    holes left by freed ones), ``allocate_many`` returns a prefix of the request: distinct,
    non-overlapping objects of the asked shape, each owned by the caller; a short result
    means not even one more object fits; releasing them gives every byte back."""
    sm = manager()
    alloc = sm.local_cpu.allocator
    held = []
    for i, (n_pages, keep, resident) in enumerate(before):
        obj = sm.allocate((n_pages * ALIGN,), torch.uint8, FMT)
        if obj is None:
            continue
        if resident:
            sm.put(key(i), obj)  # the tier takes its own reference: evictable once we drop ours
        if keep and not resident:
            held.append(obj)
        else:
            obj.ref_count_down()
    shape = (pages * ALIGN,)
    objs = sm.allocate_many(shape, torch.uint8, FMT, count)
    assert len(objs) <= count
    spans = sorted((o.host_address(), o.host_address() + o.get_physical_size()) for o in objs)
    assert all(a_end <= b for (_, a_end), (b, _) in zip(spans, spans[1:])), "objects overlap"
    assert all(o.shape == shape and o.dtype == torch.uint8 and o.ref_count == 1 for o in objs)
    for i, o in enumerate(objs):  # each object is its own memory
        o.tensor.fill_(i % 251)
    assert all(bool((o.tensor == i % 251).all()) for i, o in enumerate(objs))
    if len(objs) < count:
        assert sm.allocate(shape, torch.uint8, FMT) is None
    used = alloc.used_bytes
    release(objs)
    assert alloc.used_bytes == used - sum(o_end - o for o, o_end in spans)
    release(held)
    sm.close()


def test_allocate_many_books_one_contiguous_block_when_it_fits():
    sm = manager()
    calls = []
    original = sm.reserve
    sm.reserve = lambda *a: (calls.append(a[-1]), original(*a))[1]  # type: ignore[method-assign]
    objs = sm.allocate_many((ALIGN,), torch.uint8, FMT, 5)
    assert calls == [5] and len(objs) == 5
    addrs = [o.host_address() for o in objs]
    assert addrs == [addrs[0] + i * ALIGN for i in range(5)]
    release(objs)
    assert sm.local_cpu.allocator.used_bytes == 0
    sm.close()
