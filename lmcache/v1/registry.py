"""A small process-wide registry: named instances created on first use, optionally shared.

Used by :class:`~lmcache.v1.cache_engine.LMCacheEngineBuilder` (KV engines by instance
id) and by the vLLM EC adapter (encoder-cache engines by config, shared by counted
users). Thread-safe: every method takes the registry's lock; ``create`` and ``reuse``
callbacks run under it, so two threads asking for one name get one instance.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Hashable
from typing import Generic, TypeVar

K = TypeVar("K", bound=Hashable)
V = TypeVar("V")


class _Entry(Generic[V]):
    __slots__ = ("value", "users")

    def __init__(self, value: V) -> None:
        self.value = value
        self.users = 0


class Registry(Generic[K, V]):
    """Instances by key. The registry never closes anything; callers close what they remove."""

    def __init__(self) -> None:
        self._entries: dict[K, _Entry[V]] = {}
        self._lock = threading.Lock()

    def get(self, key: K) -> V | None:
        with self._lock:
            entry = self._entries.get(key)
            return entry.value if entry is not None else None

    def get_or_create(
        self,
        key: K,
        create: Callable[[], V],
        *,
        reuse: Callable[[V], None] | None = None,
        acquire: bool = False,
    ) -> V:
        """The instance registered as ``key``, made by ``create()`` on first use.

        ``reuse(existing)`` runs when the key is already registered (it may raise to
        refuse, e.g. on a config mismatch; nothing changes then). ``acquire`` counts
        one user, to be matched by :meth:`release`.
        """
        with self._lock:
            entry = self._entries.get(key)
            if entry is None:
                entry = _Entry(create())
                self._entries[key] = entry
            elif reuse is not None:
                reuse(entry.value)
            if acquire:
                entry.users += 1
            return entry.value

    def release(self, value: V) -> bool:
        """Drop one user of ``value``; True when that was the last (it is unregistered; the caller closes it).

        Unknown values return False.
        """
        with self._lock:
            for key, entry in self._entries.items():
                if entry.value is value:
                    entry.users -= 1
                    if entry.users > 0:
                        return False
                    del self._entries[key]
                    return True
            return False

    def pop(self, key: K) -> V | None:
        """Unregister ``key`` whatever its users; its instance (the caller closes it) or None."""
        with self._lock:
            entry = self._entries.pop(key, None)
            return entry.value if entry is not None else None

    def values(self) -> list[V]:
        with self._lock:
            return [e.value for e in self._entries.values()]

    def clear(self) -> list[V]:
        """Unregister everything; the instances (the caller closes them)."""
        with self._lock:
            values = [e.value for e in self._entries.values()]
            self._entries.clear()
            return values
