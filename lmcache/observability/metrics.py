"""Prometheus metrics ``lmcache_*``: the table, the per-step payload and the sink.

Two routes feed the same metrics (docs/observability.md):

(a) ``LMCacheConnectorV1Dynamic``: each vLLM worker turns its engine's counters into a
    small payload every step (:class:`StatsDelta`, carried by vLLM's connector-stats
    channel to the API server process), and :class:`PromSink` there adds it to metrics
    registered in vLLM's own registry.
(b) vLLM's built-in ``LMCacheConnectorV1`` (which does not forward that channel) with
    ``PROMETHEUS_MULTIPROC_DIR`` set: each worker feeds a :class:`PromSink` of its own;
    prometheus_client's multiprocess mode writes the values to files that vLLM's
    ``/metrics`` collects.

Payload (plain, msgpack/pickle friendly; string keys only)::

    {"c": {snapshot_key: delta}, "g": {"<snapshot_key>@r<rank>": value},
     "h": {"store": [seconds, ...], "retrieve": [...], "lookup": [...]}}

Counters are deltas since the previous payload of the same worker, gauges are the
worker's current values keyed by rank (so merging payloads of several steps keeps
the latest value per rank, and the sink sums ranks), histograms are raw
observations. Per-request counters are sent by rank 0 only
(:data:`~.snapshot.PER_REQUEST_KEYS`).
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

from lmcache.observability.snapshot import GAUGE_KEYS, rank0_only
from lmcache.v1.stats import LATENCY_BUCKETS
from lmcache.v1.tiers import TIERS, Tier

COUNTER, GAUGE, HISTOGRAM = "counter", "gauge", "histogram"


@dataclass(frozen=True, slots=True)
class MetricDef:
    """One Prometheus metric: name, type, help text, extra label name (or None) and its
    sources: ``label value -> snapshot keys summed`` (label value "" without a label)."""

    name: str
    kind: str
    doc: str
    label: str | None
    sources: tuple[tuple[str, tuple[str, ...]], ...]


def _c(name: str, doc: str, key: str) -> MetricDef:
    return MetricDef(name, COUNTER, doc, None, (("", (key,)),))


def _by_tier(name: str, kind: str, doc: str, tiers: Mapping[Tier, tuple[str, ...] | str]) -> MetricDef:
    """A metric with a ``tier`` label: ``tiers`` maps each label value to its snapshot key(s)."""
    sources = tuple((tier, (keys,) if isinstance(keys, str) else keys) for tier, keys in tiers.items())
    return MetricDef(name, kind, doc, "tier", sources)


METRICS: tuple[MetricDef, ...] = (
    _c("lmcache_lookup_requests", "Lookups (how many leading tokens are cached?) answered.", "lookup_requests"),
    _c("lmcache_lookup_tokens", "Prompt tokens looked up.", "lookup_tokens"),
    _c(
        "lmcache_lookup_hit_tokens",
        "Tokens lookups reported as cached (a promise; hits are counted when loaded, see lmcache_hit_tokens).",
        "lookup_hit_tokens",
    ),
    _c("lmcache_retrieve_requests", "Load requests (vLLM asked lmcache to load a cached prefix).", "retrieve_requests"),
    _c("lmcache_requested_tokens", "Tokens covered by load requests.", "requested_tokens"),
    _by_tier(
        "lmcache_hit_tokens",
        COUNTER,
        "Tokens whose KV lmcache loaded into vLLM's KV cache, by the tier it came from. Counted after "
        "the copy succeeded; a failed load is a miss.",
        {
            Tier.CPU: "hit_tokens_cpu",
            Tier.DISK: "hit_tokens_disk",
            Tier.REMOTE: "hit_tokens_remote",
        },
    ),
    _c(
        "lmcache_block_hit_tokens",
        "Tokens of lmcache_hit_tokens loaded from a block-aligned prefix of a longer or different entry "
        "(block-granular reuse).",
        "block_hit_tokens",
    ),
    _by_tier(
        "lmcache_loaded_bytes",
        COUNTER,
        "KV bytes loaded into vLLM's KV cache, by the tier they came from.",
        {
            Tier.CPU: "hit_bytes_cpu",
            Tier.DISK: "hit_bytes_disk",
            Tier.REMOTE: "hit_bytes_remote",
        },
    ),
    _c("lmcache_store_requests", "Store requests (vLLM handed computed KV to lmcache).", "store_requests"),
    _c("lmcache_stored_tokens", "Tokens newly stored (CPU tier, written through to disk/remote).", "stored_tokens"),
    _by_tier(
        "lmcache_stored_bytes",
        COUNTER,
        "Bytes stored, by tier: cpu = chunks put into the CPU tier; disk/remote = writes completed.",
        {
            Tier.CPU: "stored_bytes",
            Tier.DISK: "disk_bytes_written",
            Tier.REMOTE: "remote_bytes_written",
        },
    ),
    _c("lmcache_load_errors", "Loads that failed or came back short (the tokens were recomputed).", "load_errors"),
    _by_tier(
        "lmcache_evictions",
        COUNTER,
        "Entries evicted to make room, by tier.",
        {
            Tier.CPU: "evictions",
            Tier.DISK: "disk_evictions",
        },
    ),
    _by_tier(
        "lmcache_corrupt_entries",
        COUNTER,
        "Entries that failed verification (checksum, key or format) and were deleted, by tier.",
        {
            Tier.DISK: "disk_corrupt_entries",
            Tier.REMOTE: "remote_corrupt_entries",
        },
    ),
    _by_tier(
        "lmcache_write_errors",
        COUNTER,
        "Writes that failed with an error, by tier.",
        {
            Tier.DISK: "disk_write_errors",
            Tier.REMOTE: "remote_write_errors",
        },
    ),
    _by_tier(
        "lmcache_dropped_writes",
        COUNTER,
        "Writes not done: pool/queue/budget full, no space, entry too large or tier unavailable, by tier "
        "(cpu counts chunks).",
        {
            Tier.CPU: "store_skipped_chunks",
            Tier.DISK: ("disk_puts_dropped_queue_full", "disk_puts_rejected_no_space", "disk_puts_rejected_too_large"),
            Tier.REMOTE: ("remote_puts_dropped_inflight_full", "remote_puts_skipped_unavailable"),
        },
    ),
    _c("lmcache_remote_errors", "Failed remote calls (connection loss, timeouts, errors).", "remote_errors"),
    _c("lmcache_remote_breaker_trips", "Times the remote breaker opened (one per outage).", "remote_breaker_open"),
    MetricDef(
        "lmcache_remote_available",
        GAUGE,
        "1 while the remote tier is reachable, 0 while its breaker is open or it is disabled.",
        None,
        (("", ("remote_available",)),),
    ),
    _by_tier(
        "lmcache_pool_used_bytes",
        GAUGE,
        "Bytes in use, by tier (cpu = the memory pool, disk = entry files).",
        {
            Tier.CPU: "pool_used_bytes_cpu",
            Tier.DISK: "pool_used_bytes_disk",
        },
    ),
    _by_tier(
        "lmcache_pool_capacity_bytes",
        GAUGE,
        "Configured capacity in bytes, by tier.",
        {
            Tier.CPU: "pool_capacity_bytes_cpu",
            Tier.DISK: "pool_capacity_bytes_disk",
        },
    ),
    _c(
        "lmcache_encoder_cache_lookups",
        "Encoder-cache lookups (vLLM's scheduler asked whether an encoder output is cached).",
        "ec_lookups",
    ),
    _c("lmcache_encoder_cache_lookup_hits", "Encoder-cache lookups that answered cached.", "ec_lookup_hits"),
    _c("lmcache_encoder_cache_hits", "Encoder outputs loaded from the encoder cache.", "ec_hits"),
    _c(
        "lmcache_encoder_cache_misses",
        "Encoder-cache loads that found nothing or failed (the encoder ran instead).",
        "ec_misses",
    ),
    _c("lmcache_encoder_cache_stores", "Encoder outputs stored in the encoder cache.", "ec_puts"),
    _c(
        "lmcache_pd_sent_requests",
        "Disaggregated prefills answered with the decoder leg's parameters (prefiller).",
        "scheduler_pd_sent_requests",
    ),
    _c(
        "lmcache_pd_received_requests",
        "Disaggregated decodes that looked for a prefiller's KV (decoder).",
        "scheduler_pd_received_requests",
    ),
    _c(
        "lmcache_pd_waits",
        "Scheduler lookups answered 'ask again later' while a decoder waited for announced KV.",
        "scheduler_pd_waits",
    ),
    _c(
        "lmcache_pd_fallbacks",
        "Disaggregated decodes that computed (part of) the prompt themselves: the KV did not arrive within "
        "pd_wait_timeout, the remote tier was down, or pd_max_waiting requests were already waiting.",
        "scheduler_pd_fallbacks",
    ),
    _c(
        "lmcache_pd_refused",
        "Requests whose kv_transfer_params were not honoured (unsigned or forged do_remote_prefill, or a "
        "parameter this node's pd_role does not take); served as normal requests.",
        "scheduler_pd_refused",
    ),
    _c(
        "lmcache_pd_wait_refused",
        "Disaggregated decodes computed at once because pd_max_waiting requests were already waiting.",
        "scheduler_pd_wait_refused",
    ),
    _c(
        "lmcache_pd_remote_down",
        "Disaggregated decodes computed at once because the remote tier's breaker was open.",
        "scheduler_pd_remote_down",
    ),
    _c(
        "lmcache_pd_fingerprint_mismatches",
        "Disaggregated decodes whose prefiller has another model namespace, world size, dtype, chunk size or "
        "entry format (computed here; the log line names the field).",
        "scheduler_pd_fingerprint_mismatches",
    ),
    _c("lmcache_blend_requests", "Prompts whose KV was blended from cached documents (CacheBlend).", "blend_requests"),
    _c(
        "lmcache_blend_reused_tokens",
        "Tokens of blended prompts that kept their cached document KV (not recomputed).",
        "blend_reused_tokens",
    ),
    _c(
        "lmcache_blend_recomputed_tokens",
        "Tokens of blended prompts computed through every layer (new text, separators, selected tokens).",
        "blend_recomputed_tokens",
    ),
    _c("lmcache_blend_failures", "Blends that failed; the prompt was recomputed by vLLM.", "blend_failures"),
    _c(
        "lmcache_blend_stored_segment_tokens",
        "Tokens stored under segment keys (documents for later blends).",
        "blend_stored_segment_tokens",
    ),
    _c("lmcache_async_loads", "Hits loaded asynchronously while other requests ran.", "async_loads"),
    MetricDef(
        "lmcache_async_loads_in_flight",
        GAUGE,
        "Asynchronous loads (and blends) started and not yet handed back to vLLM.",
        None,
        (("", ("async_loads_in_flight",)),),
    ),
    _by_tier(
        "lmcache_prefetch_tokens",
        COUNTER,
        "Tokens of asynchronous loads the prefetch read from disk or Redis into the CPU tier (their "
        "hits count as tier cpu in lmcache_hit_tokens: the copy reads them there).",
        {Tier.DISK: "prefetch_tokens_disk", Tier.REMOTE: "prefetch_tokens_remote"},
    ),
    _c(
        "lmcache_async_load_timeouts",
        "Asynchronous loads past async_load_timeout (what the CPU tier did not hold was recomputed).",
        "async_load_timeouts",
    ),
    _c(
        "lmcache_async_background_copies",
        "Asynchronous loads copied into vLLM's blocks by the prefetch thread (no step copied them).",
        "async_background_copies",
    ),
    _c(
        "lmcache_shared_reads",
        "Disk or remote reads joined to a read of the same entry already in flight (not read twice).",
        "shared_reads",
    ),
    _c(
        "lmcache_recurrent_states_stored",
        "Recurrent states of hybrid models (Mamba / linear attention) stored beside the KV.",
        "recurrent_states_stored",
    ),
    _c(
        "lmcache_recurrent_states_loaded",
        "Recurrent states of hybrid models restored with a load.",
        "recurrent_states_loaded",
    ),
    _c(
        "lmcache_blend_stored_result_tokens",
        "Tokens of blended prompts stored as blend results (reused when the prompt is sent again).",
        "blend_stored_result_tokens",
    ),
    _c("lmcache_hidden_state_requests", "Hidden-state retrieve requests.", "hidden_retrieve_requests"),
    _c("lmcache_hidden_state_hit_tokens", "Tokens whose hidden states were returned.", "hidden_hit_tokens"),
    _c(
        "lmcache_hidden_state_misses",
        "Hidden-state retrieves that returned nothing (not even the first chunk was cached).",
        "hidden_misses",
    ),
    _c("lmcache_hidden_state_stored_tokens", "Tokens whose hidden states were stored.", "hidden_stored_tokens"),
    MetricDef(
        "lmcache_hidden_state_pool_used_bytes",
        GAUGE,
        "Bytes in use in the hidden-state pool.",
        None,
        (("", ("hidden_pool_used_bytes",)),),
    ),
)

HISTOGRAMS: tuple[tuple[str, str, str], ...] = (
    ("store", "lmcache_store_seconds", "Seconds per store (bulk mode): hashing, allocation and copy."),
    ("retrieve", "lmcache_retrieve_seconds", "Seconds per load (bulk mode): tier reads and copy into vLLM's KV."),
    ("lookup", "lmcache_lookup_seconds", "Seconds per lookup in the worker that holds the cache."),
    ("blend", "lmcache_blend_seconds", "Seconds per blend: segment reads, re-rotation and the selective recompute."),
    ("async_load", "lmcache_async_load_seconds",
     "Seconds a request waited for its asynchronous load: prefetch into the CPU tier and copy."),
)


def _key_index() -> dict[str, tuple[MetricDef, str]]:
    index: dict[str, tuple[MetricDef, str]] = {}
    for m in METRICS:
        for label, keys in m.sources:
            for key in keys:
                index[key] = (m, label)
    return index


KEY_INDEX = _key_index()
"""snapshot key -> (metric, label value)."""
BY_NAME = {m.name: m for m in METRICS}


# ------------------------------------------------------------------------ worker side
class StatsDelta:
    """Turns successive snapshots of one worker into payloads (see the module docstring).

    ``snapshot_fn`` returns :func:`~.snapshot.engine_snapshot`-style dicts;
    ``latency`` maps op names to :class:`~lmcache.v1.stats.LatencyHistogram` (this
    starts their export). Not thread-safe: one caller (the worker thread).
    """

    def __init__(
        self, snapshot_fn: Callable[[], Mapping[str, float]], *, rank: int = 0, latency: Mapping[str, Any] | None = None
    ) -> None:
        self._snapshot_fn = snapshot_fn
        self.rank = rank
        self._latency = dict(latency or {})
        for hist in self._latency.values():
            hist.start_export()
        self._last: dict[str, float] = {}
        self._last_gauges: dict[str, float] = {}

    def collect(self) -> dict[str, Any] | None:
        """The payload since the previous call, or None when nothing changed."""
        snap = self._snapshot_fn()
        counters: dict[str, float] = {}
        gauges: dict[str, float] = {}
        for key, value in snap.items():
            if key not in KEY_INDEX:
                continue
            if key in GAUGE_KEYS:
                if self._last_gauges.get(key) != value:
                    gauges[f"{key}@r{self.rank}"] = value
                    self._last_gauges[key] = value
                continue
            if self.rank != 0 and rank0_only(key):
                continue
            delta = value - self._last.get(key, 0)
            if delta:
                counters[key] = delta
                self._last[key] = value
        hists = {op: obs for op, h in self._latency.items() if (obs := h.drain())}
        if not counters and not gauges and not hists:
            return None
        return {"c": counters, "g": gauges, "h": hists}


def merge_payloads(a: Mapping[str, Any], b: Mapping[str, Any]) -> dict[str, Any]:
    """Two payloads as one: counters added, gauges by rank (``b`` wins), observations concatenated."""
    counters = dict(a.get("c", {}))
    for key, value in b.get("c", {}).items():
        counters[key] = counters.get(key, 0) + value
    gauges = {**a.get("g", {}), **b.get("g", {})}
    hists = {op: list(obs) for op, obs in a.get("h", {}).items()}
    for op, obs in b.get("h", {}).items():
        hists.setdefault(op, []).extend(obs)
    return {"c": counters, "g": gauges, "h": hists}


def summarize_payload(payload: Mapping[str, Any]) -> dict[str, int | float]:
    """A few headline numbers of a payload (vLLM's "KV Transfer metrics" log line)."""
    c = payload.get("c", {})
    out: dict[str, int | float] = {
        "lmcache_lookup_tokens": int(c.get("lookup_tokens", 0)),
        "lmcache_hit_tokens": int(sum(c.get(f"hit_tokens_{t}", 0) for t in TIERS)),
        "lmcache_stored_tokens": int(c.get("stored_tokens", 0)),
    }
    if c.get("load_errors"):
        out["lmcache_load_errors"] = int(c["load_errors"])
    return out


# ------------------------------------------------------------------------ sink
def _unregister_lmcache_metrics() -> None:
    """Drop ``lmcache_*`` collectors from prometheus_client's default registry (a second
    sink in one process, e.g. a restarted server in tests, re-registers them)."""
    from prometheus_client import REGISTRY

    for collector in list(REGISTRY._collector_to_names):  # noqa: SLF001 - no public listing API
        if str(getattr(collector, "_name", "")).startswith("lmcache_"):
            REGISTRY.unregister(collector)


class PromSink:
    """Registers the ``lmcache_*`` metrics and applies payloads to them.

    ``metric_types`` maps prometheus_client's ``Counter``/``Gauge``/``Histogram`` to the
    classes to instantiate (vLLM passes its own); ``labelnames`` and
    ``per_engine_labelvalues`` are vLLM's (``model_name``, ``engine``). Gauges use
    ``gauge_mode`` in prometheus_client's multiprocess mode ("mostrecent" when one
    process holds the sum over workers, "livesum" when each worker writes its own).
    Thread-safe (one lock around :meth:`observe`).
    """

    def __init__(
        self,
        metric_types: Mapping[type, type],
        labelnames: list[str],
        per_engine_labelvalues: Mapping[int, list[Any]],
        *,
        gauge_mode: str = "mostrecent",
        registry: Any = None,
    ) -> None:
        from prometheus_client import Counter, Gauge, Histogram

        self._labelnames = list(labelnames)
        self._per_engine = {int(k): [str(v) for v in vals] for k, vals in per_engine_labelvalues.items()}
        self._metrics: dict[str, Any] = {}
        self._gauge_values: dict[tuple[int, str], dict[str, float]] = {}
        self._lock = threading.Lock()
        if registry is None:
            _unregister_lmcache_metrics()
        reg = {} if registry is None else {"registry": registry}
        for m in METRICS:
            names = self._labelnames + ([m.label] if m.label else [])
            if m.kind == COUNTER:
                metric = metric_types.get(Counter, Counter)(m.name, m.doc, labelnames=names, **reg)
            else:
                metric = metric_types.get(Gauge, Gauge)(
                    m.name, m.doc, labelnames=names, multiprocess_mode=gauge_mode, **reg
                )
            self._metrics[m.name] = metric
        for op, name, doc in HISTOGRAMS:
            self._metrics[op] = metric_types.get(Histogram, Histogram)(
                name, doc, labelnames=self._labelnames, buckets=list(LATENCY_BUCKETS), **reg
            )
        # create every child at start so that /metrics lists each series (at 0) before traffic
        for engine_idx in self._per_engine:
            for m in METRICS:
                for label, _ in m.sources:
                    self._child(self._metrics[m.name], engine_idx, label if m.label else None)
            for op, _, _ in HISTOGRAMS:
                self._child(self._metrics[op], engine_idx, None)

    def _child(self, metric: Any, engine_idx: int, label: str | None) -> Any:
        values = self._per_engine.get(engine_idx) or self._per_engine.get(0) or []
        return metric.labels(*values, *([label] if label is not None else []))

    def observe(self, payload: Mapping[str, Any], engine_idx: int = 0) -> None:
        """Apply one payload (counter deltas, gauges by rank, observations)."""
        with self._lock:
            for key, delta in payload.get("c", {}).items():
                found = KEY_INDEX.get(key)
                if found is None or delta <= 0:
                    continue
                m, label = found
                self._child(self._metrics[m.name], engine_idx, label if m.label else None).inc(delta)
            touched: set[tuple[str, str]] = set()
            for ranked, value in payload.get("g", {}).items():
                key, _, rank = ranked.rpartition("@")
                found = KEY_INDEX.get(key)
                if found is None:
                    continue
                m, label = found
                self._gauge_values.setdefault((engine_idx, m.name + "|" + label), {})[f"{key}@{rank}"] = value
                touched.add((m.name, label))
            for name, label in touched:
                m = BY_NAME[name]
                total = sum(self._gauge_values[(engine_idx, name + "|" + label)].values())
                self._child(self._metrics[name], engine_idx, label if m.label else None).set(total)
            for op, obs in payload.get("h", {}).items():
                metric = self._metrics.get(op)
                if metric is None:
                    continue
                child = self._child(metric, engine_idx, None)
                for seconds in obs:
                    child.observe(seconds)
