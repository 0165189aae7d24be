"""lmcache metrics in vLLM's ``/metrics``: the two routes of docs/observability.md.

Route (a), ``LMCacheConnectorV1Dynamic``: vLLM 0.32's connector-stats channel.

* worker process: ``get_kv_connector_stats()`` is called after every model step and
  returns :class:`LMCacheKVConnectorStats` holding a :class:`~lmcache.observability.
  metrics.StatsDelta` payload (None when nothing changed);
* vLLM merges the workers' objects (:meth:`LMCacheKVConnectorStats.aggregate`), ships
  ``to_dict()`` to the API server process in its scheduler stats, and calls
  ``build_prom_metrics`` once there and ``observe(data, engine_idx)`` per update: the
  metrics live in vLLM's registry, next to vLLM's own;
* vLLM's periodic "KV Transfer metrics" log line uses ``reduce()``.

Route (b), vLLM's built-in ``LMCacheConnectorV1`` (it does not forward
``get_kv_connector_stats``): when ``PROMETHEUS_MULTIPROC_DIR`` is set, each worker
feeds a :class:`~lmcache.observability.metrics.PromSink` of its own every step;
prometheus_client's multiprocess mode writes the values to files in that directory,
and vLLM's ``/metrics`` (which uses a ``MultiProcessCollector`` whenever the variable is
set) serves them. Gauges use the "livesum" mode (summed over live workers).

Only one route is active per worker, so nothing is counted twice.
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass, field
from typing import Any

from lmcache.integration.vllm.vllm_compat import KVConnectorPromMetrics, KVConnectorStats
from lmcache.observability.metrics import PromSink, StatsDelta, merge_payloads, summarize_payload

logger = logging.getLogger(__name__)

MULTIPROC_ENV = "PROMETHEUS_MULTIPROC_DIR"


@dataclass
class LMCacheKVConnectorStats(KVConnectorStats):
    """vLLM's container for one interval of lmcache stats (``data`` is a payload dict)."""

    data: dict[str, Any] = field(default_factory=dict)

    def reset(self) -> None:
        self.data = {}

    def aggregate(self, other: KVConnectorStats) -> KVConnectorStats:
        if other.data:
            self.data = merge_payloads(self.data, other.data) if self.data else dict(other.data)
        return self

    def reduce(self) -> dict[str, int | float]:
        return summarize_payload(self.data)

    def is_empty(self) -> bool:
        return not (self.data.get("c") or self.data.get("g") or self.data.get("h"))


class LMCachePromMetrics(KVConnectorPromMetrics):
    """The ``lmcache_*`` metrics in vLLM's API server process (route a)."""

    def __init__(
        self,
        vllm_config: Any,
        metric_types: dict[type, type],
        labelnames: list[str],
        per_engine_labelvalues: dict[int, list[object]],
    ) -> None:
        super().__init__(vllm_config, metric_types, labelnames, per_engine_labelvalues)
        self.sink = PromSink(metric_types, labelnames, per_engine_labelvalues, gauge_mode="mostrecent")

    def observe(self, transfer_stats_data: dict[str, Any], engine_idx: int = 0) -> None:
        try:
            self.sink.observe(transfer_stats_data, engine_idx)
        except Exception as exc:  # noqa: BLE001 - metrics never break vLLM's stats loop
            logger.warning("lmcache metrics: dropped an update (%s: %s)", type(exc).__name__, exc)


def served_model_name(vllm_config: Any) -> str:
    name = getattr(vllm_config.model_config, "served_model_name", None)
    if isinstance(name, (list, tuple)):
        name = name[0] if name else None
    return str(name or vllm_config.model_config.model)


class MultiprocExporter:
    """Route (b): this worker's payloads written to prometheus_client's multiprocess files.

    Built only when ``PROMETHEUS_MULTIPROC_DIR`` is set; :meth:`step` runs on the
    worker thread once per model step.
    """

    def __init__(self, delta: StatsDelta, vllm_config: Any) -> None:
        engine_idx = int(getattr(vllm_config.parallel_config, "data_parallel_rank", 0) or 0)
        self.engine_idx = engine_idx
        self.delta = delta
        labels = {engine_idx: [served_model_name(vllm_config), str(engine_idx)]}
        self.sink = PromSink({}, ["model_name", "engine"], labels, gauge_mode="livesum")

    @staticmethod
    def enabled() -> bool:
        return bool(os.environ.get(MULTIPROC_ENV))

    def step(self) -> None:
        payload = self.delta.collect()
        if payload is not None:
            self.sink.observe(payload, self.engine_idx)
