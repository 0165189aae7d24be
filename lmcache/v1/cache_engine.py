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
import time
from typing import Any, Callable, Iterator

import torch

from lmcache.utils import CacheEngineKey
from lmcache.v1.config import LMCacheEngineConfig
from lmcache.v1.gpu_connector.paged import GPUConnectorInterface
from lmcache.v1.memory_management import MemoryObj
from lmcache.v1.metadata import LMCacheEngineMetadata
from lmcache.v1.stats import TIERS as _TIERS
from lmcache.v1.stats import CacheStats, LatencyHistogram
from lmcache.v1.storage_backend.storage_manager import StorageManager
from lmcache.v1.request import (
    COPY_ARG_NAMES,
    KEY_EXTRA_NAMES,
    KeyExtras,
    TransferRequest,
    mask_start,
    reject_unknown,
    tokens_to_array,
)
from lmcache.v1.token_database import ChunkedTokenDatabase, ChunkSpan, TokenInput

logger = logging.getLogger(__name__)

_KEY_ARGS = KEY_EXTRA_NAMES
_COPY_ARGS = KEY_EXTRA_NAMES + COPY_ARG_NAMES
_LAYER_ARGS = _COPY_ARGS + ("sync",)


class LMCacheEngine:
    """The KV cache of one model shard.

    Thread-safety: ``lookup``/``lookup_unpin`` may run on a scheduler thread while
    ``store``/``retrieve`` run on the worker thread; tiers are thread-safe.

    Keyword arguments of ``store``/``retrieve``: ``kvcaches`` (list of per-layer
    tensors, default: the connector's registered ones) and ``slot_mapping`` (1-D
    int32/int64 tensor, one slot per token; negative = no slot) go to the GPU
    connector; ``cache_salt``, ``request_configs`` and ``extra_keys`` are folded into
    the chunk keys (the only keyword arguments of ``lookup``/``lookup_unpin``/``keys``).
    Every public method validates its arguments once, into a
    :class:`~lmcache.v1.request.TransferRequest`, and raises TypeError/ValueError on bad
    input (unknown keyword arguments included) before touching any tier.
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
        self.latency = {op: LatencyHistogram() for op in ("store", "retrieve", "lookup")}
        """Seconds per bulk ``store``/``retrieve`` and per ``lookup`` (layerwise calls are
        not timed: their generators span the model's forward pass)."""
        self.token_database = ChunkedTokenDatabase(config, metadata)
        self.storage_manager = storage_manager or StorageManager(config, stats=self.stats)
        self.hidden_state_store = self._make_hidden_state_store()
        self._warned_full = False
        self._warned_corrupt = False
        self._closed = False

    def _make_hidden_state_store(self):
        if not self.config.enable_hidden_state_cache:
            return None
        from lmcache.v1.hidden_state_store import HiddenStateStore

        return HiddenStateStore(self.config, self.token_database, self.storage_manager)

    # ------------------------------------------------------------------ requests
    def _key_request(self, where: str, tokens: TokenInput, kwargs: dict[str, Any]) -> TransferRequest:
        reject_unknown(kwargs, _KEY_ARGS, where)
        return TransferRequest(tokens_to_array(tokens), 0, KeyExtras.from_kwargs(kwargs))

    def _copy_request(
        self, where: str, tokens: TokenInput, mask: object, kwargs: dict[str, Any], allowed: tuple[str, ...]
    ) -> TransferRequest:
        """Validate a store/retrieve call once: tokens, mask, extras, KV tensors and slots."""
        reject_unknown(kwargs, allowed, where)
        arr = tokens_to_array(tokens)
        first = mask_start(mask, arr.shape[0], self.token_database.chunk_size)
        extras = KeyExtras.from_kwargs(kwargs)
        kv = self._connector().bind(
            arr.shape[0],
            kvcaches=kwargs.get("kvcaches"),
            slot_mapping=kwargs.get("slot_mapping"),
            sync=kwargs.get("sync", True),
        )
        return TransferRequest(arr, first, extras, kv)

    def _spans(self, req: TransferRequest) -> list[ChunkSpan]:
        return self.token_database.spans_of(req.tokens, req.mask_start, req.extras)

    def _connector(self) -> GPUConnectorInterface:
        if self.gpu_connector is None:
            raise ValueError("gpu_connector: this engine was built without one; store/retrieve need it")
        return self.gpu_connector

    def fitting_prefix(
        self,
        spans: list[ChunkSpan],
        objs: list[MemoryObj],
        connector: Any,
        keys: list[CacheEngineKey] | None = None,
    ) -> int:
        """How many leading ``objs`` fit their span under ``connector``'s layout.

        The first that does not (a well-formed entry of another shape, dtype or format:
        e.g. written by a differently configured process) is a miss: its key (``keys[i]``,
        default the span's) is removed from every tier, counted in ``stats.corrupt_entries`` and logged once. The caller
        still owns (and releases) every object.
        """
        dtype, fmt = self.metadata.kv_dtype, connector.fmt
        for i, (span, obj) in enumerate(zip(spans, objs)):
            want = tuple(connector.get_shape(span.end - span.start))
            if obj.shape != want or obj.dtype != dtype or obj.fmt != fmt:
                self.drop_corrupt(keys[i] if keys is not None else span.key, f"shape {obj.shape} {obj.dtype} {obj.fmt.name}, expected {want} {dtype} {fmt.name}")
                return i
        return len(objs)

    def drop_corrupt(self, key: CacheEngineKey, why: str) -> None:
        """Remove an entry that does not fit the request from every tier (a miss, counted)."""
        self.storage_manager.remove(key)
        self.stats.add(corrupt_entries=1)
        if not self._warned_corrupt:
            self._warned_corrupt = True
            logger.warning("lmcache: dropped a cached entry that does not fit this engine (%s); treated as a miss "
                           "(logged once, counted in corrupt_entries)", why)

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

            return store_all(self, self._copy_request("store", tokens, mask, kwargs, _COPY_ARGS))
        req = self._copy_request("store", tokens, mask, kwargs, _COPY_ARGS)
        t0 = time.perf_counter()
        try:
            return self._store(req)
        finally:
            self.latency["store"].observe(time.perf_counter() - t0)

    def _store(self, req: TransferRequest) -> int:
        kv = req.kv
        assert kv is not None
        spans = self._spans(req)
        self.stats.add(store_requests=1)
        if not spans:
            return 0
        connector = self._connector()
        spans = [s for s in spans if s.end <= kv.first_unmapped]
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
            connector.batched_from_gpu(objs, [s.start for s in todo], [s.end for s in todo], kv)
            self.storage_manager.batched_put([s.key for s in todo], objs)
        finally:
            for obj in objs:
                obj.ref_count_down()
        stored = sum(s.end - s.start for s in todo)
        self.stats.add(stored_tokens=stored, stored_bytes=sum(o.get_size() for o in objs))
        logger.debug("lmcache store: %d tokens in %d chunks", stored, len(todo))
        return stored

    # ------------------------------------------------------------------ retrieve
    def retrieve(self, tokens: TokenInput, mask: torch.Tensor | None = None, **kwargs: Any) -> torch.Tensor:
        """Write cached KV for the longest cached prefix of ``tokens`` into the paged cache.

        Returns a CPU bool tensor, True where KV was written back: tokens of the
        retrieved chunks that have a slot (a token whose slot is negative gets nothing
        and stays False). Chunks where ``mask`` is False are neither read nor written.
        """
        if self.config.use_layerwise:
            from lmcache.v1.layerwise import retrieve_all

            return retrieve_all(self, self._copy_request("retrieve", tokens, mask, kwargs, _COPY_ARGS))
        req = self._copy_request("retrieve", tokens, mask, kwargs, _COPY_ARGS)
        t0 = time.perf_counter()
        try:
            return self._retrieve(req)
        finally:
            self.latency["retrieve"].observe(time.perf_counter() - t0)

    def _retrieve(self, req: TransferRequest) -> torch.Tensor:
        ret = torch.zeros(req.num_tokens, dtype=torch.bool)
        spans = self._spans(req)
        self.stats.add(retrieve_requests=1, requested_tokens=req.requested_tokens)
        if not spans:
            return ret
        sources: list[str] = []
        objs = self.storage_manager.batched_get([s.key for s in spans], sources=sources)
        hits = [o for o in objs if o is not None]
        fit = self.fitting_prefix(spans, hits, self._connector())
        for obj in hits[fit:]:
            obj.ref_count_down()
        hits = hits[:fit]
        spans = spans[:fit]
        loaded = 0
        try:
            if hits:
                self._connector().batched_to_gpu(hits, [s.start for s in spans], [s.end for s in spans], req.kv)
                req.mark_written(ret, spans[0].start, spans[-1].end)
                loaded = spans[-1].end - spans[0].start
                self.count_loaded(spans, sources, [o.get_size() for o in hits], ret)
        finally:
            for obj in hits:
                obj.ref_count_down()
        # tokens of the chunks loaded from the cache (a token without a slot, e.g. one vLLM
        # already holds, is loaded but not written: counted here, False in the mask)
        self.stats.add(hit_tokens=loaded)
        return ret

    def count_loaded(self, spans: list[ChunkSpan], tiers: list[str], nbytes: list[int], written: torch.Tensor) -> None:
        """Count the tokens (and bytes) of ``spans`` whose KV was written into the caller's
        cache, by the tier each chunk came from. ``written`` is the retrieve's mask (CPU
        bool tensor, True where KV was written: a token without a slot, e.g. the prompt's
        last one that vLLM recomputes, is not counted). Called only after the copy
        succeeded: a hit is a loaded chunk, never a promised one."""
        csum = torch.cumsum(written[: spans[-1].end].to(torch.int64), 0) if spans else None
        tokens: dict[str, int] = {}
        sizes: dict[str, int] = {}
        for span, tier, size in zip(spans, tiers, nbytes):
            assert csum is not None
            n = int(csum[span.end - 1]) - (int(csum[span.start - 1]) if span.start else 0)
            tokens[tier] = tokens.get(tier, 0) + n
            sizes[tier] = sizes.get(tier, 0) + size
        deltas = {f"hit_tokens_{t}": v for t, v in tokens.items() if t in _TIERS}
        deltas.update({f"hit_bytes_{t}": v for t, v in sizes.items() if t in _TIERS})
        if deltas:
            self.stats.add(**deltas)
        logger.debug("lmcache load: %s tokens by tier", tokens)

    # ------------------------------------------------------------------ lookup
    def lookup(self, tokens: TokenInput, pin: bool = False, **kwargs: Any) -> int:
        """Number of leading tokens whose KV is cached (a multiple of chunk_size unless
        the last chunk is partial). ``pin=True`` keeps those L1 entries from eviction
        until :meth:`lookup_unpin`."""
        if not isinstance(pin, bool):
            raise TypeError(f"pin={pin!r}: expected a bool")
        t0 = time.perf_counter()
        req = self._key_request("lookup", tokens, kwargs)
        spans = self._spans(req)
        if self.config.use_layerwise:
            from lmcache.v1.layerwise import contains_prefix

            found = contains_prefix(self.storage_manager, [s.key for s in spans], self.metadata.num_layers, pin=pin)
        else:
            found = self.storage_manager.batched_contains([s.key for s in spans], pin=pin)
        hit = spans[found - 1].end if found else 0
        self.stats.add(lookup_requests=1, lookup_tokens=req.num_tokens, lookup_hit_tokens=hit)
        self.latency["lookup"].observe(time.perf_counter() - t0)
        logger.debug("lmcache lookup: %d of %d tokens cached", hit, req.num_tokens)
        return hit

    def lookup_unpin(self, tokens: TokenInput, **kwargs: Any) -> None:
        """Undo the pins of a ``lookup(tokens, pin=True)`` with the same key extras."""
        spans = self._spans(self._key_request("lookup_unpin", tokens, kwargs))
        if self.config.use_layerwise:
            from lmcache.v1.layerwise import unpin_all

            unpin_all(self.storage_manager, [s.key for s in spans], self.metadata.num_layers)
            return
        for span in spans:
            self.storage_manager.unpin(span.key)

    # ------------------------------------------------------------------ layerwise
    def store_layer(self, tokens: TokenInput, mask: torch.Tensor | None = None, **kwargs: Any) -> Iterator[None]:
        """Layerwise store generator (num_layers + 1 ``next()`` calls); see :mod:`lmcache.v1.layerwise`."""
        from lmcache.v1.layerwise import layerwise_connector, store_layer

        layerwise_connector(self)
        return store_layer(self, self._copy_request("store_layer", tokens, mask, kwargs, _LAYER_ARGS))

    def retrieve_layer(
        self, tokens: TokenInput, mask: torch.Tensor | None = None, **kwargs: Any
    ) -> Iterator[torch.Tensor | None]:
        """Layerwise retrieve generator (num_layers + 2 yields); see :mod:`lmcache.v1.layerwise`."""
        from lmcache.v1.layerwise import layerwise_connector, retrieve_layer

        layerwise_connector(self)
        return retrieve_layer(self, self._copy_request("retrieve_layer", tokens, mask, kwargs, _LAYER_ARGS))

    # ------------------------------------------------------------------ misc
    def keys(self, tokens: TokenInput, **kwargs: Any) -> list[CacheEngineKey]:
        """The chunk keys of ``tokens`` (no mask)."""
        return [s.key for s in self._spans(self._key_request("keys", tokens, kwargs))]

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
