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

Every vLLM class it derives from or calls comes from :mod:`.vllm_compat` (the version shims).
Sleep mode (vLLM 0.33+) is declined: :meth:`supports_sleep_mode` answers False, so vLLM
refuses ``--enable-sleep-mode`` with this connector at start-up; the two sleep hooks are
still safe if called (docs/vllm.md, "Version support").
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import TYPE_CHECKING, Any

from lmcache.integration.vllm.kv_events import to_vllm_events
from lmcache.integration.vllm.kv_groups import refuse_unsupported_model
from lmcache.integration.vllm.metrics import LMCacheKVConnectorStats, LMCachePromMetrics
from lmcache.integration.vllm.vllm_compat import (
    KVCacheEvent,
    KVConnectorBase_V1,
    KVConnectorKVEvents,
    KVConnectorMetadata,
    KVConnectorRole,
    KVConnectorTransferResults,
    KVEventAggregator,
    SupportsHMA,
    check_vllm_version,
    connector_output_events,
)
from lmcache.integration.vllm.vllm_v1_adapter import LMCacheConnectorV1Impl

if TYPE_CHECKING:
    import torch
    from vllm.config import VllmConfig
    from vllm.config.kv_transfer import KVTransferConfig
    from vllm.distributed.kv_transfer.kv_connector.v1.metrics import KVConnectorPromMetrics, KVConnectorStats
    from vllm.forward_context import ForwardContext
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.kv_cache_interface import KVCacheConfig
    from vllm.v1.outputs import KVConnectorOutput
    from vllm.v1.request import Request

    from lmcache.v1.cache_engine import LMCacheEngine


class LMCacheConnectorKVEvents(KVConnectorKVEvents):
    """lmcache's KV events of one step, merged over workers (vLLM keeps the events every
    worker reported; lmcache's event hashes are the same on every tensor-parallel rank)."""

    def __init__(self, num_workers: int = 1) -> None:
        self._agg = KVEventAggregator(num_workers)

    def add_events(self, events: list[KVCacheEvent]) -> None:
        self._agg.add_events(events)

    def aggregate(self) -> LMCacheConnectorKVEvents:
        common = self._agg.get_common_events()
        self._agg.clear_events()
        self._agg.add_events(common)
        self._agg.reset_workers()
        return self

    def increment_workers(self, count: int = 1) -> None:
        self._agg.increment_workers(count)

    def get_all_events(self) -> list[KVCacheEvent]:
        return self._agg.get_all_events()

    def get_number_of_workers(self) -> int:
        return self._agg.get_number_of_workers()

    def clear_events(self) -> None:
        self._agg.clear_events()
        self._agg.reset_workers()


