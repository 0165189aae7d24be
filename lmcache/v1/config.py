"""Engine configuration: YAML file, ``LMCACHE_*`` env vars, or a dict.

Precedence for :meth:`LMCacheEngineConfig.load`: defaults < YAML file named by
``LMCACHE_CONFIG_FILE`` < ``LMCACHE_<KEY>`` environment variables.

Every value is validated when the config is built; a bad value raises
:class:`ConfigError` naming the key, the value and what was expected. Unknown keys are
logged with a "did you mean" suggestion and otherwise ignored.
"""

from __future__ import annotations

import ast
import copy
import dataclasses
import difflib
import logging
import math
import os
from dataclasses import dataclass, field
from typing import Any, Mapping

import yaml

from lmcache.errors import LMCacheError
from lmcache.v1.config_compat import RENAMED, is_lmcache_default, lmcache_key
from lmcache.v1.secrets import mask_url

logger = logging.getLogger(__name__)

CONFIG_FILE_ENV = "LMCACHE_CONFIG_FILE"
ENV_PREFIX = "LMCACHE_"
EC_ENV_PREFIX = "LMCACHE_EC_"
CACHE_POLICIES = ("LRU", "FIFO", "LFU", "MRU")
MAX_BLEND_SEGMENTS = 1024
"""Upper bound of ``blend_max_segments``."""
MIN_PD_SECRET_CHARS = 16
"""Shortest ``pd_secret`` (the proxy checks the same length: :data:`lmcache.pd.signing.MIN_SECRET_CHARS`)."""
DEFAULT_BLEND_RATIO = 0.2
"""``blend_recompute_ratios`` when unset: the lowest ratio that kept the real model's answers
within 10 accuracy points of a full prefill at under half its time to first token."""
# LMCACHE_* variables that are not config keys (read elsewhere); never warned about.
_RESERVED_ENV = {"CONFIG_FILE", "USE_NATIVE", "LOG_LEVEL"}


class ConfigError(LMCacheError, ValueError):
    """A configuration value is invalid. The message names key, value and expectation.

    An :class:`~lmcache.errors.LMCacheError` and a ``ValueError``."""


_TRUE = {"1", "true", "yes", "on"}
_FALSE = {"0", "false", "no", "off"}


def _as_bool(key: str, value: Any) -> bool:
    if isinstance(value, bool):
        return value
    if isinstance(value, int) and value in (0, 1):
        return bool(value)
    if isinstance(value, str) and value.strip().lower() in _TRUE | _FALSE:
        return value.strip().lower() in _TRUE
    raise ConfigError(f"{key}={value!r}: expected a boolean (true/false)")


def _as_int(key: str, value: Any) -> int:
    if isinstance(value, bool):
        raise ConfigError(f"{key}={value!r}: expected an integer")
    if isinstance(value, int):
        return value
    if isinstance(value, float) and value.is_integer():
        return int(value)
    if isinstance(value, str):
        try:
            return int(value.strip())
        except ValueError:
            pass
    raise ConfigError(f"{key}={value!r}: expected an integer")


def _as_float(key: str, value: Any) -> float:
    """A finite number (NaN and infinities are rejected: they break every comparison)."""
    out: float | None = None
    if isinstance(value, bool):
        raise ConfigError(f"{key}={value!r}: expected a number")
    if isinstance(value, (int, float)):
        try:
            out = float(value)
        except OverflowError:
            out = math.inf
    elif isinstance(value, str):
        try:
            out = float(value.strip())
        except ValueError:
            pass
    if out is None:
        raise ConfigError(f"{key}={value!r}: expected a number")
    if not math.isfinite(out):
        raise ConfigError(f"{key}={value!r}: expected a finite number (not NaN or infinity)")
    return out


def _as_secret(key: str, value: Any) -> str | None:
    """A password: a string or null. The value is never part of an error message."""
    if value is None:
        return None
    if isinstance(value, str):
        return value if value.strip() and value.strip().lower() not in ("none", "null") else None
    raise ConfigError(f"{key}: expected a string or null, got a {type(value).__name__} (value not shown; quote it in YAML)")


def _as_url(key: str, value: Any) -> str | None:
    """An optional URL; error messages show it with its credentials masked."""
    if value is None:
        return None
    if not isinstance(value, str):
        raise ConfigError(f"{key}: expected a URL string or null, got a {type(value).__name__} (value not shown)")
    return _as_opt_str(key, value)


def _as_path(key: str, value: Any) -> str | None:
    """An optional directory path; null (or the key absent) means unset, an empty string is an error."""
    if value is None:
        return None
    if isinstance(value, str):
        text = value.strip()
        if text.lower() in ("none", "null"):
            return None
        if not any(p.strip() not in ("", "file://") for p in text.split(",")):
            raise ConfigError(f"{key}={value!r}: expected a directory path (use null or omit the key to disable it)")
        return text
    raise ConfigError(f"{key}={value!r}: expected a directory path or null")


def _as_opt_str(key: str, value: Any) -> str | None:
    if value is None:
        return None
    if isinstance(value, str):
        value = value.strip()
        return value or None if value.lower() not in ("none", "null") else None
    raise ConfigError(f"{key}={value!r}: expected a string or null")


