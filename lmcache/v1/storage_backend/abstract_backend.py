"""The contract every storage tier implements, and :func:`resolved` (an already-completed
``Future``, for tiers that answer synchronously through the contract's asynchronous calls)."""

from __future__ import annotations

from abc import ABC, abstractmethod
from concurrent.futures import Future
from contextlib import AbstractContextManager, nullcontext
from dataclasses import dataclass
from typing import Callable, Protocol, Sequence, TypeVar

import torch

from lmcache.v1.keys import CacheEngineKey
from lmcache.v1.memory_management import MemoryFormat, MemoryObj
from lmcache.v1.tiers import Tier

T = TypeVar("T")


def resolved(value: T) -> Future[T]:
    """A ``Future`` that is already done with ``value``."""
    fut: Future[T] = Future()
    fut.set_result(value)
    return fut


class TierMemory(Protocol):
    """What a lower tier needs from the CPU pool: room for the objects it reads.

    The StorageManager owns the pool and hands each tier a :class:`PoolMemory`; a tier
    never imports or calls another tier. ``allocate`` returns an object with one
    reference owned by the caller, or None when the pool has no room even after
    eviction (the read becomes a miss). Any thread; never blocks on I/O.
    """

    @property
    def capacity(self) -> int: ...

    def allocate(self, shape: tuple[int, ...] | torch.Size, dtype: torch.dtype, fmt: MemoryFormat) -> MemoryObj | None: ...


@dataclass(frozen=True, slots=True)
class PoolMemory:
    """A :class:`TierMemory` given by the StorageManager: the pool's size and its
    allocate-or-evict function."""

    capacity: int
    allocate: Callable[[tuple[int, ...] | torch.Size, torch.dtype, MemoryFormat], MemoryObj | None]


class StorageBackend(ABC):
    """One storage tier below or at the CPU pool.

    Calling thread: any engine thread (scheduler lookups, worker stores/retrieves);
    implementations are thread-safe. ``contains``, ``submit_put``, ``remove`` and
    ``get_non_blocking`` never block on I/O beyond a bounded timeout; ``get_blocking``
    may wait for I/O.

    Ownership: ``submit_put`` does not take the caller's reference; a tier that keeps
    or writes the object asynchronously calls ``ref_count_up()`` itself and drops that
    reference when done. ``get_blocking`` and the future of ``get_non_blocking``
    return an object carrying one reference owned by the caller (or None on a miss).

    Failures (I/O errors, corrupt data, a server down) are misses, never exceptions.
    """

    name: str = "backend"
    """The tier's name, as LMCache 0.5.6 spells it (``LocalCPUBackend``, ``LocalDiskBackend``,
    ``RemoteBackend``): what ``search_range``/``location`` select and ``contains`` returns."""
    tier: Tier = Tier.OTHER
    """Tier label in stats, metrics and logs (``Tier.CPU``, ``Tier.DISK``, ``Tier.REMOTE``)."""
    listener: Callable[[str, Tier, list[CacheEngineKey]], None] | None = None
    """Optional ``listener(kind, tier, keys)`` told when entries become readable in this
    tier (``"stored"``: insert, completed write) or stop being (``"removed"``: eviction,
    removal, corrupt entry dropped); not on shutdown. Called on the thread that did it,
    possibly under the tier's lock: it must be quick and never call back into a tier.
    Set by the owner before use (vLLM KV events, :mod:`lmcache.integration.vllm.kv_events`)."""

    def _notify(self, kind: str, keys: list[CacheEngineKey]) -> None:
        listener = self.listener
        if listener is not None and keys:
            try:
                listener(kind, self.tier, keys)
            except Exception:  # noqa: BLE001 - an observer never breaks the cache
                pass

    @abstractmethod
    def contains(self, key: CacheEngineKey, pin: bool = False) -> bool:
        """Whether the key is present; ``pin`` keeps it from eviction until ``unpin``."""

    def batched_contains(self, keys: Sequence[CacheEngineKey], pin: bool = False) -> int:
        """Number of leading keys present (prefix semantics). Tiers may override to batch I/O."""
        n = 0
        for key in keys:
            if not self.contains(key, pin):
                break
            n += 1
        return n

    @abstractmethod
    def submit_put(self, key: CacheEngineKey, obj: MemoryObj) -> None:
        """Start storing ``obj`` under ``key``; may complete asynchronously."""

    def batched_submit_put(self, keys: Sequence[CacheEngineKey], objs: Sequence[MemoryObj]) -> None:
        """Submit the chunks of one sequence (``keys`` head first). Default: ``submit_put``
        from the last to the first, so the head is the most recent entry for every
        eviction policy (tail evicted before head). Tiers that book space may override
        to keep the head when not everything fits."""
        for key, obj in zip(reversed(keys), reversed(objs)):
            self.submit_put(key, obj)

    @abstractmethod
    def get_blocking(self, key: CacheEngineKey) -> MemoryObj | None:
        """The object (one reference for the caller) or None on a miss."""

    def get_non_blocking(self, key: CacheEngineKey) -> Future[MemoryObj | None]:
        """Future of :meth:`get_blocking`. Default: computed inline."""
        return resolved(self.get_blocking(key))

    @abstractmethod
    def remove(self, key: CacheEngineKey) -> bool:
        """Drop the key; True if it was present."""

    def unpin(self, key: CacheEngineKey) -> bool:
        """Undo one ``contains(pin=True)``; True if the key was present."""
        return False

    def flush(self, timeout: float | None = None) -> bool:
        """Wait until submitted puts are durable in this tier; True if all finished."""
        return True

    def waiting_writes(self, timeout: float, budget: int | None = None) -> AbstractContextManager[None]:
        """Inside the block, puts the calling thread submits wait (up to ``timeout`` s) for
        room instead of being dropped. Default: this tier never drops a put for lack of room."""
        return nullcontext()

    @abstractmethod
    def close(self) -> None:
        """Stop background work and release resources. Idempotent."""
