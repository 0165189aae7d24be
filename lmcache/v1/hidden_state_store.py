"""HiddenStateStore: per-token hidden states kept beside the KV cache.

A thinker -> talker pipeline needs the thinker's intermediate activations for every
token whose KV the engine restored without recomputing them. This store keeps those
activations per chunk, under the very chunk keys the KV cache uses, so that "the KV of
this chunk is cached" and "the hidden states of this chunk are cached" name the same
thing.

Storage model
-------------
* One entry per ``(chunk key, layer_idx)``: a ``[chunk_tokens, hidden_dim]`` MemoryObj
  (format ``HS_TD``) in the store's own :class:`PoolAllocator`, sized by
  ``max_hidden_state_cpu_size`` GiB. The KV pool is never touched.
* The store's own :class:`~lmcache.v1.storage_backend.resident_index.ResidentIndex`
  (LRU policy, atomic eviction: enough victims or none; entries being read are never
  evicted) orders the entries. Pool pressure evicts hidden states only, never KV.
* Coupled eviction is lazy: ``retrieve_hidden_states`` asks the storage manager whether
  the KV of every chunk it is about to return is still cached (with ``use_layerwise``,
  all of the chunk's per-layer KV keys must be there). Any object with LMCache's
  storage-manager method ``contains(key, search_range=None, pin=False)`` (the name of
  the tier holding ``key``, else None) will do; lmcache's own
  :class:`~lmcache.v1.storage_backend.storage_manager.StorageManager` is asked once
  per chunk for all layers (``batched_contains(..., num_layers=...)``). A chunk whose
  KV is gone is an orphan: its hidden states (all layers) are dropped and the returned
  prefix ends before it. A store built without a storage manager
  (``storage_manager=None``, bound later with
  :meth:`HiddenStateStore.bind_storage_manager`) cannot tell, and treats KV as present.

Chunk visibility
----------------
Keys come from ``token_database.spans``. A full chunk's key hashes its whole token
range; a trailing partial chunk ``tokens[start:end]`` gets a different key (it hashes
only the tokens it has). A store always keeps the trailing partial chunk of the rows it
was given, under that partial key, so a later incremental store (``token_offset`` in the
middle of the chunk) can extend it into a longer or complete chunk without zero
padding. Retrieval computes keys exactly like the KV engine does, so:

* a complete chunk is visible as soon as all its rows were stored;
* a trailing partial chunk is visible only when ``save_unfull_chunk`` is true (then it
  mirrors the KV engine's partial chunk with the same key). When it is false the
  partial entry is a private continuation buffer, consumed (removed) as soon as a later
  store extends it.

Threads and memory
------------------
All methods may be called from any thread; one lock guards the index and the policy,
while row copies run outside it on objects the caller holds a reference to (an entry
with a reference taken is never evicted). ``store_hidden_states`` blocks until the rows
are copied into the pool, so the caller keeps ownership of its tensor and may reuse it
at once. ``retrieve_hidden_states`` returns a new CPU float32 tensor owned by the
caller; it never aliases pool memory.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol

import numpy as np
import torch

from lmcache.v1.keys import CacheEngineKey
from lmcache.v1.memory_management import GiB, MemoryFormat, MemoryObj, PoolAllocator
from lmcache.v1.stats import Counters
from lmcache.log_once import LogOnce
from lmcache.v1.storage_backend.cache_policy import make_policy
from lmcache.v1.storage_backend.resident_index import ResidentIndex, allocate_evicting
from lmcache.v1.storage_backend.storage_manager import StorageManager
from lmcache.v1.request import KeyExtras
from lmcache.v1.token_database import ChunkSpan, TokenInput, tokens_to_array

if TYPE_CHECKING:
    from lmcache.v1.config import LMCacheEngineConfig
    from lmcache.v1.token_database import ChunkedTokenDatabase

logger = logging.getLogger(__name__)

HS_POLICY = "LRU"


class KVPresence(Protocol):
    """What the store needs from a storage manager: LMCache 0.5.6's ``contains`` (the
    name of the tier that holds ``key``, or None). Called from any thread."""

    def contains(self, key: CacheEngineKey, search_range: Sequence[str] | None = None, pin: bool = False) -> str | None: ...


@dataclass(frozen=True, slots=True)
class HSKey:
    """Key of one hidden-state entry: the KV chunk key plus the storage layer index."""

    chunk: CacheEngineKey
    layer_idx: int


@dataclass(slots=True)
class HiddenStateStats(Counters):
    """Counters of one store. Read with :meth:`snapshot`."""

    stored_tokens: int = 0
    """Tokens in chunks that became retrievable entries (full, or partial when visible)."""
    retrieve_requests: int = 0
    hit_tokens: int = 0
    misses: int = 0
    """Retrieves that returned None (not even the first chunk was available)."""
    evictions: int = 0
    """Entries evicted by pool pressure (hidden states only)."""
    orphans_dropped: int = 0
    """Entries dropped because the KV of their chunk was gone."""
    skipped_chunks: int = 0
    """Chunks not stored: pool full even after eviction."""
    incomplete_chunks: int = 0
    """Chunks not stored: ``token_offset`` fell inside them and their earlier rows were not cached."""


def _storage_dtype(dtype: torch.dtype) -> torch.dtype:
    """Dtype kept in the pool: the caller's, except wider than float32 is narrowed to it
    (retrieval returns float32 anyway, so nothing is lost)."""
    return torch.float32 if dtype.itemsize > 4 else dtype


class HiddenStateStore:
    """Caches per-token hidden states per ``(chunk key, layer_idx)`` beside the KV cache.

    Built by :class:`~lmcache.v1.cache_engine.LMCacheEngine` when
    ``enable_hidden_state_cache`` is true and exposed as ``engine.hidden_state_store``.
    ``token_database`` must be the engine's (same keys as the KV); ``storage_manager``
    is the KV storage manager (anything with LMCache's ``contains``, see
    :class:`KVPresence`), only asked whether KV is present; it may be given later with
    :meth:`bind_storage_manager` (until then KV counts as present).

    Thread-safe; see the module docstring for blocking behaviour and memory ownership.
    """

    def __init__(
        self,
        config: LMCacheEngineConfig,
        token_database: ChunkedTokenDatabase,
        storage_manager: KVPresence | None = None,
    ) -> None:
        if config.max_hidden_state_cpu_size <= 0:
            raise ValueError(
                f"max_hidden_state_cpu_size={config.max_hidden_state_cpu_size!r}: expected a size in GiB > 0"
            )
        self.token_database = token_database
        self.storage_manager = storage_manager
        self.save_unfull_chunk = bool(config.save_unfull_chunk)
        # a layerwise engine keeps the KV of a chunk under one key per layer
        self._kv_layers: int | None = token_database.metadata.kv_shape[0] if config.use_layerwise else None
        layers = config.hidden_state_layers
        self.allowed_layers: frozenset[int] | None = None if layers is None else frozenset(layers)
        self._allowed_text = None if layers is None else str(sorted(set(layers)))
        self.allocator = PoolAllocator(int(config.max_hidden_state_cpu_size * GiB))
        self.stats = HiddenStateStats()
        # entries another thread holds a reference to (a retrieve copying them) are busy
        self._index: ResidentIndex[HSKey, MemoryObj] = ResidentIndex(make_policy(HS_POLICY), busy=_held)
        self._layers_of: dict[CacheEngineKey, set[int]] = {}
        self._lock = threading.Lock()
        self._closed = False
        self._log_once = LogOnce(logger)

    def bind_storage_manager(self, storage_manager: KVPresence | None) -> None:
        """Use ``storage_manager`` for the coupled-eviction check (None: KV counts as present).

        It needs only LMCache's ``contains(key, search_range=None, pin=False)``
        (:class:`KVPresence`)."""
        self.storage_manager = storage_manager

    # ------------------------------------------------------------------ public API
    def store_hidden_states(
        self,
        token_ids: TokenInput,
        hidden_states: torch.Tensor,
        layer_idx: int = 0,
        token_offset: int = 0,
        *,
        cache_salt: str | None = None,
        request_configs: Mapping[str, object] | None = None,
        extra_keys: Sequence[str] | None = None,
    ) -> int:
        """Cache ``hidden_states`` (rows for ``token_ids[token_offset:]``) for ``layer_idx``.

        ``token_ids`` is the full prefix, as passed to the KV engine, so the chunk keys
        match the KV keys; ``cache_salt``/``request_configs``/``extra_keys`` must be the
        ones the KV store used. ``hidden_states`` is 2-D ``[len(token_ids) -
        token_offset, hidden_dim]``, of any floating dtype, on any device.

        Chunks already cached for this layer are kept (not overwritten). A chunk that
        ``token_offset`` falls inside is completed from the rows an earlier store left
        for ``token_ids[:token_offset]``; if those are not cached the chunk is skipped
        (counted in ``stats.incomplete_chunks``). A full pool after eviction skips the
        rest of the call (``stats.skipped_chunks``); that is not an error. A
        ``layer_idx`` outside ``hidden_state_layers`` stores nothing and returns 0 (the
        allowlist filters; callers may store every hook index).

        Blocks until the rows are copied; the caller keeps ownership of
        ``hidden_states``. Returns the number of chunks that became retrievable by
        this call (as LMCache does; ``stats.stored_tokens`` counts their tokens): full
        chunks, and the trailing partial chunk when ``save_unfull_chunk`` is true.
        Raises ValueError/TypeError on bad input.
        """
        tokens = tokens_to_array(token_ids)
        n = int(tokens.shape[0])
        rows = self._check_store_args(n, hidden_states, layer_idx, token_offset)
        extras = KeyExtras.build(cache_salt, request_configs, extra_keys)
        if self.allowed_layers is not None and layer_idx not in self.allowed_layers:
            logger.debug("hidden states: layer_idx=%d not in hidden_state_layers=%s; not stored",
                         layer_idx, self._allowed_text)
            return 0
        if rows.shape[0] == 0 or self._closed:
            return 0
        spans = self.token_database.spans_of(tokens, 0, extras, include_partial=True)
        built: list[tuple[HSKey, MemoryObj]] = []
        consumed: HSKey | None = None
        try:
            for span in spans:
                if span.end <= token_offset:
                    continue  # no new rows for this chunk
                key = HSKey(span.key, layer_idx)
                if self._touch(key):
                    continue
                # only the chunk that token_offset falls inside needs earlier rows
                head_key = None
                if span.start < token_offset:
                    head_key = self._head_key(tokens, token_offset, span, layer_idx, extras)
                head = self._acquire(head_key) if head_key is not None else None
                if head_key is not None and head is None:
                    self.stats.add(incomplete_chunks=1)
                    logger.debug("hidden states: rows %d..%d of layer %d not cached; chunk skipped",
                                 span.start, token_offset, layer_idx)
                    continue
                try:
                    obj = self._fill(span, rows, token_offset, head, layer_idx)
                finally:
                    if head is not None:
                        head.ref_count_down()
                if obj is None:
                    self.stats.add(skipped_chunks=1)
                    break
                built.append((key, obj))
                if head is not None:
                    consumed = head_key
            return self._publish(built, consumed)
        finally:
            for _, obj in built:
                obj.ref_count_down()

    def retrieve_hidden_states(
        self,
        token_ids: TokenInput,
        layer_idx: int = 0,
        *,
        cache_salt: str | None = None,
        request_configs: Mapping[str, object] | None = None,
        extra_keys: Sequence[str] | None = None,
    ) -> torch.Tensor | None:
        """The hidden states of the longest cached prefix of ``token_ids`` for ``layer_idx``.

        Prefix-strict: walks the chunks (keys as the KV engine computes them, a trailing
        partial chunk only when ``save_unfull_chunk`` is true) and stops at the first
        chunk that lacks either hidden states for ``layer_idx`` or KV in the storage
        manager; hidden states whose KV is gone are dropped there (all layers of that
        chunk). Returns a new contiguous CPU float32 ``[n_tokens, hidden_dim]`` tensor
        owned by the caller, or None when not even the first chunk is available (a
        layer outside ``hidden_state_layers`` is always a miss).
        """
        tokens = tokens_to_array(token_ids)
        _check_layer_type(layer_idx)
        extras = KeyExtras.build(cache_salt, request_configs, extra_keys)
        self.stats.add(retrieve_requests=1)
        if self._closed or (self.allowed_layers is not None and layer_idx not in self.allowed_layers):
            self.stats.add(misses=1)
            return None
        hits: list[tuple[HSKey, MemoryObj]] = []
        try:
            for span in self.token_database.spans_of(tokens, 0, extras):
                key = HSKey(span.key, layer_idx)
                obj = self._acquire(key)
                if obj is None:
                    break
                if hits and obj.shape[1] != hits[0][1].shape[1]:
                    obj.ref_count_down()
                    self._log_once(
                        logging.WARNING,
                        "dim",
                        "hidden states of layer %d change hidden_dim inside one sequence; prefix cut (logged once)",
                        layer_idx,
                    )
                    break
                if not self._kv_present(span.key):
                    obj.ref_count_down()
                    self._drop_orphan(span.key)
                    break
                hits.append((key, obj))
            if not hits:
                self.stats.add(misses=1)
                return None
            total = sum(obj.shape[0] for _, obj in hits)
            out = _new_float32(total, hits[0][1].shape[1])
            pos = 0
            for _, obj in hits:
                src = obj.tensor
                assert src is not None
                out[pos : pos + src.shape[0]].copy_(src)
                pos += src.shape[0]
            with self._lock:
                self._index.touch_sequence([key for key, _ in hits])  # tail first: the head stays most recent
            self.stats.add(hit_tokens=total)
            return out
        finally:
            for _, obj in hits:
                obj.ref_count_down()

    # ------------------------------------------------------------------ introspection
    def __len__(self) -> int:
        """Number of entries, partial continuation buffers included."""
        with self._lock:
            return len(self._index)

    @property
    def used_bytes(self) -> int:
        return self.allocator.used_bytes

    def num_cached_chunks(self) -> int:
        """Number of distinct chunk keys with hidden states for some layer (a trailing
        partial chunk kept as a continuation buffer counts too)."""
        with self._lock:
            return len(self._layers_of)

    def has_chunk(self, key: CacheEngineKey, layer_idx: int = 0) -> bool:
        """Whether hidden states of ``layer_idx`` are cached under chunk ``key`` (KV not checked)."""
        with self._lock:
            return HSKey(key, layer_idx) in self._index

    def drop_key(self, key: CacheEngineKey) -> bool:
        """Drop the hidden states of every layer of chunk ``key``; True if there were any."""
        with self._lock:
            layers = list(self._layers_of.get(key, ()))
            for layer in layers:
                self._drop_locked(HSKey(key, layer))
        return bool(layers)

    def close(self) -> None:
        """Drop every entry and release the pool. Idempotent; later calls are misses."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
            for key in self._index.keys():
                self._drop_locked(key)
        self.allocator.close()

    # ------------------------------------------------------------------ checks
    def _check_store_args(
        self, n: int, hidden_states: object, layer_idx: object, token_offset: object
    ) -> torch.Tensor:
        _check_layer_type(layer_idx)
        if isinstance(token_offset, bool) or not isinstance(token_offset, int):
            raise TypeError(f"token_offset={token_offset!r}: expected an int")
        if not 0 <= token_offset <= n:
            raise ValueError(f"token_offset={token_offset}: expected 0 <= token_offset <= len(token_ids)={n}")
        if not isinstance(hidden_states, torch.Tensor):
            raise TypeError(f"hidden_states: expected a torch.Tensor, got {type(hidden_states).__name__}")
        if hidden_states.dim() != 2:
            raise ValueError(
                "hidden_states: expected a 2-D [num_tokens, hidden_dim] tensor, "
                f"got shape {tuple(hidden_states.shape)}"
            )
        if not hidden_states.is_floating_point():
            raise TypeError(f"hidden_states: expected a floating-point dtype, got {hidden_states.dtype}")
        if hidden_states.shape[0] != n - token_offset:
            raise ValueError(
                f"hidden_states: has {hidden_states.shape[0]} rows; expected len(token_ids) - token_offset = "
                f"{n} - {token_offset} = {n - token_offset}"
            )
        if hidden_states.shape[1] == 0:
            raise ValueError("hidden_states: hidden_dim is 0; expected > 0")
        return hidden_states.detach()

    # ------------------------------------------------------------------ internals
    def _head_key(
        self, tokens: np.ndarray, token_offset: int, span: ChunkSpan, layer_idx: int, extras: KeyExtras
    ) -> HSKey:
        """Key of the partial chunk ``tokens[span.start:token_offset]`` (the earlier rows of ``span``)."""
        head = self.token_database.spans_of(tokens[:token_offset], 0, extras, include_partial=True)[-1]
        assert head.start == span.start and head.end == token_offset
        return HSKey(head.key, layer_idx)

    def _fill(
        self, span: ChunkSpan, rows: torch.Tensor, token_offset: int, head: MemoryObj | None, layer_idx: int
    ) -> MemoryObj | None:
        """A new pool object holding the chunk's rows: ``head``'s rows, then the caller's.

        None if the pool has no room. The caller owns the returned reference.
        """
        hidden_dim = int(rows.shape[1])
        dtype = _storage_dtype(rows.dtype)
        split = 0
        if head is not None:
            if head.shape[1] != hidden_dim:
                raise ValueError(
                    f"hidden_states: hidden_dim={hidden_dim} differs from the {head.shape[1]} already stored "
                    f"for tokens {span.start}..{token_offset} of layer_idx={layer_idx}"
                )
            dtype = _storage_dtype(torch.promote_types(head.dtype, dtype))
            split = token_offset - span.start
        obj = self._allocate((span.end - span.start, hidden_dim), dtype)
        if obj is None:
            return None
        dst, head_rows = obj.tensor, head.tensor if head is not None else None
        assert dst is not None
        if head_rows is not None:
            dst[:split].copy_(head_rows)
        dst[split:].copy_(rows[span.start + split - token_offset : span.end - token_offset])
        return obj

    def _kv_present(self, chunk: CacheEngineKey) -> bool:
        """Whether the KV of ``chunk`` is in some tier; on a layerwise engine, every layer's.

        Without a storage manager the answer is unknown and counts as present. lmcache's
        StorageManager answers for all layers in one batched call; any other manager is
        asked LMCache's ``contains`` per key (a tier name, or None: a falsy answer is a miss)."""
        manager = self.storage_manager
        if manager is None:
            return True
        if isinstance(manager, StorageManager):
            return manager.batched_contains([chunk], num_layers=self._kv_layers) == 1
        keys = [chunk] if self._kv_layers is None else chunk.split_layers(self._kv_layers)
        return all(manager.contains(key) for key in keys)

    def _touch(self, key: HSKey) -> bool:
        with self._lock:
            return self._index.touch(key)

    def keys(self) -> list[HSKey]:
        """Keys of the entries (partial continuation buffers included), snapshot."""
        with self._lock:
            return self._index.keys()

    def acquire(self, key: HSKey) -> MemoryObj | None:
        """The entry with one reference taken for the caller, or None.

        While the caller holds the reference the entry is never evicted; the caller
        drops it with ``ref_count_down()``. Never blocks on I/O."""
        return self._acquire(key)

    def _acquire(self, key: HSKey) -> MemoryObj | None:
        """The entry with one reference taken for the caller (so it cannot be evicted)."""
        with self._lock:
            obj = self._index.get(key)
            if obj is not None:
                obj.ref_count_up()
            return obj

    def _allocate(self, shape: tuple[int, int], dtype: torch.dtype) -> MemoryObj | None:
        """A pool object (caller owns it), evicting LRU hidden states as needed; None if full."""
        obj = self.allocator.allocate(shape, dtype, MemoryFormat.HS_TD)
        if obj is not None:
            return obj
        with self._lock:
            obj, evicted = allocate_evicting(
                self._index, self.allocator, shape, dtype, MemoryFormat.HS_TD, self._forget_locked
            )
        if evicted:
            self.stats.add(evictions=evicted)
        if obj is None:
            self._log_once(
                logging.WARNING,
                "full",
                "hidden-state pool full (%d bytes, nothing evictable for %d more): skipping stores (logged once)",
                self.allocator.capacity,
                shape[0] * shape[1] * dtype.itemsize,
            )
        return obj

    def _publish(self, built: list[tuple[HSKey, MemoryObj]], consumed: HSKey | None) -> int:
        """Insert new entries tail first (head most recent); drop a consumed private buffer.

        Returns the number of chunks that became retrievable."""
        chunk_size = self.token_database.chunk_size
        visible = 0
        chunks = 0
        with self._lock:
            if self._closed:
                return 0
            for key, obj in reversed(built):
                if self._index.touch(key):  # another thread stored it meanwhile
                    continue
                obj.ref_count_up()
                self._index.insert(key, obj, obj.get_physical_size())
                self._layers_of.setdefault(key.chunk, set()).add(key.layer_idx)
                if obj.shape[0] == chunk_size or self.save_unfull_chunk:
                    visible += obj.shape[0]
                    chunks += 1
            if consumed is not None and not self.save_unfull_chunk and consumed in self._index:
                self._drop_locked(consumed)
        self.stats.add(stored_tokens=visible)
        return chunks

    def _drop_orphan(self, chunk: CacheEngineKey) -> None:
        with self._lock:
            layers = list(self._layers_of.get(chunk, ()))
            for layer in layers:
                self._drop_locked(HSKey(chunk, layer))
        if layers:
            self.stats.add(orphans_dropped=len(layers))

    def _drop_locked(self, key: HSKey) -> None:
        obj = self._index.pop(key)
        if obj is None:
            return
        self._forget_locked(key, obj)

    def _forget_locked(self, key: HSKey, obj: MemoryObj) -> None:
        """Release an entry already out of the index."""
        layers = self._layers_of.get(key.chunk)
        if layers is not None:
            layers.discard(key.layer_idx)
            if not layers:
                del self._layers_of[key.chunk]
        obj.ref_count_down()


def _held(obj: MemoryObj) -> bool:
    """Someone besides the store holds the entry (a retrieve copying it): not evictable."""
    return obj.ref_count > 1


def _new_float32(rows: int, cols: int) -> torch.Tensor:
    """A new, caller-owned CPU float32 tensor whose pages are touched first by the copy.

    Allocated through numpy, which advises transparent huge pages for large arrays:
    first-touch page faults then cost ~5x less than with torch's own CPU allocator on
    these machines (the retrieve is bound by them). The tensor is an ordinary
    contiguous torch tensor; only its storage is not resizable in place.
    """
    return torch.from_numpy(np.empty((rows, cols), dtype=np.float32))


def _check_layer_type(layer_idx: object) -> None:
    if isinstance(layer_idx, bool) or not isinstance(layer_idx, int):
        raise TypeError(f"layer_idx={layer_idx!r}: expected a non-negative int")
    if layer_idx < 0:
        raise ValueError(f"layer_idx={layer_idx}: expected a non-negative int")
