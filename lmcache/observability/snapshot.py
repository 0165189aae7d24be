"""One flat dict of numbers per engine: the in-process stats API, metrics and summaries.

:func:`engine_snapshot` reads every counter set of a KV engine (``CacheStats``, the
disk and remote tiers' counters, the hidden-state store's) plus its gauges (pool
bytes used and capacity per tier, remote availability) and its latency histograms'
count and sum. Prometheus metrics (:mod:`.metrics`), the periodic summary
(:mod:`.summary`), ``collect_stats`` and ``lmcache stats`` are all computed from
this dict, so they always agree.

Keys (all numbers; counters only grow):

* engine counters, unprefixed: ``lookup_requests``, ``lookup_tokens``,
  ``lookup_hit_tokens``, ``retrieve_requests``, ``requested_tokens``, ``hit_tokens``,
  ``hit_tokens_{cpu,disk,remote}``, ``hit_bytes_{cpu,disk,remote}``,
  ``store_requests``, ``stored_tokens``, ``stored_bytes``, ``store_skipped_chunks``,
  ``evictions``, ``load_errors``;
* ``blend_requests``, ``blend_reused_tokens``, ``blend_recomputed_tokens``,
  ``blend_failures``, ``blend_stored_segment_tokens``, ``blend_stored_result_tokens``
  (CacheBlend);
* ``{store,retrieve,lookup,blend}_seconds_{count,sum}``;
* ``disk_<counter>`` / ``remote_<counter>`` / ``hidden_<counter>``: the tier's own
  counters (:class:`DiskTierStats`, :class:`RemoteStats`, :class:`HiddenStateStats`);
* ``ec_<counter>``: the encoder cache's counters (:class:`~lmcache.v1.ec_engine.ECStats`:
  ``ec_lookups``, ``ec_lookup_hits``, ``ec_hits``, ``ec_misses``, ``ec_puts``, ...), added
  by the vLLM adapter when the EC connector runs in the same process
  (:func:`ec_snapshot`);
* gauges: ``pool_used_bytes_{cpu,disk}``, ``pool_capacity_bytes_{cpu,disk}``,
  ``hidden_pool_used_bytes``, ``hidden_pool_capacity_bytes``, ``remote_available``
  (1 = reachable, 0 = breaker open or disabled; absent without a remote tier),
  ``async_loads_in_flight`` (asynchronous loads started and not yet reported to vLLM).

Thread-safety: any thread; each counter set is read under its own lock (the sets are
not read atomically together, which is fine for monitoring).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import TYPE_CHECKING, Any

from lmcache.v1.tiers import TIERS, Tier

if TYPE_CHECKING:
    from lmcache.v1.cache_engine import LMCacheEngine

GAUGE_KEYS = frozenset(
    {
        "pool_used_bytes_cpu",
        "pool_capacity_bytes_cpu",
        "pool_used_bytes_disk",
        "pool_capacity_bytes_disk",
        "hidden_pool_used_bytes",
        "hidden_pool_capacity_bytes",
        "remote_available",
        "async_loads_in_flight",
    }
)
"""Snapshot keys that are current values, not counters."""

PER_REQUEST_KEYS = frozenset(
    {
        "lookup_requests",
        "lookup_tokens",
        "lookup_hit_tokens",
        "retrieve_requests",
        "requested_tokens",
        "hit_tokens",
        "hit_tokens_cpu",
        "hit_tokens_disk",
        "hit_tokens_remote",
        "block_hit_tokens",
        "store_requests",
        "stored_tokens",
        "hidden_retrieve_requests",
        "hidden_hit_tokens",
        "hidden_misses",
        "hidden_stored_tokens",
        "blend_requests",
        "blend_reused_tokens",
        "blend_recomputed_tokens",
        "prefetch_tokens_disk",
        "prefetch_tokens_remote",
    }
)
EC_PREFIX = "ec_"
"""Prefix of the encoder-cache counters. The EC engines' counters are process-wide (one
set for every engine of the process), so across ranks they are taken from rank 0 only,
like the per-request counters."""
"""Counters of tokens and requests: every tensor-parallel rank sees the same request
and counts the same tokens (each for its own KV shard), so across ranks they are
taken from rank 0 only, never summed. Everything else (bytes, errors, evictions,
pool sizes) is per shard and summed."""


def engine_snapshot(engine: LMCacheEngine) -> dict[str, float]:
    """Every counter and gauge of ``engine`` (see the module docstring for the keys)."""
    out: dict[str, float] = dict(engine.stats.snapshot())
    if "async_loads_settled" in out:
        out["async_loads_in_flight"] = out["async_loads"] - out["async_loads_settled"]
    latency = getattr(engine, "latency", None) or {}
    for op, hist in latency.items():
        out.update(hist.snapshot(f"{op}_seconds"))
    sm = engine.storage_manager
    out["pool_used_bytes_cpu"] = sm.allocator.used_bytes
    out["pool_capacity_bytes_cpu"] = sm.allocator.capacity
    for backend in sm.lower:
        tier = getattr(backend, "tier", Tier.OTHER)
        stats = getattr(backend, "stats", None)
        if stats is not None and tier in (Tier.DISK, Tier.REMOTE):
            out.update({f"{tier}_{k}": v for k, v in stats.snapshot().items()})
        if tier == Tier.DISK:
            out["pool_used_bytes_disk"] = backend.used_bytes
            out["pool_capacity_bytes_disk"] = backend.capacity_bytes
        elif tier == Tier.REMOTE:
            out["remote_available"] = 1 if backend.available else 0
    hs = getattr(engine, "hidden_state_store", None)
    if hs is not None:
        out.update({f"hidden_{k}": v for k, v in hs.stats.snapshot().items()})
        out["hidden_pool_used_bytes"] = hs.allocator.used_bytes
        out["hidden_pool_capacity_bytes"] = hs.allocator.capacity
    return out


def rank0_only(key: str) -> bool:
    """Whether snapshot counter ``key`` is taken from rank 0 only (never summed over ranks)."""
    return key in PER_REQUEST_KEYS or key.startswith(EC_PREFIX)


def ec_snapshot(counters: Mapping[str, int]) -> dict[str, float]:
    """Encoder-cache counters (``ECStats.snapshot()``) under their ``ec_`` snapshot keys."""
    return {EC_PREFIX + name: value for name, value in counters.items()}


def merge_rank_snapshots(snapshots: Iterable[Mapping[str, Any]]) -> dict[str, float]:
    """Snapshots of the tensor-parallel ranks of one model (rank 0 first) as one dict.

    Per-request counters (:data:`PER_REQUEST_KEYS`) and the process-wide encoder-cache
    counters (``ec_*``) come from rank 0; everything else
    is summed. Keys missing in some ranks count as 0.
    """
    snaps = list(snapshots)
    total: dict[str, float] = {}
    for rank, snap in enumerate(snaps):
        for key, value in snap.items():
            if rank > 0 and rank0_only(key):
                continue
            total[key] = total.get(key, 0) + value
    return total


def loaded_tokens(snap: Mapping[str, Any]) -> int:
    """Tokens loaded from any tier (``hit_tokens_cpu + _disk + _remote``)."""
    return int(sum(snap.get(f"hit_tokens_{t}", 0) for t in TIERS))
