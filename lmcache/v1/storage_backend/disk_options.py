"""The disk tier's settings: :class:`DiskTierOptions` and its ``extra_config`` keys.

Read once by :class:`~lmcache.v1.storage_backend.local_disk_backend.LocalDiskBackend`
and shared with its writer (:mod:`lmcache.v1.storage_backend.disk_writer`). Still
importable from :mod:`lmcache.v1.storage_backend.local_disk_backend`. The fields'
metadata is the source of the disk rows of docs/configuration.md.

Thread-safety: the options are immutable.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

from lmcache.v1.config import ConfigError, LMCacheEngineConfig
from lmcache.v1.memory_management import GiB
from lmcache.v1.options import option, parse_options
from lmcache.v1.storage_backend.disk_file import PAGE

__all__ = [
    "EXTRA_CLOSE_TIMEOUT",
    "EXTRA_O_DIRECT",
    "EXTRA_QUEUE_DEPTH",
    "EXTRA_READ_THREADS",
    "EXTRA_WRITE_THREADS",
    "DiskTierOptions",
]

EXTRA_O_DIRECT = "local_disk_o_direct"
EXTRA_WRITE_THREADS = "local_disk_write_threads"
EXTRA_READ_THREADS = "local_disk_read_threads"
EXTRA_QUEUE_DEPTH = "local_disk_queue_depth"
EXTRA_CLOSE_TIMEOUT = "local_disk_close_timeout"


@dataclass(frozen=True, slots=True)
class DiskTierOptions:
    """The disk tier's settings, validated (bad values raise ConfigError).

    ``root``, ``capacity_bytes`` and ``cache_policy`` come from the top-level keys
    (``local_disk``, ``max_local_disk_size``, ``cache_policy``); the rest are the
    ``extra_config`` options below (their metadata is the docs' source)."""

    root: str
    capacity_bytes: int
    cache_policy: str = "LRU"
    o_direct: bool = option(False, EXTRA_O_DIRECT, "O_DIRECT reads and writes (buffered I/O if the filesystem refuses)")
    write_threads: int = option(2, EXTRA_WRITE_THREADS, "writer threads", ge=1)
    read_threads: int = option(2, EXTRA_READ_THREADS, "reader threads for non-blocking reads (prefetch)", ge=1)
    queue_depth: int = option(64, EXTRA_QUEUE_DEPTH, "queued writes; a full queue drops new writes (counted)", ge=1)
    close_timeout: float = option(60.0, EXTRA_CLOSE_TIMEOUT, "seconds `close()` waits for queued writes", ge=0)

    @classmethod
    def from_config(cls, config: LMCacheEngineConfig) -> DiskTierOptions:
        path = config.local_disk_path
        if not path:
            raise ConfigError(f"local_disk={config.local_disk!r}: expected a directory path (file:// prefix optional)")
        capacity = int(config.max_local_disk_size * GiB)
        if capacity < PAGE:
            raise ConfigError(
                f"max_local_disk_size={config.max_local_disk_size!r}: expected a size in GiB of at least one page"
            )
        return parse_options(
            cls,
            config.extra_config,
            root=os.path.abspath(os.path.expanduser(path)),
            capacity_bytes=capacity,
            cache_policy=config.cache_policy,
        )
