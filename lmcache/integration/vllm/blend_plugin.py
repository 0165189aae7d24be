"""vLLM general plugin: register every model vLLM loads, so blending can drive it.

:func:`register` is the ``vllm.general_plugins`` entry point (``lmcache_blend`` in
pyproject.toml). vLLM calls it in each of its processes, possibly several times, before
loading models. When blending is on (``enable_blending`` in the lmcache config, or
``LMCACHE_ENABLE_BLENDING`` truthy), it wraps vLLM's model loaders' ``load_model`` so that
the main model each one returns is recorded in
:class:`~lmcache.integration.vllm.blend_model.VLLMModelTracker` under the engine id of
vLLM's ``kv_transfer_config`` (``"default"`` without one). Draft models (speculative
decoding, loaded with another model config) are not recorded.

:func:`register` never raises: on any failure it logs one warning and leaves vLLM as it
was (blending then finds no model and stays off; prefix reuse is unaffected). It is
idempotent; :func:`unregister` undoes it (tests).
"""

from __future__ import annotations

import functools
import logging
import os
import threading
from typing import Any, Callable

from lmcache.integration.vllm.blend_model import VLLMModelTracker
from lmcache.integration.vllm.vllm_compat import model_loader_classes

__all__ = ["DEFAULT_INSTANCE_ID", "ENABLE_ENV", "blending_enabled", "instance_id_of", "register", "unregister"]

logger = logging.getLogger(__name__)

DEFAULT_INSTANCE_ID = "default"
ENABLE_ENV = "LMCACHE_ENABLE_BLENDING"
_TRUE = {"1", "true", "yes", "on"}
_MARK = "__lmcache_blend_original__"

_lock = threading.Lock()
_state: str | None = None
"""None: not decided yet; "off": blending disabled; "on": loaders wrapped; "failed"."""
_wrapped: list[type] = []


def blending_enabled() -> bool:
    """``LMCACHE_ENABLE_BLENDING`` truthy, else ``enable_blending`` of the lmcache config
    (``LMCacheEngineConfig.load()``: file named by ``LMCACHE_CONFIG_FILE``, then env).

    The config's own warnings (unknown or unsupported keys) are muted here: vLLM runs the
    plugin in processes that never build a connector, and the connector reports them. A
    config that does not load counts as blending off (one warning; the connector raises)."""
    if os.environ.get(ENABLE_ENV, "").strip().lower() in _TRUE:
        return True
    from lmcache.v1.config import ConfigError, LMCacheEngineConfig

    config_logger = logging.getLogger(LMCacheEngineConfig.__module__)
    level = config_logger.level
    config_logger.setLevel(logging.ERROR)
    try:
        cfg = LMCacheEngineConfig.load()
    except ConfigError as exc:
        logger.warning("blend: the lmcache config does not load (%s); blending off", exc)
        return False
    finally:
        config_logger.setLevel(level)
    return bool(getattr(cfg, "enable_blending", False))


def instance_id_of(vllm_config: Any) -> str:
    """The id a model of ``vllm_config`` is registered under: the KV transfer config's
    ``engine_id``, else :data:`DEFAULT_INSTANCE_ID`."""
    kv = getattr(vllm_config, "kv_transfer_config", None)
    engine_id = getattr(kv, "engine_id", None)
    return engine_id if isinstance(engine_id, str) and engine_id else DEFAULT_INSTANCE_ID


def _record(model: Any, vllm_config: Any, model_config: Any) -> None:
    main = getattr(vllm_config, "model_config", None)
    if model_config is not None and main is not None and model_config is not main:
        return  # a draft model (speculative decoding), not the served one
    VLLMModelTracker.register_model(instance_id_of(vllm_config), model)


def _wrap(original: Callable[..., Any]) -> Callable[..., Any]:
    @functools.wraps(original)
    def load_model(self: Any, *args: Any, **kwargs: Any) -> Any:
        model = original(self, *args, **kwargs)
        vllm_config = kwargs.get("vllm_config", args[0] if args else None)
        model_config = kwargs.get("model_config", args[1] if len(args) > 1 else None)
        try:
            _record(model, vllm_config, model_config)
        except Exception:  # a bookkeeping failure must never fail vLLM's model loading
            logger.warning("blend: could not register the loaded model; blending stays off", exc_info=True)
        return model

    setattr(load_model, _MARK, original)
    return load_model


def _loader_classes() -> list[type]:
    """``BaseModelLoader`` and every registered loader class that overrides ``load_model``
    (:func:`~.vllm_compat.model_loader_classes`)."""
    return model_loader_classes()


def _patch() -> None:
    classes = _loader_classes()
    patches = [(cls, vars(cls)["load_model"]) for cls in classes]
    for cls, original in patches:
        if not hasattr(original, _MARK):
            cls.load_model = _wrap(original)  # type: ignore[method-assign]
            _wrapped.append(cls)


def register() -> None:
    """The ``vllm.general_plugins`` entry point. Idempotent; never raises."""
    global _state
    with _lock:
        if _state is not None:
            return
        try:
            if not blending_enabled():
                _state = "off"
                return
            _patch()
            _state = "on"
            logger.info("blend: recording loaded models for CacheBlend (%d loader classes)", len(_wrapped))
        except Exception:  # a plugin must never break vLLM's start: log once, change nothing more
            _restore()
            _state = "failed"
            logger.warning("blend: plugin registration failed; vLLM left untouched, blending off", exc_info=True)


def unregister() -> None:
    """Restore the wrapped loaders and forget the decision (tests)."""
    global _state
    with _lock:
        _restore()
        _state = None


def _restore() -> None:
    while _wrapped:
        cls = _wrapped.pop()
        original = getattr(vars(cls).get("load_model"), _MARK, None)
        if original is not None:
            cls.load_model = original  # type: ignore[method-assign]
