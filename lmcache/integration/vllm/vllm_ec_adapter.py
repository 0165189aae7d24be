"""vLLM encoder-cache (EC) connector backed by :class:`lmcache.v1.ec_engine.ECCacheEngine`.

Load it with::

    ECTransferConfig(
        ec_connector="LMCacheECConnector",
        ec_role="ec_both",
        ec_connector_module_path="lmcache.integration.vllm.vllm_ec_adapter",
    )

vLLM builds one connector per role: a scheduler-side instance (asks "is this item
cached?" and plans loads) and a worker-side one (fills vLLM's ``encoder_cache`` dict
before the model runs, and saves each freshly encoded item). Both roles build the
full storage stack (CPU pool, plus disk / remote as configured) -- the scheduler's
``has_cache_item`` must see the same tiers the worker loads from. Connectors of one
process that serve the same model, encoder dtype and EC config share one engine, so
a scheduler sees what a worker in the same process stored even without a disk tier.

Per step: scheduler ``has_cache_item`` -> ``update_state_after_alloc`` (records the
hits to load) -> ``build_connector_meta`` (hands them to the worker and forgets
them) -> worker ``start_load_caches`` (one ``ECCacheEngine.get`` per item) -> the
encoder runs for the items not loaded -> ``save_caches`` per encoded item.

Configuration comes from :func:`lmcache.v1.config.load_ec_engine_config`.
"""

from __future__ import annotations

import atexit
import json
import logging
import re
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch

from lmcache.integration.vllm.stats_registry import register_ec_stats
from lmcache.integration.vllm.vllm_compat import (
    ECConnectorBase,
    ECConnectorMetadata,
    ECConnectorRole,
    UnsupportedVLLMVersion,
    check_vllm_version,
    ec_connector_metadata,
)
from lmcache.log_once import LogOnce
from lmcache.v1.config import ConfigError, LMCacheEngineConfig, load_ec_engine_config
from lmcache.v1.ec_engine import ECCacheEngine, ECStats
from lmcache.v1.metadata import dtype_name
from lmcache.v1.registry import Registry

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.request import Request

logger = logging.getLogger(__name__)

STORAGE_ROLE = "worker"
"""Both vLLM roles build the worker's full storage stack (see the module docstring)."""


# ----------------------------------------------------------------------------- metadata
@dataclass(slots=True)
class ECLoadItem:
    """One encoder output the worker should load: its ``mm_hash`` and number of embeddings."""

    mm_hash: str
    num_embeds: int


@dataclass
class LMCacheECConnectorMetadata(ECConnectorMetadata):
    """Scheduler -> worker message of one step: the items to load (plain data, picklable)."""

    mm_datas: list[ECLoadItem] = field(default_factory=list)


# ----------------------------------------------------------------------------- shared engines
_PROCESS_STATS = ECStats()
"""Counters of every EC engine this process created (tests read them via :func:`ec_connector_stats`)."""


_ENGINES: Registry[str, ECCacheEngine] = Registry()
"""The process's EC engines by (config, model, dtype), shared by counted connectors."""


def _engine_id(config: LMCacheEngineConfig, model_name: str, encoder_dtype: torch.dtype) -> str:
    return json.dumps([model_name, dtype_name(encoder_dtype), config.to_dict()], sort_keys=True, default=str)


def acquire_ec_engine(config: LMCacheEngineConfig, model_name: str, encoder_dtype: torch.dtype) -> ECCacheEngine:
    """The process's engine for this (config, model, dtype), created on first use.

    Each call must be matched by one :func:`release_ec_engine`.
    """
    return _ENGINES.get_or_create(
        _engine_id(config, model_name, encoder_dtype),
        lambda: ECCacheEngine(config, model_name, encoder_dtype, stats=_PROCESS_STATS),
        acquire=True,
    )


def release_ec_engine(engine: ECCacheEngine) -> None:
    """Drop one user of ``engine``; the last one closes it (pending disk/remote writes are finished first)."""
    if _ENGINES.release(engine):
        engine.close()


def ec_connector_stats() -> dict[str, int]:
    """Counters summed over every EC engine this process created (also closed ones).

    ``hits``/``misses`` count worker-side loads, ``lookups``/``lookup_hits`` the
    scheduler's ``has_cache_item`` answers, ``puts`` the encoder outputs stored.
    """
    return _PROCESS_STATS.snapshot()


register_ec_stats(ec_connector_stats)  # the KV connector's metrics and collect_stats report them


