"""LMCacheEngine: orchestrates keys, storage and copies. It owns no copying, hashing or I/O.

Store:    tokens -> chunk keys (token database) -> pool objects (storage manager)
          -> paged KV copied in (GPU connector) -> ``batched_put`` to the tiers.
Retrieve: chunk keys -> ``batched_get`` (prefix) -> copied into the paged KV.
Lookup:   chunk keys -> ``batched_contains`` (prefix), no data moved.
"""

from __future__ import annotations

import dataclasses
import logging
import time
from typing import Any, Callable, Iterator

import torch

from lmcache.errors import LogOnce
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
    KeyExtras,
    TransferRequest,
    mask_start,
    reject_unknown,
    tokens_to_array,
)
from lmcache.v1.stats import CacheStats
from lmcache.v1.storage_backend.storage_manager import StorageManager
from lmcache.v1.token_database import ChunkedTokenDatabase, ChunkSpan, PrefixKeys, TokenInput
from lmcache.v1.transfer import BulkTransfer, TransferContext, TransferPath

logger = logging.getLogger(__name__)

_KEY_ARGS = KEY_EXTRA_NAMES
_COPY_ARGS = KEY_EXTRA_NAMES + COPY_ARG_NAMES
_LAYER_ARGS = _COPY_ARGS + ("sync",)


