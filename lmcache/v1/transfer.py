"""Transfer paths: how a validated request's KV moves between the paged cache and storage.

An engine picks one :class:`TransferPath` when it is built (``use_layerwise`` in the
config) and forwards every store, retrieve, lookup and unpin to it; the engine's
methods contain no mode branches. A path that can also move KV one layer per step is a
:class:`LayerwiseTransferPath`; the engine checks for it once, when it is built.

* :class:`BulkTransfer` (this module): all layers of a chunk in one ``MemoryObj``,
  one key per chunk, one batched copy per call.
* :class:`~lmcache.v1.layerwise.LayerwiseTransfer`: one object and one key per
  (chunk, layer), copies pipelined with the forward pass one layer per ``next()``.

A path sees its engine only through a :class:`TransferContext` (token database,
storage manager, stats, connector, log-once, block reuse; built once, never changed), so
neither path imports the engine.

Thread: the caller's (the worker thread for copies; lookups may run on a scheduler
thread). Ownership: a path owns every object it allocates or gets and releases it
before returning (generators: when they finish or are closed).
"""

from __future__ import annotations

import logging
import time
from abc import ABC, abstractmethod
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field

import numpy as np
import torch

from lmcache.log_once import LogOnce
from lmcache.v1.block_reuse import BlockReuse
from lmcache.v1.gpu_connector.protocol import GPUConnectorInterface, KVConnector
from lmcache.v1.keys import CacheEngineKey
from lmcache.v1.memory_management import MemoryObj
from lmcache.v1.metadata import LMCacheEngineMetadata
from lmcache.v1.request import TransferRequest
from lmcache.v1.stats import CacheStats, LatencyHistogram
from lmcache.v1.storage_backend.storage_manager import LookupResult, StorageManager
from lmcache.v1.tiers import TIERS, Tier
from lmcache.v1.token_database import ChunkedTokenDatabase, ChunkSpan