def flush_ec_engines(timeout: float | None = None) -> bool:
    """Wait until every live engine's pending lower-tier writes finished; True if all did."""
    return all([e.flush(timeout) for e in _ENGINES.values()])


@atexit.register
def close_all_ec_engines() -> None:
    """Close every EC engine of this process, whoever still uses it (run at exit; tests call it too)."""
    for engine in _ENGINES.clear():
        engine.close()


_REQUEST_SCOPED_ID = re.compile(r"^renderer\d+-mm-\d+-")
"""vLLM's stand-in identifier when it skips content hashing: a per-process request counter."""


def _content_hashing_disabled(vllm_config: VllmConfig) -> bool:
    """True when vLLM names items by request counters instead of content hashes.

    vLLM skips hashing when both the multimodal processor cache
    (``mm_processor_cache_gb=0``) and prefix caching are off; then the same
    identifier means different images in different processes. Explicit
    ``multi_modal_uuids`` are kept as given.
    """
    mm_config = getattr(vllm_config.model_config, "multimodal_config", None)
    cache_config = getattr(vllm_config, "cache_config", None)
    return (
        mm_config is not None
        and getattr(mm_config, "mm_processor_cache_gb", None) == 0
        and not getattr(cache_config, "enable_prefix_caching", False)
    )


def _target_device(vllm_config: VllmConfig) -> torch.device:
    device = getattr(vllm_config.device_config, "device", None)
    if isinstance(device, torch.device):
        return device
    return torch.device(getattr(vllm_config.device_config, "device_type", None) or "cpu")


# ----------------------------------------------------------------------------- implementation
class LMCacheECConnectorImpl:
    """The connector's logic, independent of vLLM's class hierarchy.

    ``parent`` is the :class:`ECConnectorBase` that vLLM calls; it provides
    ``is_producer``, ``is_consumer`` and the bound per-step metadata.

    Calling thread: vLLM's engine-core thread (scheduler methods) and the model
    runner's thread (worker methods). Scheduler methods ask the tiers whether an
    entry exists (no payload read); ``start_load_caches`` and ``save_caches`` block
    for one copy per item. Memory: tensors placed in ``encoder_cache`` are new
    tensors owned by vLLM; ``save_caches`` copies and keeps no reference.

    A miss where a hit was planned (an entry evicted between the scheduler's check
    and the worker's load) is logged and counted; vLLM then reports the missing
    encoder output for that request.
    """

    def __init__(self, vllm_config: VllmConfig, role: ECConnectorRole, parent: ECConnectorBase) -> None:
        self._parent = parent
        self.role = role
        try:  # first: an unsupported vLLM or a bad configuration fails before anything is built, in one line
            check_vllm_version()
        except UnsupportedVLLMVersion as exc:
            logger.error("lmcache encoder cache cannot run with this vLLM: %s", exc)
            raise
        try:
            self.config = load_ec_engine_config()
        except ConfigError as exc:
            logger.error("lmcache encoder cache configuration error: %s", exc)
            raise
        model_config = vllm_config.model_config
        self.model_name: str = self.config.model_namespace or model_config.model
        self.encoder_dtype: torch.dtype = model_config.dtype
        self.device = _target_device(vllm_config)
        self.engine = acquire_ec_engine(self.config, self.model_name, self.encoder_dtype)
        # scheduler-side state; created on both roles, used on the scheduler only
        self._mm_hashes_need_loads: dict[str, int] = {}
        self._answered_hit: set[str] = set()
        self._log_once = LogOnce(logger)
        self._closed = False
        self._skip_request_scoped_ids = _content_hashing_disabled(vllm_config)
        if self._skip_request_scoped_ids:
            logger.warning(
                "encoder cache: vLLM runs with mm_processor_cache_gb=0 and prefix caching off, so it does not "
                "hash multimodal content; only items with explicit multi_modal_uuids are cached"
            )
        logger.info(
            "LMCache EC connector (%s role, storage role %s): model=%s encoder_dtype=%s local_disk=%s remote=%s",
            getattr(role, "name", role),
            STORAGE_ROLE,
            self.model_name,
            dtype_name(self.encoder_dtype),
            self.config.local_disk,
            "on" if self.config.remote_url is not None else "off",
        )

    # ------------------------------------------------------------------ scheduler side
    def _cacheable(self, identifier: str) -> bool:
        return not (self._skip_request_scoped_ids and _REQUEST_SCOPED_ID.match(identifier))

    def has_cache_item(self, identifier: str) -> bool:
        """Whether the encoder output of ``identifier`` (an mm_hash) is cached in some tier."""
        if not self._cacheable(identifier):
            return False
        found = self.engine.contains(identifier)
        if found:
            self._answered_hit.add(identifier)
        return found

    def update_state_after_alloc(self, request: Request, index: int) -> None:
        """Plan a load of the request's ``index``-th item if it is cached and we consume.

        An item that ``has_cache_item`` reported as cached in this step is always
        planned: vLLM skips its encoder run and relies on the load.
        """
        if not self._parent.is_consumer:
            return
        feature = request.mm_features[index]
        mm_hash = feature.identifier
        if mm_hash in self._mm_hashes_need_loads or not self._cacheable(mm_hash):
            return
        if mm_hash in self._answered_hit or self.engine.contains(mm_hash):
            self._mm_hashes_need_loads[mm_hash] = int(request.get_num_encoder_embeds(index))

    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> LMCacheECConnectorMetadata:
        """This step's load plan for the worker; the pending plan is cleared."""
        meta = LMCacheECConnectorMetadata([ECLoadItem(h, n) for h, n in self._mm_hashes_need_loads.items()])
        self._mm_hashes_need_loads.clear()
        self._answered_hit.clear()
        return meta

    # ------------------------------------------------------------------ worker side
    def start_load_caches(self, encoder_cache: dict[str, torch.Tensor], **kwargs: Any) -> None:
        """Put each planned, cached item into ``encoder_cache`` (items already there are skipped)."""
        metadata = ec_connector_metadata(self._parent)
        if not isinstance(metadata, LMCacheECConnectorMetadata):
            raise TypeError(
                f"connector metadata={type(metadata).__name__}: expected LMCacheECConnectorMetadata "
                "(scheduler and worker must both use LMCacheECConnector)"
            )
        for item in metadata.mm_datas:
            if item.mm_hash in encoder_cache:
                continue
            tensor = self.engine.get(item.mm_hash, self.device)
            if tensor is None:
                logger.warning(
                    "encoder cache: planned load of mm_hash %s missed (evicted or unreadable since lookup)",
                    item.mm_hash,
                )
                continue
            encoder_cache[item.mm_hash] = tensor

    def save_caches(self, encoder_cache: dict[str, torch.Tensor], mm_hash: str, **kwargs: Any) -> None:
        """Store ``encoder_cache[mm_hash]`` (a producer's freshly encoded item)."""
        if not self._parent.is_producer or not self._cacheable(mm_hash):
            return
        tensor = encoder_cache.get(mm_hash)
        if not isinstance(tensor, torch.Tensor):
            self._log_once(
                logging.WARNING,
                "not-tensor",
                "encoder cache: encoder output for %s is %s, not a tensor; not cached (logged once)",
                mm_hash,
                type(tensor).__name__,
            )
            return
        self.engine.put(mm_hash, tensor)

    # ------------------------------------------------------------------ lifecycle
    def close(self) -> None:
        """Release this connector's engine (closed, after pending writes, when no connector uses it). Idempotent."""
        if self._closed:
            return
        self._closed = True
        release_ec_engine(self.engine)


