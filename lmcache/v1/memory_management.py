"""Memory objects and the pool they come from.

A :class:`PoolAllocator` hands out :class:`MemoryObj` views into large preallocated
byte slabs and takes them back when their reference count reaches zero. Slabs are
created lazily (the first when the first object is allocated, more as the pool fills),
so start-up cost does not depend on the pool size, and freed memory is reused so hot
paths copy into already-touched pages. Slabs are page-locked (pinned) only when CUDA is
available, because pinning touches every page.

Ownership rule for the whole package: an allocation returns an object with
``ref_count == 1`` owned by the caller; whoever stores a reference calls
``ref_count_up()``; whoever drops one calls ``ref_count_down()``. A pinned object
(``pin_count > 0``) is never evicted from a tier.
"""

from __future__ import annotations

import bisect
import enum
import logging
import math
import threading
from collections.abc import Iterable
from dataclasses import dataclass

import torch

logger = logging.getLogger(__name__)

GiB = 1 << 30
ALIGN = 4096  # page alignment: lets the disk tier use O_DIRECT on pool memory
DEFAULT_SLAB_BYTES = 1 * GiB


class MemoryFormat(enum.Enum):
    """Shape convention of a MemoryObj's tensor."""

    KV_2LTD = 1
    """[2, num_layers, num_tokens, hidden]: K and V of all layers of one chunk."""
    KV_T2D = 2
    """[num_tokens, 2, hidden]: K and V of one layer of one chunk (layerwise path)."""
    KV_MLA_FMT = 3
    """[1, num_layers, num_tokens, hidden]: MLA latent vectors of all layers of one chunk."""
    HS_TD = 4
    """[num_tokens, hidden_dim]: hidden states of one chunk for one storage layer."""
    EC_TD = 5
    """[num_tokens, dim]: one multimodal encoder output."""
    BINARY = 6
    """[num_bytes] uint8: opaque bytes."""

    def token_dim(self) -> int:
        """Index of the token axis in this format's shape (:data:`TOKEN_DIM`)."""
        return TOKEN_DIM[self]


TOKEN_DIM: dict[MemoryFormat, int] = {
    MemoryFormat.KV_2LTD: 2,
    MemoryFormat.KV_T2D: 0,
    MemoryFormat.KV_MLA_FMT: 2,
    MemoryFormat.HS_TD: 0,
    MemoryFormat.EC_TD: 0,
    MemoryFormat.BINARY: 0,
}
"""Index of the token axis of each format's shape (as the member docstrings write it; BINARY's
only axis, its bytes)."""


@dataclass(frozen=True, slots=True)
class MemoryObjMetadata:
    """Shape, dtype and format of a MemoryObj (what a tier needs to rebuild it)."""

    shape: tuple[int, ...]
    dtype: torch.dtype
    fmt: MemoryFormat

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * _itemsize(self.dtype)


def _itemsize(dtype: torch.dtype) -> int:
    return dtype.itemsize  # no tensor allocation: this runs per entry in disk-index rebuilds


_LAZY = torch.empty(0)  # MemoryObj._tensor of an object whose view is not made yet (never handed out)


