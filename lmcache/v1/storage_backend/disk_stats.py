"""The disk tier's counters: :class:`DiskTierStats`.

Kept by :class:`~lmcache.v1.storage_backend.local_disk_backend.LocalDiskBackend` and
updated by it and its writer (:mod:`lmcache.v1.storage_backend.disk_writer`). Still
importable from :mod:`lmcache.v1.storage_backend.local_disk_backend`.

Thread-safety: as every :class:`~lmcache.v1.stats.TierStats`, one lock per instance.
"""

from __future__ import annotations

from dataclasses import dataclass

from lmcache.v1.stats import TierStats

__all__ = ["DiskTierStats"]


@dataclass(slots=True)
class DiskTierStats(TierStats):
    """Counters of one disk tier: the shared :class:`~lmcache.v1.stats.TierStats` and the
    disk's own. Read with :meth:`snapshot`; the tier updates them with :meth:`add`."""

    indexed_at_start: int = 0
    """Entries found by the start-up scan."""
    temp_files_removed: int = 0
    """Temp files of dead writers deleted by the start-up scan."""
    puts_accepted: int = 0
    puts_dropped_queue_full: int = 0
    puts_rejected_too_large: int = 0
    """Entries larger than the whole tier."""
    puts_rejected_no_space: int = 0
    """Puts that found too many pinned, in-use or queued entries to make room."""
    disk_full_events: int = 0
    """Writes that failed because the filesystem was full (the capacity was lowered)."""
    read_errors: int = 0
    """Reads that failed with an I/O error; the file was deleted."""
    evictions: int = 0
    adopted: int = 0
    """Entry files written by another process after start-up, found on lookup."""