def _as_list(key: str, value: Any, expected: str) -> list[Any] | None:
    """A YAML list, a bare comma-separated string or a scalar as a list; None for null."""
    if value is None:
        return None
    if isinstance(value, str):
        text = value.strip()
        if text.lower() in ("", "none", "null"):
            return None
        try:
            value = yaml.safe_load(text if text.startswith("[") else f"[{text}]")
        except yaml.YAMLError:
            raise ConfigError(f"{key}={text!r}: expected {expected}") from None
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        value = [value]
    if not isinstance(value, (list, tuple)):
        raise ConfigError(f"{key}={value!r}: expected {expected}")
    return list(value)


def _as_int_list(key: str, value: Any) -> list[int] | None:
    items = _as_list(key, value, "a list of non-negative integers")
    if items is None:
        return None
    for item in items:
        if isinstance(item, bool) or not isinstance(item, int) or item < 0:
            raise ConfigError(f"{key}={value!r}: expected a list of non-negative integers, got item {item!r}")
    return items


def _as_float_list(key: str, value: Any) -> list[float] | None:
    """A list of finite numbers; a scalar is a one-item list (LMCache accepts both)."""
    items = _as_list(key, value, "a number or a list of numbers")
    if items is None:
        return None
    if not items:
        raise ConfigError(f"{key}={value!r}: expected a number or a non-empty list of numbers")
    return [_as_float(key, item) for item in items]


def _as_separator(key: str, value: Any) -> str:
    if not isinstance(value, str) or not value.strip():
        raise ConfigError(f"{key}={value!r}: expected a non-empty separator string (with visible characters)")
    return value


def _as_dict(key: str, value: Any) -> dict[str, Any] | None:
    if value is None:
        return None
    if isinstance(value, str):
        try:
            value = yaml.safe_load(value) if value.strip() else None
        except yaml.YAMLError:
            raise ConfigError(f"{key}: expected a mapping (the string is not valid YAML)") from None
        if value is None:
            return None
    if not isinstance(value, Mapping):
        raise ConfigError(f"{key}={value!r}: expected a mapping")
    out: dict[str, Any] = {}
    for name, item in value.items():
        if not isinstance(name, str):
            raise ConfigError(f"{key}: keys must be strings, got {type(name).__name__} key {name!r}")
        if isinstance(item, float) and not math.isfinite(item):
            raise ConfigError(f"{key}.{name}={item!r}: expected a finite number (not NaN or infinity)")
        out[name] = item
    return out


def _as_policy(key: str, value: Any) -> str:
    if not isinstance(value, str) or value.strip().upper() not in CACHE_POLICIES:
        raise ConfigError(f"{key}={value!r}: expected one of {', '.join(CACHE_POLICIES)}")
    return value.strip().upper()


PD_ROLES = ("sender", "receiver", "both")
PD_CHANNELS = ("remote",)
"""``transfer_channel`` values this build supports: PD KV moves through the remote tier."""


def _as_pd_role(key: str, value: Any) -> str | None:
    role = _as_opt_str(key, value)
    if role is None:
        return None
    if role.lower() not in PD_ROLES:
        raise ConfigError(f"{key}={value!r}: expected one of {', '.join(PD_ROLES)} (or unset: from vLLM's kv_role)")
    return role.lower()


def _as_channel(key: str, value: Any) -> str | None:
    channel = _as_opt_str(key, value)
    if channel is None:
        return None
    if channel.lower() not in PD_CHANNELS:
        raise ConfigError(
            f"{key}={value!r}: this build moves disaggregated-prefill KV through the remote tier only "
            "(expected 'remote' or unset, with remote_url set); NIXL and Mooncake channels are not built in"
        )
    return channel.lower()


SCALAR_PARSERS = {"bool": _as_bool, "int": _as_int, "float": _as_float}
"""Parsers of scalar option types by annotation name (used by :mod:`lmcache.v1.options`)."""

_PARSERS = {
    "chunk_size": _as_int,
    "local_cpu": _as_bool,
    "max_local_cpu_size": _as_float,
    "local_disk": _as_path,
    "max_local_disk_size": _as_float,
    "remote_url": _as_url,
    "remote_timeout": _as_float,
    "remote_username": _as_opt_str,
    "remote_password": _as_secret,
    "save_unfull_chunk": _as_bool,
    "save_decode_cache": _as_bool,
    "lazy_store": _as_bool,
    "block_granular_reuse": _as_bool,
    "use_layerwise": _as_bool,
    "cache_policy": _as_policy,
    "enable_hidden_state_cache": _as_bool,
    "max_hidden_state_cpu_size": _as_float,
    "hidden_state_layers": _as_int_list,
    "extra_config": _as_dict,
    "model_namespace": _as_opt_str,
    "log_summary_interval": _as_float,
    "enable_pd": _as_bool,
    "pd_role": _as_pd_role,
    "pd_buffer_size": _as_int,
    "pd_proxy_host": _as_opt_str,
    "pd_proxy_port": _as_int,
    "transfer_channel": _as_channel,
    "pd_wait_timeout": _as_float,
    "pd_secret": _as_secret,
    "pd_max_waiting": _as_int,
    "enable_async_loading": _as_bool,
    "async_load_timeout": _as_float,
    "async_max_loads": _as_int,
    "async_min_tokens": _as_int,
    "async_copy_step_tokens": _as_int,
    "async_copy_in_background": _as_bool,
    "enable_blending": _as_bool,
    "blend_special_str": _as_separator,
    "blend_recompute_ratios": _as_float_list,
    "blend_check_layers": _as_int_list,
    "blend_min_tokens": _as_int,
    "blend_min_segment_tokens": _as_int,
    "blend_sink_tokens": _as_int,
    "blend_max_segments": _as_int,
    "blend_thresholds": _as_float_list,
}

