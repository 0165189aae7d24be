"""LMCache 0.5.6 configuration keys: which ones lmcache supports, renames or ignores.

Users arrive with LMCache YAML files and ``LMCACHE_*`` variables. Every top-level key
of LMCache 0.5.6 (its ``_CONFIG_DEFINITIONS`` and the aliases it still accepts) is listed
here once, with LMCache's default, so that the config loader can

* apply a supported key as usual,
* apply a renamed key under lmcache's name (one warning naming the new spelling),
* ignore an unsupported key quietly when it holds LMCache's default (a dumped LMCache
  config sets every key), and otherwise warn once, saying what to use instead.

``docs/migrating_from_lmcache.md`` renders this table; a test keeps the two in step.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

SUPPORTED = "supported"
RENAMED = "renamed"
UNSUPPORTED = "unsupported"


@dataclass(frozen=True, slots=True)
class LMCacheKey:
    """One LMCache 0.5.6 config key."""

    name: str
    default: Any
    """LMCache 0.5.6's default value."""
    status: str
    """``supported``, ``renamed`` or ``unsupported``."""
    note: str = ""
    """For ``renamed``: lmcache's key. Otherwise what differs or what to use instead."""


def _group(names: str, default_pairs: dict[str, Any], status: str, note: str) -> list[LMCacheKey]:
    return [LMCacheKey(n, default_pairs.get(n), status, note) for n in names.split()]


_INF = math.inf

_PD = "NIXL peer transfer is not built in: PD moves KV through the remote tier (`enable_pd`, `remote_url`)"
_P2P = "peer-to-peer KV sharing is not built in; share KV through the remote tier (`remote_url`)"
_CONTROLLER = "there is no cache controller / LMCache worker process; use the engine API and `stats` counters"
_GDS = "GPUDirect Storage is not supported; use the disk tier (`local_disk`, `extra_config.local_disk_o_direct`)"
_API = "there is no internal API server; read `engine.stats` / the tiers' `stats` in-process"
_LAZY = "not needed: the CPU pool is always allocated lazily, in slabs, as it fills"
_PLUGINS = "storage and runtime plugins are not supported; tiers are CPU, disk and Redis"
_STATS = "chunk statistics are not supported; see `engine.stats.snapshot()`"
_MP = "the multiprocess cache server mode is not supported; the engine runs inside each vLLM worker"

