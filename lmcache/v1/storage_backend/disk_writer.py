"""The disk tier's write pipeline: booking, the write queue, writer threads, durability, disk full.

One job: get the entries a :class:`~lmcache.v1.storage_backend.local_disk_backend.LocalDiskBackend`
accepts onto disk, crash-safe, without ever overfilling the tier. :meth:`DiskWriter.submit`
books each entry's space in the tier's index (evicting in policy order, all or nothing)
and queues it (bounded; a full queue drops the write and counts it). ``write_threads``
writer threads then write a temp file, fdatasync it, rename it into place and index it;
the directory is fsync'ed in groups (whenever the queue runs empty, and always before
:meth:`DiskWriter.flush` returns). A full filesystem (ENOSPC and the like) lowers the
tier's capacity to what the filesystem gives, evicts to fit and retries once; the
capacity grows back, up to ``max_local_disk_size``, as space frees up. A permission
error or a removed directory disables the tier.

Threads: ``submit`` runs on the caller's thread and never blocks nor does I/O;
``flush`` waits for the writers; everything else runs on the writer threads. The
writer shares the tier's lock, index, stats and log: its ``pending``
and ``doomed`` are read and changed by the tier under that lock.

Ownership: one writer per tier, created and closed by it. A queued write holds its own
reference to its memory object (taken in ``submit``, dropped when the write finishes,
fails or is cancelled) and its booking in the index (committed or released the same
way). The writer owns the directory fd it fsyncs and closes it in :meth:`DiskWriter.close`.

The tier imports this module; the writer sees the tier only through :class:`DiskTier`,
the part of it that the writer reads and calls (its lock, index, counters, options and
its disable/notify/unlink/log hooks).
"""

from __future__ import annotations

import errno
import logging
import os
import queue
import threading
import time
from dataclasses import dataclass
from typing import Any, Protocol, Sequence

import torch

from lmcache.v1.keys import CacheEngineKey
from lmcache.v1.memory_management import GiB, MemoryObj
from lmcache.v1.storage_backend.disk_file import PAGE, entry_file_name, entry_header, remove_quiet, temp_file_name, write_entry
from lmcache.v1.storage_backend.disk_index import DiskEntry, DiskIndex
from lmcache.v1.storage_backend.disk_options import DiskTierOptions
from lmcache.v1.storage_backend.disk_stats import DiskTierStats
from lmcache.v1.storage_backend.entry_format import header_size

# The disk tier logs under one name, whichever of its modules a line comes from.
logger = logging.getLogger("lmcache.v1.storage_backend.local_disk_backend")

_FULL = {errno.ENOSPC, errno.EDQUOT, errno.EFBIG}
_DENIED = {errno.EACCES, errno.EPERM, errno.EROFS}
_GONE = {errno.ENOENT, errno.ENOTDIR}
_SYNC_BATCH = 64  # renames between directory fsyncs while the queue stays busy
_REGROW_INTERVAL = 5.0  # seconds between free-space checks while the capacity is lowered


class DiskTier(Protocol):
    """What a :class:`DiskWriter` uses of its tier
    (:class:`~lmcache.v1.storage_backend.local_disk_backend.LocalDiskBackend` has it all).
    The writer reads these and calls the hooks; it sets none of them."""

    @property
    def _lock(self) -> threading.Lock: ...

    @property
    def _index(self) -> DiskIndex: ...

    @property
    def _closed(self) -> bool: ...

    @property
    def _disabled(self) -> str | None:
        """Why the tier was disabled; None while it works."""

    @property
    def _o_direct(self) -> bool: ...

    @property
    def stats(self) -> DiskTierStats: ...

    @property
    def directory(self) -> str: ...

    @property
    def options(self) -> DiskTierOptions: ...

    @property
    def owner_token(self) -> str: ...

    def _disable(self, reason: str) -> None:
        """Stop using the tier (logged once); ``reason`` says why."""

    def _stop_o_direct(self, exc: OSError) -> None:
        """Go on with buffered I/O after O_DIRECT failed with ``exc``."""

    def _unlink(self, name: str) -> None:
        """Delete the file ``name`` of the tier's directory (a missing file is fine)."""

    def _notify(self, kind: str, keys: list[CacheEngineKey]) -> None:
        """Tell the tier's listener that ``keys`` were ``"stored"`` or ``"removed"``."""

    def _log_once(self, level: int, kind: str, msg: str, *args: Any) -> None:
        """Log ``msg`` at ``level`` the first time for ``kind``, at debug level after."""