# extra_config keys read by the tiers and the vLLM adapter (see docs/configuration.md);
# others are warned about with a "did you mean" hint, like unknown top-level keys.
EXTRA_CONFIG_KEYS = (
    "local_disk_o_direct",
    "local_disk_write_threads",
    "local_disk_read_threads",
    "local_disk_queue_depth",
    "local_disk_close_timeout",
    "remote_workers",
    "remote_read_workers",
    "remote_max_inflight_mb",
    "remote_backoff_initial",
    "remote_backoff_max",
    "remote_key_prefix",
    "remote_tls_ca_certs",
    "remote_tls_certfile",
    "remote_tls_keyfile",
    "remote_tls_cert_reqs",
    "use_gpu",
    "enable_blending",
    "lookup_socket_dir",
    "lookup_timeout",
    "save_only_first_rank",
)


@dataclass(slots=True)
class LMCacheEngineConfig:
    """All engine settings. Sizes are in GiB.

    Build with :meth:`load`, :meth:`from_file`, :meth:`from_env` or :meth:`from_dict`;
    the constructor itself does not validate, :meth:`validate` does (the builders call it).
    """

    chunk_size: int = 256
    local_cpu: bool = True
    max_local_cpu_size: float = 5.0
    local_disk: str | None = None
    max_local_disk_size: float = 0.0
    remote_url: str | None = field(default=None, repr=False)  # shown masked by __repr__
    remote_timeout: float = 5.0
    remote_username: str | None = None
    remote_password: str | None = field(default=None, repr=False)  # never logged
    save_unfull_chunk: bool = False
    save_decode_cache: bool = False
    """Also store the KV of generated tokens (vLLM adapter: whole blocks, as they complete), so
    a next chat turn that repeats the answer finds it."""
    lazy_store: bool = False
    """vLLM adapter: store a request's KV (prompt and answer) once, in the step after it
    finished (vLLM keeps its blocks until then), instead of in the steps that compute it
    (docs/async_loading.md#lazy-store): its own steps and its time to first token carry no
    store. Off: prompts are stored as they are computed (answers with save_decode_cache)."""
    block_granular_reuse: bool = True
    """Reuse cached KV at the serving engine's block granularity (needs the block size in
    the engine metadata; the vLLM adapter passes it). See :mod:`lmcache.v1.block_reuse`."""
    use_layerwise: bool = False
    cache_policy: str = "LRU"
    enable_hidden_state_cache: bool = False
    max_hidden_state_cpu_size: float = 2.0
    hidden_state_layers: list[int] | None = None
    extra_config: dict[str, Any] | None = field(default=None)
    model_namespace: str | None = None
    """Name folded into every chunk key instead of the model name/path (None: the model
    name/path, as vLLM gives it). Servers loading the SAME weights from different paths
    set the same value to share a cache; different weights must never share one."""
    log_summary_interval: float = 10.0
    """Seconds between periodic INFO summaries while there is traffic (0 = off)."""
    enable_pd: bool = False
    """Disaggregated prefill/decode through the remote tier (docs/disaggregated.md): requests
    carrying vLLM's ``kv_transfer_params`` are stored durably (prefiller) or waited for
    (decoder)."""
    pd_role: str | None = None
    """``sender`` (prefiller), ``receiver`` (decoder) or ``both``; None: from vLLM's kv_role."""
    pd_buffer_size: int | None = None
    """Bytes of KV a prefiller may have in flight to the remote tier before its stores wait
    (None: the remote tier's ``remote_max_inflight_mb``)."""
    pd_proxy_host: str | None = None
    """Accepted for LMCache compatibility; lmcache's proxy needs no notification."""
    pd_proxy_port: int | None = None
    """Accepted for LMCache compatibility; lmcache's proxy needs no notification."""
    transfer_channel: str | None = None
    """How PD KV travels: ``remote`` (the remote tier) is the only channel of this build."""
    pd_wait_timeout: float = 5.0
    """Seconds a decoder waits for KV a prefiller announced, and a prefiller for its writes
    to become durable, before it recomputes (decoder) or answers anyway (prefiller)."""
    pd_secret: str | None = field(default=None, repr=False)  # never logged
    """Secret shared by prefillers, decoders and ``lmcache proxy`` (``LMCACHE_PD_SECRET``): a
    decoder honours ``do_remote_prefill`` only with parameters the proxy signed with it
    (:mod:`lmcache.pd.signing`). Required on a decoder."""
    pd_max_waiting: int = 64
    """Decoder: requests that may wait for a prefiller's KV at once; more are computed here
    at once (counted as ``pd_wait_refused``)."""
    enable_async_loading: bool = False
    """vLLM adapter (``LMCacheConnectorV1Dynamic``): a hit that is not all in the CPU tier is
    loaded while the request waits and other requests run (docs/async_loading.md): its disk
    or remote chunks are read into the CPU tier in the background, then copied into vLLM's
    blocks (``async_copy_in_background``). Off: every hit is loaded in the step that
    computes the request."""
    async_load_timeout: float = 10.0
    """Seconds an asynchronous load may take; what is not in the CPU tier by then is
    recomputed by vLLM (a frozen or lost remote tier never holds a request longer)."""
    async_max_loads: int = 16
    """Asynchronous loads in flight per engine; further hits are loaded synchronously."""
    async_min_tokens: int = 0
    """A hit loads asynchronously only when at least this many of its tokens are outside the
    CPU tier (disk, remote); a smaller lower-tier part loads in the step, where reading it
    costs the other requests less than the extra vLLM step costs the request. 0: any whole
    chunk outside the CPU tier. Blends are always asynchronous."""
    async_copy_step_tokens: int = 1024
    """Tokens of prefetched asynchronous loads copied into vLLM's blocks per step (whole
    chunks, at least one): a long hit is copied over several steps, so no step stalls
    for the whole copy. Used where the copy runs in the steps (GPU KV, or
    ``async_copy_in_background: false``)."""
    async_copy_in_background: bool = True
    """CPU KV: the prefetch thread copies a prefetched load into the request's blocks itself
    (vLLM does not touch them while the request waits), so the request is handed back one
    step after its prefetch ends and no step copies anything. False, or GPU KV: the copy runs
    at the end of the steps, ``async_copy_step_tokens`` per step."""
    enable_blending: bool = False
    """CacheBlend (docs/blending.md): documents separated by ``blend_special_str`` are cached
    on their own and reused at any position of a later prompt, with a selective recompute.
    The vLLM adapter needs vLLM's prefix caching off."""
    blend_special_str: str = " # # "
    """Text between the documents of a prompt (matched on its token ids)."""
    blend_recompute_ratios: list[float] | None = None
    """Fraction of the reused tokens recomputed at each check layer (None: ``[0.2]``, chosen from
    the measured quality/speed curve, docs/blending.md; LMCache's default is 0.15)."""
    blend_check_layers: list[int] | None = None
    """Layers where the deviation of the reused KV is measured (None: ``[1]``)."""
    blend_min_tokens: int = 256
    """Prompts shorter than this are not blended (prefix reuse only)."""
    blend_min_segment_tokens: int = 16
    """Segments (documents) shorter than this are neither stored nor reused as segments:
    they are recomputed with the prompt (bounds the entries one prompt can create)."""
    blend_sink_tokens: int = 0
    """Blending: the first this-many cached tokens of every reused segment are recomputed
    (a document cached alone from position 0 attends to its first tokens as attention
    sinks; in a prompt they are no longer its first). 0: only the first word (the key's lead)."""
    blend_max_segments: int = 64
    """Most segments one prompt is split into; a prompt with more separators is not blended
    and stores no segments (bounds the work one prompt can put on the worker)."""
    blend_thresholds: list[float] | None = None
    """Accepted for LMCache compatibility; not used (the ratios choose what is recomputed)."""

    def __repr__(self) -> str:
        """Every field except secrets; ``remote_url`` with its credentials masked."""
        parts = []
        for f in dataclasses.fields(self):
            if f.name in ("remote_password", "pd_secret"):
                parts.append(f"{f.name}={'***' if getattr(self, f.name) else None}")
            elif f.name == "remote_url":
                parts.append(f"remote_url={mask_url(self.remote_url) if self.remote_url else None!r}")
            else:
                parts.append(f"{f.name}={getattr(self, f.name)!r}")
        return f"LMCacheEngineConfig({', '.join(parts)})"

    __str__ = __repr__

    # ---------------------------------------------------------------- builders
    @classmethod
    def from_dict(cls, data: Mapping[str, Any], *, source: str = "config") -> LMCacheEngineConfig:
        """Build from a mapping of key -> value (values may be strings, as from env)."""
        cfg = cls()
        cfg.apply(data, source=source)
        return cfg

    @classmethod
    def from_file(cls, path: str | os.PathLike[str]) -> LMCacheEngineConfig:
        """Build from a YAML file. Raises ConfigError if the file is unreadable or not a mapping."""
        return cls.from_dict(_read_yaml(path), source=str(path))

    @classmethod
    def from_env(cls) -> LMCacheEngineConfig:
        """Build from ``LMCACHE_<KEY>`` environment variables alone."""
        cfg = cls()
        cfg.apply(env_overrides(ENV_PREFIX), source="environment")
        return cfg

    @classmethod
    def load(cls, path: str | os.PathLike[str] | None = None) -> LMCacheEngineConfig:
        """Defaults, then the YAML file ``path`` (default: ``LMCACHE_CONFIG_FILE``, if set),
        then ``LMCACHE_*`` env vars. A :class:`ConfigError` names where the bad value came
        from (the file's path or the environment variable)."""
        path = os.fspath(path) if path is not None else os.environ.get(CONFIG_FILE_ENV)
        cfg = cls()
        if path:
            cfg.apply(_read_yaml(path), source=str(path), validate=False)
        env = env_overrides(ENV_PREFIX)
        cfg.apply(env, source="environment", validate=False, env_prefix=ENV_PREFIX)
        try:
            cfg.validate()
        except ConfigError as exc:
            sources = " + ".join(s for s in (str(path) if path else "", "environment" if env else "") if s)
            raise ConfigError(f"{sources or 'defaults'}: {exc}") from None
        return cfg

    @classmethod
    def from_defaults(cls, **kwargs: Any) -> LMCacheEngineConfig:
        """Defaults with ``kwargs`` applied (LMCache 0.5.6's builder).

        Each value is parsed and checked (ConfigError); the rules that tie keys
        together (e.g. ``local_disk`` needs ``max_local_disk_size``) are left to
        :meth:`validate`, which the engine calls when it is built, as in LMCache: a
        base config for :func:`load_ec_engine_config` may leave the disk size to the
        encoder cache's default. Keys are lmcache's or LMCache 0.5.6's (renamed ones
        are applied under lmcache's name, unsupported ones warned about and ignored,
        see :mod:`lmcache.v1.config_compat`); any other keyword raises TypeError."""
        for key in kwargs:
            if key.lower() not in _PARSERS and lmcache_key(key) is None:
                close = difflib.get_close_matches(key.lower(), _PARSERS, n=1)
                hint = f"; did you mean {close[0]!r}?" if close else ""
                raise TypeError(f"from_defaults() got an unknown config key {key!r}{hint}")
        cfg = cls()
        cfg.apply(kwargs, source="from_defaults()", validate=False)
        return cfg

    def update_config_from_env(self) -> LMCacheEngineConfig:
        """Apply ``LMCACHE_<KEY>`` environment variables to this config (validated); returns self."""
        self.apply(env_overrides(ENV_PREFIX), source="environment", env_prefix=ENV_PREFIX)
        return self

    # ---------------------------------------------------------------- helpers
    def apply(
        self, data: Mapping[str, Any], *, source: str = "config", validate: bool = True, env_prefix: str | None = None
    ) -> None:
        """Set keys from ``data`` (validated unless ``validate`` is false); unknown keys
        are warned about and skipped; LMCache 0.5.6 keys are handled as
        :mod:`lmcache.v1.config_compat` says.

        A bad value raises :class:`ConfigError` prefixed with ``source`` (a file path,
        "environment", ...); with ``env_prefix`` the key is named as the env variable.
        """
        ours = {str(k).lower() for k in data}
        for raw_key, value in data.items():
            key = str(raw_key).lower()
            parser = _PARSERS.get(key)
            if parser is None:
                if key == "ec" or key.startswith("ec_"):
                    continue  # encoder-cache overrides: read by load_ec_engine_config
                key = _lmcache_key_to_ours(key, value, source, ours)
                if key is None:
                    continue
                parser = _PARSERS[key]
            try:
                setattr(self, key, parser(key, value))
            except ConfigError as exc:
                where = f"{env_prefix}{str(raw_key).upper()}" if env_prefix else source
                raise ConfigError(f"{where}: {exc}") from None
            if key == "extra_config":
                for name in self.extra_config or {}:
                    if name not in EXTRA_CONFIG_KEYS:
                        warn_unknown_key(name, source, known=EXTRA_CONFIG_KEYS, prefix="extra_config.")
        if validate:
            try:
                self.validate()
            except ConfigError as exc:
                raise ConfigError(f"{source}: {exc}") from None

    def validate(self) -> None:
        """Check cross-field rules; raises ConfigError."""
        if self.chunk_size <= 0:
            raise ConfigError(f"chunk_size={self.chunk_size!r}: expected an integer > 0")
        if self.max_local_cpu_size < 0:
            raise ConfigError(f"max_local_cpu_size={self.max_local_cpu_size!r}: expected a size in GiB >= 0")
        if self.local_cpu and self.max_local_cpu_size <= 0:
            raise ConfigError(
                f"max_local_cpu_size={self.max_local_cpu_size!r}: expected a size in GiB > 0 when local_cpu is true"
            )
        if self.max_local_disk_size < 0:
            raise ConfigError(f"max_local_disk_size={self.max_local_disk_size!r}: expected a size in GiB >= 0")
        if self.local_disk is not None and self.max_local_disk_size <= 0:
            raise ConfigError(
                f"max_local_disk_size={self.max_local_disk_size!r}: expected a size in GiB > 0 "
                f"when local_disk is set (local_disk={self.local_disk!r})"
            )
        if self.remote_timeout <= 0:
            raise ConfigError(f"remote_timeout={self.remote_timeout!r}: expected seconds > 0")
        if self.remote_url is not None and "://" not in self.remote_url:
            raise ConfigError(
                f"remote_url={mask_url(self.remote_url)!r}: expected a URL such as redis://host:port, "
                "rediss://host:port, unix:///path or redis-cluster://host:port,host:port"
            )
        if self.log_summary_interval < 0:
            raise ConfigError(f"log_summary_interval={self.log_summary_interval!r}: expected seconds >= 0 (0 = off)")
        if self.enable_hidden_state_cache and self.max_hidden_state_cpu_size <= 0:
            raise ConfigError(
                f"max_hidden_state_cpu_size={self.max_hidden_state_cpu_size!r}: expected a size in GiB > 0 "
                "when enable_hidden_state_cache is true"
            )
        self._validate_pd()
        self._validate_async()
        self._validate_blend()

    @property
    def blend_ratios(self) -> tuple[float, ...]:
        """``blend_recompute_ratios`` with its default filled in."""
        return tuple(self.blend_recompute_ratios) if self.blend_recompute_ratios is not None else (DEFAULT_BLEND_RATIO,)

    @property
    def blend_layers(self) -> tuple[int, ...]:
        """``blend_check_layers`` with its default filled in."""
        return tuple(self.blend_check_layers) if self.blend_check_layers is not None else (1,)

    def _validate_blend(self) -> None:
        ratios, layers = self.blend_ratios, self.blend_layers
        if any(not 0.0 <= r <= 1.0 for r in ratios):
            raise ConfigError(f"blend_recompute_ratios={list(ratios)!r}: expected numbers between 0 and 1")
        if any(b > a for a, b in zip(ratios, ratios[1:])):
            raise ConfigError(f"blend_recompute_ratios={list(ratios)!r}: expected non-increasing ratios")
        if not layers or any(b <= a for a, b in zip(layers, layers[1:])):
            raise ConfigError(f"blend_check_layers={list(layers)!r}: expected strictly increasing layer indices")
        if len(ratios) != len(layers):
            raise ConfigError(
                f"blend_recompute_ratios={list(ratios)!r} and blend_check_layers={list(layers)!r}: "
                "expected one ratio per check layer"
            )
        if self.blend_min_tokens < 1:
            raise ConfigError(f"blend_min_tokens={self.blend_min_tokens!r}: expected an integer >= 1")
        if self.blend_sink_tokens < 0:
            raise ConfigError(f"blend_sink_tokens={self.blend_sink_tokens!r}: expected an integer >= 0")
        if self.blend_min_segment_tokens < 1:
            raise ConfigError(f"blend_min_segment_tokens={self.blend_min_segment_tokens!r}: expected an integer >= 1")
        if not 1 <= self.blend_max_segments <= MAX_BLEND_SEGMENTS:
            raise ConfigError(f"blend_max_segments={self.blend_max_segments!r}: expected an integer in "
                              f"1..{MAX_BLEND_SEGMENTS}")
        if self.lazy_store and (self.enable_pd or self.enable_blending):
            other = "enable_pd" if self.enable_pd else "enable_blending"
            raise ConfigError(
                f"lazy_store=True with {other}=True: expected one of them off (a prefiller's KV must be in the "
                "remote store when its answer returns; a blend stores segments and results as it computes them)"
            )
        if self.enable_blending and self.enable_pd:
            raise ConfigError(
                "enable_blending=True with enable_pd=True: a blended prompt's KV is an approximation and "
                "must not be sent to a decoder as the prompt's exact KV; turn one of them off"
            )
        if self.blend_thresholds is not None and self.enable_blending:
            warn_once_unused_thresholds(self.blend_thresholds)

    def _validate_async(self) -> None:
        if not (self.async_load_timeout > 0 and math.isfinite(self.async_load_timeout)):
            raise ConfigError(f"async_load_timeout={self.async_load_timeout!r}: expected seconds > 0")
        if self.async_max_loads < 1:
            raise ConfigError(f"async_max_loads={self.async_max_loads!r}: expected an integer >= 1")
        if self.async_min_tokens < 0:
            raise ConfigError(f"async_min_tokens={self.async_min_tokens!r}: expected tokens >= 0")
        if self.async_copy_step_tokens < 1:
            raise ConfigError(f"async_copy_step_tokens={self.async_copy_step_tokens!r}: expected tokens >= 1")

    def _validate_pd(self) -> None:
        if self.pd_wait_timeout <= 0:
            raise ConfigError(f"pd_wait_timeout={self.pd_wait_timeout!r}: expected seconds > 0")
        if self.pd_max_waiting < 0:
            raise ConfigError(f"pd_max_waiting={self.pd_max_waiting!r}: expected an integer >= 0 (0: never wait)")
        if self.pd_secret is not None and len(self.pd_secret.strip()) < MIN_PD_SECRET_CHARS:
            raise ConfigError(f"pd_secret: {len(self.pd_secret.strip())} characters (value not shown); expected at "
                              f"least {MIN_PD_SECRET_CHARS} (e.g. python -c 'import secrets; print(secrets.token_urlsafe(32))')")
        if self.pd_buffer_size is not None and self.pd_buffer_size <= 0:
            raise ConfigError(f"pd_buffer_size={self.pd_buffer_size!r}: expected bytes > 0 (or unset)")
        if self.enable_pd and self.remote_url is None:
            raise ConfigError(
                "enable_pd=True: expected remote_url to be set (prefillers and decoders share KV through the "
                "remote tier, e.g. remote_url: redis://cache-host:6379)"
            )

    def copy(self) -> LMCacheEngineConfig:
        """A deep copy (builders never mutate a caller's config)."""
        return copy.deepcopy(self)

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    def get_extra(self, name: str, default: Any = None) -> Any:
        """A value from ``extra_config`` (free-form per-tier options)."""
        return (self.extra_config or {}).get(name, default)

    @property
    def local_disk_paths(self) -> list[str]:
        """The directories in ``local_disk`` (comma-separated, each ``file://`` optional)."""
        if self.local_disk is None:
            return []
        parts = [p.strip() for p in self.local_disk.split(",")]
        return [p[len("file://") :] if p.startswith("file://") else p for p in parts if p]

    @property
    def local_disk_path(self) -> str | None:
        """This process's disk directory: ``local_disk`` without ``file://``; of a
        comma-separated list, ``paths[device % len(paths)]`` where ``device`` is the
        current CUDA device (0 without CUDA), as LMCache's ``by_gpu`` sharding."""
        paths = self.local_disk_paths
        if not paths:
            return None if self.local_disk is None else ""
        if len(paths) == 1:
            return paths[0]
        return paths[_current_device_index() % len(paths)]


