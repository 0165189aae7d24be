"""LMCacheEngine: orchestrates keys, storage and copies. It owns no copying, hashing or I/O.

Store:    tokens -> chunk keys (token database) -> pool objects (storage manager)
          -> paged KV copied in (GPU connector) -> ``batched_put`` to the tiers.
Retrieve: chunk keys -> ``batched_get`` (prefix) -> copied into the paged KV.
Lookup:   chunk keys -> ``batched_contains`` (prefix), no data moved.
"""

from __future__ import annotations

import dataclasses
import logging
import threading
from dataclasses import dataclass
from typing import Any, Callable, Iterator

import torch

from lmcache.utils import CacheEngineKey
from lmcache.v1.config import LMCacheEngineConfig
from lmcache.v1.gpu_connector.copy_ops import first_negative_slot
from lmcache.v1.gpu_connector.paged import GPUConnectorInterface
from lmcache.v1.memory_management import MemoryObj
from lmcache.v1.metadata import LMCacheEngineMetadata
from lmcache.v1.stats import CacheStats
from lmcache.v1.storage_backend.storage_manager import StorageManager
from lmcache.v1.token_database import ChunkedTokenDatabase, ChunkSpan, TokenInput

logger = logging.getLogger(__name__)

_KEY_EXTRAS = ("cache_salt", "request_configs", "extra_keys")


@dataclass(frozen=True, slots=True)
class _Request:
    """A call's arguments split into key extras and connector arguments."""

    key_extras: dict[str, Any]
    copy_args: dict[str, Any]


def _split_kwargs(kwargs: dict[str, Any]) -> _Request:
    extras = {k: kwargs[k] for k in _KEY_EXTRAS if kwargs.get(k) is not None}
    copy_args = {k: v for k, v in kwargs.items() if k not in _KEY_EXTRAS}
    return _Request(extras, copy_args)