class LMCacheECConnector(ECConnectorBase):
    """vLLM ``ECConnectorBase`` that forwards to :class:`LMCacheECConnectorImpl`."""

    def __init__(self, vllm_config: VllmConfig, role: ECConnectorRole) -> None:
        super().__init__(vllm_config=vllm_config, role=role)
        self._impl = LMCacheECConnectorImpl(vllm_config, role, self)

    @property
    def impl(self) -> LMCacheECConnectorImpl:
        """The connector's logic (independent of vLLM's class hierarchy)."""
        return self._impl

    @property
    def engine(self) -> ECCacheEngine:
        """The encoder-cache engine this connector uses (shared within the process)."""
        return self._impl.engine

    # worker side
    def start_load_caches(self, encoder_cache: dict[str, torch.Tensor], **kwargs: Any) -> None:
        self._impl.start_load_caches(encoder_cache, **kwargs)

    def save_caches(self, encoder_cache: dict[str, torch.Tensor], mm_hash: str, **kwargs: Any) -> None:
        self._impl.save_caches(encoder_cache, mm_hash, **kwargs)

    # scheduler side
    def has_cache_item(self, identifier: str) -> bool:
        return self._impl.has_cache_item(identifier)

    def update_state_after_alloc(self, request: Request, index: int) -> None:
        self._impl.update_state_after_alloc(request, index)

    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> ECConnectorMetadata:
        return self._impl.build_connector_meta(scheduler_output)

    def shutdown(self) -> None:
        self._impl.close()
