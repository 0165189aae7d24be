"""Layerwise store and retrieve: KV moves one layer per ``next()``, pipelined with the forward pass.

Keys: chunk ``j`` of a request has one :class:`~lmcache.v1.keys.LayerCacheEngineKey` per
layer (``key.split_layers(num_layers)``); each holds a one-layer ``KV_2LTD`` object
``[2, 1, tokens, hidden]`` (``KV_MLA_FMT`` ``[1, 1, tokens, hidden]`` for MLA).

Store generator (:meth:`LayerwiseTransfer.store_layer`), exactly ``num_layers + 1`` ``next()`` calls, all
returning None:

* call 0 reserves the pool bytes of every (chunk, layer) upfront (so the store cannot
  run out of pool memory half way and evict its own earlier layers) and copies layer 0;
* call ``i`` (1 <= i < num_layers) first hands every earlier layer whose copy has
  completed to ``StorageManager.batched_put`` (all its chunks at once), then copies
  layer ``i``. Publication trails the copy by one call: on CPU (synchronous copies)
  layer ``i`` is in storage when call ``i + 1`` returns; on CUDA it is published by the
  first later call that finds its copy event complete, at the latest the last one. Call
  0 thus does only the set-up and layer 0's copy, and each later call publishes the
  previous layer while its bookkeeping is still in cache;
* the last call waits for the remaining copies, publishes them, returns what was never
  used to the pool and updates the stats. Publishing hands the generator's references
  to L1 (``batched_put(..., give=True)``); a generator closed early releases the objects
  of the layers it had not published.

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

import logging
import math
import threading
from collections.abc import Iterator, Sequence
from concurrent.futures import Future
from dataclasses import dataclass, field

import torch

from lmcache.v1.gpu_connector.protocol import LayerCopy, LayerwiseGPUConnectorInterface
from lmcache.v1.keys import CacheEngineKey, LayerCacheEngineKey
from lmcache.v1.memory_management import MemoryFormat, MemoryObj, PoolReservation, pool_bytes
from lmcache.v1.request import TransferRequest
from lmcache.v1.storage_backend.storage_manager import LookupResult, StorageManager
from lmcache.v1.tiers import Tier
from lmcache.v1.token_database import ChunkSpan
from lmcache.v1.transfer import LayerwiseTransferPath, TransferContext, equal_runs, release

logger = logging.getLogger(__name__)


# ---------------------------------------------------------------------- keys
_ROWS_MAX = 4096
_rows: dict[CacheEngineKey, list[LayerCacheEngineKey | None]] = {}
_rows_lock = threading.Lock()


def _row(key: CacheEngineKey, num_layers: int) -> list[LayerCacheEngineKey | None]:
    """The (cached) per-layer keys of chunk ``key``; entries are made on first use."""
    row = _rows.get(key)
    if row is None or len(row) != num_layers:
        with _rows_lock:
            row = _rows.get(key)
            if row is None or len(row) != num_layers:
                if len(_rows) >= _ROWS_MAX:
                    del _rows[next(iter(_rows))]  # oldest first
                row = _rows[key] = [None] * num_layers
    return row


class LayerKeys(Sequence[list[LayerCacheEngineKey]]):
    """``keys[layer][chunk]``: the layer keys of a request's chunk keys, made one layer at a time.

    Splitting a chunk key into its ``num_layers`` layer keys costs about as much as
    hashing the chunk; a layerwise store or retrieve needs layer ``i``'s keys only when
    it reaches layer ``i``, so each layer's list is built on first access. Layer keys
    are cached per chunk key (bounded, shared by all requests and threads): a retrieve
    gets the very key objects its store put into the tiers, which makes the tier dict
    lookups (identity before equality) cheap.
    """

    __slots__ = ("_chunks", "_rows", "_layers")

    def __init__(self, chunk_keys: Sequence[CacheEngineKey], num_layers: int) -> None:
        if num_layers <= 0:
            raise ValueError(f"num_layers must be > 0, got {num_layers}")
        self._chunks = list(chunk_keys)
        self._rows = [_row(k, num_layers) for k in self._chunks]
        self._layers: list[list[LayerCacheEngineKey] | None] = [None] * num_layers

    def select(self, chunks: Sequence[int]) -> LayerKeys:
        """The layer keys of the chunks at ``chunks`` (positions into this request's chunks),
        sharing the rows already looked up; ``self`` when that is every chunk in order."""
        if list(chunks) == list(range(len(self._chunks))):
            return self
        out = LayerKeys.__new__(LayerKeys)
        out._chunks = [self._chunks[j] for j in chunks]
        out._rows = [self._rows[j] for j in chunks]
        out._layers = [None] * len(self._layers)
        return out

    def __len__(self) -> int:
        return len(self._layers)

    def __getitem__(self, layer):  # type: ignore[override]
        if isinstance(layer, slice):
            return [self[i] for i in range(*layer.indices(len(self._layers)))]
        got = self._layers[layer]
        if got is None:
            got = []
            for key, row in zip(self._chunks, self._rows):
                lk = row[layer]
                if lk is None:
                    lk = row[layer] = LayerCacheEngineKey(
                        key.model_name, key.world_size, key.worker_id, key.chunk_hash, key.dtype, key.request_configs, layer
                    )
                got.append(lk)
            self._layers[layer] = got
        return got

    def __iter__(self) -> Iterator[list[LayerCacheEngineKey]]:
        return (self[i] for i in range(len(self._layers)))


def layer_keys(keys: Sequence[CacheEngineKey], num_layers: int) -> list[list[LayerCacheEngineKey]]:
    """Per layer, the layer keys of ``keys`` (``result[layer][chunk]``; see :class:`LayerKeys`)."""
    return list(LayerKeys(keys, num_layers))


def _touch_tail_to_head(storage_manager: StorageManager, keys_per_layer: Sequence[Sequence[CacheEngineKey]], hit: int) -> None:
    """Re-order L1 recency so a request's tail chunks (all their layers) are evicted first.

    Layerwise puts touch keys layer by layer; afterwards the eviction order would be
    "all of layer 0, then layer 1, ...". Chunk ``j`` is usable only if every layer of
    chunks ``0..j`` is present, so evicting whole chunks from the tail wastes the least.
    Only the first ``hit`` chunks are touched.
    """
    if not hit or not keys_per_layer:
        return
    layers = [layer_list[:hit] for layer_list in reversed(keys_per_layer)]
    # head first; batched_touch walks it backwards: chunk by chunk from the tail, layers in order
    order = [layer_list[chunk] for chunk in range(hit) for layer_list in layers]
    storage_manager.batched_touch(order)


def _release_when_done(fut: Future) -> None:
    """Drop the references a layer future will deliver to nobody."""

    def _drop(f: Future) -> None:
        if not f.cancelled() and f.exception() is None:
            release(f.result())

    fut.add_done_callback(_drop)


def _shapes(connector: LayerwiseGPUConnectorInterface, spans: Sequence[ChunkSpan]) -> list[tuple[int, ...]]:
    """Each chunk's one-layer object shape (computed once per distinct length)."""
    by_len: dict[int, tuple[int, ...]] = {}
    out = []
    for s in spans:
        n = s.end - s.start
        shape = by_len.get(n)
        if shape is None:
            shape = by_len[n] = tuple(connector.get_shape(n))
        out.append(shape)
    return out


# ---------------------------------------------------------------------- generator state
@dataclass(slots=True)
class StoreOutcome:
    """What a finished store generator did (filled in by its last call)."""

    stored_tokens: int = 0
    finished: bool = False


class _Preallocated:
    """One chunk's objects allocated one by one (fallback when no contiguous reservation fits)."""

    __slots__ = ("objs", "taken")

    def __init__(self, objs: list[MemoryObj]) -> None:
        self.objs = objs
        self.taken = 0

    @property
    def num_chunks(self) -> int:
        return 1

    def take_layer(self, layer: int) -> list[MemoryObj]:
        self.taken = layer + 1
        return [self.objs[layer]]

    def release(self) -> None:
        release(self.objs[self.taken :])
        self.objs = []


class _Reserved:
    """``num_chunks`` consecutive same-shape chunks in one :class:`PoolReservation`, chunk
    major: slot ``j * num_layers + layer`` holds ``layer`` of chunk ``j``, so a chunk's
    layers lie side by side as with one reservation per chunk (evicting a whole chunk
    frees one contiguous block that the next request's reservation can use)."""

    __slots__ = ("res", "num_chunks", "num_layers")

    def __init__(self, res: PoolReservation, num_chunks: int, num_layers: int) -> None:
        self.res = res
        self.num_chunks = num_chunks
        self.num_layers = num_layers

    def take_layer(self, layer: int) -> list[MemoryObj]:
        return self.res.take_many(range(layer, self.num_chunks * self.num_layers, self.num_layers))

    def release(self) -> None:
        self.res.release()


@dataclass(slots=True)
class _StoreState:
    groups: list[_Reserved | _Preallocated] = field(default_factory=list)  # the chunks, in order
    num_chunks: int = 0
    objs: list[list[MemoryObj]] = field(default_factory=list)  # [layer][chunk], made layer by layer
    pending: list[LayerCopy] = field(default_factory=list)
    given: int = 0  # layers [0, given) were handed to storage with our references (publish)
    released: bool = False

    def add(self, group: _Reserved | _Preallocated) -> None:
        self.groups.append(group)
        self.num_chunks += group.num_chunks

    def layer(self, layer: int) -> list[MemoryObj]:
        """Layer ``layer``'s objects (created from the reservations on first use; layers in order)."""
        while len(self.objs) <= layer:
            i = len(self.objs)
            objs: list[MemoryObj] = []
            for group in self.groups:
                objs += group.take_layer(i)
            self.objs.append(objs)
        return self.objs[layer]

    def publish(self, sm: StorageManager, keys: Sequence[CacheEngineKey]) -> None:
        """Hand the next layer's objects (copy complete) to storage under ``keys``, with
        their references: from here storage owns them."""
        layer = self.given
        self.given += 1
        sm.batched_put(keys, self.layer(layer), give=True)

    def release(self) -> None:
        if self.released:
            return
        self.released = True
        for handle in self.pending[self.given :]:
            if not handle.done():
                handle.wait()  # a copy in flight still writes into the objects
        for layer_objs in self.objs[self.given :]:
            release(layer_objs)
        for group in self.groups:
            group.release()


class _LayerObjs(Sequence[MemoryObj]):
    """Layer ``layer`` of a store's objects as the connector sees it: the length is known
    upfront, the objects are made when the layer is copied (:meth:`_StoreState.layer`)."""

    __slots__ = ("_state", "_layer")

    def __init__(self, state: _StoreState, layer: int) -> None:
        self._state = state
        self._layer = layer

    def __len__(self) -> int:
        return self._state.num_chunks

    def __getitem__(self, i):  # type: ignore[override]
        return self._state.layer(self._layer)[i]

    def __iter__(self) -> Iterator[MemoryObj]:
        return iter(self._state.layer(self._layer))


@dataclass(slots=True)
class _RetrieveState:
    held: list[tuple[LayerCopy | None, list[MemoryObj]]] = field(default_factory=list)
    ahead: list[list[MemoryObj] | None] = field(default_factory=list)  # [layer]: L1 objects taken for later layers
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

    def release(self) -> None:
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
        for objs in self.ahead:
            if objs:
                release(objs)
        self.ahead = []


# ---------------------------------------------------------------------- the path
class LayerwiseTransfer(LayerwiseTransferPath):
    """One object and one key per (chunk, layer); copies one layer per ``next()`` (module docstring)."""

    def __init__(self, ctx: TransferContext) -> None:
        super().__init__(ctx)
        self.num_layers = ctx.metadata.num_layers

    def connector(self) -> LayerwiseGPUConnectorInterface:
        """The engine's connector if it is a layerwise one matching the metadata; ValueError otherwise."""
        connector = self.ctx.connector
        if not isinstance(connector, LayerwiseGPUConnectorInterface):
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
    def lookup(self, keys: Sequence[CacheEngineKey], pin: bool, search_range: frozenset[str] | None = None) -> LookupResult:
        """The leading chunks of ``keys`` present for every layer (in the tiers
        ``search_range`` names; None: all).

        ``pin`` pins the L1 entries found (every layer key of them; listed in ``pinned``),
        like ``StorageManager.batched_lookup``; undo with :meth:`unpin`. Non-blocking
        apart from lower-tier existence checks.
        """
        return self.ctx.storage_manager.batched_lookup(LayerKeys(keys, self.num_layers), pin=pin, search_range=search_range)

    def unpin(self, keys: Sequence[CacheEngineKey]) -> None:
        self.ctx.storage_manager.batched_unpin([k for layer_list in LayerKeys(keys, self.num_layers) for k in layer_list])

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

    def _store_steps(self, connector: LayerwiseGPUConnectorInterface, req: TransferRequest, outcome: StoreOutcome) -> Iterator[None]:
        ctx = self.ctx
        num_layers = self.num_layers
        sm = ctx.storage_manager
        state = _StoreState()
        try:
            # ---- call 0: plan, reserve the pool bytes of every (chunk, layer), copy layer 0
            kv = req.kv
            assert kv is not None
            spans: list[ChunkSpan] = ctx.spans(req)
            ctx.stats.add(store_requests=1)
            spans = [s for s in spans if s.end <= kv.first_unmapped]
            keys = LayerKeys([s.key for s in spans], num_layers)
            # one batched lookup per layer (one round trip per remote tier): skip the cached prefix
            cached = sm.batched_lookup(keys).hits if spans else 0
            # chunks after the prefix that L1 holds for every layer (layer 0 probed in one batch)
            held0 = sm.resident_flags(keys[0][cached:]) if spans else []
            todo = [j for j, h in enumerate(held0, cached) if not (h and all(sm.is_resident(kl[j]) for kl in keys))]
            todo = self._reserve(connector, spans, todo, state)
            spans = [spans[j] for j in todo]
            keys = keys.select(todo)
            copier = None
            if spans:
                objs_per_layer = [_LayerObjs(state, layer) for layer in range(num_layers)]
                copier = connector.batched_from_gpu(objs_per_layer, [s.start for s in spans], [s.end for s in spans], kv)
            pending = state.pending
            for layer in range(num_layers):
                if copier is not None:
                    # publish the earlier layers whose copies are complete, then copy this one
                    while state.given < len(pending) and pending[state.given].done():
                        state.publish(sm, keys[state.given])
                    state.layer(layer)
                    pending.append(next(copier))
                yield None
            # ---- last call: publish what is left, release, stats
            stored_bytes = sum(o.get_size() for o in state.objs[0]) * num_layers if state.objs else 0
            while state.given < len(pending):
                if not pending[state.given].done():
                    pending[state.given].wait()
                state.publish(sm, keys[state.given])
            _touch_tail_to_head(sm, keys, len(spans))
            state.release()
            outcome.stored_tokens = sum(s.end - s.start for s in spans)
            outcome.finished = True
            ctx.stats.add(stored_tokens=outcome.stored_tokens, stored_bytes=stored_bytes)
            yield None
        finally:
            state.release()

    def _reserve(self, connector: LayerwiseGPUConnectorInterface, spans: list[ChunkSpan], todo: list[int], state: _StoreState) -> list[int]:
        """Reserve the pool bytes of every layer of the ``todo`` chunks; returns the chunks
        that got all their layers (a prefix of ``todo``).

        Runs of consecutive same-shape chunks (a request's full chunks) share one
        contiguous reservation (:class:`_Reserved`), as many chunks per reservation as a
        slab holds: one allocator call per request instead of one per chunk. When the
        pool has no such block, chunk by chunk: one block per chunk, or, when none fits,
        one allocation per layer. On pool exhaustion the remaining chunks are skipped
        (counted, logged once); a chunk is never stored with some layers missing. The
        objects themselves are created layer by layer (:meth:`_StoreState.layer`).
        """
        num_layers = self.num_layers
        sm = self.ctx.storage_manager
        dtype, fmt = self.ctx.metadata.kv_dtype, connector.fmt
        shapes = _shapes(connector, [spans[j] for j in todo])
        for start, stop in equal_runs(shapes):
            shape = shapes[start]
            per = max(1, sm.max_reservation_bytes // (num_layers * pool_bytes(math.prod(shape) * dtype.itemsize)))
            for i in range(start, stop, per):  # as many chunks per reservation as a slab holds
                end = min(stop, i + per)
                res = sm.reserve(shape, dtype, fmt, num_layers * (end - i)) if end - i > 1 else None
                if res is not None:
                    state.add(_Reserved(res, end - i, num_layers))
                    continue
                for n_done in range(i, end):  # chunk by chunk
                    if not self._reserve_chunk(shape, dtype, fmt, state):
                        self.ctx.pool_full(len(todo) - n_done)
                        return todo[:n_done]
        return todo

    def _reserve_chunk(self, shape: tuple[int, ...], dtype: torch.dtype, fmt: MemoryFormat, state: _StoreState) -> bool:
        """Reserve one chunk's layers into ``state``; False when the pool has no room."""
        num_layers = self.num_layers
        sm = self.ctx.storage_manager
        res = sm.reserve(shape, dtype, fmt, num_layers)
        if res is not None:
            state.add(_Reserved(res, 1, num_layers))
            return True
        objs: list[MemoryObj] = []
        for _ in range(num_layers):
            obj = sm.allocate(shape, dtype, fmt)
            if obj is None:
                release(objs)
                return False
            objs.append(obj)
        state.add(_Preallocated(objs))
        return True

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

    def _retrieve_steps(self, connector: LayerwiseGPUConnectorInterface, req: TransferRequest) -> Iterator[torch.Tensor | None]:
        ctx = self.ctx
        num_layers = self.num_layers
        sm = ctx.storage_manager
        state = _RetrieveState()
        loader = None
        defer_layer1 = False
        try:
            # ---- call 0: keys, start layer 0's reads
            spans: list[ChunkSpan] = ctx.spans(req)
            ctx.stats.add(retrieve_requests=1, requested_tokens=req.requested_tokens)
            keys = LayerKeys([s.key for s in spans], num_layers)
            hit = len(spans)
            sources: list[list[Tier]] = []
            want = _shapes(connector, spans)
            if hit:
                loader = connector.batched_to_gpu([s.start for s in spans], [s.end for s in spans], req.kv)
                next(loader)
                state.inflight = sm.layer_batched_get(keys[0], sources=sources, touch=False)
            # layer 0 wholly in L1 (read inline): layer 1's reads wait for call 2, off layer 0's path
            defer_layer1 = all(h == [sm.local_cpu.tier] for h in sources)
            yield None
            # ---- calls 1..num_layers: one layer each
            for layer in range(num_layers):
                if loader is not None:
                    if layer == 1:  # the rest of the set-up, off layer 0's critical path
                        hit = self._hold_rest(keys, hit, state)
                        if state.inflight is None:
                            state.inflight = self._read(keys, 1, hit, state)
                    assert state.inflight is not None
                    got: list[MemoryObj | None] = state.inflight.result()
                    state.inflight = None
                    ok = self._usable(got, hit, spans, want, connector, keys[layer])
                    if ok < hit:
                        if layer >= 2:  # layers 0 and 1 are part of the set-up: a shorter prefix is a plain miss
                            self._report_shortfall(layer, hit, ok)
                        hit = ok
                    release(got[hit:])
                    objs: list[MemoryObj] = got[:hit]  # type: ignore[assignment]
                    state.release_done()  # layer 0's objects are released here, off its path
                    handle = None
                    try:
                        handle = loader.send(objs)
                    finally:
                        state.held.append((handle, objs))  # released once the copy is done (or failed)
                    if layer:
                        state.release_done()
                    if layer + 1 < num_layers and not (layer == 0 and defer_layer1):
                        state.inflight = self._read(keys, layer + 1, hit, state)  # overlaps the forward pass
                yield None
            # ---- last call: final ordering, release, mask
            if loader is not None:
                next(loader)
            state.release()
            ret = torch.zeros(req.num_tokens, dtype=torch.bool)
            if hit:
                req.mark_written(ret, spans[0].start, spans[hit - 1].end)
            _touch_tail_to_head(sm, keys, hit)
            if hit:
                tiers = [h[0] if h else Tier.UNKNOWN for h in sources[:hit]]
                itemsize = ctx.metadata.kv_dtype.itemsize
                nbytes = [math.prod(shape) * itemsize * num_layers for shape in want[:hit]]  # every layer fitted its shape
                ctx.count_loaded(spans[:hit], tiers, nbytes, ret)
            ctx.stats.add(hit_tokens=spans[hit - 1].end - spans[0].start if hit else 0)  # loaded chunks' tokens
            yield ret
        finally:
            state.release()
            if loader is not None:
                loader.close()

    def _hold_rest(self, keys: LayerKeys, hit: int, state: _RetrieveState) -> int:
        """Chunks (of the first ``hit``) present in layers ``2..num_layers-1``; takes those
        layers' L1 objects for them, so they cannot be evicted before their read (layers 0
        and 1 are held by their reads already)."""
        if not hit or self.num_layers <= 2:
            return hit
        found, held = self.ctx.storage_manager.hold_layers([keys[layer][:hit] for layer in range(2, self.num_layers)])
        state.ahead = [None, None]
        for objs in held:
            release(objs[found:])
            state.ahead.append(objs[:found])
        return min(hit, found)

    def _read(self, keys: LayerKeys, layer: int, hit: int, state: _RetrieveState) -> Future:
        """Start layer ``layer``'s reads for the first ``hit`` chunks (its held L1 objects first)."""
        held = state.ahead[layer] if layer < len(state.ahead) else None
        if layer < len(state.ahead):
            state.ahead[layer] = None
        if held is not None and len(held) > hit:
            release(held[hit:])
            held = held[:hit]
        return self.ctx.storage_manager.layer_batched_get(keys[layer][:hit], held=held, touch=False)

    def _usable(
        self,
        got: list[MemoryObj | None],
        hit: int,
        spans: list[ChunkSpan],
        want: list[tuple[int, ...]],
        connector: LayerwiseGPUConnectorInterface,
        keys: list[LayerCacheEngineKey],
    ) -> int:
        """Leading objects of ``got`` (at most ``hit``) present and fitting their chunk; the
        first that does not fit is dropped from every tier (``TransferContext.fitting_prefix``)."""
        dtype, fmt = self.ctx.metadata.kv_dtype, connector.fmt
        n = min(hit, len(got))
        for i in range(n):
            obj = got[i]
            if obj is None:
                return i
            meta = obj.meta
            if meta.shape != want[i] or meta.dtype != dtype or meta.fmt is not fmt:
                return i + self.ctx.fitting_prefix(spans[i : i + 1], [obj], connector, keys[i : i + 1])
        return n

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
