from __future__ import annotations

import time

import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from lmcache.v1.memory_management import ALIGN, GiB, MemoryFormat, MemoryObj, PoolAllocator


@settings(max_examples=60, deadline=None)
@given(st.lists(st.tuples(st.booleans(), st.integers(1, 40_000)), max_size=60))
def test_allocator_never_overlaps_or_exceeds(ops):
    alloc = PoolAllocator(256 * 1024, slab_bytes=64 * 1024)
    live: list[MemoryObj] = []
    for is_alloc, size in ops:
        if is_alloc or not live:
            obj = alloc.allocate((size,), torch.uint8, MemoryFormat.BINARY)
            if obj is not None:
                obj.tensor.fill_(len(live) % 251)
                live.append(obj)
        else:
            live.pop(size % len(live)).ref_count_down()
        assert 0 <= alloc.used_bytes <= alloc.capacity
        ranges = sorted((o.byte_array.data_ptr(), o.byte_array.data_ptr() + o.get_size()) for o in live)
        assert all(a[1] <= b[0] for a, b in zip(ranges, ranges[1:]))
        assert all(p % ALIGN == 0 for p, _ in ranges)
    for obj in live:
        obj.ref_count_down()
    assert alloc.used_bytes == 0
    # everything coalesced: a full-slab allocation fits again
    assert alloc.allocate((64 * 1024,), torch.uint8, MemoryFormat.BINARY) is not None


def test_ref_and_pin_counts_and_reuse():
    alloc = PoolAllocator(1 << 20)
    obj = alloc.allocate((4, 8), torch.float32, MemoryFormat.HS_TD)
    assert obj.ref_count == 1 and obj.tensor.shape == (4, 8) and obj.num_tokens() == 4
    ptr = obj.tensor.data_ptr()
    obj.ref_count_up()
    obj.pin()
    assert obj.is_pinned
    obj.unpin()
    obj.ref_count_down()
    assert alloc.used_bytes == ALIGN
    obj.ref_count_down()
    assert alloc.used_bytes == 0 and obj.tensor is None
    again = alloc.allocate((4, 8), torch.float32, MemoryFormat.HS_TD)
    assert again.tensor.data_ptr() == ptr  # freed memory is reused


def test_full_pool_returns_none():
    alloc = PoolAllocator(2 * ALIGN)
    a = alloc.allocate((ALIGN,), torch.uint8, MemoryFormat.BINARY)
    b = alloc.allocate((ALIGN,), torch.uint8, MemoryFormat.BINARY)
    assert a is not None and b is not None
    assert alloc.allocate((1,), torch.uint8, MemoryFormat.BINARY) is None
    assert alloc.allocate((10 * ALIGN,), torch.uint8, MemoryFormat.BINARY) is None


def test_startup_does_not_scale_with_pool_size():
    t0 = time.perf_counter()
    small = PoolAllocator(GiB // 16)
    t_small = time.perf_counter() - t0
    t0 = time.perf_counter()
    big = PoolAllocator(64 * GiB)  # more than this machine's RAM: must be lazy
    t_big = time.perf_counter() - t0
    assert big.used_bytes == 0 and small.used_bytes == 0
    # no memory is reserved until the first allocation
    assert big.reserved_bytes == 0
    obj = big.allocate((1024,), torch.uint8, MemoryFormat.BINARY)
    assert obj is not None and big.reserved_bytes <= big.slab_bytes
    del t_small, t_big
