from __future__ import annotations

import time

import pytest
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


# ----------------------------------------------------------------------------- reservations
def _extent(obj: MemoryObj) -> tuple[int, int]:
    """Byte range of an object's payload as its tensor sees it (checked against data_ptr)."""
    t = obj.tensor
    assert t is not None and t.is_contiguous()
    assert t.data_ptr() == obj.data_ptr == obj.host_address() == obj.byte_array.data_ptr()
    return t.data_ptr(), t.data_ptr() + obj.get_size()


@settings(max_examples=60, deadline=None)
@given(
    st.lists(
        st.tuples(st.sampled_from(["alloc", "reserve", "take", "free", "release"]), st.integers(1, 20_000), st.integers(1, 6)),
        max_size=50,
    ),
    st.sampled_from([torch.uint8, torch.bfloat16, torch.float32]),
)
def test_reservations_and_allocations_never_overlap(ops, dtype):
    """Reserved slots become ordinary objects at their own page-aligned offsets; untaken
    slots go back on release; nothing overlaps and every byte returns to the pool."""
    alloc = PoolAllocator(256 * 1024, slab_bytes=64 * 1024)
    live: list[MemoryObj] = []
    open_res: list = []
    for op, size, count in ops:
        elems = max(1, size // dtype.itemsize)
        if op == "alloc":
            obj = alloc.allocate((elems,), dtype, MemoryFormat.BINARY)
            if obj is not None:
                live.append(obj)
        elif op == "reserve":
            res = alloc.reserve((elems,), dtype, MemoryFormat.BINARY, count)
            if res is not None:
                assert res.count == count and res.size % ALIGN == 0
                open_res.append(res)
        elif op == "take" and open_res:
            res = open_res[size % len(open_res)]
            free_slots = [i for i in range(res.count) if not res._taken[i]]
            if free_slots:
                obj = res.take(free_slots[0])
                assert obj.ref_count == 1 and obj.shape == res.meta.shape and obj.dtype == dtype
                live.append(obj)
        elif op == "free" and live:
            live.pop(size % len(live)).ref_count_down()
        elif op == "release" and open_res:
            open_res.pop(size % len(open_res)).release()
        assert 0 <= alloc.used_bytes <= alloc.capacity
        ranges = sorted(_extent(o) for o in live)
        assert all(a[1] <= b[0] for a, b in zip(ranges, ranges[1:]))
        assert all(lo % ALIGN == 0 for lo, _ in ranges)
        for i, obj in enumerate(live):  # every object reads back its own bytes
            obj.byte_array.fill_(i % 251)
        assert all(bool((o.byte_array == i % 251).all()) for i, o in enumerate(live))
    for res in open_res:
        res.release()
        res.release()  # idempotent
    for obj in live:
        obj.ref_count_down()
    assert alloc.used_bytes == 0
    assert alloc.allocate((64 * 1024,), torch.uint8, MemoryFormat.BINARY) is not None


def test_reservation_slots_are_taken_once_and_views_are_made_on_demand():
    alloc = PoolAllocator(1 << 20)
    res = alloc.reserve((2, 1, 16, 8), torch.bfloat16, MemoryFormat.KV_2LTD, 4)
    assert res is not None and alloc.used_bytes == 4 * ALIGN
    obj = res.take(2)
    assert obj._tensor is not None and obj.host_address() == res.address + res._offset + 2 * ALIGN
    t = obj.tensor  # made on first use
    assert t.shape == (2, 1, 16, 8) and t.dtype == torch.bfloat16 and t.data_ptr() == obj.data_ptr
    t.fill_(3)
    assert obj.tensor is t and bool((obj.byte_array.view(torch.bfloat16) == 3).all())
    assert obj.raw_tensor is not None and obj.raw_tensor.numel() == ALIGN
    with pytest.raises(ValueError, match="already taken"):
        res.take(2)
    res.release()
    assert alloc.used_bytes == ALIGN  # the three untaken slots went back; the object keeps its page
    with pytest.raises(ValueError):
        res.take(0)
    obj.ref_count_down()
    assert alloc.used_bytes == 0 and obj.tensor is None and obj.host_address() is None and not obj.is_valid()


def test_reservation_take_many_is_take_in_order():
    alloc = PoolAllocator(1 << 20)
    res = alloc.reserve((2, 1, 16, 8), torch.bfloat16, MemoryFormat.KV_2LTD, 6)
    assert res is not None
    objs = res.take_many(range(1, 6, 2))
    assert [o.host_address() for o in objs] == [res.address + res._offset + i * ALIGN for i in (1, 3, 5)]
    assert all(o.get_ref_count() == 1 and o.meta == res.meta for o in objs)
    with pytest.raises(ValueError, match="already taken"):
        res.take_many([0, 3])
    assert res.take(4).host_address() == res.address + res._offset + 4 * ALIGN
    res.release()
    with pytest.raises(ValueError, match="released"):
        res.take_many([2])
    assert alloc.used_bytes == 4 * ALIGN  # the failed call took nothing: slots 0 and 2 went back


def test_reserve_needs_one_contiguous_block():
    alloc = PoolAllocator(8 * ALIGN, slab_bytes=8 * ALIGN)
    objs = [alloc.allocate((ALIGN,), torch.uint8, MemoryFormat.BINARY) for _ in range(8)]
    for obj in objs[::2]:
        obj.ref_count_down()  # 4 free pages, none adjacent
    assert alloc.reserve((ALIGN,), torch.uint8, MemoryFormat.BINARY, 2) is None
    assert alloc.reserve((ALIGN,), torch.uint8, MemoryFormat.BINARY, 1) is not None
    with pytest.raises(ValueError):
        alloc.reserve((ALIGN,), torch.uint8, MemoryFormat.BINARY, 0)


def test_every_format_names_its_token_axis():
    """``token_dim`` is keyed by format: every member has one, within its documented rank."""
    ranks = {MemoryFormat.KV_2LTD: 4, MemoryFormat.KV_T2D: 3, MemoryFormat.KV_MLA_FMT: 4,
             MemoryFormat.HS_TD: 2, MemoryFormat.EC_TD: 2, MemoryFormat.BINARY: 1}
    assert set(ranks) == set(MemoryFormat)
    for fmt, rank in ranks.items():
        assert 0 <= fmt.token_dim() < rank
    assert (MemoryFormat.KV_2LTD.token_dim(), MemoryFormat.KV_T2D.token_dim()) == (2, 0)