_warned_thresholds = False


def warn_once_unused_thresholds(thresholds: list[float]) -> None:
    global _warned_thresholds
    if not _warned_thresholds:
        _warned_thresholds = True
        logger.warning(
            "blend_thresholds=%s is accepted but not used: blend_recompute_ratios chooses the recomputed tokens",
            thresholds,
        )


def config_keys() -> tuple[str, ...]:
    return tuple(_PARSERS)


def warn_unknown_key(key: str, source: str, *, known: Any = None, prefix: str = "") -> None:
    close = difflib.get_close_matches(key, known if known is not None else _PARSERS, n=1)
    hint = f"; did you mean {prefix + close[0]!r}?" if close else ""
    logger.warning("unknown lmcache config key %r in %s (ignored)%s", prefix + key, source, hint)


def env_overrides(prefix: str) -> dict[str, str]:
    """``{key: value}`` for env vars ``<prefix><KEY>`` (lower-cased key).

    A value wrapped in matching quotes (``'...'`` or ``"..."``, as shells and
    container specs often leave them) is unquoted, escapes included."""
    out: dict[str, str] = {}
    for name, value in os.environ.items():
        if not name.startswith(prefix):
            continue
        key = name[len(prefix) :]
        if prefix == ENV_PREFIX and (key in _RESERVED_ENV or key.startswith("EC_")):
            continue
        out[key.lower()] = unquote_env(value)
    return out


