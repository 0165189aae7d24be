"""Observability: logging set-up, the stats snapshot, Prometheus metrics, the periodic summary.

See docs/observability.md. Nothing here imports vLLM; the vLLM side of the metrics
and KV events lives in :mod:`lmcache.integration.vllm.metrics` and
:mod:`lmcache.integration.vllm.kv_events`.
"""

from lmcache.observability.logs import setup_logging

__all__ = ["setup_logging"]
