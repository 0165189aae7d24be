"""KV events for KV-cache-aware routers: what lmcache holds, through vLLM's event publisher.

When vLLM runs with ``--kv-events-config '{"enable_kv_cache_events": true, ...}'`` the
worker side records, per tier, when a chunk becomes readable (``BlockStored``: put
into the CPU tier, written to disk, written to the remote server) and when it stops
being readable (``BlockRemoved``: evicted, removed, dropped as corrupt). vLLM's
scheduler publishes them with its own events (ZMQ, ``KVEventBatch``).

Event fields:

* ``medium``: ``"CPU"``, ``"DISK"`` or ``"REMOTE"`` (the tier);
* ``block_hashes``: one 63-bit integer per chunk, chained over the prompt's chunks
  (``h_i = xxh3_64(h_{i-1} || tokens of chunk i)``, seeded with the key namespace,
  chunk size and per-request key extras such as ``cache_salt``); identical on every
  tensor-parallel rank and across restarts, so events of all ranks agree;
* ``parent_block_hash``: the hash of the chunk before (None for the first chunk);
* ``token_ids``: the chunk's tokens, ``block_size``: the chunk size (the token range
  of chunk ``i`` is ``[i * block_size, i * block_size + len(token_ids))``); a router can
  re-hash the tokens with its own scheme;
* ``lora_id`` / ``lora_name``: None (LoRA and multimodal identity is folded into the hash).

Routes: ``LMCacheConnectorV1Dynamic`` forwards both kinds through
``get_kv_connector_kv_cache_events`` / ``update_connector_output`` / ``take_events``;
vLLM's built-in ``LMCacheConnectorV1`` calls ``get_kv_events()`` and turns every
entry into a ``BlockStored``, so on that route only stored events are reported.

Threads: the recorder is called from the worker thread (saves, L1 inserts and
evictions) and from tier writer threads (completed disk/remote writes, disk
evictions); one lock guards it. Memory: at most ``max_events`` pending events and
``max_chunks`` remembered chunk descriptions (oldest dropped first, counted).
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import xxhash

from lmcache.v1.keys import CacheEngineKey
from lmcache.v1.tiers import TIERS, Tier

MEDIUM: dict[Tier, str] = {tier: tier.upper() for tier in TIERS}
"""vLLM's ``medium`` of each built-in tier (``"CPU"``, ``"DISK"``, ``"REMOTE"``)."""
_MASK63 = (1 << 63) - 1


@dataclass(frozen=True, slots=True)
class ChunkInfo:
    """What an event says about one chunk."""

    block_hash: int
    parent_block_hash: int | None
    token_ids: tuple[int, ...]


@dataclass(frozen=True, slots=True)
class StoredEvent:
    """A ``BlockStored`` before conversion (the attributes vLLM's built-in wrapper reads)."""

    block_hashes: list[int]
    parent_block_hash: int | None
    token_ids: list[int]
    block_size: int
    medium: str
    lora_id: int | None = None
    lora_name: str | None = None


@dataclass(frozen=True, slots=True)
class RemovedEvent:
    block_hashes: list[int]
    medium: str


def chunk_hashes(namespace: str, chunk_size: int, tokens: np.ndarray, extras: dict[str, Any]) -> list[ChunkInfo]:
    """:class:`ChunkInfo` of every chunk of ``tokens`` (the last one may be partial)."""
    ident = repr((namespace, chunk_size, sorted((k, repr(v)) for k, v in extras.items())))
    seed = xxhash.xxh3_64_intdigest(ident.encode())
    out: list[ChunkInfo] = []
    prev: int | None = None
    arr = np.ascontiguousarray(tokens, dtype="<i4")
    for start in range(0, len(arr), chunk_size):
        part = arr[start : start + chunk_size]
        h = xxhash.xxh3_64_intdigest((prev or 0).to_bytes(8, "little") + part.tobytes(), seed=seed) & _MASK63
        out.append(ChunkInfo(h, prev, tuple(int(t) for t in part)))
        prev = h
    return out