def unquote_env(value: str) -> str:
    """``"'redis://h:1'"`` -> ``"redis://h:1"``: strip one pair of matching outer quotes."""
    text = value.strip()
    if len(text) >= 2 and text[0] == text[-1] and text[0] in ("'", '"'):
        try:
            parsed = ast.literal_eval(text)
        except (ValueError, SyntaxError):
            return text[1:-1]
        return parsed if isinstance(parsed, str) else text[1:-1]
    return value


def _lmcache_key_to_ours(key: str, value: Any, source: str, given: set[str]) -> str | None:
    """The lmcache key an LMCache 0.5.6 key is applied as, or None (ignored, logged)."""
    known = lmcache_key(key)
    if known is None:
        warn_unknown_key(key, source)
        return None
    if known.status == RENAMED:
        if known.note in given:
            logger.warning("LMCache config key %r in %s ignored: %r is set too", key, source, known.note)
            return None
        logger.warning("LMCache config key %r in %s is spelled %r in lmcache; applied as %r",
                       key, source, known.note, known.note)
        return known.note
    if is_lmcache_default(value, known.default):
        logger.debug("LMCache config key %r in %s (LMCache's default) ignored", key, source)
    else:
        logger.warning("LMCache config key %r in %s is not supported by lmcache (ignored): %s; "
                       "see docs/migrating_from_lmcache.md", key, source, known.note)
    return None


