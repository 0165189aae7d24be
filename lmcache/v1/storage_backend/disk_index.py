"""The disk tier's in-memory index, its rebuild from the files, and temp-file ownership.

:class:`DiskIndex` is the disk tier's :class:`ResidentIndex` (keys to entries, bytes
counted against a capacity, victims picked through an :class:`EvictionPolicy`, all or
nothing); it does no I/O and is not thread-safe (the tier calls it under its lock). :func:`scan_directory` rebuilds the entries from file headers alone
(no payload reads). :class:`OwnerLock` marks which process owns which temp files, so
a restart removes only the temp files of writers that are gone, even when another
live process shares the directory.
"""

from __future__ import annotations

import fcntl
import logging
import os
import secrets
from dataclasses import dataclass, field

from lmcache.v1.keys import CacheEngineKey, parse_cache_key
from lmcache.v1.memory_management import MemoryObjMetadata
from lmcache.v1.storage_backend.cache_policy import EvictionPolicy
from lmcache.v1.storage_backend.disk_file import (
    ENTRY_NAME_LEN,
    ENTRY_SUFFIX,
    entry_file_name,
    read_header,
    remove_quiet,
    temp_file_owner,
)
from lmcache.v1.storage_backend.entry_format import CorruptEntryError
from lmcache.v1.storage_backend.resident_index import ResidentIndex

_O_NOFOLLOW = getattr(os, "O_NOFOLLOW", 0)
"""Entry files are never opened through a symlink (a planted link could point anywhere)."""

logger = logging.getLogger(__name__)

_LOCK_PREFIX = ".owner-"
_LOCK_SUFFIX = ".lock"


@dataclass(slots=True, eq=False)
class DiskEntry:
    """One indexed file. Compared by identity: a rewrite of a key is a new entry."""

    key: CacheEngineKey
    name: str
    meta: MemoryObjMetadata
    header_len: int
    size: int
    """Bytes on disk (header + payload)."""
    readers: int = 0
    """Reads in progress; like pins, they keep the entry from eviction."""


class DiskIndex(ResidentIndex[CacheEngineKey, DiskEntry]):
    """The disk tier's :class:`ResidentIndex`: key -> :class:`DiskEntry`, byte accounting
    against a capacity, entries being read are busy (never evicted).

    Two-phase writes: :meth:`reserve` makes room (evicting whole entries in policy
    order, skipping pinned and in-use ones; all or nothing) and books the bytes;
    :meth:`commit` turns the booking into an entry, :meth:`release` cancels it.
    Not thread-safe; no I/O: the caller deletes the files of returned victims.
    """

    def __init__(self, capacity: int, policy: EvictionPolicy) -> None:
        super().__init__(policy, capacity, busy=_being_read)

    def add(self, entry: DiskEntry, *, pins: int = 0) -> DiskEntry | None:
        """Index ``entry``; returns the entry it replaced (its file is the caller's to delete)."""
        return self.insert(entry.key, entry, entry.size, pins=pins)

    def entries(self) -> list[DiskEntry]:
        return self.values()


def _being_read(entry: DiskEntry) -> bool:
    return entry.readers > 0


# ---------------------------------------------------------------------- rebuild
@dataclass(slots=True)
class ScanResult:
    """What :func:`scan_directory` found."""

    entries: list[DiskEntry] = field(default_factory=list)
    """Valid entries, oldest (by modification time) first."""
    corrupt: int = 0
    """Entry files with a bad header, a wrong size or a name that is not their key's (deleted)."""
    temp_removed: int = 0
    """Temp files of writers that are gone (deleted)."""


def scan_directory(directory: str, *, own_token: str | None = None) -> ScanResult:
    """Rebuild the entries of ``directory`` from the file headers (no payload reads).

    Bad entry files are deleted and counted; temp files whose owner process is gone are
    deleted; files the tier did not write are left alone. Runs on the calling thread.
    """
    result = ScanResult()
    dated: list[tuple[int, DiskEntry]] = []
    temp_owners: dict[str, list[str]] = {}
    with os.scandir(directory) as it:
        for de in it:
            name = de.name
            if name.endswith(ENTRY_SUFFIX) and len(name) == ENTRY_NAME_LEN:
                try:
                    header, st = read_header(de.path)
                    if entry_file_name(header.key) != name:
                        raise CorruptEntryError(f"file holds key {header.key!r}, which has another file name")
                    key = parse_cache_key(header.key)
                except FileNotFoundError:
                    continue
                except (CorruptEntryError, ValueError, OSError) as exc:  # CorruptEntryError is a ValueError
                    logger.debug("disk tier: removing bad entry file %s: %s", de.path, exc)
                    result.corrupt += 1
                    remove_quiet(de.path)
                    continue
                entry = DiskEntry(key, name, header.meta, header.header_len, st.st_size)
                dated.append((st.st_mtime_ns, entry))
            elif name.startswith(_LOCK_PREFIX) and name.endswith(_LOCK_SUFFIX):
                owner = name[len(_LOCK_PREFIX) : -len(_LOCK_SUFFIX)]
                if owner != own_token:
                    temp_owners.setdefault(owner, [])
            else:
                owner = temp_file_owner(name)
                if owner is not None and owner != own_token:
                    temp_owners.setdefault(owner, []).append(name)
    for owner, names in temp_owners.items():
        if OwnerLock.is_alive(directory, owner):
            continue
        for name in names:
            if remove_quiet(os.path.join(directory, name)):
                result.temp_removed += 1
        remove_quiet(OwnerLock.path_for(directory, owner))
    dated.sort(key=lambda item: item[0])
    result.entries = [entry for _, entry in dated]
    return result


class OwnerLock:
    """An flock'ed file that says "the process holding this token is alive".

    Temp files carry their writer's token in their name. A scan deletes temp files
    only when it can take the token's lock (the kernel drops flock locks when a
    process dies, kill -9 included), so a restart never deletes the temp file of a
    live writer in another process.
    """

    def __init__(self, directory: str) -> None:
        self.token = f"{os.getpid():x}{secrets.token_hex(4)}"
        self.path = self.path_for(directory, self.token)
        self._fd: int | None = os.open(self.path, os.O_RDONLY | os.O_CREAT | os.O_CLOEXEC | _O_NOFOLLOW, 0o600)
        fcntl.flock(self._fd, fcntl.LOCK_EX | fcntl.LOCK_NB)

    @staticmethod
    def path_for(directory: str, token: str) -> str:
        return os.path.join(directory, f"{_LOCK_PREFIX}{token}{_LOCK_SUFFIX}")

    @classmethod
    def is_alive(cls, directory: str, token: str) -> bool:
        """Whether the owner of ``token`` still holds its lock."""
        try:
            fd = os.open(cls.path_for(directory, token), os.O_RDONLY | os.O_CLOEXEC | _O_NOFOLLOW)
        except OSError:
            return False
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            return True
        except OSError:
            return False
        finally:
            os.close(fd)
        return False

    def release(self) -> None:
        """Drop the lock and its file. Idempotent."""
        if self._fd is None:
            return
        remove_quiet(self.path)
        os.close(self._fd)
        self._fd = None
