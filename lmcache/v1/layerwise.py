"""Layerwise store and retrieve: KV moves one layer per ``next()``, pipelined with the forward pass.

Keys: chunk ``j`` of a request has one :class:`~lmcache.v1.keys.LayerCacheEngineKey` per
layer (``key.split_layers(num_layers)``); each holds a one-layer ``KV_2LTD`` object
``[2, 1, tokens, hidden]`` (``KV_MLA_FMT`` ``[1, 1, tokens, hidden]`` for MLA).

Store generator (:meth:`LayerwiseTransfer.store_layer`), exactly ``num_layers + 1`` ``next()`` calls, all
returning None:

* call 0 allocates the objects of every (chunk, layer) upfront (so the store cannot run
  out of pool memory half way and evict its own earlier layers) and copies layer 0;
* call ``i`` (1 <= i < num_layers) copies layer ``i``;
* after each copy, every layer whose copy has completed is handed to
  ``StorageManager.batched_put`` (all its chunks at once). On CPU copies are
  synchronous, so layer ``i`` is in storage when call ``i`` returns; on CUDA it is
  published by the first call that finds its copy complete, at the latest the last one;
* the last call waits for the remaining copies, publishes them, drops the generator's
  references and updates the stats.

Retrieve generator (:meth:`LayerwiseTransfer.retrieve_layer`), exactly ``num_layers + 2`` ``next()`` calls:

* call 0 (setup) determines the retrievable prefix over *all* layers (a chunk counts
  only if every layer of it and of all earlier chunks is present), pins the L1 entries
  of that prefix so a concurrent store cannot evict them half way, starts layer 0's
  reads and returns None;
* call ``i + 1`` copies layer ``i`` into the paged KV (objects are allocated per layer,
  on demand, by ``StorageManager.layerwise_batched_get``) after starting layer
  ``i + 1``'s reads, so reading the next layer overlaps with copying this one; it
  returns None;
* the last call returns a CPU bool tensor, True for tokens whose KV was written for
  every layer.

Storage order: a layer's objects are published only when all its chunks are copied,
and a retrieve never reports a token whose KV is missing for some layer. If an entry
disappears between setup and its layer's read (a lower tier lost it), the retrieve
continues with the shorter prefix, counts ``stats.load_errors`` and the final mask has
fewer True tokens than the lookup promised. Tokens past the final mask may hold KV for
some layers only: the caller (the vLLM adapter) must recompute them, never use them.

Thread: the worker thread that runs the forward pass. Ownership: the generators own
every object they allocate or get and release them themselves, also when a generator
is closed (or garbage-collected) before its last call.
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Iterator, Sequence
from concurrent.futures import Future
from dataclasses import dataclass, field

import torch

from lmcache.v1.gpu_connector.layerwise import LayerCopy, LayerwiseGPUConnector
from lmcache.v1.keys import CacheEngineKey, LayerCacheEngineKey
from lmcache.v1.memory_management import MemoryObj
from lmcache.v1.request import TransferRequest
from lmcache.v1.storage_backend.storage_manager import StorageManager
from lmcache.v1.token_database import ChunkSpan
from lmcache.v1.transfer import TransferContext, TransferPath, release

logger = logging.getLogger(__name__)


# ---------------------------------------------------------------------- keys
@functools.lru_cache(maxsize=4096)
def _split_cached(key: CacheEngineKey, num_layers: int) -> tuple[LayerCacheEngineKey, ...]:
    return tuple(key.split_layers(num_layers))


def layer_keys(keys: Sequence[CacheEngineKey], num_layers: int) -> list[list[LayerCacheEngineKey]]:
    """Per layer, the layer keys of ``keys`` (``result[layer][chunk]``).

    Recently split keys are reused (bounded cache): a retrieve then gets the very key
    objects its store put into the tiers, which makes both the splitting and the tier
    dict lookups (identity before equality) cheap on the time-to-first-layer path.
    """
    per_chunk = [_split_cached(k, num_layers) for k in keys]
    return [[chunk[layer] for chunk in per_chunk] for layer in range(num_layers)]


def _touch_tail_to_head(storage_manager: StorageManager, keys_per_layer: Sequence[Sequence[CacheEngineKey]]) -> None:
    """Re-order L1 recency so a request's tail chunks (all their layers) are evicted first.

    Layerwise puts and gets touch keys layer by layer; afterwards the eviction order
    would be "all of layer 0, then layer 1, ...". Chunk ``j`` is usable only if every
    layer of chunks ``0..j`` is present, so evicting whole chunks from the tail wastes
    the least.
    """
    if not keys_per_layer:
        return
    # head first; batched_touch walks it backwards: chunk by chunk from the tail, layers in order
    order = [layer_list[chunk] for chunk in range(len(keys_per_layer[0])) for layer_list in reversed(keys_per_layer)]
    storage_manager.batched_touch(order)


def _release_when_done(fut: Future) -> None:
    """Drop the references a layer future will deliver to nobody."""

    def _drop(f: Future) -> None:
        if not f.cancelled() and f.exception() is None:
            release(f.result())

    fut.add_done_callback(_drop)


# ---------------------------------------------------------------------- generator state
@dataclass(slots=True)
class StoreOutcome:
    """What a finished store generator did (filled in by its last call)."""

    stored_tokens: int = 0
    finished: bool = False


@dataclass(slots=True)
class _StoreState:
    objs: list[list[MemoryObj]] = field(default_factory=list)  # [layer][chunk]
    pending: list[LayerCopy] = field(default_factory=list)
    released: bool = False

    def release(self) -> None:
        if self.released:
            return
        self.released = True
        for handle in self.pending:
            if not handle.done():
                handle.wait()  # a copy in flight still writes into the objects
        for layer_objs in self.objs:
            release(layer_objs)


@dataclass(slots=True)
class _RetrieveState:
    pinned: list[CacheEngineKey] = field(default_factory=list)
    held: list[tuple[LayerCopy | None, list[MemoryObj]]] = field(default_factory=list)
    inflight: Future | None = None
    released: bool = False

    def release_done(self) -> None:
        """Drop the objects of layers whose copy has completed (non-blocking)."""
        keep = []
        for handle, objs in self.held:
            if handle is None or handle.done():
                release(objs)
            else:
                keep.append((handle, objs))
        self.held = keep

    def release(self, sm: StorageManager) -> None:
        if self.released:
            return
        self.released = True
        for handle, objs in self.held:
            if handle is not None and not handle.done():
                handle.wait()  # a copy in flight still reads the objects
            release(objs)
        self.held = []
        if self.inflight is not None:
            _release_when_done(self.inflight)
            self.inflight = None
        sm.batched_unpin(self.pinned)
        self.pinned = []


# ---------------------------------------------------------------------- the path
class LayerwiseTransfer(TransferPath):
    """One object and one key per (chunk, layer); copies one layer per ``next()`` (module docstring)."""

    name = "layerwise"

    def __init__(self, ctx: TransferContext) -> None:
        super().__init__(ctx)
        self.num_layers = ctx.metadata.num_layers

    def connector(self) -> LayerwiseGPUConnector:
        """The engine's connector if it is a layerwise one matching the metadata; ValueError otherwise."""
        connector = self.ctx.connector
        if not isinstance(connector, LayerwiseGPUConnector):
            raise ValueError(
                f"gpu_connector: layerwise store/retrieve need a layerwise connector "
                f"(VLLMPagedMemLayerwiseGPUConnector or VLLMBufferLayerwiseGPUConnector), got {type(connector).__name__}"
            )
        if connector.num_layers != self.num_layers:
            raise ValueError(
                f"gpu_connector: num_layers={connector.num_layers} does not match "
                f"the metadata's num_layers={self.num_layers}"
            )
        return connector

    def check_layer_calls(self) -> None:
        self.connector()

    # ------------------------------------------------------------------ lookups
    def lookup(self, keys: Sequence[CacheEngineKey], pin: bool) -> int:
        """Number of leading chunks of ``keys`` present for every layer.

        ``pin`` pins the L1 entries found, like ``StorageManager.batched_contains``;
        undo with :meth:`unpin`. Non-blocking apart from lower-tier existence checks.
        """
        return self.ctx.storage_manager.batched_lookup(layer_keys(keys, self.num_layers), pin=pin).hits

    def unpin(self, keys: Sequence[CacheEngineKey]) -> None:
        self.ctx.storage_manager.batched_unpin([k for layer_list in layer_keys(keys, self.num_layers) for k in layer_list])

    # ------------------------------------------------------------------ whole requests
    def store(self, req: TransferRequest) -> int:
        """A whole layerwise store (all generator calls); the number of stored tokens."""
        outcome = StoreOutcome()
        for _ in self.store_layer(req, outcome=outcome):
            pass
        return outcome.stored_tokens

    def retrieve(self, req: TransferRequest) -> torch.Tensor:
        """A whole layerwise retrieve (all generator calls); the retrieved-token mask."""
        result = None
        for result in self.retrieve_layer(req):
            pass
        assert isinstance(result, torch.Tensor)
        return result

    # ------------------------------------------------------------------ store
    def store_layer(self, req: TransferRequest, *, outcome: StoreOutcome | None = None) -> Iterator[None]:
        """Layerwise store generator: exactly ``num_layers + 1`` ``next()`` calls (module docstring).

        ``req`` is the validated call (``LMCacheEngine.store_layer`` builds it; its
        ``kv.sync`` is True for the first request of a batch on CUDA, see
        :mod:`lmcache.v1.gpu_connector.layerwise`). Chunks already cached for every
        layer, and chunks at or after the first negative slot, are not stored.
        ``outcome``, if given, receives the number of stored tokens. The connector is
        checked here; everything else happens in the ``next()`` calls.
        """
        return self._store_steps(self.connector(), req, outcome or StoreOutcome())

    def _store_steps(self, connector: LayerwiseGPUConnector, req: TransferRequest, outcome: StoreOutcome) -> Iterator[None]:
        ctx = self.ctx
        num_layers = self.num_layers
        sm = ctx.storage_manager
        state = _StoreState()
        try:
            # ---- call 0: plan, allocate every (chunk, layer) upfront, copy layer 0
            kv = req.kv
            assert kv is not None
            spans: list[ChunkSpan] = ctx.spans(req)
            ctx.stats.add(store_requests=1)
            spans = [s for s in spans if s.end <= kv.first_unmapped]
            keys = layer_keys([s.key for s in spans], num_layers)
            # one batched lookup per layer (one round trip per remote tier): skip the cached prefix
            cached = sm.batched_lookup(keys).hits
            todo = [j for j in range(cached, len(spans)) if not all(sm.is_resident(kl[j]) for kl in keys)]
            todo = self._allocate(connector, spans, todo, state)
            spans = [spans[j] for j in todo]
            keys = [[layer_list[j] for j in todo] for layer_list in keys]
            copier = None
            if spans:
                copier = connector.batched_from_gpu(state.objs, [s.start for s in spans], [s.end for s in spans], kv)
            published = 0  # layers [0, published) are in storage
            for _layer in range(num_layers):
                if copier is not None:
                    state.pending.append(next(copier))
                    while published < len(state.pending) and state.pending[published].done():
                        sm.batched_put(keys[published], state.objs[published])
                        published += 1
                yield None
            # ---- last call: publish what is left, release, stats
            for handle in state.pending[published:]:
                if not handle.done():
                    handle.wait()
                sm.batched_put(keys[handle.layer], state.objs[handle.layer])
            _touch_tail_to_head(sm, keys)
            state.release()
            outcome.stored_tokens = sum(s.end - s.start for s in spans)
            outcome.finished = True
            ctx.stats.add(stored_tokens=outcome.stored_tokens)
            yield None
        finally:
            state.release()

    def _allocate(
        self, connector: LayerwiseGPUConnector, spans: list[ChunkSpan], todo: list[int], state: _StoreState
    ) -> list[int]:
        """Allocate every layer of the ``todo`` chunks, chunk by chunk; returns the chunks that got all.

        On pool exhaustion the remaining chunks are skipped (counted, logged once); a
        chunk is never stored with some layers missing.
        """
        num_layers = self.num_layers
        dtype = self.ctx.metadata.kv_dtype
        per_chunk: list[list[MemoryObj]] = []
        for n_done, j in enumerate(todo):
            shape = connector.get_shape(spans[j].end - spans[j].start)
            chunk_objs: list[MemoryObj] = []
            for _ in range(num_layers):
                obj = self.ctx.storage_manager.allocate(shape, dtype, connector.fmt)
                if obj is None:
                    break
                chunk_objs.append(obj)
            if len(chunk_objs) < num_layers:
                release(chunk_objs)
                self.ctx.pool_full(len(todo) - n_done)
                todo = todo[:n_done]
                break
            per_chunk.append(chunk_objs)
        state.objs = [[chunk[layer] for chunk in per_chunk] for layer in range(num_layers)] if per_chunk else []
        return todo

    # ------------------------------------------------------------------ retrieve
    def retrieve_layer(self, req: TransferRequest) -> Iterator[torch.Tensor | None]:
        """Layerwise retrieve generator: exactly ``num_layers + 2`` ``next()`` calls (module docstring).

        ``req`` is the validated call (``kv.sync`` is True for the last request of a
        batch on CUDA; see :mod:`lmcache.v1.gpu_connector.layerwise`). The first
        ``num_layers + 1`` calls return None, the last the retrieved-token mask (CPU
        bool, ``len(tokens)``, True only for tokens with a slot). Chunks where ``mask``
        is False are neither read nor written.
        """
        return self._retrieve_steps(self.connector(), req)

    @staticmethod
    def _pin_prefix(sm: StorageManager, keys_per_layer: list[list[LayerCacheEngineKey]], state: _RetrieveState) -> int:
        """Chunks retrievable for every layer; pins (and records) the L1 entries of that prefix."""
        lookup = sm.batched_lookup(keys_per_layer, pin=True)
        state.pinned.extend(lookup.pinned)
        return lookup.hits

    def _retrieve_steps(self, connector: LayerwiseGPUConnector, req: TransferRequest) -> Iterator[torch.Tensor | None]:
        ctx = self.ctx
        num_layers = self.num_layers
        sm = ctx.storage_manager
        state = _RetrieveState()
        loader = None
        try:
            # ---- call 0: setup
            ret = torch.zeros(req.num_tokens, dtype=torch.bool)
            spans: list[ChunkSpan] = ctx.spans(req)
            ctx.stats.add(retrieve_requests=1, requested_tokens=req.requested_tokens)
            keys = layer_keys([s.key for s in spans], num_layers)
            hit = self._pin_prefix(sm, keys, state) if spans else 0
            spans, keys = spans[:hit], [layer_list[:hit] for layer_list in keys]
            reads = None
            sources: list[list[str]] = []
            chunk_bytes = [0] * hit
            if hit:
                loader = connector.batched_to_gpu([s.start for s in spans], [s.end for s in spans], req.kv)
                next(loader)
                reads = sm.layerwise_batched_get(keys, sources=sources)
                state.inflight = next(reads)
            yield None
            # ---- calls 1..num_layers: one layer each
            for layer in range(num_layers):
                if loader is not None:
                    got: list[MemoryObj | None] = state.inflight.result()
                    state.inflight = next(reads) if layer + 1 < num_layers else None  # overlap the next layer's reads
                    ok = 0
                    while ok < min(hit, len(got)) and got[ok] is not None:
                        ok += 1
                    ok = ctx.fitting_prefix(spans[:ok], got[:ok], connector, keys[layer][:ok])  # type: ignore[arg-type]
                    if ok < hit:
                        self._report_shortfall(layer, hit, ok)
                        hit = ok
                    release(got[hit:])
                    objs = [o for o in got[:hit] if o is not None]
                    for i, o in enumerate(objs):
                        chunk_bytes[i] += o.get_size()
                    handle = None
                    try:
                        handle = loader.send(objs)
                    finally:
                        state.held.append((handle, objs))  # released once the copy is done (or failed)
                    state.release_done()
                yield None
            # ---- last call: final ordering, release, mask
            if loader is not None:
                next(loader)
            state.release(sm)
            if hit:
                req.mark_written(ret, spans[0].start, spans[hit - 1].end)
            _touch_tail_to_head(sm, [layer_list[:hit] for layer_list in keys])
            if hit:
                tiers = [h[0] if h else "unknown" for h in sources[:hit]]
                ctx.count_loaded(spans[:hit], tiers, chunk_bytes[:hit], ret)
            ctx.stats.add(hit_tokens=spans[hit - 1].end - spans[0].start if hit else 0)  # loaded chunks' tokens
            yield ret
        finally:
            state.release(sm)
            if loader is not None:
                loader.close()

    def _report_shortfall(self, layer: int, expected: int, got: int) -> None:
        self.ctx.stats.add(load_errors=1)
        self.ctx.log_once(
            logging.WARNING,
            "layer-miss",
            "lmcache layerwise retrieve: layer %d has %d of %d chunks (entry lost after lookup); "
            "the request's mask is cut there and the rest must be recomputed (logged once)",
            layer,
            got,
            expected,
        )