def _current_device_index() -> int:
    try:
        import torch

        return int(torch.cuda.current_device()) if torch.cuda.is_available() else 0
    except (ImportError, RuntimeError):
        return 0


def _load_data() -> tuple[dict[str, Any], str]:
    """The raw keys of :meth:`LMCacheEngineConfig.load`: the YAML file, then env vars."""
    data: dict[str, Any] = {}
    path = os.environ.get(CONFIG_FILE_ENV)
    if path:
        data.update(_read_yaml(path))
    data.update(env_overrides(ENV_PREFIX))
    return data, path or "environment"


def _read_yaml(path: str | os.PathLike[str]) -> dict[str, Any]:
    try:
        with open(path, encoding="utf-8") as f:
            data = yaml.safe_load(f)
    except OSError as exc:
        raise ConfigError(f"{CONFIG_FILE_ENV}={str(path)!r}: cannot read the file ({exc.strerror})") from None
    except yaml.YAMLError as exc:
        raise ConfigError(f"{CONFIG_FILE_ENV}={str(path)!r}: not valid YAML ({exc})") from None
    if data is None:
        return {}
    if not isinstance(data, dict):
        raise ConfigError(f"{CONFIG_FILE_ENV}={str(path)!r}: expected a YAML mapping at top level")
    return data


