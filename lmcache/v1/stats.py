"""Thread-safe counters that tests and users read (never parsed from logs)."""

from __future__ import annotations

import bisect
import dataclasses
import threading
from dataclasses import dataclass, field

@dataclass(slots=True)
class Counters:
    """Base of every counter set: integer fields, updated under one lock.

    Subclasses declare their counters as ``int`` fields with default 0.
    """

    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False, compare=False)

    def add(self, **deltas: int) -> None:
        """Add each ``name=delta`` atomically."""
        with self._lock:
            for name, delta in deltas.items():
                setattr(self, name, getattr(self, name) + delta)

    def snapshot(self) -> dict[str, int]:
        """A consistent copy of all counters."""
        with self._lock:
            return {f.name: getattr(self, f.name) for f in dataclasses.fields(self) if not f.name.startswith("_")}


@dataclass(slots=True)
class CacheStats(Counters):
    """Counters of one KV engine."""

    store_requests: int = 0
    stored_tokens: int = 0
    store_skipped_chunks: int = 0
    """Chunks not stored because the pool had no room even after eviction."""
    stored_bytes: int = 0
    """Payload bytes of the chunks counted in ``stored_tokens`` (written to the CPU tier)."""
    retrieve_requests: int = 0
    requested_tokens: int = 0
    hit_tokens: int = 0
    """Tokens of the chunks retrieves loaded, including tokens without a slot (not
    written, False in the mask; e.g. the prompt's last token, which vLLM recomputes)."""
    hit_tokens_cpu: int = 0
    """Tokens whose KV was loaded into the caller's KV cache from the CPU tier. Counted
    after the copy succeeded (a failed load is a miss); see also ``_disk``/``_remote``."""
    hit_tokens_disk: int = 0
    hit_tokens_remote: int = 0
    hit_bytes_cpu: int = 0
    """Payload bytes read from the CPU tier for those loads (likewise ``_disk``/``_remote``)."""
    hit_bytes_disk: int = 0
    hit_bytes_remote: int = 0
    block_hit_tokens: int = 0
    """Tokens of ``hit_tokens`` loaded from a block-aligned prefix of a longer or
    different entry (block-granular reuse; see :mod:`lmcache.v1.block_reuse`)."""
    lookup_requests: int = 0
    lookup_tokens: int = 0
    lookup_hit_tokens: int = 0
    blend_requests: int = 0
    """Prompts whose KV was blended from cached segments (CacheBlend)."""
    blend_reused_tokens: int = 0
    """Tokens of blended prompts that kept their cached segment KV."""
    blend_recomputed_tokens: int = 0
    """Tokens of blended prompts computed through every layer (new text and selected tokens)."""
    blend_failures: int = 0
    """Blends that failed (the prompt was recomputed)."""
    blend_stored_segment_tokens: int = 0
    """Tokens stored under segment keys (documents for later blends)."""
    blend_stored_result_tokens: int = 0
    """Tokens of blended prompts stored as blend results (for the same prompt sent again)."""
    async_loads: int = 0
    """Hits loaded asynchronously (prefetched into the CPU tier while other requests ran)."""
    async_loads_settled: int = 0
    """Asynchronous loads (and blends) reported to vLLM as done, loaded or failed: the
    snapshot's ``async_loads_in_flight`` is ``async_loads`` minus this."""
    prefetch_tokens_disk: int = 0
    """Tokens of asynchronous loads the prefetch read from the disk tier into the CPU tier
    (their hits then count as ``hit_tokens_cpu``: the copy reads them there)."""
    prefetch_tokens_remote: int = 0
    """Likewise, read from the remote tier."""
    async_load_timeouts: int = 0
    """Asynchronous loads not prefetched within ``async_load_timeout`` (the rest recomputed)."""
    async_background_copies: int = 0
    """Asynchronous loads the prefetch thread copied into vLLM's blocks itself (CPU KV,
    ``async_copy_in_background``): no step copied them."""
    shared_reads: int = 0
    """Lower-tier reads joined to a read of the same key already in flight (a duplicated
    prompt's prefetch, say): no second disk or remote read."""
    recurrent_states_stored: int = 0
    """Recurrent states (Mamba / linear-attention layers of a hybrid model) stored beside the KV."""
    recurrent_states_loaded: int = 0
    """Recurrent states written into vLLM's state blocks with a load."""
    evictions: int = 0
    load_errors: int = 0
    corrupt_entries: int = 0
    """Stored entries that did not fit the request's layout (shape/dtype/format): served as
    misses and removed from every tier."""


