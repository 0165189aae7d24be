"""Small helpers of the vLLM adapter: names, slot mappings, layer order, stats, logging.

Nothing here holds state except the loggers of :func:`failure_logger`. Functions that read vLLM objects
use attribute access only (duck typing), so unit tests can pass small fakes.
"""

from __future__ import annotations

import hashlib
import logging
import os
import re
import sys
import threading
from collections.abc import Callable, Iterable, Sequence
from typing import TYPE_CHECKING, Any

import numpy as np

from lmcache.log_once import LogOnce
from lmcache.v1.cache_engine import LMCacheEngine, LMCacheEngineBuilder
from lmcache.v1.private_files import default_runtime_dir
from lmcache.v1.request import KeyExtras

if TYPE_CHECKING:
    import torch

logger = logging.getLogger(__name__)


# ------------------------------------------------------------------------ naming
def instance_id(engine_id: str, rank: int) -> str:
    """Registry name (:class:`LMCacheEngineBuilder`) of the engine of one vLLM worker."""
    return f"vllm-{engine_id}-r{rank}"


def engine_for(engine_id: str, rank: int) -> LMCacheEngine | None:
    """The engine of worker ``rank`` of the vLLM instance ``engine_id``, if it lives in this process."""
    return LMCacheEngineBuilder.get(instance_id(engine_id, rank))


def default_socket_dir() -> str:
    """Per-user directory (mode 0700) for lookup sockets: ``$XDG_RUNTIME_DIR/lmcache`` or ``<tmp>/lmcache-<uid>``.

    The server creates and verifies it (:mod:`lmcache.v1.private_files`).
    """
    return default_runtime_dir()


def socket_path(socket_dir: str, engine_id: str, rank: int) -> str:
    """Unix socket of worker ``rank``'s lookup server (short: AF_UNIX paths are ~107 bytes)."""
    digest = hashlib.sha1(engine_id.encode()).hexdigest()[:16]
    return os.path.join(socket_dir, f"lookup-{digest}-r{rank}.sock")


# ------------------------------------------------------------------------ requests
def request_key_extras(request: Any) -> dict[str, Any]:
    """Per-request key extras: ``cache_salt``, and LoRA / multimodal hashes as ``extra_keys``.

    Two requests share cached chunks only when these agree (tenant isolation via the
    salt; a LoRA adapter or an image changes the KV of identical placeholder tokens).
    """
    salt = getattr(request, "cache_salt", None)
    keys: list[str] = []
    lora = getattr(request, "lora_request", None)
    if lora is not None:
        name = getattr(lora, "lora_name", None) or getattr(lora, "lora_int_id", None)
        keys.append(f"lora={name}")
    for feature in getattr(request, "mm_features", None) or ():
        ident = getattr(feature, "identifier", None) or getattr(feature, "mm_hash", None)
        if ident:
            keys.append(f"mm={ident}")
    return KeyExtras.build(cache_salt=str(salt) if salt else None, extra_keys=keys or None).as_kwargs()


def slot_mapping(block_ids: Sequence[int], block_size: int, num_tokens: int) -> np.ndarray:
    """``slot[i] = block_ids[i // block_size] * block_size + i % block_size`` for ``i < num_tokens``.

    Tokens past the allocated blocks get -1 (the copy paths skip negative slots).
    """
    if block_size <= 0:
        raise ValueError(f"block_size={block_size}: expected > 0")
    out = np.full(num_tokens, -1, dtype=np.int64)
    blocks = np.asarray(block_ids, dtype=np.int64)
    covered = min(num_tokens, len(blocks) * block_size)
    if covered:
        idx = np.arange(covered)
        out[:covered] = blocks[idx // block_size] * block_size + idx % block_size
    return out


def blocks_of_tokens(slots: np.ndarray | torch.Tensor, block_size: int, start: int, end: int) -> set[int]:
    """Block ids holding tokens ``[start, end)`` (from their slots; negative slots ignored)."""
    part = np.asarray(slots[start:end])
    part = part[part >= 0]
    return set((part // block_size).tolist())


# ------------------------------------------------------------------------ layers
_INT = re.compile(r"(?:^|\.)(\d+)(?:\.|$)")


def layer_index(name: str) -> int | None:
    """The layer number in a module name like ``model.layers.3.self_attn.attn`` (first integer)."""
    m = _INT.search(name)
    return int(m.group(1)) if m else None


def ordered_layers(names: Iterable[str]) -> list[str]:
    """Layer names in model order (by layer number; names without one keep their order, last)."""
    names = list(names)
    keyed = [(layer_index(n), i, n) for i, n in enumerate(names)]
    keyed.sort(key=lambda t: (t[0] is None, t[0] if t[0] is not None else 0, t[1]))
    return [n for _, _, n in keyed]


# ------------------------------------------------------------------------ stats
_SCHEDULER_STATS: dict[str, Any] = {}
_SCHEDULER_STATS_LOCK = threading.Lock()


def register_scheduler_stats(engine_id: str, snapshot: Any) -> None:
    """Make a scheduler side's counters visible to :func:`collect_stats` in this process."""
    with _SCHEDULER_STATS_LOCK:
        _SCHEDULER_STATS[engine_id] = snapshot


def unregister_scheduler_stats(engine_id: str, snapshot: Any) -> None:
    with _SCHEDULER_STATS_LOCK:
        if _SCHEDULER_STATS.get(engine_id) is snapshot:
            del _SCHEDULER_STATS[engine_id]


def sum_stats(snapshots: Iterable[dict[str, int]]) -> dict[str, int]:
    """Snapshots of a model's tensor-parallel ranks (rank 0 first) as one dict; see
    :func:`lmcache.observability.snapshot.merge_rank_snapshots`."""
    from lmcache.observability.snapshot import merge_rank_snapshots

    return merge_rank_snapshots(snapshots)  # type: ignore[return-value]


def process_snapshot(engine: LMCacheEngine) -> dict[str, float]:
    """``engine_snapshot(engine)`` plus the encoder-cache counters of this process.

    The EC counters (``ec_*``) are added when the EC connector module is loaded in
    this process (vLLM runs the EC and KV connectors' worker sides in one process), so
    both metrics routes and ``collect_stats`` report them; without an EC connector
    nothing is added.
    """
    from lmcache.observability.snapshot import ec_snapshot, engine_snapshot

    snap = engine_snapshot(engine)
    ec_adapter = sys.modules.get("lmcache.integration.vllm.vllm_ec_adapter")
    if ec_adapter is not None:
        snap.update(ec_snapshot(ec_adapter.ec_connector_stats()))
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
    with _SCHEDULER_STATS_LOCK:
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


# ------------------------------------------------------------------------ logging
def failure_logger(log: logging.Logger) -> Callable[..., None]:
    """``warn(kind, msg, *args)``: the first failure of each kind at WARNING (one line), later ones at DEBUG.

    A cache failure must not flood vLLM's log; the counters in ``CacheStats`` count
    every occurrence. One per adapter part (scheduler, worker, tracker).
    """
    once = LogOnce(log)

    def warn(kind: str, msg: str, *args: Any) -> None:
        if not once(logging.WARNING, kind, msg + " (further %s failures are logged at debug level)", *args, kind):
            log.debug(msg, *args)

    return warn