LMCACHE_056_KEYS: tuple[LMCacheKey, ...] = (
    LMCacheKey("chunk_size", 256, SUPPORTED),
    LMCacheKey("local_cpu", True, SUPPORTED),
    LMCacheKey("max_local_cpu_size", 5.0, SUPPORTED),
    LMCacheKey("local_cpu_use_hugepages", False, UNSUPPORTED,
               "the pool is allocated through torch; transparent huge pages follow the OS setting"),
    LMCacheKey("reserve_local_cpu_size", 0.0, UNSUPPORTED, "size the pool with `max_local_cpu_size` alone"),
    LMCacheKey("local_disk", None, SUPPORTED,
               "one path or a comma-separated list (one path per GPU, `paths[device % len(paths)]`); `file://` optional"),
    LMCacheKey("local_disk_path_sharding", "by_gpu", UNSUPPORTED, "paths are always chosen by GPU (`by_gpu`)"),
    LMCacheKey("max_local_disk_size", 0.0, SUPPORTED, "required (> 0) when `local_disk` is set"),
    LMCacheKey("remote_url", None, SUPPORTED,
               "Redis only: `redis://`, `rediss://`, `unix://`, `redis-cluster://`; "
               "`lm://`, `mooncakestore://`, `infinistore://` and other connectors are not supported"),
    LMCacheKey("remote_serde", "naive", UNSUPPORTED,
               "entries always use lmcache's verified entry format (like `naive`, plus checksums); no compression"),
    LMCacheKey("use_layerwise", False, SUPPORTED),
    LMCacheKey("save_decode_cache", False, SUPPORTED,
               "the vLLM adapter stores generated tokens' KV block by block (whole chunks without block reuse)"),
    LMCacheKey("pre_caching_hash_algorithm", "builtin", UNSUPPORTED,
               "chunk hashes are always chained 128-bit BLAKE2b, seed-free (see 'Chunk keys' above)"),
    LMCacheKey("enable_blending", False, SUPPORTED,
               "CacheBlend in the vLLM adapter (docs/blending.md); needs vLLM's prefix caching off"),
    LMCacheKey("blend_special_str", " # # ", SUPPORTED, "matched on its token ids (tokenized without special tokens)"),
    LMCacheKey("blend_recompute_ratios", None, SUPPORTED, "a number or a list (one per check layer); unset: 0.2 here (LMCache: 0.15), from the measured quality/speed curve"),
    LMCacheKey("blend_check_layers", None, SUPPORTED, "a layer index or a list; unset: 1"),
    LMCacheKey("blend_min_tokens", 256, SUPPORTED, "shorter prompts use prefix reuse only"),
    LMCacheKey("blend_thresholds", None, SUPPORTED, "accepted, unused (warned about): the ratios choose"),
    LMCacheKey("retrieve_locations", None, UNSUPPORTED, "every configured tier is read, L1 first"),
    LMCacheKey("store_location", None, UNSUPPORTED, "stores write through to every configured tier"),
    *_group("enable_p2p p2p_host p2p_init_ports p2p_lookup_ports", {"enable_p2p": False}, UNSUPPORTED, _P2P),
    *_group("mp_host mp_port", {"mp_port": 5555}, UNSUPPORTED, _MP),
    *_group("enable_controller lmcache_instance_id controller_pull_url controller_reply_url lmcache_worker_ports "
            "lmcache_worker_ids lmcache_worker_heartbeat_delay_time lmcache_worker_heartbeat_time",
            {"enable_controller": False, "lmcache_worker_heartbeat_delay_time": 10}, UNSUPPORTED, _CONTROLLER),
    LMCacheKey("enable_pd", False, SUPPORTED,
               "PD through the remote tier (`remote_url` required), not NIXL; see disaggregated.md"),
    LMCacheKey("pd_role", None, SUPPORTED, "`sender`, `receiver` or `both`; unset: from vLLM's `kv_role`"),
    LMCacheKey("pd_buffer_size", None, SUPPORTED,
               "bytes of KV a prefiller may have in flight to the remote tier before its stores wait"),
    LMCacheKey("pd_proxy_host", None, SUPPORTED, "accepted, unused: `lmcache proxy` needs no notification"),
    LMCacheKey("pd_proxy_port", None, SUPPORTED, "accepted, unused: `lmcache proxy` needs no notification"),
    LMCacheKey("transfer_channel", None, SUPPORTED,
               "`remote` only (KV through `remote_url`); `nixl` and `mooncake` are refused at start-up"),
    *_group("pd_buffer_device pd_peer_host pd_peer_init_port pd_peer_alloc_port "
            "pd_peer_query_port pd_allocation_timeout_sec pd_shutdown_timeout_sec "
            "pd_condition_poll_interval_sec pd_max_prefill_len pd_backend_mode pd_skip_proxy_notification "
            "pd_bidirectional nixl_backends nixl_buffer_size nixl_buffer_device",
            {"enable_pd": False, "pd_allocation_timeout_sec": _INF, "pd_shutdown_timeout_sec": 5.0,
             "pd_condition_poll_interval_sec": 0.005, "pd_max_prefill_len": 0, "pd_backend_mode": "async",
             "pd_skip_proxy_notification": False, "pd_bidirectional": False}, UNSUPPORTED, _PD),
    *_group("gds_path gds_path_sharding gds_buffer_size use_gds gds_backend",
            {"gds_path_sharding": "by_gpu", "use_gds": True, "gds_backend": "cufile"}, UNSUPPORTED, _GDS),
    *_group("maru_path maru_pool_size", {"maru_pool_size": 4.0}, UNSUPPORTED, "the Maru backend is not supported"),
    LMCacheKey("audit_actual_remote_url", None, UNSUPPORTED, "there is no audit connector"),
    LMCacheKey("internal_api_server_host", "127.0.0.1", UNSUPPORTED, _API),
    LMCacheKey("extra_config", None, SUPPORTED,
               "lmcache reads its own keys there (`local_disk_*`, `remote_*`); LMCache's (`use_odirect`, "
               "`disk_io_threads`, ...) are not read: use `local_disk_o_direct`, `local_disk_write_threads`"),
    LMCacheKey("save_unfull_chunk", False, SUPPORTED),
    LMCacheKey("blocking_timeout_secs", 10, RENAMED, "remote_timeout"),
    LMCacheKey("external_lookup_client", None, UNSUPPORTED,
               "the vLLM scheduler looks up through the engine's own socket; no external lookup client"),
    LMCacheKey("py_enable_gc", True, UNSUPPORTED, "lmcache never changes the garbage collector"),
    LMCacheKey("cache_policy", "LRU", SUPPORTED, "LRU, FIFO, LFU or MRU"),
    LMCacheKey("numa_mode", None, UNSUPPORTED, "no NUMA binding; start the process under `numactl` if needed"),
    LMCacheKey("enable_async_loading", False, SUPPORTED,
               "with `LMCacheConnectorV1Dynamic`: hits not all in the CPU tier load while other requests run "
               "(`async_load_timeout`, `async_max_loads`); vLLM's built-in `LMCacheConnectorV1` always loads "
               "synchronously"),
    LMCacheKey("internal_api_server_enabled", False, UNSUPPORTED, _API),
    LMCacheKey("internal_api_server_port_start", 6999, UNSUPPORTED, _API),
    LMCacheKey("priority_limit", None, UNSUPPORTED, "every request may store; there are no priorities"),
    LMCacheKey("internal_api_server_include_index_list", None, UNSUPPORTED, _API),
    LMCacheKey("internal_api_server_socket_path_prefix", None, UNSUPPORTED, _API),
    *_group("runtime_plugin_locations storage_plugins remote_storage_plugins", {}, UNSUPPORTED, _PLUGINS),
    LMCacheKey("lookup_timeout_ms", 3000, UNSUPPORTED, "the scheduler's lookup socket has a fixed timeout; a timeout is a miss"),
    LMCacheKey("min_retrieve_tokens", 0, UNSUPPORTED, "every hit is retrieved"),
    LMCacheKey("hit_miss_ratio", None, UNSUPPORTED, "every hit is retrieved"),
    LMCacheKey("lookup_server_worker_ids", None, UNSUPPORTED, "every worker answers lookups for its own shard"),
    LMCacheKey("enable_scheduler_bypass_lookup", False, UNSUPPORTED, "the scheduler always asks the workers"),
    *_group("script_allowed_imports run_script_api_enabled", {"run_script_api_enabled": False}, UNSUPPORTED,
            "there is no script API"),
    *_group("enable_lazy_memory_allocator lazy_memory_initial_ratio lazy_memory_expand_trigger_ratio "
            "lazy_memory_step_ratio lazy_memory_safe_size",
            {"enable_lazy_memory_allocator": False, "lazy_memory_initial_ratio": 0.2,
             "lazy_memory_expand_trigger_ratio": 0.5, "lazy_memory_step_ratio": 0.1, "lazy_memory_safe_size": 0.0},
            UNSUPPORTED, _LAZY),
    *_group("enable_chunk_statistics chunk_statistics_auto_start_statistics chunk_statistics_auto_exit_timeout_hours "
            "chunk_statistics_auto_exit_target_unique_chunks chunk_statistics_strategy",
            {"enable_chunk_statistics": False, "chunk_statistics_auto_start_statistics": False,
             "chunk_statistics_auto_exit_timeout_hours": 0.0, "chunk_statistics_auto_exit_target_unique_chunks": 0,
             "chunk_statistics_strategy": "memory_bloom_filter"}, UNSUPPORTED, _STATS),
    LMCacheKey("enable_kv_events", False, UNSUPPORTED, "KV cache events are not emitted"),
    LMCacheKey("use_gpu_connector_v3", False, UNSUPPORTED,
               "one connector family (`VLLMPagedMemGPUConnectorV2` and the layerwise ones); the layout is detected"),
    LMCacheKey("pin_timeout_sec", 300, UNSUPPORTED,
               "pins are released by `lookup_unpin`; there is no timeout monitor"),
    LMCacheKey("pin_check_interval_sec", 30, UNSUPPORTED, "pins are released by `lookup_unpin`; there is no monitor"),
    LMCacheKey("remote_config_url", None, UNSUPPORTED, "configuration is local only (file, env, vLLM extra config)"),
    LMCacheKey("app_id", None, UNSUPPORTED, "configuration is local only"),
    LMCacheKey("enable_hidden_state_cache", False, SUPPORTED),
    LMCacheKey("max_hidden_state_cpu_size", 2.0, SUPPORTED),
    LMCacheKey("hidden_state_layers", None, SUPPORTED),
    LMCacheKey("hidden_states_retrieve_mode", "prefix_strict", UNSUPPORTED,
               "retrieval is always `prefix_strict`; `skip_missing_chunks` is not offered"),
)

