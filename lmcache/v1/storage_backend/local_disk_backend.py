"""L2: the local disk tier. Persistent, crash-safe, verified, asynchronous.

Layout: ``<local_disk>/<namespace>/`` (mode 0700) holds one file per entry (mode
0600), named ``<xxh3-128 of the key string>.lmc``, in the shared entry format with a
page-aligned payload (:mod:`lmcache.v1.storage_backend.disk_file`). A write goes to a
temp file, is fdatasync'ed and renamed into place, so a visible file is always
complete; the directory is fsync'ed in groups (always before :meth:`flush` returns).
A read checks size, header, full key and payload checksum; any failure is a miss,
the bad file is deleted and counted. A restart rebuilds the index from file headers
alone (:mod:`lmcache.v1.storage_backend.disk_index`).

This module is the tier contract (:class:`LocalDiskBackend`: lookups, pins, reads,
removal, flush/close) plus start-up (directory checks, index rebuild, the O_DIRECT
probe). The write half (booking, the write queue, writer threads, directory fsyncs,
disk-full handling) is :mod:`lmcache.v1.storage_backend.disk_writer`.

Threads: ``submit_put`` reserves the entry's space (evicting in policy order, all or
nothing; a writer unlinks the evicted files before its next write) and queues the write
(bounded; a full queue drops the write and counts it); ``write_threads`` workers do the
I/O. Because space is booked when a write is submitted, ``contains`` never promises an
entry that a queued write will evict when it lands: the indexed entries and the queued
ones fit the capacity together, and a queued entry is served from its memory object
until its file exists. ``get_non_blocking`` runs reads on ``read_threads`` reader
threads. Runtime failures never raise into the engine: a full filesystem (ENOSPC and
the like) lowers the tier's effective capacity to what the filesystem gives, evicts its
own entries to fit and keeps caching (the capacity grows back, up to
``max_local_disk_size``, when space frees up); a permission error or a removed
directory disables the tier. Each is logged once.

Options (``extra_config``): :class:`~lmcache.v1.storage_backend.disk_options.DiskTierOptions`
(keys, types, defaults and bounds in its fields; tabled in docs/configuration.md);
counters: :class:`~lmcache.v1.storage_backend.disk_stats.DiskTierStats`. Both are
defined in their own modules, which the writer imports too, and re-exported here.
"""

from __future__ import annotations

import errno
import logging
import os
import re
import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any, Sequence

from lmcache.log_once import LogOnce
from lmcache.v1.keys import CacheEngineKey
from lmcache.v1.config import ConfigError, LMCacheEngineConfig
from lmcache.v1.memory_management import GiB, MemoryObj
from lmcache.v1.private_files import UnsafePathError, check_parent_dir, ensure_private_dir, open_private_dir
from lmcache.v1.storage_backend.abstract_backend import StorageBackend, TierMemory, resolved
from lmcache.v1.storage_backend.cache_policy import make_policy
from lmcache.v1.storage_backend.disk_file import (
    entry_file_name,
    o_direct_supported,
    read_entry,
    read_header,
)
from lmcache.v1.storage_backend.disk_index import DiskEntry, DiskIndex, OwnerLock, scan_directory
from lmcache.v1.storage_backend.disk_options import (
    EXTRA_CLOSE_TIMEOUT as EXTRA_CLOSE_TIMEOUT,
    EXTRA_O_DIRECT as EXTRA_O_DIRECT,
    EXTRA_QUEUE_DEPTH as EXTRA_QUEUE_DEPTH,
    EXTRA_READ_THREADS as EXTRA_READ_THREADS,
    EXTRA_WRITE_THREADS as EXTRA_WRITE_THREADS,
    DiskTierOptions,
)
from lmcache.v1.storage_backend.disk_stats import DiskTierStats
from lmcache.v1.storage_backend.disk_writer import DiskWriter
from lmcache.v1.storage_backend.entry_format import CorruptEntryError, EntryHeader
from lmcache.v1.tiers import Tier