# ------------------------------------------------------------------- encoder cache
EC_DEFAULT_CPU_SIZE_GIB = 1.0
EC_DEFAULT_DISK_SIZE_GIB = 64.0
EC_KEY_PREFIX = "ec_"
EC_MAP_KEY = "ec"


def _ec_file_overrides(path: str | None) -> tuple[dict[str, Any], dict[str, Any]]:
    """``(ec_ keys, nested ec: map)`` of the YAML file at ``path``, keys lower-cased and unprefixed."""
    if not path:
        return {}, {}
    try:
        data = _read_yaml(path)
    except ConfigError as exc:
        logger.warning("encoder cache: no EC overrides read from the config file (%s)", exc)
        return {}, {}
    prefixed = {
        key[len(EC_KEY_PREFIX) :].lower(): value
        for key, value in data.items()
        if isinstance(key, str) and key.lower().startswith(EC_KEY_PREFIX)
    }
    nested: dict[str, Any] = {}
    raw = next((v for k, v in data.items() if isinstance(k, str) and k.lower() == EC_MAP_KEY), None)
    if isinstance(raw, Mapping):
        nested = {str(k).lower(): v for k, v in raw.items()}
    elif raw is not None:
        logger.warning("encoder cache: %r in %s is %r, not a mapping; ignored", EC_MAP_KEY, path, raw)
    return prefixed, nested