logger = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class TransferContext:
    """What a transfer path needs from its engine, complete when built and never changed.

    ``connector`` may be None (``LMCacheEngineBuilder`` attaches a connector to an
    engine built without one: the engine then builds a new context and path with it);
    :meth:`require_connector` raises then. ``blocks``: block-granular reuse, None when
    off (see :mod:`lmcache.v1.block_reuse`). ``stats`` and ``latency`` are shared,
    mutable counters.
    """

    metadata: LMCacheEngineMetadata
    token_database: ChunkedTokenDatabase
    storage_manager: StorageManager
    stats: CacheStats
    log_once: LogOnce
    connector: KVConnector | None
    blocks: BlockReuse | None
    latency: dict[str, LatencyHistogram] = field(
        default_factory=lambda: {
            op: LatencyHistogram() for op in ("store", "retrieve", "lookup", "blend", "async_load")
        }
    )
    """Seconds per bulk ``store``/``retrieve`` and per ``lookup`` (layerwise calls are
    not timed: their generators span the model's forward pass)."""

    def require_connector(self) -> KVConnector:
        if self.connector is None:
            raise ValueError("gpu_connector: this engine was built without one; store/retrieve need it")
        return self.connector

    def spans(self, req: TransferRequest) -> list[ChunkSpan]:
        if req.spans is not None:  # chunks named by caller-supplied hashes
            return list(req.spans)
        return self.token_database.spans_of(req.tokens, req.mask_start, req.extras)

    def store_spans(self, req: TransferRequest) -> list[ChunkSpan]:
        """Spans a store writes: with block reuse on, what :meth:`BlockReuse.store_spans`
        says (not for chunks named by hashes: they have no tokens to cut)."""
        if self.blocks is None or req.spans is not None:
            return self.spans(req)
        return self.blocks.store_spans(req)

    def pool_full(self, skipped_chunks: int) -> None:
        """The pool had no room even after eviction: the rest of a store is skipped (counted, logged once)."""
        self.stats.add(store_skipped_chunks=skipped_chunks)
        self.log_once(logging.WARNING, "full", "lmcache CPU pool full (nothing evictable): skipping stores (logged once)")

    def fitting_prefix(
        self,
        spans: Sequence[ChunkSpan],
        objs: Sequence[MemoryObj],
        connector: KVConnector,
        keys: Sequence[CacheEngineKey] | None = None,
    ) -> int:
        """How many leading ``objs`` fit their span under ``connector``'s layout.

        The first that does not (a well-formed entry of another shape, dtype or format:
        e.g. written by a differently configured process) is a miss: its key
        (``keys[i]``, default the span's) is removed from every tier, counted in
        ``stats.corrupt_entries`` and logged once. The caller still owns (and releases)
        every object.
        """
        dtype, fmt = self.metadata.kv_dtype, connector.fmt
        for i, (span, obj) in enumerate(zip(spans, objs)):
            want = tuple(connector.get_shape(span.end - span.start))
            if obj.shape != want or obj.dtype != dtype or obj.fmt != fmt:
                key = keys[i] if keys is not None else span.key
                self.drop_corrupt(key, f"shape {obj.shape} {obj.dtype} {obj.fmt.name}, expected {want} {dtype} {fmt.name}")
                return i
        return len(objs)

    def count_loaded(self, spans: Sequence[ChunkSpan], tiers: Sequence[Tier], nbytes: Sequence[int], written: torch.Tensor) -> None:
        """Count the tokens (and bytes) of ``spans`` whose KV was written into the caller's
        cache, by the tier each chunk came from. ``written`` is the retrieve's mask (CPU
        bool tensor, True where KV was written: a token without a slot, e.g. the prompt's
        last one that vLLM recomputes, is not counted). Called only after the copy
        succeeded: a hit is a loaded chunk, never a promised one."""
        if not spans:
            return
        # written tokens before each span boundary, from one cumulative sum (no per-span tensor op)
        csum = np.concatenate(([0], np.cumsum(written[: spans[-1].end].numpy(), dtype=np.int64)))
        bounds = csum[[i for s in spans for i in (s.start, s.end)]].tolist()
        tokens: dict[Tier, int] = {}
        sizes: dict[Tier, int] = {}
        for k, (tier, size) in enumerate(zip(tiers, nbytes)):
            tokens[tier] = tokens.get(tier, 0) + bounds[2 * k + 1] - bounds[2 * k]
            sizes[tier] = sizes.get(tier, 0) + size
        deltas = {f"hit_tokens_{t}": v for t, v in tokens.items() if t in TIERS}
        deltas.update({f"hit_bytes_{t}": v for t, v in sizes.items() if t in TIERS})
        if deltas:
            self.stats.add(**deltas)
        logger.debug("lmcache load: %s tokens by tier", tokens)

    def drop_corrupt(self, key: CacheEngineKey, why: str) -> None:
        """Remove an entry that does not fit the request from every tier (a miss, counted)."""
        self.storage_manager.remove(key)
        self.stats.add(corrupt_entries=1)
        self.log_once(
            logging.WARNING,
            "corrupt",
            "lmcache: dropped a cached entry that does not fit this engine (%s); treated as a miss "
            "(logged once, counted in corrupt_entries)",
            why,
        )


@dataclass(frozen=True, slots=True)
class _Tail:
    """A block prefix found by :meth:`BulkTransfer._block_tail` (``obj`` owned by the caller)."""

    span: ChunkSpan
    obj: MemoryObj
    source: Tier


def release(objs: Sequence[MemoryObj | None]) -> None:
    """Drop one reference of each object (None entries are skipped)."""
    for obj in objs:
        if obj is not None:
            obj.ref_count_down()


def equal_runs(values: Sequence[object]) -> Iterator[tuple[int, int]]:
    """``[start, end)`` of each run of equal consecutive ``values`` (a request's chunks of
    one length or shape are allocated together)."""
    i = 0
    while i < len(values):
        j = i + 1
        while j < len(values) and values[j] == values[i]:
            j += 1
        yield i, j
        i = j


class TransferPath(ABC):
    """One way of moving KV for whole requests (see the module docstring).

    Every method takes keys or a validated :class:`~lmcache.v1.request.TransferRequest`
    and trusts it. ``store``/``retrieve`` block until the copy is complete.
    """

    def __init__(self, ctx: TransferContext) -> None:
        self.ctx = ctx

    @abstractmethod
    def store(self, req: TransferRequest) -> int:
        """Store the request's KV; the number of tokens newly stored."""

    @abstractmethod
    def retrieve(self, req: TransferRequest) -> torch.Tensor:
        """Write cached KV of the longest cached prefix; CPU bool mask of the written tokens."""

    @abstractmethod
    def lookup(self, keys: Sequence[CacheEngineKey], pin: bool, search_range: frozenset[str] | None = None) -> LookupResult:
        """The leading chunk keys retrievable (``hits``), asking the tiers ``search_range``
        names (None: all); ``pin`` pins their L1 entries (``pinned``: the storage keys
        pinned, for ``StorageManager.batched_unpin``)."""

    @abstractmethod
    def unpin(self, keys: Sequence[CacheEngineKey]) -> None:
        """Undo the pins of ``lookup(keys, pin=True)``."""