LMCACHE_056_ALIASES: dict[str, str] = {
    "enable_xpyd": "enable_pd",
    "nixl_peer_host": "pd_peer_host",
    "nixl_peer_init_port": "pd_peer_init_port",
    "nixl_peer_alloc_port": "pd_peer_alloc_port",
    "nixl_proxy_host": "pd_proxy_host",
    "nixl_proxy_port": "pd_proxy_port",
    "nixl_buffer_size": "pd_buffer_size",
    "nixl_role": "pd_role",
    "controller_url": "controller_pull_url",
    "lmcache_worker_port": "lmcache_worker_ports",
    "plugin_locations": "runtime_plugin_locations",
    "external_backends": "storage_plugins",
}
"""Older LMCache spellings that 0.5.6 still accepts, mapped to its current key."""

_BY_NAME: dict[str, LMCacheKey] = {k.name: k for k in LMCACHE_056_KEYS}


def lmcache_key(name: str) -> LMCacheKey | None:
    """The LMCache 0.5.6 key ``name`` (aliases resolved), or None if LMCache has no such key."""
    name = name.lower()
    return _BY_NAME.get(LMCACHE_056_ALIASES.get(name, name))


def renamed_keys() -> dict[str, str]:
    """LMCache key -> lmcache key, for the keys that lmcache spells differently."""
    return {k.name: k.note for k in LMCACHE_056_KEYS if k.status == RENAMED}


def is_lmcache_default(value: Any, default: Any) -> bool:
    """Whether ``value`` (as read from YAML, env text or a keyword) equals LMCache's ``default``."""
    if isinstance(value, str):
        text = value.strip().strip("'\"").strip()
        if default is None:
            return text.lower() in ("", "none", "null")
        if isinstance(default, bool):
            return text.lower() in (("true", "1", "yes", "on") if default else ("false", "0", "no", "off"))
        if isinstance(default, (int, float)):
            try:
                return float(text) == float(default)
            except ValueError:
                return False
        return text == str(default) or text.lower() == str(default).lower()
    if default is None:
        return value is None
    if isinstance(default, bool) or isinstance(value, bool):
        return value is default
    if isinstance(default, (int, float)) and isinstance(value, (int, float)):
        return float(value) == float(default)
    return bool(value == default)
