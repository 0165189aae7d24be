"""StorageManager: one front door to the tiers (L1 CPU, L2 disk, L3 remote).

The manager owns the CPU pool (:class:`PoolAllocator`). L1 keeps its entries in it;
the lower tiers get a :class:`PoolMemory` (the pool's size and its allocate-or-evict
function) to read into, so no tier imports or calls another tier.

Writes go to L1 and are written through to the lower tiers asynchronously. Reads try
L1 first, then each lower tier in order; a lower-tier hit is promoted into L1 as its read
completes (one read per key in flight, shared by every reader of that key:
:mod:`~lmcache.v1.storage_backend.shared_reads`), and the hits of a sequence are then
recorded in one L1 visit, tail to head.
Allocation failure is not an error: the caller skips the store.
"""

from __future__ import annotations

import logging
import math
import threading
from concurrent.futures import Future
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass
from typing import Iterator, Sequence

import torch

from lmcache.v1.keys import CacheEngineKey, LayerCacheEngineKey
from lmcache.v1.config import LMCacheEngineConfig
from lmcache.v1.memory_management import GiB, MemoryFormat, MemoryObj, PoolAllocator, PoolReservation, pool_bytes
from lmcache.v1.request import TIER_NAMES, tier_names
from lmcache.v1.stats import CacheStats
from lmcache.v1.tiers import Tier
from lmcache.v1.storage_backend.abstract_backend import PoolMemory, StorageBackend, resolved
from lmcache.v1.storage_backend.cache_policy import make_policy
from lmcache.v1.storage_backend.local_cpu_backend import LocalCPUBackend
from lmcache.v1.storage_backend.shared_reads import SharedReads

logger = logging.getLogger(__name__)

STAGING_POOL_GIB = 1.0  # pool size when local_cpu is off (staging for lower tiers only)


@dataclass(frozen=True, slots=True)
class LookupResult:
    """What :meth:`StorageManager.batched_lookup` found."""

    hits: int
    """Leading chunks present (for every layer)."""
    pinned: tuple[CacheEngineKey, ...] = ()
    """L1 keys this lookup pinned (undo with :meth:`StorageManager.batched_unpin`)."""


def split_per_layer(keys: Sequence[CacheEngineKey], num_layers: int) -> list[list[LayerCacheEngineKey]]:
    """``result[layer][chunk]``: the layer keys of chunk keys ``keys``."""
    per_chunk = [k.split_layers(num_layers) for k in keys]
    return [[chunk[layer] for chunk in per_chunk] for layer in range(num_layers)]