def load_ec_engine_config(
    base_config: LMCacheEngineConfig | None = None, *, base: LMCacheEngineConfig | None = None
) -> LMCacheEngineConfig:
    """The encoder-cache engine's config: a clone of ``base_config`` with EC overrides applied.

    ``base_config`` (LMCache's keyword; ``base`` is accepted too) None means the keys
    :meth:`LMCacheEngineConfig.load` reads, taken before the KV engine's own checks:
    a base that sets ``local_disk`` without ``max_local_disk_size`` still gives the EC
    engine its 64 GiB default below (the KV engine keeps its error for that file). The EC overrides come from
    the YAML file named by ``LMCACHE_CONFIG_FILE`` (whether or not ``base`` came from
    it) and the environment; later wins:

    1. ``ec_<key>: value`` top-level YAML keys,
    2. the nested ``ec: {<key>: value}`` YAML map,
    3. ``LMCACHE_EC_<KEY>`` environment variables.

    Values are parsed and validated like the base keys (a bad value raises
    :class:`ConfigError` naming ``ec_<key>``); unknown EC keys are logged and dropped.
    Then: ``local_cpu`` is forced on; ``max_local_cpu_size`` is 1 GiB unless an EC
    override sets it (the EC budget is separate from the KV one, so the base value
    is not inherited); if ``local_disk`` is set (inherited or overridden),
    ``max_local_disk_size`` is 64 GiB unless an EC override sets it. No disk path is
    ever invented: without ``local_disk`` entries live in CPU memory only. The
    hidden-state cache and the layerwise path are switched off (EC has neither).
    The caller's ``base`` is never mutated.
    """
    if base_config is not None and base is not None:
        raise TypeError("load_ec_engine_config(): give base_config or base, not both")
    base_config = base_config if base_config is not None else base
    if base_config is not None:
        cfg = base_config.copy()
    else:
        data, source = _load_data()
        cfg = LMCacheEngineConfig()
        cfg.apply(data, source=source, validate=False)
    prefixed, nested = _ec_file_overrides(os.environ.get(CONFIG_FILE_ENV))
    overrides: dict[str, Any] = {}
    for source in (prefixed, nested, env_overrides(EC_ENV_PREFIX)):
        overrides.update(source)

    known: dict[str, Any] = {}
    for key, value in overrides.items():
        if key in _PARSERS:
            known[key] = value
        else:
            close = difflib.get_close_matches(key, _PARSERS, n=1)
            hint = f"; did you mean {close[0]!r}?" if close else ""
            logger.warning("encoder cache: unknown EC config key %r dropped%s", key, hint)

    for key, value in known.items():
        setattr(cfg, key, _PARSERS[key](f"{EC_KEY_PREFIX}{key}", value))
    if "local_cpu" in known and not cfg.local_cpu:
        logger.warning("encoder cache: ec_local_cpu=false ignored; the encoder cache always keeps a CPU tier")
    cfg.local_cpu = True
    if "max_local_cpu_size" not in known:
        cfg.max_local_cpu_size = EC_DEFAULT_CPU_SIZE_GIB
    if cfg.local_disk is not None and "max_local_disk_size" not in known:
        cfg.max_local_disk_size = EC_DEFAULT_DISK_SIZE_GIB
    cfg.enable_hidden_state_cache = False
    cfg.use_layerwise = False
    cfg.validate()
    return cfg
