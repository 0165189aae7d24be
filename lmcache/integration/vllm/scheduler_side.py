"""Scheduler-side half of the adapter: lookups, request tracking, connector metadata.

Runs on vLLM's scheduler thread. Lookups block for at most the lookup timeout per
tensor-parallel rank (see :mod:`.lookup_service`); everything else is bookkeeping.
Any exception is logged once per kind and answered as "nothing cached", so a broken
cache makes vLLM compute, never fail.
"""

from __future__ import annotations

import logging
from typing import Any

from lmcache.integration.vllm.connector_metadata import LMCacheConnectorMetadata
from lmcache.integration.vllm.lookup_service import LookupClient
from lmcache.integration.vllm.metadata_builder import AdapterSettings
from lmcache.integration.vllm.request_tracker import PlannerConfig, RequestPlanner
from lmcache.integration.vllm.utils import (
    failure_logger,
    engine_for,
    register_scheduler_stats,
    socket_path,
    unregister_scheduler_stats,
)

from lmcache.v1.request import KEY_EXTRA_NAMES

logger = logging.getLogger(__name__)

class LookupDispatcher:
    """Answers "how many leading tokens are cached?" for the scheduler.

    Uses the workers' engines directly when all of them live in this process
    (single-process vLLM), otherwise the workers' lookup servers. Returns None when
    no answer can be had (the caller treats it as a miss).
    """

    def __init__(self, settings: AdapterSettings) -> None:
        self.engine_id = settings.engine_id
        self.world_size = settings.world_size
        self.paths = [socket_path(settings.socket_dir, settings.engine_id, r) for r in range(settings.world_size)]
        self.timeout = settings.lookup_timeout
        self._client: LookupClient | None = None
        self.used_socket = False

    def lookup(self, tokens: list[int], extras: dict[str, Any]) -> int | None:
        engines = [engine_for(self.engine_id, r) for r in range(self.world_size)]
        if all(e is not None for e in engines):
            return min(e.lookup(tokens, **extras) for e in engines if e is not None)
        if self._client is None:
            self._client = LookupClient(self.paths, timeout=self.timeout)
        self.used_socket = True
        return self._client.lookup(tokens, extras)

    @property
    def last_error(self) -> str | None:
        return self._client.last_error if self._client is not None else None

    def close(self) -> None:
        if self._client is not None:
            self._client.close()


class SchedulerConnector:
    """The scheduler-role methods of ``LMCacheConnectorV1Impl``."""

    def __init__(self, settings: AdapterSettings, *, lookups: LookupDispatcher | None = None) -> None:
        self.settings = settings
        self.planner = RequestPlanner(
            PlannerConfig(
                chunk_size=settings.chunk_size,
                block_size=settings.block_size,
                save_unfull_chunk=settings.config.save_unfull_chunk,
                enable_load=settings.enable_load,
                enable_save=settings.enable_save,
            )
        )
        self.lookups = lookups if lookups is not None else LookupDispatcher(settings)
        self.warn = failure_logger(logger)
        self.counters = {"lookups": 0, "lookup_failures": 0, "offered_tokens": 0, "accepted_tokens": 0}
        """Scheduler-side counters (scheduler thread only); see :meth:`snapshot`."""
        register_scheduler_stats(settings.engine_id, self.snapshot)

    def snapshot(self) -> dict[str, int]:
        """Counters of this scheduler side and its planner, ``scheduler_``-prefixed."""
        merged = {**self.counters, **self.planner.counters}
        return {f"scheduler_{k}": int(v) for k, v in merged.items()}

    def get_num_new_matched_tokens(self, request: Any, num_computed_tokens: int) -> int:
        try:
            tokens = self.planner.lookup_tokens(request)
            if tokens is None:
                return 0
            tracker = self.planner.track(request)
            extras = {k: v for k, v in (tracker.key_extras if tracker else {}).items() if k in KEY_EXTRA_NAMES}
            self.counters["lookups"] += 1
            hit = self.lookups.lookup(tokens, extras)
            if hit is None:
                self.counters["lookup_failures"] += 1
                self.warn("lookup", "lmcache: lookup unavailable (%s); treating as a miss", self.lookups.last_error)
                hit = 0
            offered = self.planner.offer(request, num_computed_tokens, hit)
            logger.debug(
                "lmcache: lookup %s: %d of %d tokens cached, %d offered to vLLM",
                request.request_id, hit, len(tokens), offered,
            )  # fmt: skip
        except Exception as exc:  # noqa: BLE001 - a cache failure is a miss
            self.counters["lookup_failures"] += 1
            self.warn("lookup", "lmcache: lookup failed (%s: %s); treating as a miss", type(exc).__name__, exc)
            return 0
        self.counters["offered_tokens"] += offered
        return offered

    def update_state_after_alloc(self, request: Any, num_external_tokens: int) -> None:
        try:
            self.planner.on_alloc(request, num_external_tokens)
            self.counters["accepted_tokens"] += max(0, int(num_external_tokens))
        except Exception as exc:  # noqa: BLE001
            self.warn("alloc", "lmcache: tracking request failed (%s: %s)", type(exc).__name__, exc)

    def build_connector_meta(self, scheduler_output: Any) -> LMCacheConnectorMetadata:
        try:
            return LMCacheConnectorMetadata(self.planner.build(scheduler_output))
        except Exception as exc:  # noqa: BLE001
            self.warn(
                "meta",
                "lmcache: building connector metadata failed (%s: %s); nothing loaded or saved this step",
                type(exc).__name__,
                exc,
            )
            return LMCacheConnectorMetadata()

    def request_finished(self, request: Any, block_ids: list[int]) -> tuple[bool, dict[str, Any] | None]:
        """Saves are synchronous (done in ``wait_for_save``): blocks can be freed at once."""
        self.planner.finish(request.request_id)
        return False, None

    def close(self) -> None:
        unregister_scheduler_stats(self.settings.engine_id, self.snapshot)
        self.lookups.close()