class LayerwiseTransferPath(TransferPath):
    """A transfer path that also moves KV one layer per step, pipelined with the forward
    pass: ``store_layer``/``retrieve_layer`` return generators."""

    @abstractmethod
    def check_layer_calls(self) -> None:
        """ValueError unless ``store_layer``/``retrieve_layer`` can run (checked before the request is built)."""

    @abstractmethod
    def store_layer(self, req: TransferRequest) -> Iterator[None]:
        """Layerwise store generator (``num_layers + 1`` ``next()`` calls)."""

    @abstractmethod
    def retrieve_layer(self, req: TransferRequest) -> Iterator[torch.Tensor | None]:
        """Layerwise retrieve generator (``num_layers + 2`` ``next()`` calls)."""


class BulkTransfer(TransferPath):
    """All layers of a chunk in one object; one batched copy per store/retrieve."""

    def connector(self) -> GPUConnectorInterface:
        """The engine's connector if it is a bulk one; ValueError otherwise."""
        connector = self.ctx.require_connector()
        if not isinstance(connector, GPUConnectorInterface):
            raise ValueError(
                f"gpu_connector: the bulk path (use_layerwise: false) needs a bulk connector "
                f"(VLLMPagedMemGPUConnectorV2), got {type(connector).__name__}"
            )
        return connector

    def store(self, req: TransferRequest) -> int:
        t0 = time.perf_counter()
        try:
            return self._store(req)
        finally:
            self.ctx.latency["store"].observe(time.perf_counter() - t0)

    def _store(self, req: TransferRequest) -> int:
        ctx = self.ctx
        kv = req.kv
        assert kv is not None
        spans = ctx.store_spans(req)
        ctx.stats.add(store_requests=1)
        if not spans:
            return 0
        connector = self.connector()
        sm = ctx.storage_manager
        spans = [s for s in spans if s.end <= kv.first_unmapped]
        # one batched lookup (one round trip for remote tiers): skip the cached prefix
        cached = sm.batched_contains([s.key for s in spans])
        todo = [s for s in spans[cached:] if not sm.is_resident(s.key)]
        objs = self._allocate(connector, todo)
        todo = todo[: len(objs)]
        if objs:
            try:
                connector.batched_from_gpu(objs, [s.start for s in todo], [s.end for s in todo], kv)
                sm.batched_put([s.key for s in todo], objs)
            finally:
                release(objs)
        if ctx.blocks is not None:
            # the cached prefix too: its entries may come from a restart's disk tier or
            # another server, and re-adding refreshes the index's order
            ctx.blocks.register(req, spans[:cached] + todo, chain=spans)
        if not objs:
            return 0
        stored = sum(s.end - s.start for s in todo)
        ctx.stats.add(stored_tokens=stored, stored_bytes=sum(o.get_size() for o in objs))
        logger.debug("lmcache store: %d tokens in %d chunks", stored, len(todo))
        return stored

    def _allocate(self, connector: KVConnector, spans: Sequence[ChunkSpan]) -> list[MemoryObj]:
        """One object per span, runs of same-length spans in one batch each
        (:meth:`StorageManager.allocate_many`); a prefix when the pool is full (the rest
        is skipped, counted and logged once)."""
        ctx = self.ctx
        dtype, fmt = ctx.metadata.kv_dtype, connector.fmt
        objs: list[MemoryObj] = []
        lengths = [s.end - s.start for s in spans]
        for i, j in equal_runs(lengths):
            got = ctx.storage_manager.allocate_many(tuple(connector.get_shape(lengths[i])), dtype, fmt, j - i)
            objs += got
            if len(got) < j - i:
                ctx.pool_full(len(spans) - len(objs))
                break
        return objs

    def retrieve(self, req: TransferRequest) -> torch.Tensor:
        t0 = time.perf_counter()
        try:
            return self._retrieve(req)
        finally:
            self.ctx.latency["retrieve"].observe(time.perf_counter() - t0)

    def _retrieve(self, req: TransferRequest) -> torch.Tensor:
        ctx = self.ctx
        ret = torch.zeros(req.num_tokens, dtype=torch.bool)
        spans = ctx.spans(req)
        ctx.stats.add(retrieve_requests=1, requested_tokens=req.requested_tokens)
        if not spans and ctx.blocks is None:
            return ret
        connector = self.connector()
        sources: list[Tier] = []
        objs = ctx.storage_manager.batched_get([s.key for s in spans], sources=sources)
        hits = [o for o in objs if o is not None]
        fit = ctx.fitting_prefix(spans, hits, connector)
        release(hits[fit:])
        tail = None
        if fit == len(hits) and ctx.blocks is not None:
            try:
                tail = self._block_tail(req, spans, fit, connector)
            except BaseException:
                release(hits[:fit])
                raise
        hits = hits[:fit]
        spans = spans[:fit]
        if tail is not None:
            spans.append(tail.span)
            hits.append(tail.obj)
            sources = sources[:fit] + [tail.source]
        loaded = 0
        try:
            if hits:
                connector.batched_to_gpu(hits, [s.start for s in spans], [s.end for s in spans], req.kv)
                req.mark_written(ret, spans[0].start, spans[-1].end)
                loaded = spans[-1].end - spans[0].start
                ctx.count_loaded(spans, sources, [o.get_size() for o in hits], ret)
                if tail is not None:
                    ctx.stats.add(block_hit_tokens=tail.span.end - tail.span.start)
        finally:
            release(hits)
        if loaded and ctx.blocks is not None:  # chunks written by a previous process or another server
            ctx.blocks.register(req, spans[:-1] if tail is not None else spans)
        # tokens of the chunks loaded from the cache (a token without a slot, e.g. one vLLM
        # already holds, is loaded but not written: counted here, False in the mask)
        ctx.stats.add(hit_tokens=loaded)
        return ret

    def _block_tail(
        self, req: TransferRequest, spans: Sequence[ChunkSpan], num_hit: int, connector: GPUConnectorInterface
    ) -> _Tail | None:
        """Block-granular reuse after ``num_hit`` retrieved spans: the longest block-aligned
        prefix of the next chunk that an indexed entry holds, as a pool object of exactly
        those tokens (a copy of the entry's first tokens when the entry is longer); None
        when there is none or it cannot be read. The caller owns the returned object."""
        ctx = self.ctx
        assert ctx.blocks is not None
        probe = ctx.blocks.retrieve_candidates(req, spans, num_hit)
        sources: list[Tier] = []
        for hit in probe.hits:  # longest first; a gone entry falls back
            obj = ctx.storage_manager.batched_get([hit.key], sources=sources)[0]
            if obj is not None:
                break
        else:
            return None
        n = hit.num_tokens
        dtype, fmt = ctx.metadata.kv_dtype, connector.fmt
        held = obj.shape[fmt.token_dim()] if len(obj.shape) == 4 else -1
        if obj.dtype != dtype or obj.fmt != fmt or held < n or obj.shape != tuple(connector.get_shape(held)):
            release([obj])
            ctx.drop_corrupt(hit.key, f"shape {obj.shape} {obj.dtype} {obj.fmt.name} for a {n}-token block prefix")
            return None
        if held > n:
            part = ctx.storage_manager.allocate(connector.get_shape(n), dtype, fmt)
            if part is not None:
                assert part.tensor is not None and obj.tensor is not None
                part.tensor.copy_(obj.tensor.narrow(fmt.token_dim(), 0, n))
            release([obj])
            if part is None:
                return None
            obj = part
        return _Tail(ChunkSpan(probe.start, probe.start + n, hit.key), obj, sources[0] if sources else Tier.UNKNOWN)

    def lookup(self, keys: Sequence[CacheEngineKey], pin: bool, search_range: frozenset[str] | None = None) -> LookupResult:
        return self.ctx.storage_manager.batched_lookup([keys], pin, search_range=search_range)

    def unpin(self, keys: Sequence[CacheEngineKey]) -> None:
        for key in keys:
            self.ctx.storage_manager.unpin(key)