class KVEventRecorder:
    """Collects events of one worker's tiers (see the module docstring)."""

    def __init__(self, chunk_size: int, *, max_events: int = 10_000, max_chunks: int = 1 << 16) -> None:
        self.chunk_size = chunk_size
        self.max_events = max_events
        self.max_chunks = max_chunks
        self._chunks: OrderedDict[CacheEngineKey, ChunkInfo] = OrderedDict()
        self._events: list[StoredEvent | RemovedEvent] = []
        self._resident: OrderedDict[tuple[str, CacheEngineKey], None] = OrderedDict()
        self._lock = threading.Lock()
        self.dropped_events = 0

    def expect(self, keys: Sequence[CacheEngineKey], infos: Sequence[ChunkInfo]) -> None:
        """Remember what the chunks ``keys`` are, before they are stored (worker thread)."""
        with self._lock:
            for key, info in zip(keys, infos):
                self._chunks[key] = info
                self._chunks.move_to_end(key)
            while len(self._chunks) > self.max_chunks:
                self._chunks.popitem(last=False)

    def __call__(self, kind: str, tier: Tier, keys: list[CacheEngineKey]) -> None:
        """The tiers' listener (``StorageBackend.listener``)."""
        medium = MEDIUM.get(tier)
        if medium is None:
            return
        with self._lock:
            for key in keys:
                base = key.base_key() if hasattr(key, "base_key") else key
                info = self._chunks.get(base)
                if info is None:
                    continue  # not a KV chunk we described (hidden states, another engine)
                mark = (tier, base)
                if kind == "stored":
                    if mark in self._resident:
                        continue  # layerwise: one event per chunk, not per layer
                    self._resident[mark] = None
                    if len(self._resident) > 4 * self.max_chunks:
                        self._resident.popitem(last=False)
                    event: StoredEvent | RemovedEvent = StoredEvent(
                        [info.block_hash], info.parent_block_hash, list(info.token_ids), self.chunk_size, medium
                    )
                else:
                    if mark not in self._resident:
                        continue
                    del self._resident[mark]
                    event = RemovedEvent([info.block_hash], medium)
                if len(self._events) >= self.max_events:
                    self._events.pop(0)
                    self.dropped_events += 1
                self._events.append(event)

    def drain(self) -> list[StoredEvent | RemovedEvent]:
        """Pending events, oldest first; consecutive events of one sequence and tier merged."""
        with self._lock:
            events, self._events = self._events, []
        return merge_events(events)


def merge_events(events: list[StoredEvent | RemovedEvent]) -> list[StoredEvent | RemovedEvent]:
    """Join a stored event onto the previous one when it continues the same chain in the
    same tier, and consecutive removals in one tier (fewer, larger events)."""
    out: list[StoredEvent | RemovedEvent] = []
    for ev in _chain_order(events):
        last = out[-1] if out else None
        if (
            isinstance(ev, StoredEvent)
            and isinstance(last, StoredEvent)
            and last.medium == ev.medium
            and ev.parent_block_hash == last.block_hashes[-1]
        ):
            out[-1] = StoredEvent(
                last.block_hashes + ev.block_hashes, last.parent_block_hash, last.token_ids + ev.token_ids,
                last.block_size, last.medium,
            )  # fmt: skip
        elif isinstance(ev, RemovedEvent) and isinstance(last, RemovedEvent) and last.medium == ev.medium:
            out[-1] = RemovedEvent(last.block_hashes + ev.block_hashes, last.medium)
        else:
            out.append(ev)
    return out


def _chain_order(events: list[StoredEvent | RemovedEvent]) -> list[StoredEvent | RemovedEvent]:
    """Within each run of consecutive single-chunk stored events of one tier, put parents
    before children (tiers insert a request's chunks tail first)."""
    out: list[StoredEvent | RemovedEvent] = []
    i = 0
    while i < len(events):
        ev = events[i]
        if not isinstance(ev, StoredEvent):
            out.append(ev)
            i += 1
            continue
        j = i
        while j < len(events) and isinstance(events[j], StoredEvent) and events[j].medium == ev.medium:
            j += 1
        run: list[StoredEvent] = events[i:j]  # type: ignore[assignment]
        by_parent = {e.parent_block_hash: e for e in run if len(e.block_hashes) == 1}
        if len(by_parent) == len(run):
            hashes = {e.block_hashes[0] for e in run}
            ordered: list[StoredEvent] = []
            for root in (e for e in run if e.parent_block_hash not in hashes):
                node: StoredEvent | None = root
                while node is not None and len(ordered) <= len(run):
                    ordered.append(node)
                    node = by_parent.get(node.block_hashes[0])
            run = ordered if len(ordered) == len(run) else run
        out.extend(run)
        i = j
    return out


def kv_events_enabled(vllm_config: Any) -> bool:
    cfg = getattr(vllm_config, "kv_events_config", None)
    return bool(cfg is not None and getattr(cfg, "enable_kv_cache_events", False))


def to_vllm_events(events: list[StoredEvent | RemovedEvent]) -> list[Any]:
    """vLLM's ``BlockStored`` / ``BlockRemoved`` objects for ``events``."""
    from lmcache.integration.vllm.vllm_compat import BlockRemoved, BlockStored

    out: list[Any] = []
    for ev in events:
        if isinstance(ev, StoredEvent):
            out.append(
                BlockStored(
                    block_hashes=ev.block_hashes,
                    parent_block_hash=ev.parent_block_hash,
                    token_ids=ev.token_ids,
                    block_size=ev.block_size,
                    lora_id=None,
                    medium=ev.medium,
                    lora_name=None,
                )
            )
        else:
            out.append(BlockRemoved(block_hashes=ev.block_hashes, medium=ev.medium))
    return out


def describe_request(recorder: KVEventRecorder, engine: Any, tokens: np.ndarray, extras: dict[str, Any]) -> None:
    """Tell ``recorder`` what the chunks of ``tokens`` are (before a store or a load)."""
    keys = engine.keys(tokens, **extras)
    infos = chunk_hashes(engine.metadata.model_name, engine.config.chunk_size, tokens, extras)
    recorder.expect(keys, infos[: len(keys)])


def attach(recorder: KVEventRecorder, engine: Any) -> None:
    """Make every tier of ``engine`` report to ``recorder``."""
    for backend in engine.storage_manager.backends:
        backend.listener = recorder