class MemoryObj:
    """A tensor view into pool memory with reference and pin counts.

    Thread-safe counters. ``tensor`` stays valid while the caller holds a reference.
    When the reference count reaches 0 the memory returns to its allocator (objects
    not backed by an allocator simply drop their tensor).
    """

    __slots__ = ("meta", "_raw", "_tensor", "_allocator", "_slab", "_offset", "_size", "_ref", "_pin", "_lock", "_base")

    def __init__(
        self,
        meta: MemoryObjMetadata,
        raw: torch.Tensor,
        allocator: PoolAllocator | None = None,
        slab: int = -1,
        offset: int = 0,
        size: int = 0,
    ) -> None:
        self.meta = meta
        self._raw: torch.Tensor | None = raw
        self._base: PoolReservation | None = None
        self._tensor: torch.Tensor | None = raw[: meta.nbytes].view(meta.dtype).view(meta.shape)
        self._allocator = allocator
        self._slab = slab
        self._offset = offset
        self._size = size
        self._ref = 1
        self._pin = 0
        self._lock = threading.Lock()

    @classmethod
    def _in_reservation(cls, reservation: PoolReservation, offset: int) -> MemoryObj:
        """A pool object at ``offset`` of ``reservation``'s slab; its tensor views are made on
        first use (:attr:`tensor`, :attr:`byte_array`), so creating it costs no tensor op."""
        obj = cls.__new__(cls)
        obj.meta = reservation.meta
        obj._raw = None
        obj._base = reservation
        obj._tensor = _LAZY
        obj._allocator = reservation._allocator
        obj._slab = reservation._slab
        obj._offset = offset
        obj._size = reservation.size
        obj._ref = 1
        obj._pin = 0
        obj._lock = threading.Lock()
        return obj

    def _raw_view(self) -> torch.Tensor:
        raw = self._raw
        if raw is None:
            assert self._base is not None
            raw = self._raw = self._base._buf[self._offset : self._offset + self._size]
        return raw

    @classmethod
    def from_tensor(cls, tensor: torch.Tensor, fmt: MemoryFormat) -> MemoryObj:
        """Wrap a standalone contiguous CPU tensor (not pool memory) as a MemoryObj."""
        t = tensor.contiguous()
        meta = MemoryObjMetadata(tuple(t.shape), t.dtype, fmt)
        return cls(meta, t.view(-1).view(torch.uint8))

    # ------------------------------------------------------------------ views
    @property
    def tensor(self) -> torch.Tensor | None:
        """The typed view, or None after the object has been freed."""
        t = self._tensor
        if t is _LAZY:
            with self._lock:
                if self._tensor is _LAZY:
                    self._tensor = self._base._typed_view(self._offset)
                t = self._tensor
        return t

    def host_address(self) -> int | None:
        """Address of the payload if the object is valid and lives in CPU memory, else None.

        For pool objects (always CPU memory) this is arithmetic: no tensor is touched or
        created, which is what the per-layer copy paths want."""
        if self._tensor is None:
            return None
        if self._base is not None:
            return self._base.address + self._offset
        if self._allocator is not None:
            return self._raw_view().data_ptr()
        t = self.tensor
        return t.data_ptr() if t is not None and t.device.type == "cpu" else None

    @property
    def byte_array(self) -> torch.Tensor:
        """The payload as a flat uint8 tensor (length ``meta.nbytes``)."""
        return self._raw_view()[: self.meta.nbytes]

    @property
    def shape(self) -> tuple[int, ...]:
        return self.meta.shape

    @property
    def dtype(self) -> torch.dtype:
        return self.meta.dtype

    @property
    def fmt(self) -> MemoryFormat:
        return self.meta.fmt

    def get_size(self) -> int:
        """Payload bytes."""
        return self.meta.nbytes

    def num_tokens(self) -> int:
        return self.meta.shape[self.meta.fmt.token_dim()]

    # LMCache 0.5.6 accessor names (same values as the properties above)
    @property
    def metadata(self) -> MemoryObjMetadata:
        return self.meta

    def get_shape(self) -> torch.Size:
        return torch.Size(self.meta.shape)

    def get_dtype(self) -> torch.dtype:
        return self.meta.dtype

    def get_memory_format(self) -> MemoryFormat:
        return self.meta.fmt

    def get_num_tokens(self) -> int:
        return self.num_tokens()

    def get_physical_size(self) -> int:
        """Bytes the object occupies in its pool (payload rounded up to a page)."""
        return self._size if self._allocator is not None else self.meta.nbytes

    def get_ref_count(self) -> int:
        return self._ref

    def is_valid(self) -> bool:
        """False once the last reference was dropped (the memory went back to the pool)."""
        return self._tensor is not None

    @property
    def raw_tensor(self) -> torch.Tensor | None:
        """The object's whole pool region as uint8 (None after it was freed)."""
        return self._raw_view() if self._tensor is not None else None

    @property
    def data_ptr(self) -> int:
        """Address of the payload's first byte."""
        if self._base is not None:
            return self._base.address + self._offset
        return self._raw_view().data_ptr()

    # ------------------------------------------------------------------ counts
    @property
    def ref_count(self) -> int:
        return self._ref

    @property
    def pin_count(self) -> int:
        return self._pin

    @property
    def is_pinned(self) -> bool:
        """Whether a pin keeps the object from eviction (a property, as in LMCache)."""
        return self._pin > 0

    @property
    def can_evict(self) -> bool:
        """Whether a tier holding the only reference may evict it (not pinned, no other holder)."""
        return self._pin == 0 and self._ref <= 1

    def ref_count_up(self) -> None:
        with self._lock:
            assert self._ref > 0, "ref_count_up on a freed MemoryObj"
            self._ref += 1

    def ref_count_down(self) -> None:
        """Drop one reference; at zero the memory goes back to the pool."""
        with self._lock:
            assert self._ref > 0, "ref_count_down on a freed MemoryObj"
            self._ref -= 1
            if self._ref:
                return
            self._tensor = None
        if self._allocator is not None:
            self._allocator._release(self._slab, self._offset, self._size)

    def pin(self) -> bool:
        """Add one pin; returns True (LMCache's signature)."""
        with self._lock:
            self._pin += 1
        return True

    def unpin(self) -> bool:
        """Drop one pin; True if there was one."""
        with self._lock:
            if self._pin > 0:
                self._pin -= 1
                return True
        return False

    def __repr__(self) -> str:
        return f"MemoryObj(shape={self.meta.shape}, dtype={self.meta.dtype}, fmt={self.meta.fmt.name}, ref={self._ref}, pin={self._pin})"