@dataclass(slots=True, eq=False)
class PendingWrite:
    """A put between ``submit`` and its rename (holds one reference to ``obj`` and
    a booking of ``size`` bytes in the index)."""

    key: CacheEngineKey
    key_str: str
    obj: MemoryObj
    seq: int
    size: int
    pins: int = 0
    cancelled: bool = False
    finished: bool = False


class DiskWriter:
    """The write half of one disk tier (:class:`DiskTier`; see the module docstring).

    ``pending`` (key -> its queued write) and ``doomed`` (names of files evicted at
    submit, not yet unlinked) are guarded by the tier's lock.
    """

    def __init__(self, tier: DiskTier, dir_fd: int) -> None:
        self._tier = tier
        self._lock = tier._lock
        self._cond = threading.Condition(self._lock)  # signalled whenever a write leaves the pipeline
        self._index = tier._index
        self.stats = tier.stats
        self.directory = tier.directory
        self.options = tier.options
        self._token = tier.owner_token
        self._sync_lock = threading.Lock()
        self._dir_fd = dir_fd
        self._lowered_at: float | None = None  # monotonic time the capacity was last lowered (disk full)
        self.pending: dict[CacheEngineKey, PendingWrite] = {}
        self.doomed: set[str] = set()  # files of entries evicted at submit, not yet unlinked
        self._unwritten: set[int] = set()  # seqs queued or being written
        self._to_sync: list[int] = []  # seqs renamed since the last directory fsync
        self._seq = 0
        self._queue: queue.Queue[PendingWrite | None] = queue.Queue(maxsize=self.options.queue_depth)
        self._threads = [
            threading.Thread(target=self._write_loop, name=f"lmcache-disk-write-{i}", daemon=True)
            for i in range(self.options.write_threads)
        ]
        for t in self._threads:
            t.start()

    # ------------------------------------------------------------------ caller side
    def submit(self, keys: Sequence[CacheEngineKey], objs: Sequence[MemoryObj]) -> None:
        """Book and queue the chunks of one sequence, ``keys`` head first (see
        :meth:`~lmcache.v1.storage_backend.local_disk_backend.LocalDiskBackend.batched_submit_put`).
        Never blocks, never does I/O."""
        assert len(keys) == len(objs)
        tier = self._tier
        self._maybe_regrow()  # also here: a tier shrunk below one entry queues no writes to check it
        booked: list[PendingWrite] = []
        victims: list[DiskEntry] = []
        with self._lock:
            if tier._closed or tier._disabled:
                return
            for key in reversed(keys):
                self._index.touch(key)
            room = self.options.queue_depth - self._queue.qsize()  # only we add, under the lock
            seen: set[CacheEngineKey] = set()
            for i, (key, obj) in enumerate(zip(keys, objs)):
                if key in self.pending or key in self._index or key in seen:
                    continue
                seen.add(key)
                key_str = key.to_string()
                size = header_size(key_str, len(obj.meta.shape), PAGE) + obj.get_size()
                if size > self._index.capacity:
                    self.stats.add(puts_rejected_too_large=len(keys) - i)
                    tier._log_once(
                        logging.WARNING,
                        "too-large",
                        "lmcache disk tier: entry of %d bytes is larger than the tier (%d bytes); not stored",
                        size,
                        self._index.capacity,
                    )
                    break
                if len(booked) >= room:
                    self._drop_queue_full(len(keys) - i)
                    break
                evicted = self._index.reserve(size)
                if evicted is None:
                    self.stats.add(puts_rejected_no_space=len(keys) - i)
                    break
                victims += [entry for _, entry in evicted]
                self._seq += 1
                booked.append(PendingWrite(key, key_str, obj, self._seq, size))
            self.doomed.update(v.name for v in victims)  # unlinked by a writer, before its next write
            for item in reversed(booked):
                item.obj.ref_count_up()
                self._queue.put_nowait(item)  # room was checked above
                self.pending[item.key] = item
                self._unwritten.add(item.seq)
        if booked or victims:
            self.stats.add(puts_accepted=len(booked), evictions=len(victims))
        tier._notify("removed", [v.key for v in victims])

    def _drop_queue_full(self, count: int) -> None:
        self.stats.add(puts_dropped_queue_full=count)
        self._tier._log_once(
            logging.WARNING,
            "queue-full",
            "lmcache disk tier: write queue full (%d entries); dropping writes until it drains",
            self.options.queue_depth,
        )

    def flush(self, timeout: float | None = None) -> bool:
        """Wait until every write submitted before this call is finished and its rename
        durable; False if ``timeout`` seconds passed first."""
        deadline = None if timeout is None else time.monotonic() + timeout
        with self._lock:
            target = self._seq
            while self._unwritten and min(self._unwritten) <= target:
                left = None if deadline is None else deadline - time.monotonic()
                if left is not None and left <= 0:
                    return False
                self._cond.wait(left)
        self._sync_dir()
        return True

    def cancel_all_locked(self) -> None:
        """Mark every queued write cancelled (its writer releases it). Call with the tier's lock held."""
        for item in self.pending.values():
            item.cancelled = True

    def close(self) -> None:
        """Cancel what is still queued, stop the writer threads (each waits up to
        ``local_disk_close_timeout``), unlink evicted files and close the directory fd."""
        with self._lock:
            self.cancel_all_locked()
        for _ in self._threads:
            self._queue.put(None)  # behind the remaining items, which see ``cancelled``
        for t in self._threads:
            t.join(self.options.close_timeout)
        self._reap()
        with self._sync_lock:
            os.close(self._dir_fd)
            self._dir_fd = -1

    # ------------------------------------------------------------------ writer threads
    def _reap(self) -> None:
        """Unlink the files of entries evicted by ``submit`` (writer thread).

        One file per lock hold, so lookups wait for at most one unlink; a name that a
        new write of the same key renamed into place meanwhile is not in the set any
        more (the rename removed it), so a live file is never deleted."""
        while True:
            with self._lock:
                if not self.doomed:
                    return
                self._tier._unlink(self.doomed.pop())

    def _write_loop(self) -> None:
        while True:
            item = self._queue.get()
            self._reap()
            if item is None:
                return
            try:
                self._write_one(item)
            except Exception:  # a bug must not kill the writer thread; the entry is just not stored
                logger.exception("lmcache disk tier: unexpected error writing an entry")
                with self._lock:
                    self._finish_locked(item)
            if self._queue.empty():
                self._sync_dir()

    def _write_one(self, item: PendingWrite, retry_when_full: bool = True) -> None:
        """Write a temp file, rename it into place, index it. Runs on a writer thread.

        The space was reserved by :meth:`submit`; every way out commits or releases
        that booking. A full filesystem lowers the capacity (evicting to fit) and, if
        the entry still fits, the write is tried once more."""
        tier = self._tier
        name = entry_file_name(item.key_str)
        with self._lock:
            if item.cancelled or tier._disabled:
                self._index.release(item.size)
                self._finish_locked(item)
                return
        self._maybe_regrow()
        payload = item.obj.byte_array
        tmp = os.path.join(self.directory, temp_file_name(name, self._token, item.seq))
        try:
            header = entry_header(item.key_str, item.obj.meta, payload)  # ValueError: dtype not storable
            self._write_file(tmp, header, payload)
            with self._lock:
                if item.cancelled or tier._disabled:
                    remove_quiet(tmp)
                    self._index.release(item.size)
                    self._finish_locked(item)
                    return
                self.doomed.discard(name)  # an older file of this key, evicted but not yet unlinked, is replaced
                os.rename(tmp, os.path.join(self.directory, name))
                entry = DiskEntry(item.key, name, item.obj.meta, len(header), item.size)
                self._index.commit(item.key, entry, item.size, item.size, pins=item.pins)
                self._to_sync.append(item.seq)
                self.stats.add(writes_completed=1, bytes_written=item.size)
                self._finish_locked(item)
            tier._notify("stored", [item.key])
        except (OSError, ValueError) as exc:
            remove_quiet(tmp)  # write_entry removed its own partial file; this covers a failed rename
            if isinstance(exc, OSError) and exc.errno in _FULL and not item.cancelled:
                if self._on_disk_full(exc, item) and retry_when_full:
                    self._write_one(item, retry_when_full=False)
                    return
            else:
                self._on_write_error(exc)
            self.stats.add(write_errors=1)
            with self._lock:
                self._index.release(item.size)
                self._finish_locked(item)

    def _write_file(self, path: str, header: bytes, payload: torch.Tensor) -> None:
        tier = self._tier
        if tier._o_direct:
            try:
                write_entry(path, header, payload, o_direct=True)
                return
            except OSError as exc:
                if exc.errno != errno.EINVAL:
                    raise
                tier._stop_o_direct(exc)
        write_entry(path, header, payload, o_direct=False)

    def _finish_locked(self, item: PendingWrite) -> None:
        """A put leaves the pipeline (written, failed or dropped): drop its reference. Idempotent."""
        if item.finished:
            return
        item.finished = True
        if self.pending.get(item.key) is item:
            del self.pending[item.key]
        self._unwritten.discard(item.seq)
        item.obj.ref_count_down()
        self._cond.notify_all()

    def _sync_dir(self) -> None:
        """fsync the directory so that finished renames survive a power loss."""
        with self._sync_lock:
            with self._lock:
                batch, self._to_sync = self._to_sync, []
            if not batch or self._dir_fd < 0:
                return
            try:
                os.fsync(self._dir_fd)
            except OSError as exc:
                self._tier._log_once(
                    logging.WARNING, "dir-fsync", "lmcache disk tier: directory fsync failed: %s", exc
                )

    def _on_write_error(self, exc: OSError | ValueError) -> None:
        tier = self._tier
        if not isinstance(exc, OSError):
            tier._log_once(logging.WARNING, "unstorable", "lmcache disk tier: entry not stored: %s", exc)
        elif exc.errno in _DENIED:
            tier._disable(f"cannot write ({exc.strerror})")
        elif exc.errno in _GONE and not os.path.isdir(self.directory):
            tier._disable("the cache directory was removed")
        else:
            tier._log_once(
                logging.WARNING,
                f"write-{exc.errno}",
                "lmcache disk tier %s: write failed (%s); skipped",
                self.directory,
                exc,
            )

    # ------------------------------------------------------------------ disk full
    def _fs_room(self) -> int | None:
        """Bytes this tier can hold on its filesystem now: its files plus the free space,
        less a page per writer thread (slack for file-system overhead); None if unknown."""
        try:
            st = os.statvfs(self.directory)
        except OSError:
            return None
        return self._index.used + st.f_bavail * st.f_frsize - PAGE * self.options.write_threads

    def _on_disk_full(self, exc: OSError, item: PendingWrite) -> bool:
        """Lower the capacity to what the filesystem gives and evict to fit it.

        Returns True if ``item`` (whose booking is still held) fits the lowered capacity,
        i.e. a retry may succeed. Never raises."""
        tier = self._tier
        self.stats.add(disk_full_events=1)
        self._reap()  # evicted files still on disk would make the room look smaller than it is
        room = self._fs_room()
        with self._lock:
            old = self._index.capacity
            new = max(PAGE, min(old, room if room is not None else self._index.used))
            self._index.capacity = new
            self._lowered_at = time.monotonic()
            victims = [entry for _, entry in self._index.shrink_to_capacity()]
            for victim in victims:
                tier._unlink(victim.name)
            fits = self._index.used + self._index.reserved <= new
        if victims:
            self.stats.add(evictions=len(victims))
            tier._notify("removed", [v.key for v in victims])
        tier._log_once(
            logging.WARNING,
            "full",
            "lmcache disk tier %s: filesystem full (%s); capacity lowered from %.3f to %.3f GiB "
            "(%d entries evicted) and caching goes on",
            self.directory,
            exc.strerror,
            old / GiB,
            new / GiB,
            len(victims),
        )
        return fits

    def _maybe_regrow(self) -> None:
        """While the capacity is lowered, grow it back (up to the configured size) as
        the filesystem frees up; checked at most every few seconds (one statvfs), on
        submits and before writes."""
        lowered = self._lowered_at
        if lowered is None or time.monotonic() - lowered < _REGROW_INTERVAL:
            return
        room = self._fs_room()
        with self._lock:
            self._lowered_at = time.monotonic()
            if room is None or room <= self._index.capacity:
                return
            self._index.capacity = min(self.options.capacity_bytes, room)
            if self._index.capacity >= self.options.capacity_bytes:
                self._lowered_at = None
