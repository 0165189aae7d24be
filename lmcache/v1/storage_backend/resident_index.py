"""ResidentIndex: key -> resident entry, with sizes, pins, an eviction policy and atomic eviction.

One index serves every place that keeps entries in a bounded space and evicts by a
policy: the CPU tier (L1, entries are pool objects), the disk tier (entries are files)
and the HiddenStateStore (entries are pool objects of its own pool).

Contract:

* **Atomic reserve-or-evict.** :meth:`make_room` and :meth:`reserve` first pick *all*
  victims (policy order, skipping pinned and busy entries); if they cannot free enough,
  nothing changes and None is returned. Otherwise the victims leave the index and are
  returned; releasing their resources (a pool reference, a file) is the caller's job.
* **Pins.** :meth:`pin` / :meth:`unpin` count per entry; a pinned entry is never a
  victim. An owner may also declare an entry *busy* (``busy(value)``, e.g. "someone
  else holds a reference" or "a read is in progress"): busy entries are skipped too.
* **Policy.** An :class:`~lmcache.v1.storage_backend.cache_policy.EvictionPolicy` only
  orders keys; the index tells it about inserts, hits and removals.
* **Tail before head.** :meth:`touch_sequence` and :meth:`insert_sequence` take the
  chunks of one sequence head first and hand them to the policy from the last to the
  first, so the head is the most recent entry and the tail goes first.

Capacity: with ``capacity`` set, the index does the byte accounting itself (``used`` +
``reserved`` never exceed it after a successful :meth:`reserve`); with ``capacity=None``
the space lives elsewhere (a pool allocator) and the owner asks :meth:`make_room` for
the bytes its allocator is missing.

Not thread-safe and no I/O: the owner calls it under its own lock.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Generic, Hashable, Iterable, Iterator, Sequence, TypeVar

import torch

from lmcache.v1.memory_management import ALIGN, MemoryFormat, MemoryObj, PoolAllocator
from lmcache.v1.storage_backend.cache_policy import EvictionPolicy

try:  # optional native module (setup.py): the prefix probe as one C loop
    from lmcache._keyhash import prefix_in as _native_prefix_in
except ImportError:  # pragma: no cover - depends on the build
    _native_prefix_in = None

K = TypeVar("K", bound=Hashable)
V = TypeVar("V")


@dataclass(slots=True, eq=False)
class _Slot(Generic[V]):
    value: V
    size: int
    pins: int = 0


class ResidentIndex(Generic[K, V]):
    """Key -> value with a size in bytes, pin counts and an eviction policy.

    ``busy(value)`` (optional) marks entries that may not be evicted right now besides
    pinned ones. See the module docstring for the contract.
    """

    def __init__(
        self,
        policy: EvictionPolicy,
        capacity: int | None = None,
        *,
        busy: Callable[[V], bool] | None = None,
    ) -> None:
        if capacity is not None and capacity <= 0:
            raise ValueError(f"capacity={capacity!r}: expected bytes > 0")
        self.policy = policy
        self.capacity = capacity
        self.used = 0
        """Bytes of the indexed entries."""
        self.reserved = 0
        """Bytes booked by :meth:`reserve` and not yet committed or released."""
        self._busy = busy
        self._slots: dict[K, _Slot[V]] = {}

    # ------------------------------------------------------------------ reading
    def __len__(self) -> int:
        return len(self._slots)

    def __contains__(self, key: object) -> bool:
        return key in self._slots

    def present(self, keys: Iterable[K]) -> list[bool]:
        """For each key, whether it is indexed (one C-level pass, no Python call per key)."""
        return list(map(self._slots.__contains__, keys))

    def __iter__(self) -> Iterator[K]:
        return iter(list(self._slots))

    def get(self, key: K) -> V | None:
        slot = self._slots.get(key)
        return None if slot is None else slot.value

    def keys(self) -> list[K]:
        return list(self._slots)

    def values(self) -> list[V]:
        return [s.value for s in self._slots.values()]

    def items(self) -> list[tuple[K, V]]:
        return [(k, s.value) for k, s in self._slots.items()]

    def pins(self, key: K) -> int:
        """Pin count of ``key`` (0 if absent)."""
        slot = self._slots.get(key)
        return 0 if slot is None else slot.pins

    def prefix(self, keys: Iterable[K], start: int = 0) -> int:
        """Number of leading ``keys`` present (``keys[:start]`` are taken as present
        without a probe: the caller knows). For a list or tuple the probe is one native
        loop when ``lmcache._keyhash`` is built (no Python code per key with the native
        key classes)."""
        if _native_prefix_in is not None and keys.__class__ in (list, tuple):
            return _native_prefix_in(self._slots, keys, start)
        n = 0
        for i, key in enumerate(keys):
            if i >= start and key not in self._slots:
                break
            n += 1
        return n

    # ------------------------------------------------------------------ changing
    def insert(self, key: K, value: V, size: int, *, pins: int = 0) -> V | None:
        """Index ``value`` under ``key``; returns the value it replaced (the caller releases it)."""
        old = self.pop(key)
        self._add(key, value, size, pins)
        return old

    def _add(self, key: K, value: V, size: int, pins: int) -> None:
        """Index an absent key."""
        self._slots[key] = _Slot(value, size, pins)
        self.used += size
        self.policy.on_insert(key)

    def admit(
        self, keys: Sequence[K], values: Sequence[V | None], size_of: Callable[[V], int], take: Callable[[V], None] | None
    ) -> list[K]:
        """One sequence's entries (``keys`` head first), visited tail first: a present key is
        touched; an absent one with a value is indexed after ``take(value)`` (the caller's
        hook for taking its reference; None when the caller hands its own reference over).
        Returns the inserted keys, tail first."""
        slots, on_hit = self._slots, self.policy.on_hit
        inserted: list[K] = []
        for key, value in zip(reversed(keys), reversed(values)):
            if key in slots:
                on_hit(key)
            elif value is not None:
                if take is not None:
                    take(value)
                self._add(key, value, size_of(value), 0)
                inserted.append(key)
        return inserted

    def pop(self, key: K) -> V | None:
        """Remove ``key``; its value (the caller releases it) or None."""
        slot = self._slots.pop(key, None)
        if slot is None:
            return None
        self.used -= slot.size
        self.policy.on_remove(key)
        return slot.value

    def discard(self, key: K, value: V) -> bool:
        """Remove ``key`` only if ``value`` (by identity) is still its entry."""
        slot = self._slots.get(key)
        if slot is None or slot.value is not value:
            return False
        self.pop(key)
        return True

    def clear(self) -> list[tuple[K, V]]:
        """Remove everything; the removed entries (the caller releases them)."""
        out = self.items()
        for key, _ in out:
            self.pop(key)
        return out

    def touch(self, key: K) -> bool:
        """Record a hit; True if the key is present."""
        if key not in self._slots:
            return False
        self.policy.on_hit(key)
        return True

    def touch_sequence(self, keys: Sequence[K]) -> int:
        """Touch the chunks of one sequence (``keys`` head first) tail first; number present."""
        slots = self._slots
        present = [key for key in reversed(keys) if key in slots]
        self.policy.on_hits(present)
        return len(present)

    def pin(self, key: K) -> bool:
        slot = self._slots.get(key)
        if slot is None:
            return False
        slot.pins += 1
        return True

    def unpin(self, key: K) -> bool:
        """Undo one :meth:`pin` (never below zero); True if the key is present."""
        slot = self._slots.get(key)
        if slot is None:
            return False
        slot.pins = max(0, slot.pins - 1)
        return True

    # ------------------------------------------------------------------ eviction
    def evictable(self, key: K) -> bool:
        slot = self._slots.get(key)
        return slot is not None and not slot.pins and not (self._busy is not None and self._busy(slot.value))

    def pick_victims(self, need: int) -> list[K] | None:
        """Keys (policy order) whose entries free at least ``need`` bytes; None if impossible.

        Changes nothing."""
        if need <= 0:
            return []
        victims: list[K] = []
        freed = 0
        for key in self.policy.victims():
            if not self.evictable(key):
                continue
            victims.append(key)
            freed += self._slots[key].size
            if freed >= need:
                return victims
        return None

    def make_room(self, need: int) -> list[tuple[K, V]] | None:
        """Evict entries freeing at least ``need`` bytes, all or nothing.

        Returns the evicted ``(key, value)`` pairs (out of the index; the caller
        releases them), or None, changing nothing, when not enough is evictable."""
        keys = self.pick_victims(need)
        if keys is None:
            return None
        out: list[tuple[K, V]] = []
        for key in keys:
            out.append((key, self._slots[key].value))
            self.pop(key)
        return out

    def evict_one(self) -> tuple[K, V] | None:
        """Evict the first evictable entry in policy order (None if there is none)."""
        for key in self.policy.victims():
            if self.evictable(key):
                value = self._slots[key].value
                self.pop(key)
                return key, value
        return None

    def reserve(self, nbytes: int) -> list[tuple[K, V]] | None:
        """Book ``nbytes`` against ``capacity``, evicting as few entries as needed.

        Returns the evicted entries, or None (nothing changed) when the bytes cannot fit
        (more than the whole capacity, or too much pinned/busy). Needs a capacity."""
        assert self.capacity is not None, "reserve() needs an index with a capacity"
        if nbytes > self.capacity:
            return None
        victims = self.make_room(self.used + self.reserved + nbytes - self.capacity)
        if victims is None:
            return None
        self.reserved += nbytes
        return victims

    def release(self, nbytes: int) -> None:
        """Cancel a booking made by :meth:`reserve`."""
        self.reserved -= nbytes
        assert self.reserved >= 0

    def commit(self, key: K, value: V, size: int, reserved: int, *, pins: int = 0) -> V | None:
        """Turn a booking of ``reserved`` bytes into an entry; returns a replaced value."""
        self.release(reserved)
        return self.insert(key, value, size, pins=pins)

    def shrink_to_capacity(self) -> list[tuple[K, V]]:
        """Evict in policy order until ``used + reserved`` fits the capacity (as far as
        unpinned, idle entries allow); returns the evicted entries."""
        assert self.capacity is not None
        victims: list[tuple[K, V]] = []
        if self.used + self.reserved <= self.capacity:
            return victims
        for key in self.policy.victims():
            if not self.evictable(key):
                continue
            victims.append((key, self._slots[key].value))
            self.pop(key)
            if self.used + self.reserved <= self.capacity:
                break
        return victims


def allocate_evicting(
    index: ResidentIndex[K, MemoryObj],
    allocator: PoolAllocator,
    shape: tuple[int, ...] | torch.Size,
    dtype: torch.dtype,
    fmt: MemoryFormat,
    drop: Callable[[K, MemoryObj], None],
) -> tuple[MemoryObj | None, int]:
    """A pool object (ref 1, caller owns it), evicting entries of ``index`` as needed.

    For an index whose entries are objects of ``allocator`` (``capacity=None``). The
    eviction is atomic by bytes: victims freeing enough pool bytes are picked first, or
    nothing is evicted and None returned. ``drop(key, obj)`` releases each victim
    (already out of the index). Should the freed bytes be fragmented across the pool's
    slabs, further entries are evicted one at a time until the object fits. Returns
    the object (or None) and the number of evicted entries. Call under the owner's lock.
    """
    obj = allocator.allocate(shape, dtype, fmt)
    if obj is not None:
        return obj, 0
    nbytes = int(torch.Size(shape).numel()) * torch.empty((), dtype=dtype).element_size()
    if not allocator.can_ever_fit(nbytes):
        return None, 0
    need = (max(nbytes, 1) + ALIGN - 1) // ALIGN * ALIGN
    victims = index.make_room(need - allocator.free_bytes)
    if victims is None:
        return None, 0
    for key, victim in victims:
        drop(key, victim)
    evicted = len(victims)
    obj = allocator.allocate(shape, dtype, fmt)
    while obj is None:  # enough bytes, but not contiguous in one slab
        one = index.evict_one()
        if one is None:
            break
        drop(*one)
        evicted += 1
        obj = allocator.allocate(shape, dtype, fmt)
    return obj, evicted