class _Slab:
    """One contiguous byte buffer with a sorted, coalescing free list."""

    __slots__ = ("buf", "size", "free_offsets", "free_sizes", "typed")

    def __init__(self, size: int, pin_memory: bool) -> None:
        raw = None
        if pin_memory:
            # torch's pinned allocator rounds every request up to a power of two and
            # returns page-aligned blocks: ask for exactly ``size`` (a 1 GiB slab plus
            # alignment slack would pin 2 GiB).
            raw = torch.empty(size, dtype=torch.uint8, pin_memory=True)
            if raw.data_ptr() % ALIGN:
                raw = None
        if raw is None:
            raw = torch.empty(size + ALIGN, dtype=torch.uint8, pin_memory=pin_memory)
        skew = (-raw.data_ptr()) % ALIGN  # start on a page boundary (O_DIRECT-friendly)
        self.buf = raw[skew : skew + size]
        self.size = size
        self.free_offsets = [0]
        self.free_sizes = [size]
        self.typed: dict[torch.dtype, torch.Tensor] = {}
        """The whole slab viewed as each dtype asked for (reservations build their views from it)."""

    def view_as(self, dtype: torch.dtype) -> torch.Tensor:
        typed = self.typed.get(dtype)
        if typed is None:
            typed = self.typed[dtype] = self.buf.view(dtype)
        return typed

    def alloc(self, size: int) -> int | None:
        for i, fsize in enumerate(self.free_sizes):
            if fsize >= size:
                off = self.free_offsets[i]
                if fsize == size:
                    del self.free_offsets[i], self.free_sizes[i]
                else:
                    self.free_offsets[i] = off + size
                    self.free_sizes[i] = fsize - size
                return off
        return None

    def free(self, off: int, size: int) -> None:
        i = bisect.bisect_left(self.free_offsets, off)
        # merge with the following free block
        if i < len(self.free_offsets) and off + size == self.free_offsets[i]:
            size += self.free_sizes[i]
            del self.free_offsets[i], self.free_sizes[i]
        # merge with the preceding free block
        if i > 0 and self.free_offsets[i - 1] + self.free_sizes[i - 1] == off:
            self.free_sizes[i - 1] += size
            return
        self.free_offsets.insert(i, off)
        self.free_sizes.insert(i, size)