@dataclass(slots=True)
class TierStats(Counters):
    """The counters every lower tier keeps, under the same names: snapshot keys
    ``<tier>_<name>`` (``disk_bytes_read``, ``remote_bytes_read``, ...). A tier adds its
    own in a subclass (:class:`~lmcache.v1.storage_backend.local_disk_backend.DiskTierStats`,
    :class:`~lmcache.v1.storage_backend.remote_backend.RemoteStats`). Submissions are
    ``puts_*`` (decided when a put is submitted), completed I/O is ``writes_*``. The CPU
    tier's equivalents are engine counters (:class:`CacheStats`): ``hit_bytes_cpu``,
    ``stored_bytes``, ``store_skipped_chunks``, ``evictions``."""

    hits: int = 0
    """Reads that returned an entry."""
    misses: int = 0
    """Reads that returned nothing (absent, corrupt, failed, or no room in the CPU pool)."""
    bytes_read: int = 0
    """Bytes read for the hits (disk: the payload; remote: header and payload)."""
    writes_completed: int = 0
    """Entries written."""
    bytes_written: int = 0
    """Bytes of the entries written, header included."""
    write_errors: int = 0
    """Writes that failed with an error."""
    corrupt_entries: int = 0
    """Entries that failed verification (checksum, key, namespace, version or format), found
    by a read (a miss) or, on disk, by the start-up scan; each was deleted."""
    alloc_failures: int = 0
    """Hits turned into misses because the CPU pool had no room."""


LATENCY_BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0)
"""Upper bounds (seconds) of the latency histograms; the last bucket is +Inf."""


class LatencyHistogram:
    """Cumulative latency histogram (bucket counts, count, sum), thread-safe.

    :meth:`observe` is cheap (one bisect under a lock). When an exporter is attached
    (:meth:`start_export`), raw observations are also kept until :meth:`drain` takes
    them (at most ``max_pending``; older ones beyond that are dropped from the export
    only, never from the cumulative numbers).
    """

    __slots__ = ("buckets", "_counts", "_count", "_sum", "_pending", "_export", "_max_pending", "_lock")

    def __init__(self, buckets: tuple[float, ...] = LATENCY_BUCKETS, *, max_pending: int = 10_000) -> None:
        self.buckets = buckets
        self._counts = [0] * (len(buckets) + 1)
        self._count = 0
        self._sum = 0.0
        self._pending: list[float] = []
        self._export = False
        self._max_pending = max_pending
        self._lock = threading.Lock()

    def observe(self, seconds: float) -> None:
        with self._lock:
            self._counts[bisect.bisect_left(self.buckets, seconds)] += 1
            self._count += 1
            self._sum += seconds
            if self._export and len(self._pending) < self._max_pending:
                self._pending.append(seconds)

    def start_export(self) -> None:
        """Keep raw observations for :meth:`drain` from now on."""
        with self._lock:
            self._export = True

    def drain(self) -> list[float]:
        """Observations since the last drain (empty unless exporting)."""
        with self._lock:
            out, self._pending = self._pending, []
            return out

    def snapshot(self, prefix: str) -> dict[str, float]:
        """``{prefix_count: n, prefix_sum: seconds}`` (cumulative)."""
        with self._lock:
            return {f"{prefix}_count": self._count, f"{prefix}_sum": self._sum}

    def bucket_counts(self) -> list[int]:
        """Cumulative count per bucket bound (``le`` semantics), then the +Inf total."""
        with self._lock:
            out, running = [], 0
            for n in self._counts:
                running += n
                out.append(running)
            return out