class StorageManager:
    """Routes puts, gets and lookups across the configured tiers.

    Thread-safe. Ownership: :meth:`allocate` and the ``get`` family return objects with
    one reference owned by the caller; :meth:`batched_put` does not consume the
    caller's references (tiers take their own).
    """

    def __init__(
        self,
        config: LMCacheEngineConfig,
        *,
        namespace: str = "kv",
        stats: CacheStats | None = None,
        lower_backends: Sequence[StorageBackend] | None = None,
        pool_bytes: int | None = None,
    ) -> None:
        self.config = config
        self.stats = stats if stats is not None else CacheStats()
        size_gib = config.max_local_cpu_size if config.max_local_cpu_size > 0 else STAGING_POOL_GIB
        self.allocator = PoolAllocator(pool_bytes if pool_bytes is not None else int(size_gib * GiB))
        self.local_cpu = LocalCPUBackend(
            self.allocator,
            make_policy(config.cache_policy),
            retain=config.local_cpu,
            on_evict=lambda n: self.stats.add(evictions=n),
        )
        self.memory = PoolMemory(self.allocator.capacity, self.local_cpu.allocate)
        """What the lower tiers allocate their reads from (this manager's pool)."""
        if lower_backends is None:
            from lmcache.v1.storage_backend import create_lower_backends

            lower_backends = create_lower_backends(config, self.memory, namespace=namespace)
        self.lower: list[StorageBackend] = list(lower_backends)
        self._reads: SharedReads[CacheEngineKey] = SharedReads(
            self._start_lower_read, self._promote, on_join=lambda: self.stats.add(shared_reads=1)
        )
        """Lower-tier reads in flight, one per key (a second reader joins the first)."""
        self._closed = False

    @property
    def closed(self) -> bool:
        """Whether :meth:`close` was called."""
        return self._closed

    @property
    def backends(self) -> list[StorageBackend]:
        """All tiers, L1 first."""
        return [self.local_cpu, *self.lower]

    @property
    def tier_names(self) -> tuple[str, ...]:
        """The names ``search_range``/``location``/``locations`` accept: LMCache's
        (:data:`~lmcache.v1.request.TIER_NAMES`) and any other configured tier's."""
        extra = tuple(b.name for b in self.lower if b.name not in TIER_NAMES)
        return TIER_NAMES + extra

    def select(self, names: object, field: str = "search_range") -> list[StorageBackend]:
        """The configured tiers among ``names`` (validated by :func:`~lmcache.v1.request.tier_names`;
        None or empty: every tier), L1 first."""
        if names is None:
            return self.backends
        chosen = tier_names(names, field, self.tier_names)
        if chosen is None:
            return self.backends
        return [b for b in self.backends if b.name in chosen]

    def _location(self, location: object) -> StorageBackend | None:
        """The one tier LMCache's ``location`` names (None: it is not configured here)."""
        if isinstance(location, (list, tuple, set, frozenset)):
            raise TypeError(f"location={location!r}: expected one backend name ({', '.join(self.tier_names)})")
        found = self.select(location, "location")
        return found[0] if found else None

    # ------------------------------------------------------------------ allocation
    def allocate(
        self,
        shapes: tuple[int, ...] | torch.Size,
        dtypes: torch.dtype,
        fmt: MemoryFormat = MemoryFormat.KV_2LTD,
        eviction: bool = True,
        busy_loop: bool = True,
    ) -> MemoryObj | None:
        """A pool object of shape ``shapes`` and dtype ``dtypes`` (ref 1, caller owns it),
        evicting from L1 as needed (``eviction=False``: from free pool memory only);
        None if full. LMCache 0.5.6's signature: one shape and one dtype (its list form
        for several layer groups is not supported); ``busy_loop`` is accepted and has no
        effect (a full pool is never waited on: the caller skips the store)."""
        if isinstance(dtypes, list) or (isinstance(shapes, list) and shapes and not isinstance(shapes[0], int)):
            raise TypeError("shapes/dtypes: expected one shape and one dtype (lists of them are not supported)")
        if not eviction:
            return self.allocator.allocate(shapes, dtypes, fmt)
        return self.local_cpu.allocate(shapes, dtypes, fmt)

    def reserve(
        self, shape: tuple[int, ...] | torch.Size, dtype: torch.dtype, fmt: MemoryFormat, count: int
    ) -> PoolReservation | None:
        """Pool bytes for ``count`` same-shape objects, created later one by one
        (:class:`~lmcache.v1.memory_management.PoolReservation`), evicting from L1 as
        needed; None if the pool has no contiguous room for them (use :meth:`allocate`)."""
        return self.local_cpu.reserve(shape, dtype, fmt, count)

    def allocate_many(
        self, shape: tuple[int, ...] | torch.Size, dtype: torch.dtype, fmt: MemoryFormat, count: int
    ) -> list[MemoryObj]:
        """Up to ``count`` pool objects of one shape (ref 1 each, the caller owns them),
        evicting from L1 as needed: one contiguous reservation per slab-full when the pool
        has the room (objects made without a tensor op), else one by one. Fewer than
        ``count`` (a prefix of the request) when the pool is full."""
        objs: list[MemoryObj] = []
        per = max(1, self.max_reservation_bytes // pool_bytes(math.prod(int(d) for d in shape) * dtype.itemsize))
        contiguous = True
        while len(objs) < count:
            n = min(per, count - len(objs))
            if contiguous and n > 1:
                res = self.reserve(shape, dtype, fmt, n)
                if res is not None:
                    objs += res.take_many(range(n))
                    res.release()  # every slot is taken: marks the reservation done
                    continue
                contiguous = False  # no such block: one by one from here (no retries)
            obj = self.allocate(shape, dtype, fmt)
            if obj is None:
                break
            objs.append(obj)
        return objs

    @property
    def max_reservation_bytes(self) -> int:
        """The most bytes one :meth:`reserve` can ever book (one slab of the L1 pool)."""
        return self.local_cpu.allocator.slab_bytes

    def suspect_remote(self, reason: str) -> None:
        """Open the remote tier's breaker (see ``RemoteBackend.suspect``); no-op without one."""
        for backend in self.lower:
            suspect = getattr(backend, "suspect", None)
            if backend.tier == Tier.REMOTE and suspect is not None:
                suspect(reason)

    def resident_flags(self, keys: Sequence[CacheEngineKey]) -> list[bool]:
        """For each key, whether L1 holds it (one in-memory probe under one lock; never I/O)."""
        return self.local_cpu.resident_flags(keys)

    # ------------------------------------------------------------------ writes
    def batched_put(
        self,
        keys: Sequence[CacheEngineKey],
        memory_objs: Sequence[MemoryObj],
        transfer_spec: object = None,
        location: str | None = None,
        *,
        give: bool = False,
    ) -> None:
        """Store objects in L1 and submit them to the lower tiers.

        Each tier gets the whole sequence (``batched_submit_put``, keys head first) and
        hands the keys to its policy from the last to the first, so that the head of a
        sequence is the most recent entry for every eviction policy (tail evicted
        before head). Each tier takes its own references; the caller keeps its own.

        ``give=True`` hands the caller's reference of each (distinct) object to L1
        instead (:meth:`LocalCPUBackend.admit_sequence`): the caller must not use or
        release the objects after the call. The lower tiers take theirs first, so L1
        evicting an object at once cannot free it under them.

        LMCache 0.5.6's keywords: ``location`` puts into that one tier only (a tier name,
        see :attr:`tier_names`; one that is not configured stores nothing);
        ``transfer_spec`` (its disaggregated-prefill target) is accepted and ignored.
        """
        objs = memory_objs
        assert len(keys) == len(objs)
        if location is not None:
            self._put_at(location, keys, objs, give)
            return
        if not give:
            for backend in self.backends:
                backend.batched_submit_put(keys, objs)
            return
        for backend in self.lower:
            backend.batched_submit_put(keys, objs)
        self.local_cpu.admit_sequence(keys, objs, give=True)

    def _put_at(self, location: str, keys: Sequence[CacheEngineKey], objs: Sequence[MemoryObj], give: bool) -> None:
        """:meth:`batched_put` into the one tier ``location`` names."""
        target = self._location(location)
        if target is not None:
            target.batched_submit_put(keys, objs)
        if give:  # the tier took its own references; drop the caller's (once per object)
            for obj in {id(o): o for o in objs}.values():
                obj.ref_count_down()

    def put(self, key: CacheEngineKey, memory_obj: MemoryObj, location: str | None = None) -> None:
        """:meth:`batched_put` of one object (the caller keeps its reference)."""
        self.batched_put([key], [memory_obj], location=location)

    # ------------------------------------------------------------------ reads
    def get(self, key: CacheEngineKey, location: str | None = None) -> MemoryObj | None:
        """The object (caller owns one reference) or None; lower-tier hits are promoted.
        ``location`` (LMCache's keyword, a tier name) reads that tier only."""
        if location is not None:
            return self._read_at(self._location(location), [key])[0]
        obj = self.local_cpu.get_blocking(key)
        if obj is not None:
            return obj
        for backend in self.lower:
            obj = backend.get_blocking(key)
            if obj is not None:
                self.local_cpu.admit_sequence([key], [obj])
                return obj
        return None

    def batched_get(
        self, keys: Sequence[CacheEngineKey], location: str | None = None, *, sources: list[Tier] | None = None
    ) -> list[MemoryObj | None]:
        """Objects for a prefix of ``keys``; entries after the first miss are None.

        The L1 prefix is read inline (one lock hold); the rest is read from the lower
        tiers in parallel (their reader threads), not one blocking read after another.
        Lower-tier hits are promoted into L1 as their reads complete (a read of the same
        key already in flight is joined, not repeated); L1 then sees the whole result once,
        touched from the tail to the head so the head stays most recent. If
        ``sources`` is given, the tier (``StorageBackend.tier``, a :class:`Tier`) of each
        returned object is appended to it, in order. ``location`` (LMCache's keyword, a
        tier name) reads that one tier only. (:meth:`iter_prefix`, read to its end.)
        """
        if location is not None:
            return self._read_at(self._location(location), keys, sources)
        out: list[MemoryObj | None] = [obj for batch in self.iter_prefix(keys, sources=sources) for obj in batch]
        return out + [None] * (len(keys) - len(out))

    def iter_prefix(
        self, keys: Sequence[CacheEngineKey], *, sources: list[Tier] | None = None
    ) -> Iterator[list[MemoryObj]]:
        """The reads of :meth:`batched_get` as they land: yields the objects of the prefix of ``keys``
        in order, in batches (the L1 prefix first, then each lower-tier read with those after it
        that have landed too), one reference each for the caller, and stops at the first miss.
        The lower tiers are read in parallel as in :meth:`batched_get`; a batch is yielded as
        soon as its first read ends, so the caller can use it while the rest are read.
        Closing the iterator early releases the objects of reads it did not yield when those
        reads end; either way L1 sees the yielded prefix once at the end, as in :meth:`batched_get`,
        so the caller holds the yielded objects at least until the iterator is exhausted or closed.
        ``sources``, if given, receives the tier of each yielded object (in order) before it is yielded."""
        got: list[MemoryObj] = list(self.local_cpu.get_prefix(keys))
        n_l1 = len(got)
        holders: list[list[Tier]] = [[] for _ in keys[n_l1:]]
        futures = [self._read_lower(k, h) for k, h in zip(keys[n_l1:], holders)]
        taken, missed = 0, False
        try:
            if got:
                if sources is not None:
                    sources.extend(self.local_cpu.tier for _ in got)
                yield list(got)
            while taken < len(futures) and not missed:
                batch: list[MemoryObj] = []
                while taken < len(futures) and (not batch or futures[taken].done()):
                    obj = _result_or_none(futures[taken])
                    taken += 1
                    if obj is None:  # a miss ends the prefix
                        missed = True
                        break
                    batch.append(obj)
                if batch:
                    if sources is not None:
                        at = len(got) - n_l1
                        sources.extend(h[0] if h else Tier.UNKNOWN for h in holders[at : at + len(batch)])
                    got += batch
                    yield batch
        finally:
            for f in futures[taken:]:
                f.add_done_callback(_release_result)
            self.local_cpu.admit_sequence(keys[: len(got)], got)

    def get_non_blocking(self, key: CacheEngineKey, location: str | None = None) -> Future[MemoryObj | None]:
        """Future of :meth:`get`. Lower tiers are asked in order with their own
        non-blocking read (a miss is the read's answer: no separate existence round
        trip); a hit is promoted into L1. With ``location`` (a tier name) the one tier
        is read before returning (a resolved future)."""
        if location is not None:
            return resolved(self.get(key, location))
        return self._get_non_blocking(key, None)

    def _read_at(
        self, backend: StorageBackend | None, keys: Sequence[CacheEngineKey], sources: list[Tier] | None = None
    ) -> list[MemoryObj | None]:
        """Objects of a prefix of ``keys`` from ``backend`` only (None from the first miss
        on; None backend: all misses), one reference each for the caller; lower-tier hits
        are promoted into L1 and every hit is touched there, tail to head. ``sources``
        receives the tier of each hit."""
        hits: list[MemoryObj] = []
        if backend is self.local_cpu:
            hits = self.local_cpu.get_prefix(keys, touch=True)
        elif backend is not None:
            got = _gather_prefix([backend.get_non_blocking(k) for k in keys]).result()
            hits = [o for o in got if o is not None]
            self.local_cpu.admit_sequence(keys[: len(hits)], hits)
        if sources is not None and backend is not None:
            sources.extend(backend.tier for _ in hits)
        return [*hits, *([None] * (len(keys) - len(hits)))]

    def _get_non_blocking(self, key: CacheEngineKey, source: list[Tier] | None) -> Future[MemoryObj | None]:
        """:meth:`get_non_blocking`; a hit appends its tier name to ``source``."""
        obj = self.local_cpu.get_blocking(key)
        if obj is not None:
            if source is not None:
                source.append(self.local_cpu.tier)
            return resolved(obj)
        return self._reads.read(key, source)

    def _read_lower(self, key: CacheEngineKey, source: list[Tier] | None = None) -> Future[MemoryObj | None]:
        """Future of ``key``'s entry from the lower tiers (None if none), joined to a read of
        the same key in flight; promoted into L1 before it resolves. A hit appends its tier
        name to ``source``."""
        return self._reads.read(key, source)

    def _start_lower_read(self, key: CacheEngineKey, tiers: list[Tier]) -> Future[MemoryObj | None]:
        """A new read of ``key`` (:class:`SharedReads`): L1 first (a read of the same key that
        just settled promoted it there), then each lower tier in order."""
        obj = self.local_cpu.get_blocking(key)
        if obj is not None:
            tiers.append(self.local_cpu.tier)
            return resolved(obj)
        out: Future[MemoryObj | None] = Future()
        self._read_from(key, 0, out, tiers)
        return out

    def _promote(self, key: CacheEngineKey, obj: MemoryObj) -> None:
        """A lower-tier hit into L1 (its own reference), before the read leaves the in-flight table."""
        self.local_cpu.admit_sequence([key], [obj])

    def _read_from(self, key: CacheEngineKey, tier: int, out: Future, source: list[Tier]) -> None:
        """Resolve ``out`` with the first hit among ``self.lower[tier:]`` (None if none)."""
        if tier == len(self.lower):
            out.set_result(None)
            return

        def _done_reading(fut: Future) -> None:
            obj = None if fut.cancelled() or fut.exception() is not None else fut.result()
            if obj is None:
                self._read_from(key, tier + 1, out, source)
                return
            source.append(self.lower[tier].tier)
            out.set_result(obj)

        self.lower[tier].get_non_blocking(key).add_done_callback(_done_reading)

    def layerwise_batched_get(
        self,
        keys: Sequence[Sequence[CacheEngineKey]],
        location: str | None = None,
        *,
        sources: list[list[Tier]] | None = None,
    ) -> Iterator[Future]:
        """Yield one Future per layer of ``keys`` (``keys[layer][chunk]``); its result is the
        list of that layer's objects.

        Each list holds objects (one reference each, owned by the caller) for a prefix of
        the layer's keys and None from the first miss on. Layer ``i+1``'s reads are
        started only when the consumer asks for the next future, so layer ``i`` is
        available as early as possible. ``sources`` (optional) receives one list per key
        of the first layer; once that layer's future is done, a hit's list holds its
        tier name. ``location`` (LMCache's keyword, a tier name) reads each layer from
        that one tier, when its future is asked for.
        """
        if location is not None:
            backend = self._location(location)
            for layer, layer_keys in enumerate(keys):
                found: list[Tier] = []
                objs = self._read_at(backend, layer_keys, found)
                if sources is not None and layer == 0:
                    sources.extend([tier] for tier in found)
                    sources.extend([] for _ in range(len(layer_keys) - len(found)))
                yield resolved(objs)
            return
        for layer, layer_keys in enumerate(keys):
            yield self.layer_batched_get(layer_keys, sources=sources if layer == 0 else None)

    def layer_batched_get(
        self,
        keys: Sequence[CacheEngineKey],
        *,
        held: list[MemoryObj] | None = None,
        sources: list[list[Tier]] | None = None,
        touch: bool = True,
    ) -> Future:
        """One layer of :meth:`layerwise_batched_get`: a Future of the objects of a prefix
        of ``keys`` (None from the first miss on; one reference each, caller owns them).

        L1 hits are read inline (one lock hold, no per-key future); the rest go to the
        lower tiers' non-blocking reads (hits promoted into L1). ``held``: the leading
        L1 objects of ``keys`` the caller already took (:meth:`hold_layers`); their
        references move into the result and only the keys after them are read.
        ``sources``: as in :meth:`layerwise_batched_get`. ``touch=False`` leaves the L1
        recency of the hits alone (the caller records it, e.g. :meth:`batched_touch`).
        """
        resident = held if held is not None else self.local_cpu.get_prefix(keys, touch=touch)
        if sources is not None:
            sources.extend([self.local_cpu.tier] for _ in resident)
        if len(resident) >= len(keys):
            return resolved(resident)
        holders: list[list[Tier]] = [[] for _ in keys[len(resident) :]]
        if sources is not None:
            sources.extend(holders)
        futures = [resolved(o) for o in resident] + [
            self._get_non_blocking(k, h) for k, h in zip(keys[len(resident) :], holders)
        ]
        return _gather_prefix(futures)

    # ------------------------------------------------------------------ lookups
    def contains(self, key: CacheEngineKey, search_range: object = None, pin: bool = False) -> str | None:
        """The name of the first tier (L1 first) that holds ``key``, else None (LMCache
        0.5.6's meaning). ``search_range``: the tier names to ask (see :attr:`tier_names`;
        None: all); ``pin`` pins an L1 hit until :meth:`unpin`."""
        for backend in self.select(search_range):
            if backend.contains(key, pin and backend is self.local_cpu):
                return backend.name
        return None

    def batched_contains(
        self,
        keys: Sequence[CacheEngineKey],
        search_range: object = None,
        pin: bool = False,
        *,
        num_layers: int | None = None,
    ) -> int:
        """Number of leading keys present in some tier (pinning the L1 ones if asked).

        ``search_range``: the tier names to ask (None: all). With ``num_layers`` the keys
        are chunk keys of a layerwise engine: a chunk counts only when all its
        ``num_layers`` layer keys are present (see :meth:`batched_lookup`). One batched
        call per tier and layer, never one per key. (LMCache 0.5.6 returns the count
        with a tier -> keys mapping; this returns the count.)
        """
        per_layer = [keys] if num_layers is None else split_per_layer(keys, num_layers)
        return self.batched_lookup(per_layer, pin, search_range=search_range).hits

    def batched_lookup(
        self, keys_per_layer: Sequence[Sequence[CacheEngineKey]], pin: bool = False, *, search_range: object = None
    ) -> LookupResult:
        """The leading chunks present for every layer (``keys_per_layer[layer][chunk]``;
        one inner list for a bulk engine), pinning the L1 entries found if asked.

        Per layer, L1 answers first (in memory) and only the rest goes to the lower
        tiers, as one batched call each; a layer only asks about the chunks the layers
        before it had. The pinned keys are returned for :meth:`batched_unpin`.
        ``search_range`` limits the tiers asked (tier names; None: all).
        """
        tiers = self.backends if search_range is None else self.select(search_range)
        found = len(keys_per_layer[0]) if keys_per_layer else 0
        pinned: list[CacheEngineKey] = []
        for layer in range(len(keys_per_layer)):
            if not found:
                break
            candidates = keys_per_layer[layer][:found]  # a layer's keys are only made when asked for
            hit = 0
            for backend in tiers:
                if hit == found:
                    break
                if backend is self.local_cpu:
                    hit = self.local_cpu.batched_contains(candidates, pin)
                    if pin:
                        pinned.extend(candidates[:hit])
                else:
                    hit += backend.batched_contains(candidates[hit:])
            found = hit
        return LookupResult(found, tuple(pinned))

    def batched_unpin(
        self, keys: Sequence[CacheEngineKey], locations: object = None, *, num_layers: int | None = None
    ) -> None:
        """Undo one pin of each of ``keys`` (with ``num_layers``: of every layer key of each
        chunk). Only L1 pins; ``locations`` (tier names) without L1 unpins nothing."""
        if self.local_cpu not in self.select(locations, "locations"):
            return
        if num_layers is not None:
            keys = [k for layer_list in split_per_layer(keys, num_layers) for k in layer_list]
        self.local_cpu.batched_unpin(keys)

    def batched_touch(self, keys: Sequence[CacheEngineKey]) -> None:
        """Record L1 hits for ``keys`` (head first) from the last to the first, in one
        visit, so the head stays the most recent entry (tail evicted before head)."""
        self.local_cpu.touch_sequence(keys)

    def hold_layers(self, keys_per_layer: Sequence[Sequence[CacheEngineKey]]) -> tuple[int, list[list[MemoryObj]]]:
        """For a layerwise retrieve: take the L1 objects of every layer's leading keys and
        count the leading chunks present for every layer.

        Returns ``(hits, held)``: ``held[layer]`` are the layer's leading L1 objects
        (one reference each, owned by the caller; held objects cannot be evicted, like
        pinned ones) and ``hits`` the number of leading chunks present for every layer
        in some tier (L1 first; the rest as one batched existence check per lower tier
        and layer). Pass ``held`` to :meth:`layerwise_batched_get`. L1 recency is not
        changed. Non-blocking apart from lower-tier existence checks.
        """
        held = [self.local_cpu.get_prefix(keys) for keys in keys_per_layer]
        hits = min((len(keys) for keys in keys_per_layer), default=0)
        for keys, objs in zip(keys_per_layer, held):
            n = len(objs)
            for backend in self.lower:
                if n >= hits:
                    break
                n += backend.batched_contains(keys[n:hits])
            hits = min(hits, n)
        return hits, held

    def is_resident(self, key: CacheEngineKey) -> bool:
        """Whether L1 holds the key (in-memory check, never I/O)."""
        return self.local_cpu.contains(key)

    def unpin(self, key: CacheEngineKey) -> bool:
        return self.local_cpu.unpin(key)

    def remove(self, key: CacheEngineKey, locations: object = None) -> bool:
        """Remove from every tier (``locations``: from the named tiers only); True if any had it."""
        return any([b.remove(key) for b in self.select(locations, "locations")])

    def flush(self, timeout: float | None = None) -> bool:
        """Wait for the lower tiers' pending writes; True if all finished."""
        return all([b.flush(timeout) for b in self.lower])

    @contextmanager
    def waiting_writes(self, timeout: float, budget: int | None = None) -> Iterator[None]:
        """Inside the block, the calling thread's writes to the lower tiers wait for room
        (up to ``timeout`` s) instead of being dropped when a tier's write budget is full
        (:meth:`StorageBackend.waiting_writes`). For writes a peer is waiting for."""
        with ExitStack() as stack:
            for backend in self.lower:
                stack.enter_context(backend.waiting_writes(timeout, budget))
            yield

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        for backend in reversed(self.backends):
            backend.close()


def _result_or_none(fut: Future) -> MemoryObj | None:
    """A read's object, blocking until it ends; None for a miss, a failed or a cancelled read."""
    try:
        return fut.result()
    except Exception:  # noqa: BLE001 - a failed read is a miss (the tier logged it)
        return None


def _release_result(fut: Future) -> None:
    """Done-callback: drop the reference of a read nobody takes."""
    if fut.cancelled() or fut.exception() is not None:
        return
    obj = fut.result()
    if obj is not None:
        obj.ref_count_down()


def _gather_prefix(futures: list[Future]) -> Future:
    """A future of the list of results, cut to a prefix at the first miss."""
    out: Future = Future()
    if not futures:
        out.set_result([])
        return out
    remaining = [len(futures)]
    lock = threading.Lock()

    def _one_done(_: Future) -> None:
        with lock:
            remaining[0] -= 1
            if remaining[0]:
                return
        results: list[MemoryObj | None] = []
        missed = False
        for f in futures:
            obj = None if f.cancelled() or f.exception() is not None else f.result()
            if missed and obj is not None:
                obj.ref_count_down()
                obj = None
            missed = missed or obj is None
            results.append(obj)
        out.set_result(results)

    for f in futures:
        f.add_done_callback(_one_done)
    return out