class PoolAllocator:
    """Fixed-budget allocator of page-aligned MemoryObjs over lazily created slabs.

    Any thread may call :meth:`allocate`; it never blocks on I/O and returns None when
    the budget is exhausted (the caller evicts or skips). Memory returns to the pool
    when an object's reference count reaches zero.
    """

    def __init__(self, capacity_bytes: int, *, pin_memory: bool | None = None, slab_bytes: int = DEFAULT_SLAB_BYTES):
        if capacity_bytes <= 0:
            raise ValueError(f"capacity_bytes={capacity_bytes!r}: expected > 0")
        self.capacity = capacity_bytes
        self.pin_memory = torch.cuda.is_available() if pin_memory is None else pin_memory
        self.slab_bytes = max(ALIGN, min(slab_bytes, capacity_bytes) // ALIGN * ALIGN)
        self._slabs: list[_Slab] = []
        self._reserved = 0  # bytes of slabs created so far
        self._used = 0
        self._lock = threading.Lock()

    @property
    def used_bytes(self) -> int:
        return self._used

    @property
    def free_bytes(self) -> int:
        return self.capacity - self._used

    @property
    def reserved_bytes(self) -> int:
        """Bytes of the slabs created so far (slabs are created lazily, on allocation)."""
        return self._reserved

    def slab_ranges(self) -> list[tuple[int, int]]:
        """``(start address, size)`` of every slab (introspection: where pool memory lives)."""
        with self._lock:
            return [(s.buf.data_ptr(), s.size) for s in self._slabs]

    def can_ever_fit(self, nbytes: int) -> bool:
        return _round_up(nbytes) <= self.slab_bytes

    def allocate(self, shape: tuple[int, ...] | torch.Size, dtype: torch.dtype, fmt: MemoryFormat) -> MemoryObj | None:
        """A new object with ref_count 1, owned by the caller; None if the pool is full."""
        meta = MemoryObjMetadata(tuple(int(d) for d in shape), dtype, fmt)
        size = pool_bytes(meta.nbytes)
        if size > self.slab_bytes:
            return None
        with self._lock:
            if self._used + size > self.capacity:
                return None
            for idx, slab in enumerate(self._slabs):
                off = slab.alloc(size)
                if off is not None:
                    break
            else:
                slab_size = min(self.slab_bytes, self.capacity - self._reserved) // ALIGN * ALIGN
                if slab_size < size:
                    return None
                slab = _Slab(slab_size, self.pin_memory)
                self._slabs.append(slab)
                self._reserved += slab_size
                idx = len(self._slabs) - 1
                off = slab.alloc(size)
                assert off is not None
            self._used += size
        return MemoryObj(meta, slab.buf[off : off + size], self, idx, off, size)

    def reserve(
        self, shape: tuple[int, ...] | torch.Size, dtype: torch.dtype, fmt: MemoryFormat, count: int
    ) -> PoolReservation | None:
        """Pool bytes for ``count`` objects of one shape in one contiguous block, or None
        (budget exhausted, or no slab has such a block free). The objects are created
        later, one by one (:meth:`PoolReservation.take`); see :class:`PoolReservation`."""
        if count <= 0:
            raise ValueError(f"count={count!r}: expected > 0")
        meta = MemoryObjMetadata(tuple(int(d) for d in shape), dtype, fmt)
        size = pool_bytes(meta.nbytes)
        total = size * count
        if total > self.slab_bytes or size % _itemsize(dtype):
            return None
        with self._lock:
            if self._used + total > self.capacity:
                return None
            for idx, slab in enumerate(self._slabs):
                off = slab.alloc(total)
                if off is not None:
                    break
            else:
                slab_size = min(self.slab_bytes, self.capacity - self._reserved) // ALIGN * ALIGN
                if slab_size < total:
                    return None
                slab = _Slab(slab_size, self.pin_memory)
                self._slabs.append(slab)
                self._reserved += slab_size
                idx = len(self._slabs) - 1
                off = slab.alloc(total)
                assert off is not None
            self._used += total
            typed = slab.view_as(dtype)
        return PoolReservation(self, meta, idx, slab.buf, typed, off, size, count)

    def _release(self, slab: int, offset: int, size: int) -> None:
        with self._lock:
            if slab < len(self._slabs):  # after close() the slabs are gone
                self._slabs[slab].free(offset, size)
            self._used -= size
            assert self._used >= 0

    def close(self) -> None:
        with self._lock:
            self._slabs.clear()
            self._reserved = 0


class PoolReservation:
    """Pool bytes booked for ``count`` same-shape objects in one contiguous block.

    Made by :meth:`PoolAllocator.reserve`. The bytes count as used from the start (so a
    request that reserved all it needs cannot run out half way), but the objects are
    created only when asked for: :meth:`take` returns slot ``i`` as an ordinary pool
    object (ref_count 1, owned by the caller, freed on its own when its count reaches
    zero); :meth:`release` returns every slot never taken to the pool. Creating an
    object from a reservation costs one tensor view (no allocator lock).

    Thread: one owner at a time (not thread-safe). The owner must call :meth:`release`
    (idempotent) when done, also on error paths.
    """

    __slots__ = (
        "_allocator", "meta", "_slab", "_buf", "_typed", "_offset", "size", "count", "_taken", "_strides", "_released", "address"
    )

    def __init__(
        self,
        allocator: PoolAllocator,
        meta: MemoryObjMetadata,
        slab: int,
        buf: torch.Tensor,
        typed: torch.Tensor,
        offset: int,
        size: int,
        count: int,
    ) -> None:
        self._allocator = allocator
        self.meta = meta
        self._slab = slab
        self._buf = buf
        self._typed = typed
        self._offset = offset
        self.size = size
        """Pool bytes of each slot (the payload rounded up to a page)."""
        self.count = count
        self._taken = [False] * count
        strides, step = [], 1
        for d in reversed(meta.shape):
            strides.append(step)
            step *= d
        self._strides = tuple(reversed(strides))
        self._released = False
        self.address = buf.data_ptr()
        """Address of the slab's first byte (objects are at ``address + their offset``)."""

    def take(self, i: int) -> MemoryObj:
        """Slot ``i`` as a new object (ref_count 1, caller owns it); each slot once."""
        if self._released or self._taken[i]:
            raise ValueError(f"slot {i}: already taken or the reservation was released")
        self._taken[i] = True
        return MemoryObj._in_reservation(self, self._offset + i * self.size)

    def take_many(self, slots: Iterable[int]) -> list[MemoryObj]:
        """:meth:`take` of each of ``slots``, in order (one call for a whole layer of a
        request); takes none if any was taken already."""
        if self._released:
            raise ValueError("take_many: the reservation was released")
        slots = list(slots)
        taken = self._taken
        for i in slots:
            if taken[i]:
                raise ValueError(f"slot {i}: already taken")  # before any is taken: nothing leaks
        base, size, make = self._offset, self.size, MemoryObj._in_reservation
        out = []
        for i in slots:
            taken[i] = True
            out.append(make(self, base + i * size))
        return out

    def _typed_view(self, offset: int) -> torch.Tensor:
        """The typed tensor of the object at slab byte ``offset``."""
        # as_strided's offset counts from the start of the storage, not of the slab's view
        start = self._typed.storage_offset() + offset // _itemsize(self.meta.dtype)
        return torch.as_strided(self._typed, self.meta.shape, self._strides, start)

    def release(self) -> None:
        """Return every slot never taken to the pool (idempotent)."""
        if self._released:
            return
        self._released = True
        i = 0
        while i < self.count:
            if self._taken[i]:
                i += 1
                continue
            j = i
            while j < self.count and not self._taken[j]:
                j += 1
            self._allocator._release(self._slab, self._offset + i * self.size, (j - i) * self.size)
            i = j


def _round_up(n: int) -> int:
    return (n + ALIGN - 1) // ALIGN * ALIGN


def pool_bytes(nbytes: int) -> int:
    """Pool bytes one object with an ``nbytes`` payload takes (whole pages, at least one)."""
    return _round_up(max(nbytes, 1))