class LMCacheEngine:
    """The KV cache of one model shard.

    Thread-safety: ``lookup``/``lookup_unpin`` may run on a scheduler thread while
    ``store``/``retrieve`` run on the worker thread; tiers are thread-safe.

    Keyword arguments of ``store``/``retrieve``: ``kvcaches`` (list of per-layer
    tensors) and ``slot_mapping`` (tensor, one slot per token; negative = skip) go to the
    GPU connector; ``cache_salt``, ``request_configs`` and ``extra_keys`` are folded into
    the chunk keys (also accepted by ``lookup``).
    """

    def __init__(
        self,
        config: LMCacheEngineConfig,
        metadata: LMCacheEngineMetadata,
        gpu_connector: GPUConnectorInterface | None,
        *,
        storage_manager: StorageManager | None = None,
    ) -> None:
        config.validate()
        self.config = config
        self.metadata = metadata
        self.gpu_connector = gpu_connector
        self.stats = CacheStats()
        self.token_database = ChunkedTokenDatabase(config, metadata)
        self.storage_manager = storage_manager or StorageManager(config, stats=self.stats)
        self.hidden_state_store = self._make_hidden_state_store()
        self._warned_full = False
        self._closed = False

    def _make_hidden_state_store(self):
        if not self.config.enable_hidden_state_cache:
            return None
        from lmcache.v1.hidden_state_store import HiddenStateStore

        return HiddenStateStore(self.config, self.token_database, self.storage_manager)

    # ------------------------------------------------------------------ helpers
    def _spans(self, tokens: TokenInput, mask, extras: dict[str, Any]) -> list[ChunkSpan]:
        return self.token_database.spans(tokens, mask, **extras)

    def _connector(self) -> GPUConnectorInterface:
        if self.gpu_connector is None:
            raise ValueError("gpu_connector: this engine was built without one; store/retrieve need it")
        return self.gpu_connector

    # ------------------------------------------------------------------ store
    def store(self, tokens: TokenInput, mask: torch.Tensor | None = None, **kwargs: Any) -> int:
        """Copy the KV of ``tokens`` (where ``mask`` is True) into the cache.

        The already-cached prefix of chunks is skipped; chunks containing a negative slot are not
        stored (their KV is not in the paged cache), nor is anything after them. If the
        pool is full even after eviction, the rest of the request is skipped and
        counted (``stats.store_skipped_chunks``); this is not an error.
        Returns the number of tokens newly stored. The engine keeps no reference to
        the caller's tensors.
        """
        if self.config.use_layerwise:
            from lmcache.v1.layerwise import store_all

            return store_all(self, tokens, mask, **kwargs)
        req = _split_kwargs(kwargs)
        spans = self._spans(tokens, mask, req.key_extras)
        self.stats.add(store_requests=1)
        if not spans:
            return 0
        connector = self._connector()
        limit = first_negative_slot(req.copy_args.get("slot_mapping"), spans[-1].end)
        spans = [s for s in spans if s.end <= limit]
        # one batched lookup (one round trip for remote tiers): skip the cached prefix
        cached = self.storage_manager.batched_contains([s.key for s in spans])
        todo = [s for s in spans[cached:] if not self.storage_manager.is_resident(s.key)]
        objs: list[MemoryObj] = []
        for span in todo:
            obj = self.storage_manager.allocate(connector.get_shape(span.end - span.start), self.metadata.kv_dtype, connector.fmt)
            if obj is None:
                self.stats.add(store_skipped_chunks=len(todo) - len(objs))
                if not self._warned_full:
                    self._warned_full = True
                    logger.warning("lmcache CPU pool full (nothing evictable): skipping stores (logged once)")
                break
            objs.append(obj)
        todo = todo[: len(objs)]
        if not objs:
            return 0
        try:
            connector.batched_from_gpu(objs, [s.start for s in todo], [s.end for s in todo], **req.copy_args)
            self.storage_manager.batched_put([s.key for s in todo], objs)
        finally:
            for obj in objs:
                obj.ref_count_down()
        stored = sum(s.end - s.start for s in todo)
        self.stats.add(stored_tokens=stored)
        return stored

    # ------------------------------------------------------------------ retrieve
    def retrieve(self, tokens: TokenInput, mask: torch.Tensor | None = None, **kwargs: Any) -> torch.Tensor:
        """Write cached KV for the longest cached prefix of ``tokens`` into the paged cache.

        Returns a CPU bool tensor, True where KV was written back. Chunks where
        ``mask`` is False are neither read nor written.
        """
        if self.config.use_layerwise:
            from lmcache.v1.layerwise import retrieve_all

            return retrieve_all(self, tokens, mask, **kwargs)
        req = _split_kwargs(kwargs)
        n = len(tokens)
        ret = torch.zeros(n, dtype=torch.bool)
        spans = self._spans(tokens, mask, req.key_extras)
        requested = n - (int((~torch.as_tensor(mask, dtype=torch.bool)).sum()) if mask is not None else 0)
        self.stats.add(retrieve_requests=1, requested_tokens=requested)
        if not spans:
            return ret
        objs = self.storage_manager.batched_get([s.key for s in spans])
        hits = [o for o in objs if o is not None]
        spans = spans[: len(hits)]
        try:
            if hits:
                self._connector().batched_to_gpu(hits, [s.start for s in spans], [s.end for s in spans], **req.copy_args)
                for s in spans:
                    ret[s.start : s.end] = True
        finally:
            for obj in hits:
                obj.ref_count_down()
        self.stats.add(hit_tokens=int(ret.sum()))
        return ret

    # ------------------------------------------------------------------ lookup
    def lookup(self, tokens: TokenInput, pin: bool = False, **kwargs: Any) -> int:
        """Number of leading tokens whose KV is cached (a multiple of chunk_size unless
        the last chunk is partial). ``pin=True`` keeps those L1 entries from eviction
        until :meth:`lookup_unpin`."""
        spans = self._spans(tokens, None, _split_kwargs(kwargs).key_extras)
        if self.config.use_layerwise:
            from lmcache.v1.layerwise import contains_prefix

            found = contains_prefix(self.storage_manager, [s.key for s in spans], self.metadata.num_layers, pin=pin)
        else:
            found = self.storage_manager.batched_contains([s.key for s in spans], pin=pin)
        hit = spans[found - 1].end if found else 0
        self.stats.add(lookup_requests=1, lookup_tokens=len(tokens), lookup_hit_tokens=hit)
        return hit

    def lookup_unpin(self, tokens: TokenInput, **kwargs: Any) -> None:
        """Undo the pins of a ``lookup(tokens, pin=True)`` with the same key extras."""
        spans = self._spans(tokens, None, _split_kwargs(kwargs).key_extras)
        if self.config.use_layerwise:
            from lmcache.v1.layerwise import unpin_all

            unpin_all(self.storage_manager, [s.key for s in spans], self.metadata.num_layers)
            return
        for span in spans:
            self.storage_manager.unpin(span.key)

    # ------------------------------------------------------------------ layerwise
    def store_layer(self, tokens: TokenInput, mask: torch.Tensor | None = None, **kwargs: Any) -> Iterator[None]:
        """Layerwise store generator (num_layers + 1 ``next()`` calls); see :mod:`lmcache.v1.layerwise`."""
        from lmcache.v1.layerwise import store_layer

        return store_layer(self, tokens, mask, **kwargs)

    def retrieve_layer(
        self, tokens: TokenInput, mask: torch.Tensor | None = None, **kwargs: Any
    ) -> Iterator[torch.Tensor | None]:
        """Layerwise retrieve generator (num_layers + 2 yields); see :mod:`lmcache.v1.layerwise`."""
        from lmcache.v1.layerwise import retrieve_layer

        return retrieve_layer(self, tokens, mask, **kwargs)

    # ------------------------------------------------------------------ misc
    def keys(self, tokens: TokenInput, **kwargs: Any) -> list[CacheEngineKey]:
        """The chunk keys of ``tokens`` (no mask)."""
        return [s.key for s in self._spans(tokens, None, _split_kwargs(kwargs).key_extras)]

    def close(self) -> None:
        """Stop background work and free memory. Idempotent."""
        if self._closed:
            return
        self._closed = True
        if self.hidden_state_store is not None:
            self.hidden_state_store.close()
        self.storage_manager.close()


