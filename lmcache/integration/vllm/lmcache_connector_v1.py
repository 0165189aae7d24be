"""``LMCacheConnectorV1Dynamic``: the connector loaded by module path.

Use it when vLLM's built-in ``LMCacheConnectorV1`` is not wanted (or not present)::

    KVTransferConfig(
        kv_connector="LMCacheConnectorV1Dynamic",
        kv_connector_module_path="lmcache.integration.vllm.lmcache_connector_v1",
        kv_role="kv_both",
        kv_load_failure_policy="recompute",
    )

It forwards every vLLM call to :class:`~.vllm_v1_adapter.LMCacheConnectorV1Impl`,
the same object vLLM's built-in connector drives, so both behave alike.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorMetadata,
    KVConnectorRole,
)

from lmcache.integration.vllm.metrics import LMCacheKVConnectorStats, LMCachePromMetrics
from lmcache.integration.vllm.vllm_v1_adapter import LMCacheConnectorV1Impl

if TYPE_CHECKING:
    import torch
    from vllm.distributed.kv_transfer.kv_connector.v1.metrics import KVConnectorPromMetrics, KVConnectorStats
    from vllm.config import VllmConfig
    from vllm.forward_context import ForwardContext
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.kv_cache_interface import KVCacheConfig
    from vllm.v1.request import Request


class LMCacheConnectorV1Dynamic(KVConnectorBase_V1):
    """vLLM KV connector backed by lmcache (loadable via ``kv_connector_module_path``).

    Unlike vLLM's built-in wrapper it forwards vLLM's connector-metrics hooks, so the
    ``lmcache_*`` metrics appear in vLLM's ``/metrics`` with nothing to set
    (:mod:`.metrics`, route a).
    """

    forwards_connector_stats = True
    """Read by the impl: metrics go through :meth:`get_kv_connector_stats`."""

    def __init__(
        self, vllm_config: VllmConfig, role: KVConnectorRole, kv_cache_config: KVCacheConfig | None = None
    ) -> None:
        super().__init__(vllm_config=vllm_config, role=role, kv_cache_config=kv_cache_config)
        self._impl = LMCacheConnectorV1Impl(vllm_config, role, self)

    @property
    def requires_kv_delivery(self) -> bool:
        """A cache, not a hand-off: a dropped save is only a future miss."""
        return False

    # ------------------------------------------------------------------ worker side
    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        self._impl.register_kv_caches(kv_caches)

    def bind_connector_metadata(self, connector_metadata: KVConnectorMetadata) -> None:
        super().bind_connector_metadata(connector_metadata)
        self._impl.bind_connector_metadata(connector_metadata)

    def start_load_kv(self, forward_context: ForwardContext, **kwargs: Any) -> None:
        self._impl.start_load_kv(forward_context, **kwargs)

    def wait_for_layer_load(self, layer_name: str) -> None:
        self._impl.wait_for_layer_load(layer_name)

    def save_kv_layer(self, layer_name: str, kv_layer: torch.Tensor, attn_metadata: Any, **kwargs: Any) -> None:
        self._impl.save_kv_layer(layer_name, kv_layer, attn_metadata, **kwargs)

    def wait_for_save(self) -> None:
        self._impl.wait_for_save()

    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str] | None, set[str] | None]:
        return self._impl.get_finished(finished_req_ids)

    def get_block_ids_with_load_errors(self) -> set[int]:
        return self._impl.get_block_ids_with_load_errors()

    def shutdown(self) -> None:
        self._impl.close()

    # ------------------------------------------------------------------ metrics (route a)
    def get_kv_connector_stats(self) -> KVConnectorStats | None:
        data = self._impl.get_kv_connector_stats()
        return LMCacheKVConnectorStats(data=data) if data else None

    @classmethod
    def build_kv_connector_stats(cls, data: dict[str, Any] | None = None) -> KVConnectorStats | None:
        return LMCacheKVConnectorStats(data=dict(data) if data else {})

    @classmethod
    def build_prom_metrics(
        cls,
        vllm_config: VllmConfig,
        metric_types: dict[type, type],
        labelnames: list[str],
        per_engine_labelvalues: dict[int, list[object]],
    ) -> KVConnectorPromMetrics | None:
        return LMCachePromMetrics(vllm_config, metric_types, labelnames, per_engine_labelvalues)

    # ------------------------------------------------------------------ scheduler side
    def get_num_new_matched_tokens(self, request: Request, num_computed_tokens: int) -> tuple[int | None, bool]:
        return self._impl.get_num_new_matched_tokens(request, num_computed_tokens), False

    def update_state_after_alloc(self, request: Request, blocks: KVCacheBlocks, num_external_tokens: int) -> None:
        self._impl.update_state_after_alloc(request, num_external_tokens)

    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> KVConnectorMetadata:
        return self._impl.build_connector_meta(scheduler_output)

    def request_finished(self, request: Request, block_ids: list[int]) -> tuple[bool, dict[str, Any] | None]:
        return self._impl.request_finished(request, block_ids)