class LMCacheConnectorV1Dynamic(KVConnectorBase_V1, SupportsHMA):
    """vLLM KV connector backed by lmcache (loadable via ``kv_connector_module_path``).

    Unlike vLLM's built-in wrapper it forwards vLLM's connector-metrics hooks, so the
    ``lmcache_*`` metrics appear in vLLM's ``/metrics`` with nothing to set
    (:mod:`.metrics`, route a), and it declares ``SupportsHMA``: vLLM keeps its hybrid KV
    cache manager on, so a model mixing sliding-window and full attention keeps only the
    window's blocks for its sliding layers (:mod:`.kv_groups`).
    """

    forwards_connector_stats = True
    """Read by the impl: metrics go through :meth:`get_kv_connector_stats`."""

    def __init__(
        self, vllm_config: VllmConfig, role: KVConnectorRole, kv_cache_config: KVCacheConfig | None = None
    ) -> None:
        super().__init__(vllm_config=vllm_config, role=role, kv_cache_config=kv_cache_config)
        self._impl = LMCacheConnectorV1Impl(vllm_config, role, self)
        self._kv_events: LMCacheConnectorKVEvents | None = None

    @property
    def impl(self) -> LMCacheConnectorV1Impl:
        """The connector's logic (independent of vLLM's class hierarchy)."""
        return self._impl

    @property
    def engine(self) -> LMCacheEngine | None:
        """This worker's lmcache engine (None on the scheduler role or when disabled)."""
        return self._impl.engine

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

    def get_transfer_results(self, finished_req_ids: set[str]) -> KVConnectorTransferResults:
        """:meth:`get_finished`, plus the asynchronous loads that failed as a whole (several KV
        cache groups: vLLM then recomputes those requests from their start)."""
        sending, recving = self._impl.get_finished(finished_req_ids)
        failed = self._impl.take_failed_loads()
        return KVConnectorTransferResults(
            finished_sending=set(sending or ()), finished_recving=set(recving or ()) | failed, failed_recving=failed
        )

    def get_block_ids_with_load_errors(self) -> set[int]:
        return self._impl.get_block_ids_with_load_errors()

    def shutdown(self) -> None:
        self._impl.close()

    # ------------------------------------------------------------------ sleep mode (vLLM 0.33+)
    @classmethod
    def supports_sleep_mode(cls, kv_transfer_config: KVTransferConfig) -> bool:
        """Declined: lmcache copies from and to the KV tensors vLLM registered at start-up and
        cannot follow a sleeping engine's remap of them (vLLM then refuses sleep mode)."""
        return False

    def unregister_kv_caches(self) -> None:
        """Not reached while :meth:`supports_sleep_mode` is False; if called, this worker drops
        every reference to vLLM's KV tensors and stops caching. Idempotent."""
        self._impl.unregister_kv_caches()

    def restore_kv_caches(self) -> None:
        """After :meth:`unregister_kv_caches`: the cache stays off on this worker (vLLM passes
        no tensors to re-register). Idempotent."""
        self._impl.restore_kv_caches()

    # ------------------------------------------------------------------ KV events
    def get_kv_connector_kv_cache_events(self) -> KVConnectorKVEvents | None:
        """Worker side, every step: this worker's stored/removed chunk events."""
        events = self._impl.take_kv_events()
        if not events:
            return None
        out = LMCacheConnectorKVEvents(num_workers=1)
        out.add_events(to_vllm_events(events))
        return out

    def update_connector_output(self, connector_output: KVConnectorOutput) -> None:
        """Scheduler side: collect the workers' events for :meth:`take_events`."""
        events = connector_output_events(connector_output)
        if not isinstance(events, LMCacheConnectorKVEvents):
            return
        if self._kv_events is None:
            self._kv_events = events
        else:
            self._kv_events.add_events(events.get_all_events())
            self._kv_events.increment_workers(events.get_number_of_workers())

    def take_events(self) -> Iterable[KVCacheEvent]:
        """Scheduler side: the events vLLM's publisher sends this step."""
        if self._kv_events is None:
            return ()
        batch, self._kv_events = self._kv_events, None
        return batch.aggregate().get_all_events()

    @classmethod
    def get_required_kvcache_layout(cls, vllm_config: VllmConfig) -> str | None:
        """No layout preference; used as vLLM's earliest class hook to refuse a model lmcache
        cannot cache (an attention-free model) with a clear reason, before vLLM's own checks
        fail with a message that does not name the connector. An unsupported
        vLLM release is refused here too (one line naming the supported range)."""
        check_vllm_version()
        refuse_unsupported_model(vllm_config, hma=True)
        return None

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
        return self._impl.match(request, num_computed_tokens)

    def update_state_after_alloc(self, request: Request, blocks: KVCacheBlocks, num_external_tokens: int) -> None:
        block_ids = blocks.get_block_ids() if num_external_tokens and blocks is not None else None
        self._impl.update_state_after_alloc(request, num_external_tokens, block_ids)

    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> KVConnectorMetadata:
        return self._impl.build_connector_meta(scheduler_output)

    def request_finished(self, request: Request, block_ids: list[int]) -> tuple[bool, dict[str, Any] | None]:
        return self._impl.request_finished(request, block_ids)

    def request_finished_all_groups(
        self, request: Request, block_ids: tuple[list[int], ...]
    ) -> tuple[bool, dict[str, Any] | None]:
        """vLLM's hook with the hybrid KV cache manager on (every request, one block list per
        group): saves are synchronous, so this is :meth:`request_finished`."""
        return self._impl.request_finished(request, block_ids[0] if block_ids else [])