def make_transfer_path(config: LMCacheEngineConfig, ctx: TransferContext) -> TransferPath:
    """The transfer path ``config`` asks for: layerwise when ``use_layerwise``, else bulk."""
    return LayerwiseTransfer(ctx) if config.use_layerwise else BulkTransfer(ctx)


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

    The transfer path (:attr:`transfer`: bulk, or layerwise when ``use_layerwise``) is
    chosen here, once; every store/retrieve/lookup goes through it.
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
        self._ctx = TransferContext(
            metadata, self.token_database, self.storage_manager, self.stats, LogOnce(logger), gpu_connector
        )
        self._ctx.blocks = BlockReuse.create(config, metadata, self.token_database, self.storage_manager)
        self.transfer: TransferPath = make_transfer_path(config, self._ctx)
        self.latency = self._ctx.latency
        """Seconds per bulk ``store``/``retrieve`` and per ``lookup`` (layerwise calls are
        not timed: their generators span the model's forward pass)."""
        self.hidden_state_store = self._make_hidden_state_store()
        self._closed = False

    @property
    def gpu_connector(self) -> KVConnector | None:
        """The connector copies go through (None until one is attached)."""
        return self._ctx.connector

    @gpu_connector.setter
    def gpu_connector(self, connector: KVConnector | None) -> None:
        self._ctx.connector = connector

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
        kv = self._ctx.require_connector().bind(
            arr.shape[0],
            kvcaches=kwargs.get("kvcaches"),
            slot_mapping=kwargs.get("slot_mapping"),
            sync=kwargs.get("sync", True),
        )
        return TransferRequest(arr, first, extras, kv)

    def _spans(self, req: TransferRequest) -> list[ChunkSpan]:
        return self._ctx.spans(req)

    # ------------------------------------------------------------------ store / retrieve
    def store(self, tokens: TokenInput, mask: torch.Tensor | None = None, **kwargs: Any) -> int:
        """Copy the KV of ``tokens`` (where ``mask`` is True) into the cache.

        The already-cached prefix of chunks is skipped; chunks containing a negative slot are not
        stored (their KV is not in the paged cache), nor is anything after them. If the
        pool is full even after eviction, the rest of the request is skipped and
        counted (``stats.store_skipped_chunks``); this is not an error.
        Returns the number of tokens newly stored. The engine keeps no reference to
        the caller's tensors.
        """
        return self.transfer.store(self._copy_request("store", tokens, mask, kwargs, _COPY_ARGS))

    def retrieve(self, tokens: TokenInput, mask: torch.Tensor | None = None, **kwargs: Any) -> torch.Tensor:
        """Write cached KV for the longest cached prefix of ``tokens`` into the paged cache.

        Returns a CPU bool tensor, True where KV was written back: tokens of the
        retrieved chunks that have a slot (a token whose slot is negative gets nothing
        and stays False). Chunks where ``mask`` is False are neither read nor written.
        """
        return self.transfer.retrieve(self._copy_request("retrieve", tokens, mask, kwargs, _COPY_ARGS))

    # ------------------------------------------------------------------ lookup
    def lookup(self, tokens: TokenInput, pin: bool = False, **kwargs: Any) -> int:
        """Number of leading tokens whose KV is cached: whole chunks, then (block-granular
        reuse, when the metadata names a block size) whole blocks of the next chunk, or a
        cached partial last chunk. ``pin=True`` keeps the L1 entries of the whole chunks
        from eviction until :meth:`lookup_unpin` (and reports whole chunks only)."""
        if not isinstance(pin, bool):
            raise TypeError(f"pin={pin!r}: expected a bool")
        return self.lookup_prefix(self.prefix_keys(tokens, **kwargs), pin=pin)

    def prefix_keys(self, tokens: TokenInput, **kwargs: Any) -> PrefixKeys:
        """The chunk keys :meth:`lookup` probes for ``tokens`` (key extras as in lookup).

        One native pass over a token list (no int32 array, no span objects). A caller that
        asks again for the same tokens (vLLM's scheduler for a waiting request) keeps the
        result and calls :meth:`lookup_prefix` with it."""
        reject_unknown(kwargs, _KEY_ARGS, "lookup")
        return self.token_database.prefix_keys(tokens, KeyExtras.from_kwargs(kwargs))

    def lookup_prefix(self, pk: PrefixKeys, pin: bool = False) -> int:
        """:meth:`lookup` for keys from :meth:`prefix_keys` of this engine."""
        if not isinstance(pin, bool):
            raise TypeError(f"pin={pin!r}: expected a bool")
        if not isinstance(pk, PrefixKeys) or pk.chunk_size != self.token_database.chunk_size:
            raise TypeError(f"pk={type(pk).__name__}: expected PrefixKeys from this engine's prefix_keys")
        t0 = time.perf_counter()
        found = self.transfer.lookup(pk.keys, pin)
        hit = pk.end(found)
        if not pin and hit < pk.num_tokens and self._ctx.blocks is not None:
            hit += self._block_extension(pk, found)
        self.stats.add(lookup_requests=1, lookup_tokens=pk.num_tokens, lookup_hit_tokens=hit)
        self.latency["lookup"].observe(time.perf_counter() - t0)
        logger.debug("lmcache lookup: %d of %d tokens cached", hit, pk.num_tokens)
        return hit

    def _block_extension(self, pk: PrefixKeys, found: int) -> int:
        """Cached tokens of chunk ``found`` (the first that missed) at block granularity."""
        blocks = self._ctx.blocks
        assert blocks is not None
        if pk.tokens is None or pk.extras is None or not len(blocks.index):
            return 0
        hashes = pk.block_hashes.get(found)
        if hashes is None:
            start = found * pk.chunk_size
            chunk = tokens_to_array(pk.tokens[start : start + pk.chunk_size])
            prev = pk.keys[found - 1] if found else None
            hashes = blocks.prefix_hashes(chunk, blocks.prev_digest(chunk, pk.extras, 0, prev))
            pk.block_hashes[found] = hashes
        hit = blocks.best(hashes)
        return hit.num_tokens if hit is not None else 0

    def lookup_unpin(self, tokens: TokenInput, **kwargs: Any) -> None:
        """Undo the pins of a ``lookup(tokens, pin=True)`` with the same key extras."""
        spans = self._spans(self._key_request("lookup_unpin", tokens, kwargs))
        self.transfer.unpin([s.key for s in spans])

    # ------------------------------------------------------------------ layerwise
    def store_layer(self, tokens: TokenInput, mask: torch.Tensor | None = None, **kwargs: Any) -> Iterator[None]:
        """Layerwise store generator (num_layers + 1 ``next()`` calls); see :mod:`lmcache.v1.layerwise`.

        Needs ``use_layerwise: true`` and a layerwise connector (ValueError otherwise)."""
        self.transfer.check_layer_calls()
        return self.transfer.store_layer(self._copy_request("store_layer", tokens, mask, kwargs, _LAYER_ARGS))

    def retrieve_layer(
        self, tokens: TokenInput, mask: torch.Tensor | None = None, **kwargs: Any
    ) -> Iterator[torch.Tensor | None]:
        """Layerwise retrieve generator (num_layers + 2 yields); see :mod:`lmcache.v1.layerwise`.

        Needs ``use_layerwise: true`` and a layerwise connector (ValueError otherwise)."""
        self.transfer.check_layer_calls()
        return self.transfer.retrieve_layer(self._copy_request("retrieve_layer", tokens, mask, kwargs, _LAYER_ARGS))

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
