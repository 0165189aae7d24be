"""Storage tiers and the manager that routes between them.

Layers do not import upwards: backends know keys and memory objects, nothing about
the engine or GPU connectors, and no tier imports another: the StorageManager owns the
CPU pool and hands the lower tiers a :class:`TierMemory` to read into.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from lmcache.v1.config import LMCacheEngineConfig
    from lmcache.v1.storage_backend.abstract_backend import StorageBackend, TierMemory

logger = logging.getLogger(__name__)


def create_lower_backends(
    config: LMCacheEngineConfig, memory: TierMemory, *, namespace: str = "kv"
) -> list[StorageBackend]:
    """The L2/L3 tiers named by the config (disk, then remote), in lookup order.

    ``memory`` is the CPU pool the tiers read into (the StorageManager's
    :class:`~lmcache.v1.storage_backend.abstract_backend.PoolMemory`).

    ``namespace`` separates caches that share a directory or server (``"kv"``,
    ``"ec"``, ...). A configuration the tier cannot use (a disk path that cannot be
    created or written, a malformed URL) raises ConfigError here, at start-up. A tier
    that fails later (disk full, server down, wrong password) logs once and degrades
    to misses; the engine keeps serving from the other tiers.
    """
    out: list[StorageBackend] = []
    if config.local_disk_path is not None:
        from lmcache.v1.storage_backend.local_disk_backend import LocalDiskBackend

        out.append(LocalDiskBackend(config, memory, namespace=namespace))
    if config.remote_url is not None:
        from lmcache.v1.storage_backend.remote_backend import RemoteBackend

        out.append(RemoteBackend(config, memory, namespace=namespace))
    return out
