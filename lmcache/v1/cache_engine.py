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
from collections.abc import Mapping, Sequence
from typing import Any, Callable, Iterator

import numpy as np
import torch

from lmcache.log_once import LogOnce
from lmcache.v1.block_reuse import BlockReuse
from lmcache.v1.config import LMCacheEngineConfig
from lmcache.v1.gpu_connector.protocol import KVConnector
from lmcache.v1.keys import CacheEngineKey
from lmcache.v1.layerwise import LayerwiseTransfer
from lmcache.v1.metadata import LMCacheEngineMetadata
from lmcache.v1.registry import Registry
from lmcache.v1.request import (
    COPY_ARG_NAMES,
    KEY_EXTRA_NAMES,
    LMCACHE_COPY_ARG_NAMES,
    ChunkHashes,
    KeyExtras,
    MaskInput,
    TransferRequest,
    check_lmcache_copy_args,
    check_lookup_id,
    mask_start,
    reject_unknown,
    slots_from_list,
    tier_names,
    tokens_to_array,
)
from lmcache.v1.stats import CacheStats
from lmcache.v1.storage_backend.storage_manager import StorageManager
from lmcache.v1.token_database import ChunkedTokenDatabase, ChunkSpan, PrefixKeys, TokenInput
from lmcache.v1.transfer import BulkTransfer, LayerwiseTransferPath, TransferContext, TransferPath

logger = logging.getLogger(__name__)

_KEY_ARGS = KEY_EXTRA_NAMES
_LOOKUP_ARGS = tuple(n for n in KEY_EXTRA_NAMES if n != "request_configs")  # a named parameter of lookup
_COPY_ARGS = KEY_EXTRA_NAMES + COPY_ARG_NAMES + LMCACHE_COPY_ARG_NAMES
_LAYER_ARGS = _COPY_ARGS + ("sync",)


def _chunk_hashes(where: str, tokens: object, hashes: object, offsets: object) -> ChunkHashes | None:
    """LMCache's ``hashes``/``offsets`` validated (None when absent). ``tokens``, when
    given, name the chunks instead (as in LMCache); one of the two is required."""
    if hashes is None:
        if tokens is None:
            alt = " (or hashes= with offsets=)" if where in ("store", "lookup") else ""
            raise ValueError(f"tokens: missing; {where}() needs the token ids{alt}")
        return None
    return ChunkHashes.build(hashes, offsets)


@dataclasses.dataclass(slots=True)
class LookupPins:
    """Storage keys pinned by ``lookup(..., lookup_id=..., pin=True)``, by lookup id, until
    ``lookup_unpin(lookup_id)`` (LMCache 0.5.6's pairing). A lookup repeated under one id
    adds to its pins. Thread-safe: lookups run on the scheduler thread, unpins on the
    worker's."""

    _keys: dict[str, list[CacheEngineKey]] = dataclasses.field(default_factory=dict)
    _lock: threading.Lock = dataclasses.field(default_factory=threading.Lock)

    def add(self, lookup_id: str, keys: Sequence[CacheEngineKey]) -> None:
        with self._lock:
            self._keys.setdefault(lookup_id, []).extend(keys)

    def pop(self, lookup_id: str) -> list[CacheEngineKey]:
        """The keys pinned under ``lookup_id`` (forgotten here); [] for an unknown id."""
        with self._lock:
            return self._keys.pop(lookup_id, [])


def make_transfer_path(config: LMCacheEngineConfig, ctx: TransferContext) -> TransferPath:
    """The transfer path ``config`` asks for: layerwise when ``use_layerwise``, else bulk."""
    return LayerwiseTransfer(ctx) if config.use_layerwise else BulkTransfer(ctx)


