"""Logging of the ``lmcache`` logger tree: a visible, prefixed handler and the startup line.

Under vLLM nothing configures the root logger, so without a handler of our own every
lmcache INFO line would be dropped and warnings would reach stderr as bare lines
through Python's last-resort handler. :func:`setup_logging` attaches one stderr
handler to the ``lmcache`` logger with the format ``[lmcache] LEVEL message``.

It never fights the host application:

* if the ``lmcache`` logger already has a handler (the host configured it), nothing
  is attached;
* the handler only emits while the root logger has no handlers; once the host
  configures root logging (``logging.basicConfig``, pytest's capture, ...) records go
  there, with the host's format, and are not printed twice;
* records still propagate, so a host's own handlers see them.

The level comes from ``LMCACHE_LOG_LEVEL`` (DEBUG, INFO, WARNING, ERROR; default
INFO). Set explicitly, it wins over a level the host set on the ``lmcache`` logger.

Thread-safety: :func:`setup_logging` is idempotent and may be called from any thread.
"""

from __future__ import annotations

import logging
import os
import sys
import threading
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from lmcache.v1.config import LMCacheEngineConfig

LOGGER_NAME = "lmcache"
LEVEL_ENV = "LMCACHE_LOG_LEVEL"
PREFIX = "[lmcache]"
FORMAT = f"{PREFIX} %(levelname)s %(asctime)s %(filename)s:%(lineno)d] %(message)s"
DATE_FORMAT = "%m-%d %H:%M:%S"
_LEVELS = ("DEBUG", "INFO", "WARNING", "ERROR", "CRITICAL")

_lock = threading.Lock()
_handler: logging.Handler | None = None


class _RootUnconfigured(logging.Filter):
    """Pass records only while the root logger has no handlers (the host did not configure logging)."""

    def filter(self, record: logging.LogRecord) -> bool:
        return not logging.getLogger().handlers


def _level_from_env() -> int | None:
    raw = os.environ.get(LEVEL_ENV)
    if raw is None or not raw.strip():
        return None
    name = raw.strip().upper()
    if name not in _LEVELS:
        print(
            f"{PREFIX} WARNING {LEVEL_ENV}={raw!r}: expected one of {', '.join(_LEVELS)}; using INFO",
            file=sys.stderr,
        )
        return logging.INFO
    return getattr(logging, name)


def setup_logging() -> logging.Handler | None:
    """Give the ``lmcache`` logger its handler and level (see the module docstring).

    Returns the handler attached by lmcache (None if the host owns the logger).
    """
    global _handler
    with _lock:
        log = logging.getLogger(LOGGER_NAME)
        level = _level_from_env()
        if level is not None:
            log.setLevel(level)
        elif log.level == logging.NOTSET:
            log.setLevel(logging.INFO)
        if _handler is not None:
            return _handler
        if log.handlers:
            return None  # configured by the host application
        handler = logging.StreamHandler(sys.stderr)
        handler.setFormatter(logging.Formatter(FORMAT, DATE_FORMAT))
        handler.addFilter(_RootUnconfigured())
        handler.set_name("lmcache")
        log.addHandler(handler)
        _handler = handler
        return handler


# ------------------------------------------------------------------------ startup line
def _gib(value: float) -> str:
    return f"{value:g} GiB"


def masked_url(url: str | None) -> str | None:
    """``url`` safe to print: any password replaced by ``***``."""
    if url is None:
        return None
    from lmcache.v1.storage_backend.connector.url import mask_url

    return mask_url(url)


SECRET_KEYS = ("remote_password", "pd_secret")
"""Config keys whose values are never printed."""


def effective_config(config: LMCacheEngineConfig) -> dict[str, Any]:
    """The config as a dict safe to print: secrets masked, empty optional keys kept as None."""
    data = config.to_dict()
    for name in SECRET_KEYS:
        if data.get(name) is not None:
            data[name] = "***"
    data["remote_url"] = masked_url(data.get("remote_url"))
    extra = data.get("extra_config")
    if isinstance(extra, dict):
        data["extra_config"] = {
            k: ("***" if any(s in str(k).lower() for s in ("password", "secret", "token")) else v)
            for k, v in extra.items()
        }
    return data


def describe_tiers(config: LMCacheEngineConfig) -> str:
    """``cpu 5 GiB, disk /path 10 GiB, remote redis://host:6379`` (secrets masked)."""
    parts = []
    if config.local_cpu:
        parts.append(f"cpu {_gib(config.max_local_cpu_size)}")
    else:
        parts.append("cpu off (staging only)")
    if config.local_disk_path is not None:
        parts.append(f"disk {config.local_disk_path} {_gib(config.max_local_disk_size)}")
    if config.remote_url is not None:
        parts.append(f"remote {masked_url(config.remote_url)}")
    return ", ".join(parts)


def startup_line(config: LMCacheEngineConfig, *, who: str, model_namespace: str, layout: str | None = None) -> str:
    """The one INFO line logged when an engine starts (no secrets)."""
    return (
        f"lmcache started ({who}): tiers [{describe_tiers(config)}], chunk_size={config.chunk_size}, "
        f"layout={layout or 'auto'}, layerwise={config.use_layerwise}, policy={config.cache_policy}, "
        f"save_unfull_chunk={config.save_unfull_chunk}, hidden_states={config.enable_hidden_state_cache}, "
        f"namespace={model_namespace!r}, summary every {config.log_summary_interval:g} s"
    )
