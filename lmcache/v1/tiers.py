"""The names of the storage tiers: one enum for stats keys, metric labels, logs and KV events.

:class:`Tier` is a ``StrEnum``: each member is the lowercase string it always was
(``Tier.DISK == "disk"``, ``f"hit_tokens_{Tier.DISK}" == "hit_tokens_disk"``), so
snapshot keys, Prometheus ``tier`` labels and JSON output read the same. LMCache 0.5.6's
backend names (``LocalCPUBackend``, ...), which ``search_range``/``location`` take, are a
different vocabulary: :data:`lmcache.v1.request.TIER_NAMES`.
"""

from __future__ import annotations

from enum import StrEnum


class Tier(StrEnum):
    """A storage tier's label (``StorageBackend.tier``)."""

    CPU = "cpu"
    """L1: the CPU memory pool."""
    DISK = "disk"
    """L2: the local disk tier."""
    REMOTE = "remote"
    """L3: the remote (Redis/Valkey) tier."""
    OTHER = "other"
    """A tier given by the caller (``lower_backends``) that declares none of the above;
    it has no per-tier counters."""
    UNKNOWN = "unknown"
    """Where a hit came from when no tier was recorded for it (not counted per tier)."""


TIERS: tuple[Tier, ...] = (Tier.CPU, Tier.DISK, Tier.REMOTE)
"""The built-in tiers, L1 first: the ones with per-tier counters and metric labels."""