logger = logging.getLogger(__name__)

_NAMESPACE_RE = re.compile(r"[A-Za-z0-9_-]+")


class LocalDiskBackend(StorageBackend):
    """Entries on a local filesystem, surviving restarts, verified on every read.

    Calling threads: any. ``contains``, ``submit_put``, ``remove``, ``unpin`` and
    ``get_non_blocking`` do no data I/O (a removal unlinks a file);
    ``get_blocking`` reads on the calling thread; ``flush`` and ``close`` wait for
    the writers.

    Memory: ``submit_put`` takes its own reference to the object until the write is
    done (so the caller may drop its own at once); a read allocates from
    ``memory`` (the CPU pool, given by the StorageManager) and returns an object with one reference owned by
    the caller. Puts still in the queue are served from their memory object.

    Writes: one :class:`~lmcache.v1.storage_backend.disk_writer.DiskWriter`, created and
    closed by the tier, shares its lock and index (its ``pending`` queued puts are read here).
    """

    tier = Tier.DISK

    name = "LocalDiskBackend"

    def __init__(self, config: LMCacheEngineConfig, memory: TierMemory, namespace: str = "kv") -> None:
        if not _NAMESPACE_RE.fullmatch(namespace):
            raise ValueError(f"namespace={namespace!r}: expected letters, digits, '_' or '-'")
        self.options = DiskTierOptions.from_config(config)
        self.directory = os.path.join(self.options.root, namespace)
        self.memory = memory
        self.stats = DiskTierStats()
        _prepare_directory(self.options.root, self.directory, config.local_disk)
        self._lock = threading.Lock()
        self._index = DiskIndex(self.options.capacity_bytes, make_policy(self.options.cache_policy))
        self._disabled: str | None = None
        self._closed = False
        self._logged = LogOnce(logger)
        try:
            self._owner = OwnerLock(self.directory)
            dir_fd = open_private_dir(self.directory, create=False, what="disk cache directory")
            self._load_index()
        except OSError as exc:
            raise ConfigError(
                f"local_disk={config.local_disk!r}: cannot use {self.directory} ({exc.strerror}); "
                "expected a readable and writable directory"
            ) from None
        self._check_free_space()
        self._o_direct = self.options.o_direct and self._probe_o_direct()
        self._writer = DiskWriter(self, dir_fd)  # starts the writer threads; owns dir_fd from here
        self._readers = ThreadPoolExecutor(self.options.read_threads, thread_name_prefix="lmcache-disk-read")

    # ------------------------------------------------------------------ start-up
    def _load_index(self) -> None:
        t0 = time.perf_counter()
        scan = scan_directory(self.directory, own_token=self._owner.token)
        for entry in scan.entries:
            self._index.add(entry)
        victims = [entry for _, entry in self._index.shrink_to_capacity()]
        for entry in victims:
            self._unlink(entry.name)
        self.stats.add(
            indexed_at_start=len(scan.entries),
            temp_files_removed=scan.temp_removed,
            corrupt_entries=scan.corrupt,
            evictions=len(victims),
        )
        logger.info(
            "lmcache disk tier %s: %d entries (%.2f GiB) indexed in %.3f s; %d over the size limit evicted, "
            "%d bad files and %d stale temp files removed",
            self.directory,
            len(self._index),
            self._index.used / GiB,
            time.perf_counter() - t0,
            len(victims),
            scan.corrupt,
            scan.temp_removed,
        )

    def _check_free_space(self) -> None:
        try:
            st = os.statvfs(self.directory)
        except OSError:
            return
        room = self._index.used + st.f_bavail * st.f_frsize
        if room < self._index.capacity:
            logger.warning(
                "lmcache disk tier %s: max_local_disk_size is %.2f GiB but only %.2f GiB can be used on this "
                "filesystem; writes will be skipped when it is full",
                self.directory,
                self._index.capacity / GiB,
                room / GiB,
            )

    def _probe_o_direct(self) -> bool:
        if o_direct_supported(self.directory):
            return True
        logger.warning("lmcache disk tier %s: the filesystem refuses O_DIRECT; using buffered I/O", self.directory)
        return False

    # ------------------------------------------------------------------ properties
    @property
    def used_bytes(self) -> int:
        """Bytes of indexed entry files."""
        return self._index.used

    @property
    def capacity_bytes(self) -> int:
        """The effective capacity: ``max_local_disk_size``, or less after the filesystem filled up."""
        return self._index.capacity

    @property
    def reserved_bytes(self) -> int:
        """Bytes booked by queued writes (counted against the capacity with ``used_bytes``)."""
        return self._index.reserved

    @property
    def o_direct(self) -> bool:
        """Whether O_DIRECT is in use (asked for and accepted by the filesystem)."""
        return self._o_direct

    @property
    def owner_token(self) -> str:
        """This process's token in the names of its temp files (see :class:`OwnerLock`)."""
        return self._owner.token

    @property
    def disabled_reason(self) -> str | None:
        """Why the tier turned itself off at run time, or None while it works."""
        return self._disabled

    def __len__(self) -> int:
        return len(self._index)

    def keys(self) -> list[CacheEngineKey]:
        """Keys of the entries on disk (not counting queued puts)."""
        with self._lock:
            return [e.key for e in self._index.entries()]

    # ------------------------------------------------------------------ contract
    def contains(self, key: CacheEngineKey, pin: bool = False) -> bool:
        with self._lock:
            if self._closed or self._disabled:
                return False
            pending = self._writer.pending.get(key)
            if pending is not None:
                pending.pins += pin
                return True
            if key in self._index:
                if pin:
                    self._index.pin(key)
                return True
        if not self._discover(key):
            return False
        return self.contains(key, pin) if pin else True

    def batched_contains(self, keys: Sequence[CacheEngineKey], pin: bool = False) -> int:
        """Leading ``keys`` present: indexed or pending runs in one lock hold (the index
        probe is one native loop when built), a key in neither is looked for on disk
        (:meth:`_discover`, without the lock) as :meth:`contains` does. ``pin`` takes the
        per-key path."""
        if pin:
            return super().batched_contains(keys, pin)
        keys = keys if keys.__class__ in (list, tuple) else list(keys)
        n = 0
        while n < len(keys):
            with self._lock:
                if self._closed or self._disabled:
                    return n
                while n < len(keys):
                    n = self._index.prefix(keys, n)
                    if n == len(keys) or keys[n] not in self._writer.pending:
                        break
                    n += 1
            if n == len(keys) or not self._discover(keys[n]):
                return n
            n += 1
        return n

    def _discover(self, key: CacheEngineKey) -> bool:
        """Index an entry file of ``key`` that another process wrote after our scan.

        This keeps one directory live between processes (a scheduler and its workers,
        or several engines): a lookup that misses the index reads the header of the
        file the key maps to. Header only; a missing, unreadable or foreign file is not
        adopted (a corrupt payload is caught by the verified read later). Called
        without the lock; never raises.
        """
        key_str = key.to_string()
        name = entry_file_name(key_str)
        if name in self._writer.doomed:  # evicted, file not yet unlinked (a racy read is harmless: checked again below)
            return False
        try:
            header, st = read_header(os.path.join(self.directory, name))
        except (OSError, ValueError):  # CorruptEntryError is a ValueError
            return False
        if header.key != key_str:
            return False
        with self._lock:
            if self._closed or self._disabled:
                return False
            if key in self._index or key in self._writer.pending:
                return True
            if name in self._writer.doomed:
                return False
            evicted = self._index.reserve(st.st_size)
            if evicted is None:
                return False
            victims = [entry for _, entry in evicted]
            for victim in victims:
                self._unlink(victim.name)
            entry = DiskEntry(key, name, header.meta, header.header_len, st.st_size)
            self._index.commit(key, entry, st.st_size, st.st_size)
        self.stats.add(adopted=1, evictions=len(victims))
        self._notify("removed", [v.key for v in victims])
        return True

    def unpin(self, key: CacheEngineKey) -> bool:
        with self._lock:
            pending = self._writer.pending.get(key)
            if pending is not None:
                pending.pins = max(0, pending.pins - 1)
                return True
            return self._index.unpin(key)

    def submit_put(self, key: CacheEngineKey, obj: MemoryObj) -> None:
        """Reserve space for ``obj`` (evicting now, in policy order) and queue its write.

        Never does I/O: evicted entries leave the index at once and a writer thread
        unlinks their files before its next write. Drops and counts the put
        if the queue is full or not enough entries can be evicted (pinned, being read,
        or themselves queued); then nothing is evicted."""
        self.batched_submit_put([key], [obj])

    def batched_submit_put(self, keys: Sequence[CacheEngineKey], objs: Sequence[MemoryObj]) -> None:
        """Submit the chunks of one sequence, ``keys`` head first.

        Space is reserved head first, so a sequence larger than what can be freed keeps
        its head (its tail is unreachable without it anyway) and the rest is dropped
        and counted; writes are queued tail first, so the head lands last and is the
        most recent entry. Entries already on disk are only touched (tail first)."""
        self._writer.submit(keys, objs)

    def get_blocking(self, key: CacheEngineKey) -> MemoryObj | None:
        """Read ``key`` into a new CPU-pool object (caller owns its reference); None on a miss."""
        with self._lock:
            if self._closed or self._disabled:
                return None
            pending = self._writer.pending.get(key)
            if pending is not None:
                pending.obj.ref_count_up()
                self.stats.add(hits=1)
                return pending.obj
            entry = self._index.get(key)
        if entry is None and self._discover(key):
            with self._lock:
                entry = self._index.get(key)
        with self._lock:
            if entry is None or self._index.get(key) is not entry:
                self.stats.add(misses=1)
                return None
            entry.readers += 1
            self._index.touch(key)
        try:
            return self._read(entry)
        finally:
            with self._lock:
                entry.readers -= 1

    def get_non_blocking(self, key: CacheEngineKey) -> Future[MemoryObj | None]:
        """Future of :meth:`get_blocking`, read on a reader thread (a known miss resolves at once)."""
        with self._lock:
            known = not (self._closed or self._disabled) and (key in self._writer.pending or key in self._index)
        if not known and not self._discover(key):
            self.stats.add(misses=1)
            return resolved(None)
        try:
            return self._readers.submit(self.get_blocking, key)
        except RuntimeError:  # shut down by close()
            return resolved(None)

    def remove(self, key: CacheEngineKey) -> bool:
        with self._lock:
            pending = self._writer.pending.pop(key, None)
            if pending is not None:
                pending.cancelled = True
            entry = self._index.pop(key)
            if entry is not None:
                self._unlink(entry.name)
        if entry is not None:
            self._notify("removed", [key])
        return pending is not None or entry is not None

    def flush(self, timeout: float | None = None) -> bool:
        """Wait until every put submitted before this call is written and its rename durable.

        Returns False if ``timeout`` seconds passed first. Puts that failed or were
        dropped count as finished.
        """
        return self._writer.flush(timeout)

    def close(self) -> None:
        """Finish queued writes (up to ``local_disk_close_timeout``), stop the threads. Idempotent."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
        if not self.flush(self.options.close_timeout):
            logger.warning("lmcache disk tier %s: close timed out; unfinished writes are dropped", self.directory)
        self._writer.close()
        self._readers.shutdown(wait=True, cancel_futures=True)
        self._owner.release()

    # ------------------------------------------------------------------ reads
    def _read(self, entry: DiskEntry) -> MemoryObj | None:
        meta = entry.meta
        obj = self.memory.allocate(meta.shape, meta.dtype, meta.fmt)
        if obj is None:
            self.stats.add(alloc_failures=1, misses=1)
            self._log_once(logging.WARNING, "alloc", "lmcache disk tier: CPU pool full; disk hits become misses")
            return None
        path = os.path.join(self.directory, entry.name)
        try:
            header = self._read_file(path, entry, obj)
            if header.meta != meta:
                raise CorruptEntryError(f"entry holds {header.meta}, index says {meta}")
        except FileNotFoundError:
            obj.ref_count_down()
            self.stats.add(misses=1)
            if not os.path.isdir(self.directory):
                self._disable("the cache directory was removed")
            else:
                with self._lock:
                    self._index.discard(entry.key, entry)
            return None
        except CorruptEntryError as exc:
            obj.ref_count_down()
            self.stats.add(corrupt_entries=1, misses=1)
            self._log_once(logging.WARNING, "corrupt", "lmcache disk tier: deleting corrupt entry %s: %s", path, exc)
            self._drop_bad(entry)
            return None
        except OSError as exc:
            obj.ref_count_down()
            self.stats.add(read_errors=1, misses=1)
            self._log_once(
                logging.WARNING, "read-error", "lmcache disk tier: deleting unreadable entry %s: %s", path, exc
            )
            self._drop_bad(entry)
            return None
        self.stats.add(hits=1, bytes_read=meta.nbytes)
        return obj

    def _read_file(self, path: str, entry: DiskEntry, obj: MemoryObj) -> EntryHeader:
        key = entry.key.to_string()
        if self._o_direct:
            try:
                return read_entry(path, key, entry.header_len, obj.byte_array, o_direct=True)
            except OSError as exc:
                if exc.errno != errno.EINVAL:
                    raise
                self._stop_o_direct(exc)
        return read_entry(path, key, entry.header_len, obj.byte_array, o_direct=False)

    def _drop_bad(self, entry: DiskEntry) -> None:
        with self._lock:
            dropped = self._index.discard(entry.key, entry)
            if dropped:
                self._unlink(entry.name)
        if dropped:
            self._notify("removed", [entry.key])

    # ------------------------------------------------------------------ failures
    def _disable(self, reason: str) -> None:
        with self._lock:
            if self._disabled:
                return
            self._disabled = reason
            self._index.clear()
            self._writer.cancel_all_locked()
        logger.error("lmcache disk tier %s disabled: %s; the engine keeps serving from memory", self.directory, reason)

    def _stop_o_direct(self, exc: OSError) -> None:
        self._o_direct = False
        self._log_once(logging.WARNING, "o-direct", "lmcache disk tier: O_DIRECT refused (%s); using buffered I/O", exc)

    def _unlink(self, name: str) -> None:
        try:
            os.unlink(os.path.join(self.directory, name))
        except FileNotFoundError:
            pass
        except OSError as exc:
            self._log_once(logging.WARNING, "unlink", "lmcache disk tier: cannot delete %s: %s", name, exc)

    def _log_once(self, level: int, kind: str, msg: str, *args: Any) -> None:
        if not self._logged(level, kind, msg + " (further occurrences logged at debug level)", *args):
            logger.debug(msg, *args)


def _prepare_directory(root: str, directory: str, raw: str | None) -> None:
    """Create ``root`` and ``directory`` (0700); ConfigError if that is impossible or unsafe.

    ``directory`` (where entries live) must be ours, a real directory (not a symlink)
    and writable by nobody else (see :mod:`lmcache.v1.private_files`): entries planted
    by another local user would otherwise be served.
    """
    if os.path.exists(root) and not os.path.isdir(root):
        raise ConfigError(f"local_disk={raw!r}: {root} exists and is not a directory; expected a directory path")
    try:
        os.makedirs(root, mode=0o700, exist_ok=True)
        check_parent_dir(root, what="local_disk directory")
        ensure_private_dir(directory, what="disk cache directory")
    except UnsafePathError as exc:
        raise ConfigError(f"local_disk={raw!r}: {exc}") from None
    except OSError as exc:
        raise ConfigError(
            f"local_disk={raw!r}: cannot create the cache directory {directory} ({exc.strerror}); "
            "expected a writable directory path"
        ) from None
