"""lmcache's counters of a vLLM instance, gathered for the metrics routes and the CLI.

Holds process-wide state: the registry of the scheduler sides' counters
(:func:`register_scheduler_stats`) and the encoder-cache counters' source
(:func:`register_ec_stats`, set by :mod:`~lmcache.integration.vllm.vllm_ec_adapter` when
it is imported), both behind one lock. :func:`collect_stats` reads the engines of this
process, or asks each worker's lookup server when they live elsewhere.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterable
from typing import Any

from lmcache.integration.vllm.naming import default_socket_dir, engine_for, socket_path
from lmcache.v1.cache_engine import LMCacheEngine

_SCHEDULER_STATS: dict[str, Any] = {}
_EC_STATS: Callable[[], dict[str, int]] | None = None
_LOCK = threading.Lock()


def register_scheduler_stats(engine_id: str, snapshot: Any) -> None:
    """Make a scheduler side's counters visible to :func:`collect_stats` in this process."""
    with _LOCK:
        _SCHEDULER_STATS[engine_id] = snapshot


def unregister_scheduler_stats(engine_id: str, snapshot: Any) -> None:
    with _LOCK:
        if _SCHEDULER_STATS.get(engine_id) is snapshot:
            del _SCHEDULER_STATS[engine_id]


def register_ec_stats(source: Callable[[], dict[str, int]]) -> None:
    """Make the encoder cache's counters (``source()``: an ``ECStats`` snapshot) part of
    :func:`process_snapshot`; the last registration wins."""
    global _EC_STATS
    with _LOCK:
        _EC_STATS = source


def sum_stats(snapshots: Iterable[dict[str, int]]) -> dict[str, int]:
    """Snapshots of a model's tensor-parallel ranks (rank 0 first) as one dict; see
    :func:`lmcache.observability.snapshot.merge_rank_snapshots`."""
    from lmcache.observability.snapshot import merge_rank_snapshots

    return merge_rank_snapshots(snapshots)  # type: ignore[return-value]


def process_snapshot(engine: LMCacheEngine) -> dict[str, float]:
    """``engine_snapshot(engine)`` plus the encoder-cache counters of this process.

    The EC counters (``ec_*``) are added when the EC connector module has registered
    them in this process (vLLM runs the EC and KV connectors' worker sides in one
    process), so both metrics routes and ``collect_stats`` report them; without an EC
    connector nothing is added.
    """
    from lmcache.observability.snapshot import ec_snapshot, engine_snapshot

    snap = engine_snapshot(engine)
    with _LOCK:
        ec_stats = _EC_STATS
    if ec_stats is not None:
        snap.update(ec_snapshot(ec_stats()))
    return snap


def collect_stats(
    engine_id: str, world_size: int = 1, *, socket_dir: str | None = None, timeout: float = 5.0
) -> dict[str, int] | None:
    """lmcache's counters and gauges of a vLLM instance, merged over its workers.

    The keys are those of :func:`lmcache.observability.snapshot.engine_snapshot`
    (engine counters, ``hit_tokens_{cpu,disk,remote}``, ``disk_*``/``remote_*`` tier
    counters, pool gauges, latency counts/sums); they are the numbers the Prometheus
    metrics report (docs/observability.md). Per-request counters come from rank 0,
    the rest is summed over ranks.

    Reads the engines in this process when they are here (single-process vLLM, the
    offline ``LLM`` class), otherwise asks each worker's lookup server. None if no
    worker answers. When the scheduler side lives in this process too, its
    ``scheduler_*`` counters are added.
    """
    with _LOCK:
        sched = _SCHEDULER_STATS.get(engine_id)
    extra = sched() if sched is not None else {}
    engines = [engine_for(engine_id, r) for r in range(world_size)]
    if all(e is not None for e in engines):
        return {**sum_stats(process_snapshot(e) for e in engines if e is not None), **extra}
    from lmcache.integration.vllm.lookup_service import LookupClient

    paths = [socket_path(socket_dir or default_socket_dir(), engine_id, r) for r in range(world_size)]
    client = LookupClient(paths, timeout=timeout)
    try:
        snaps = client.stats()
    finally:
        client.close()
    return {**sum_stats(snaps), **extra} if snaps else None