class LMCacheEngineBuilder:
    """Process-wide registry of engines by instance id (one per model shard)."""

    _engines: dict[str, LMCacheEngine] = {}
    _configs: dict[str, LMCacheEngineConfig] = {}
    _lock = threading.Lock()

    @classmethod
    def get_or_create(
        cls,
        instance_id: str,
        config: LMCacheEngineConfig,
        metadata: LMCacheEngineMetadata,
        gpu_connector: GPUConnectorInterface | None,
        broadcast_fn: Callable[..., Any] | None = None,
        broadcast_object_fn: Callable[..., Any] | None = None,
    ) -> LMCacheEngine:
        """The engine registered as ``instance_id``, created on first use.

        LMCache 0.5.6's signature. ``broadcast_fn``/``broadcast_object_fn`` are
        accepted and unused (this engine never broadcasts between ranks). An existing
        id asked for with a different config or metadata raises ValueError naming the
        fields that differ; a copy of the config is kept, so mutating the caller's
        object later cannot hide a change. A connector given for an engine that was
        built without one is attached to it.
        """
        with cls._lock:
            engine = cls._engines.get(instance_id)
            if engine is None:
                engine = LMCacheEngine(config, metadata, gpu_connector)
                cls._engines[instance_id] = engine
                cls._configs[instance_id] = config.copy()
                return engine
            cfg_diffs = [f"config.{name}" for name in _differing_fields(cls._configs[instance_id], config)]
            md_diffs = [f"metadata.{name}" for name in _differing_fields(engine.metadata, metadata)]
            if cfg_diffs or md_diffs:
                what = " and ".join(w for w, d in (("configuration", cfg_diffs), ("metadata", md_diffs)) if d)
                raise ValueError(
                    f"instance_id={instance_id!r}: already registered with different {what} "
                    f"(differs: {', '.join(cfg_diffs + md_diffs)}); destroy() it first or use another instance id"
                )
            if engine.gpu_connector is None and gpu_connector is not None:
                engine.gpu_connector = gpu_connector
            return engine

    @classmethod
    def get(cls, instance_id: str) -> LMCacheEngine | None:
        with cls._lock:
            return cls._engines.get(instance_id)

    @classmethod
    def destroy(cls, instance_id: str) -> None:
        """Close and forget the engine; unknown ids are ignored."""
        with cls._lock:
            engine = cls._engines.pop(instance_id, None)
            cls._configs.pop(instance_id, None)
        if engine is not None:
            engine.close()


def _differing_fields(old: Any, new: Any) -> list[str]:
    """Names of the dataclass fields whose values differ (``type`` if the classes do)."""
    if type(old) is not type(new):
        return [f"type ({type(old).__name__} != {type(new).__name__})"]
    return [f.name for f in dataclasses.fields(old) if getattr(old, f.name) != getattr(new, f.name)]