class LMCacheEngine:
    """The KV cache of one model shard.

    Thread-safety: ``lookup``/``lookup_unpin`` may run on a scheduler thread while
    ``store``/``retrieve`` run on the worker thread; tiers are thread-safe.

    Keyword arguments of ``store``/``retrieve`` (and the layerwise calls): ``kvcaches``
    (list of per-layer tensors, default: the connector's registered ones),
    ``slot_mapping`` (int32/int64, one slot per token, 2-D: a row per KV cache group; negative = no slot)
    and, for the layerwise calls, ``sync`` go to the GPU connector; ``cache_salt``,
    ``request_configs`` and ``extra_keys`` are folded into the chunk keys (the only
    keyword arguments of ``keys``/``lookup_unpin(tokens)``); LMCache 0.5.6's ``req_id``,
    ``offset``, ``vllm_cached_tokens`` and ``transfer_spec`` are accepted and unused.
    Every keyword LMCache 0.5.6's methods take is taken here
    (docs/migrating_from_lmcache.md).
    Every public method validates its arguments once, into a
    :class:`~lmcache.v1.request.TransferRequest`, and raises TypeError/ValueError on bad
    input (unknown keyword arguments included) before touching any tier.

    The transfer path (:attr:`transfer`: bulk, or layerwise when ``use_layerwise``) is
    chosen here, once (built again, of the same kind, over a new context when a connector
    is attached); every store/retrieve/lookup goes through it. Block-granular reuse
    (:class:`~lmcache.v1.block_reuse.BlockReuse`) is built here too and handed to the
    context; a lookup asks it for the block-aligned part of the first missing chunk.
    """

    def __init__(
        self,
        config: LMCacheEngineConfig,
        metadata: LMCacheEngineMetadata,
        gpu_connector: KVConnector | None,
        *,
        storage_manager: StorageManager | None = None,
    ) -> None:
        config.validate()
        self.config = config
        self.metadata = metadata
        self.stats = CacheStats()
        self.token_database = ChunkedTokenDatabase(config, metadata)
        self.storage_manager = storage_manager or StorageManager(config, stats=self.stats)
        blocks = BlockReuse.create(config, metadata, self.token_database, self.storage_manager)
        self._use(
            TransferContext(
                metadata, self.token_database, self.storage_manager, self.stats, LogOnce(logger), gpu_connector, blocks
            )
        )
        self.latency = self._ctx.latency
        """Seconds per bulk ``store``/``retrieve`` and per ``lookup`` (layerwise calls are
        not timed: their generators span the model's forward pass)."""
        self.hidden_state_store = self._make_hidden_state_store()
        self.segments = self._make_segment_store()
        """Blending's segment entries (:mod:`lmcache.v1.blend.segment_store`); None unless
        ``enable_blending`` (and never for MLA models)."""
        self._pins = LookupPins()
        self._closed = False

    @property
    def gpu_connector(self) -> KVConnector | None:
        """The connector copies go through (None until one is attached)."""
        return self._ctx.connector

    @gpu_connector.setter
    def gpu_connector(self, connector: KVConnector | None) -> None:
        self._use(dataclasses.replace(self._ctx, connector=connector))

    def _use(self, ctx: TransferContext) -> None:
        """Build the transfer path over ``ctx`` (at construction, and again when a
        connector is attached: a context never changes once built)."""
        path = make_transfer_path(self.config, ctx)
        self._ctx = ctx
        self.transfer: TransferPath = path
        self._layer_path = path if isinstance(path, LayerwiseTransferPath) else None
        """The transfer path when it can move KV layer by layer, else None."""

    def _make_hidden_state_store(self):
        if not self.config.enable_hidden_state_cache:
            return None
        from lmcache.v1.hidden_state_store import HiddenStateStore

        return HiddenStateStore(self.config, self.token_database, self.storage_manager)

    def _make_segment_store(self):
        if not self.config.enable_blending or self.metadata.use_mla:
            return None
        from lmcache.v1.blend.segment_store import SegmentStore

        return SegmentStore(self.metadata, self.token_database, self.storage_manager)

    def lookup_segments(self, tokens: TokenInput, bounds: Sequence[tuple[Any, ...]], **kwargs: Any) -> list[int]:
        """For each ``(start, end)`` or ``(start, end, lead)`` segment of ``tokens`` (``lead``:
        bytes of its key, :class:`~lmcache.v1.blend.segments.Segment`), the leading tokens whose
        segment entries are cached (0 for all without blending). Key extras as in :meth:`lookup`."""
        from lmcache.v1.blend.segments import Segment

        req = self._key_request("lookup_segments", tokens, kwargs)
        if self.segments is None:
            return [0] * len(bounds)
        arr = req.tokens
        out = []
        for bound in bounds:
            start, end = bound[0], bound[1]
            lead = bound[2] if len(bound) > 2 else b""
            if not 0 <= start < end <= arr.shape[0]:
                raise ValueError(f"segment ({start}, {end}): expected 0 <= start < end <= {arr.shape[0]}")
            if not isinstance(lead, bytes):
                raise TypeError(f"segment ({start}, {end}) lead: expected bytes, got {type(lead).__name__}")
            out.append(self.segments.lookup(Segment(start, end, tuple(arr[start:end].tolist()), lead), req.extras))
        return out

    # ------------------------------------------------------------------ requests
    def _key_request(self, where: str, tokens: TokenInput, kwargs: dict[str, Any]) -> TransferRequest:
        reject_unknown(kwargs, _KEY_ARGS, where)
        return TransferRequest(tokens_to_array(tokens), 0, KeyExtras.from_kwargs(kwargs))

    def _copy_request(
        self,
        where: str,
        tokens: TokenInput | None,
        mask: object,
        kwargs: dict[str, Any],
        allowed: tuple[str, ...] = _COPY_ARGS,
        hashes: object = None,
        offsets: object = None,
    ) -> TransferRequest:
        """Validate a store/retrieve call once: tokens (or chunk hashes), mask, extras, KV
        tensors and slots, and the LMCache arguments that are accepted and unused."""
        reject_unknown(kwargs, allowed, where)
        check_lmcache_copy_args(kwargs)
        extras = KeyExtras.from_kwargs(kwargs)
        chunks = _chunk_hashes(where, tokens, hashes, offsets)
        slot_mapping = kwargs.get("slot_mapping")
        if tokens is not None:
            arr = tokens_to_array(tokens)
        else:
            assert chunks is not None
            arr = np.broadcast_to(np.int32(0), (chunks.num_tokens,))  # placeholder: the chunks are named by hashes
            if isinstance(slot_mapping, list):  # LMCache takes a list of slots with hashes
                slot_mapping = slots_from_list(slot_mapping)
        n = arr.shape[0]
        first = mask_start(mask, n, self.token_database.chunk_size)
        spans = None
        if tokens is None and chunks is not None:
            spans = tuple(self.token_database.hashed_spans(chunks, first, extras))
        kv = self._ctx.require_connector().bind(
            n, kvcaches=kwargs.get("kvcaches"), slot_mapping=slot_mapping, sync=kwargs.get("sync", True)
        )
        return TransferRequest(arr, first, extras, kv, spans)

    def _spans(self, req: TransferRequest) -> list[ChunkSpan]:
        return self._ctx.spans(req)

    # ------------------------------------------------------------------ store / retrieve
    def store(
        self,
        tokens: TokenInput | None = None,
        mask: MaskInput = None,
        *,
        hashes: Sequence[int | bytes] | None = None,
        offsets: Sequence[int] | None = None,
        **kwargs: Any,
    ) -> int:
        """Copy the KV of ``tokens`` (where ``mask`` is True) into the cache.

        The already-cached prefix of chunks is skipped; chunks containing a negative slot are not
        stored (their KV is not in the paged cache), nor is anything after them. If the
        pool is full even after eviction, the rest of the request is skipped and
        counted (``stats.store_skipped_chunks``); this is not an error.
        Returns the number of tokens newly stored. The engine keeps no reference to
        the caller's tensors.

        ``mask``: bools, or numbers that are each exactly 0 or 1. LMCache's
        ``hashes``/``offsets`` name the chunks instead of ``tokens`` (``hashes[i]``, an
        int or bytes, covers the next ``offsets[i]`` tokens; found again by
        ``lookup(hashes=..., offsets=...)``); with ``tokens`` they are checked and unused,
        as in LMCache. ``req_id``, ``offset``, ``vllm_cached_tokens`` and
        ``transfer_spec`` are accepted and unused (docs/migrating_from_lmcache.md).
        """
        return self.transfer.store(self._copy_request("store", tokens, mask, kwargs, hashes=hashes, offsets=offsets))

    def retrieve(self, tokens: TokenInput, mask: MaskInput = None, **kwargs: Any) -> torch.Tensor:
        """Write cached KV for the longest cached prefix of ``tokens`` into the paged cache.

        Returns a CPU bool tensor, True where KV was written back: tokens of the
        retrieved chunks that have a slot (a token whose slot is negative gets nothing
        and stays False). Chunks where ``mask`` is False (0) are neither read nor written.
        Keyword arguments as in :meth:`store`.
        """
        return self.transfer.retrieve(self._copy_request("retrieve", tokens, mask, kwargs))

    # ------------------------------------------------------------------ lookup
    def lookup(
        self,
        tokens: TokenInput | None = None,
        hashes: Sequence[int | bytes] | None = None,
        offsets: Sequence[int] | None = None,
        search_range: Sequence[str] | str | None = None,
        lookup_id: str | None = None,
        pin: bool = False,
        request_configs: Mapping[str, object] | None = None,
        **kwargs: Any,
    ) -> int:
        """Number of leading tokens whose KV is cached: whole chunks, then (block-granular
        reuse, when the metadata names a block size) whole blocks of the next chunk, or a
        cached partial last chunk. ``pin=True`` keeps the L1 entries of the whole chunks
        from eviction until :meth:`lookup_unpin` (and reports whole chunks only).

        LMCache 0.5.6's signature. ``search_range``: the tiers to ask, by LMCache's names
        (``LocalCPUBackend``, ``LocalDiskBackend``, ``RemoteBackend``; None: all; an
        unknown name is a ValueError listing the valid ones). ``lookup_id``: with
        ``pin``, the id :meth:`lookup_unpin` releases the pins by. ``hashes``/``offsets``
        instead of ``tokens``: chunks named as in :meth:`store` (the count is the tokens of
        the leading chunks found). ``request_configs``, ``cache_salt`` and ``extra_keys``
        are folded into the keys, as for a store.
        """
        if not isinstance(pin, bool):
            raise TypeError(f"pin={pin!r}: expected a bool")
        tiers = self._tiers(search_range)
        lid = check_lookup_id(lookup_id)
        reject_unknown(kwargs, _LOOKUP_ARGS, "lookup")
        if request_configs is not None:
            kwargs["request_configs"] = request_configs
        chunks = _chunk_hashes("lookup", tokens, hashes, offsets)
        if tokens is None:
            assert chunks is not None
            return self._lookup_hashes(chunks, KeyExtras.from_kwargs(kwargs), pin, tiers, lid)
        return self._lookup_prefix(self.prefix_keys(tokens, **kwargs), pin, tiers, lid)

    def prefix_keys(self, tokens: TokenInput, **kwargs: Any) -> PrefixKeys:
        """The chunk keys :meth:`lookup` probes for ``tokens`` (key extras as in lookup).

        One native pass over a token list (no int32 array, no span objects). A caller that
        asks again for the same tokens (vLLM's scheduler for a waiting request) keeps the
        result and calls :meth:`lookup_prefix` with it."""
        reject_unknown(kwargs, _KEY_ARGS, "lookup")
        return self.token_database.prefix_keys(tokens, KeyExtras.from_kwargs(kwargs))

    def lookup_prefix(
        self,
        pk: PrefixKeys,
        pin: bool = False,
        *,
        search_range: Sequence[str] | str | None = None,
        lookup_id: str | None = None,
    ) -> int:
        """:meth:`lookup` for keys from :meth:`prefix_keys` of this engine."""
        if not isinstance(pin, bool):
            raise TypeError(f"pin={pin!r}: expected a bool")
        if not isinstance(pk, PrefixKeys) or pk.chunk_size != self.token_database.chunk_size:
            raise TypeError(f"pk={type(pk).__name__}: expected PrefixKeys from this engine's prefix_keys")
        tiers = self._tiers(search_range)
        return self._lookup_prefix(pk, pin, tiers, check_lookup_id(lookup_id))

    def resident_prefix(self, pk: PrefixKeys, end: int) -> int:
        """Leading tokens, up to ``end``, whose whole chunks the CPU tier (L1) holds now: an
        in-memory probe under one lock, never I/O, not counted as a lookup."""
        if not isinstance(pk, PrefixKeys) or pk.chunk_size != self.token_database.chunk_size:
            raise TypeError(f"pk={type(pk).__name__}: expected PrefixKeys from this engine's prefix_keys")
        end = max(0, min(int(end), pk.num_tokens))
        flags = self.storage_manager.resident_flags(pk.keys[: -(-end // pk.chunk_size)])
        held = next((i for i, f in enumerate(flags) if not f), len(flags))
        return min(pk.end(held), end)

    def _tiers(self, search_range: object) -> frozenset[str] | None:
        """``search_range`` validated against the storage manager's tier names (None: all)."""
        if search_range is None:
            return None
        return tier_names(search_range, "search_range", self.storage_manager.tier_names)

    def _lookup_prefix(self, pk: PrefixKeys, pin: bool, tiers: frozenset[str] | None, lookup_id: str | None) -> int:
        t0 = time.perf_counter()
        found = self._probe(pk.keys, pin, tiers, lookup_id)
        hit = pk.end(found)
        blocks = self._ctx.blocks
        if not pin and hit < pk.num_tokens and blocks is not None:
            hit += blocks.lookup_tokens(pk, found, tiers)
        self._count_lookup(pk.num_tokens, hit, t0)
        return hit

    def _lookup_hashes(
        self, chunks: ChunkHashes, extras: KeyExtras, pin: bool, tiers: frozenset[str] | None, lookup_id: str | None
    ) -> int:
        t0 = time.perf_counter()
        spans = self.token_database.hashed_spans(chunks, 0, extras)
        found = self._probe([s.key for s in spans], pin, tiers, lookup_id)
        hit = spans[found - 1].end if found else 0
        self._count_lookup(chunks.num_tokens, hit, t0)
        return hit

    def _probe(
        self, keys: Sequence[CacheEngineKey], pin: bool, tiers: frozenset[str] | None, lookup_id: str | None
    ) -> int:
        """Leading chunk keys present (in ``tiers``); the pins of a ``lookup_id`` are kept
        for :meth:`lookup_unpin`."""
        res = self.transfer.lookup(keys, pin, tiers)
        if lookup_id is not None and res.pinned:
            self._pins.add(lookup_id, res.pinned)
        return res.hits

    def _count_lookup(self, num_tokens: int, hit: int, t0: float) -> None:
        self.stats.add(lookup_requests=1, lookup_tokens=num_tokens, lookup_hit_tokens=hit)
        self.latency["lookup"].observe(time.perf_counter() - t0)
        logger.debug("lmcache lookup: %d of %d tokens cached", hit, num_tokens)

    def lookup_unpin(
        self, lookup_id: str | TokenInput | None = None, tokens: TokenInput | None = None, **kwargs: Any
    ) -> None:
        """Undo the pins of a pinned lookup.

        LMCache 0.5.6's form ``lookup_unpin(lookup_id)`` releases every pin taken by
        ``lookup(..., lookup_id=lookup_id, pin=True)`` (an unknown id does nothing). The
        older form ``lookup_unpin(tokens, **key_extras)`` undoes ``lookup(tokens,
        pin=True)`` with the same key extras.
        """
        if tokens is None and (lookup_id is None or isinstance(lookup_id, (str, int))):
            reject_unknown(kwargs, (), "lookup_unpin")
            lid = check_lookup_id(lookup_id)
            if lid is None:
                raise TypeError("lookup_unpin(): expected a lookup_id (or the tokens of a pinned lookup)")
            pinned = self._pins.pop(lid)
            if pinned:
                self.storage_manager.batched_unpin(pinned)
            return
        if tokens is not None and lookup_id is not None:
            raise TypeError("lookup_unpin(): expected a lookup_id or tokens, not both")
        spans = self._spans(self._key_request("lookup_unpin", tokens if tokens is not None else lookup_id, kwargs))
        self.transfer.unpin([s.key for s in spans])

    # ------------------------------------------------------------------ layerwise
    def store_layer(self, tokens: TokenInput, mask: MaskInput = None, **kwargs: Any) -> Iterator[None]:
        """Layerwise store generator (num_layers + 1 ``next()`` calls); see :mod:`lmcache.v1.layerwise`.

        Needs ``use_layerwise: true`` and a layerwise connector (ValueError otherwise).
        Mask and keyword arguments as in :meth:`store`."""
        path = self._layerwise()
        return path.store_layer(self._copy_request("store_layer", tokens, mask, kwargs, _LAYER_ARGS))

    def retrieve_layer(self, tokens: TokenInput, mask: MaskInput = None, **kwargs: Any) -> Iterator[torch.Tensor | None]:
        """Layerwise retrieve generator (num_layers + 2 yields); see :mod:`lmcache.v1.layerwise`.

        Needs ``use_layerwise: true`` and a layerwise connector (ValueError otherwise).
        Mask and keyword arguments as in :meth:`store`."""
        path = self._layerwise()
        return path.retrieve_layer(self._copy_request("retrieve_layer", tokens, mask, kwargs, _LAYER_ARGS))

    def _layerwise(self) -> LayerwiseTransferPath:
        """The layerwise path, its connector checked; ValueError when this engine has none
        (checked before the request is built)."""
        path = self._layer_path
        if path is None:
            raise ValueError(
                "gpu_connector: layerwise store/retrieve need use_layerwise: true and a layerwise connector "
                "(VLLMPagedMemLayerwiseGPUConnector or VLLMBufferLayerwiseGPUConnector); this engine uses the "
                f"bulk path with {type(self._ctx.connector).__name__}"
            )
        path.check_layer_calls()
        return path

    # ------------------------------------------------------------------ misc
    def keys(self, tokens: TokenInput, **kwargs: Any) -> list[CacheEngineKey]:
        """The chunk keys of ``tokens`` (no mask)."""
        return [s.key for s in self._spans(self._key_request("keys", tokens, kwargs))]

    @property
    def closed(self) -> bool:
        """Whether :meth:`close` has run."""
        return self._closed

    def close(self) -> None:
        """Stop background work and free memory. Idempotent."""
        if self._closed:
            return
        self._closed = True
        if self.hidden_state_store is not None:
            self.hidden_state_store.close()
        self.storage_manager.close()


@dataclasses.dataclass(slots=True)
class _Registered:
    engine: LMCacheEngine
    config: LMCacheEngineConfig  # a copy: mutating the caller's object cannot hide a change


class LMCacheEngineBuilder:
    """Process-wide registry of engines by instance id (one per model shard)."""

    _registry: Registry[str, _Registered] = Registry()

    @classmethod
    def get_or_create(
        cls,
        instance_id: str,
        config: LMCacheEngineConfig,
        metadata: LMCacheEngineMetadata,
        gpu_connector: KVConnector | None,
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

        def create() -> _Registered:
            return _Registered(LMCacheEngine(config, metadata, gpu_connector), config.copy())

        def reuse(reg: _Registered) -> None:
            cfg_diffs = [f"config.{name}" for name in _differing_fields(reg.config, config)]
            md_diffs = [f"metadata.{name}" for name in _differing_fields(reg.engine.metadata, metadata)]
            if cfg_diffs or md_diffs:
                what = " and ".join(w for w, d in (("configuration", cfg_diffs), ("metadata", md_diffs)) if d)
                raise ValueError(
                    f"instance_id={instance_id!r}: already registered with different {what} "
                    f"(differs: {', '.join(cfg_diffs + md_diffs)}); destroy() it first or use another instance id"
                )
            if reg.engine.gpu_connector is None and gpu_connector is not None:
                reg.engine.gpu_connector = gpu_connector

        return cls._registry.get_or_create(instance_id, create, reuse=reuse).engine

    @classmethod
    def get(cls, instance_id: str) -> LMCacheEngine | None:
        reg = cls._registry.get(instance_id)
        return reg.engine if reg is not None else None

    @classmethod
    def destroy(cls, instance_id: str) -> None:
        """Close and forget the engine; unknown ids are ignored."""
        reg = cls._registry.pop(instance_id)
        if reg is not None:
            reg.engine.close()


def _differing_fields(old: Any, new: Any) -> list[str]:
    """Names of the dataclass fields whose values differ (``type`` if the classes do)."""
    if type(old) is not type(new):
        return [f"type ({type(old).__name__} != {type(new).__name__})"]
    return [f.name for f in dataclasses.fields(old) if getattr(old, f.name) != getattr(new, f.name)]
