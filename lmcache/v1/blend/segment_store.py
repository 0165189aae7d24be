"""Segments' KV in the engine's tiers, under position-free keys.

A segment (a document of a blended prompt, :mod:`.segments`) is stored chunk by chunk
under its :class:`~.segments.SegmentKeys`, one entry per chunk in the engine's usual
``KV_2LTD`` format (``[2, num_layers, tokens, kv_heads * head_dim]``), so every tier (CPU
pool, disk, Redis) keeps, evicts, verifies and shares it like any other entry. The keys
never collide with prefix keys (their chain starts from a personalised seed), so a
segment entry can never be served as an exact prefix hit.

Position-free means the *caller* stores keys rotated for positions ``0 .. len-1`` (as if
the segment started the prompt) and moves them to the positions it needs when reading:
the rotation is the model's business (:mod:`lmcache.integration.vllm.blend_worker`).

Threads: :meth:`SegmentStore.lookup` may run on a scheduler or lookup-server thread while
:meth:`get`/:meth:`put` run on the worker thread; the tiers are thread-safe. Nothing here
raises for a missing, evicted or corrupt entry: a lookup counts the leading chunks found,
a read returns what it could read (possibly nothing). Memory: :meth:`put` copies the
caller's tensors into pool objects the tiers own; :meth:`get` returns new tensors the
caller owns and releases every pool object it read.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Sequence

import torch

from lmcache.v1.blend.segments import Segment, SegmentKeys
from lmcache.v1.memory_management import MemoryFormat
from lmcache.v1.metadata import LMCacheEngineMetadata
from lmcache.v1.request import NO_EXTRAS, KeyExtras
from lmcache.v1.storage_backend.storage_manager import StorageManager
from lmcache.v1.token_database import ChunkedTokenDatabase, ChunkSpan

__all__ = ["SegmentKV", "SegmentStore"]

logger = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True, eq=False)
class SegmentKV:
    """The cached leading tokens of a segment: per layer ``[num_tokens, kv_heads, head_dim]``,
    keys rotated for positions ``0 .. num_tokens-1``."""

    keys: list[torch.Tensor]
    values: list[torch.Tensor]

    @property
    def num_tokens(self) -> int:
        return self.keys[0].shape[0] if self.keys else 0


class SegmentStore:
    """Reads and writes segments' KV through a :class:`StorageManager` (see the module docstring)."""

    def __init__(self, metadata: LMCacheEngineMetadata, db: ChunkedTokenDatabase, storage: StorageManager) -> None:
        if metadata.use_mla:
            raise ValueError("segment storage needs separate K and V (MLA models cannot blend)")
        num_layers, _, _, kv_heads, head_dim = metadata.kv_shape
        self._keys = SegmentKeys(db)
        self._storage = storage
        self.num_layers, self.kv_heads, self.head_dim = int(num_layers), int(kv_heads), int(head_dim)
        self.dtype = metadata.kv_dtype

    def spans(self, segment: Segment, extras: KeyExtras = NO_EXTRAS) -> list[ChunkSpan]:
        """The chunk spans (prompt positions, position-free keys) of ``segment``."""
        return self._keys.spans(segment, extras)

    def lookup(self, segment: Segment, extras: KeyExtras = NO_EXTRAS) -> int:
        """Leading tokens of ``segment`` whose KV is cached (whole chunks, the last one
        possibly partial); 0 on a miss."""
        spans = self.spans(segment, extras)
        found = self._storage.batched_contains([s.key for s in spans])
        return spans[found - 1].end - segment.start if found else 0

    def get(self, segment: Segment, num_tokens: int, extras: KeyExtras = NO_EXTRAS) -> SegmentKV:
        """KV of the first ``num_tokens`` tokens of ``segment`` as far as it can be read
        (whole chunks; stops at the first chunk that is missing, corrupt or of another shape)."""
        spans = [s for s in self.spans(segment, extras) if s.start - segment.start < num_tokens]
        objs = self._storage.batched_get([s.key for s in spans])
        keys: list[list[torch.Tensor]] = [[] for _ in range(self.num_layers)]
        values: list[list[torch.Tensor]] = [[] for _ in range(self.num_layers)]
        try:
            for span, obj in zip(spans, objs):
                tensor = obj.tensor if obj is not None else None
                n = span.end - span.start
                if tensor is None or tuple(tensor.shape) != self._shape(n) or tensor.dtype != self.dtype:
                    break
                kv = tensor.view(2, self.num_layers, n, self.kv_heads, self.head_dim)
                for li in range(self.num_layers):
                    keys[li].append(kv[0, li].clone())
                    values[li].append(kv[1, li].clone())
        finally:
            for obj in objs:
                if obj is not None:
                    obj.ref_count_down()
        if not keys[0]:
            return SegmentKV([], [])
        return SegmentKV([torch.cat(k) for k in keys], [torch.cat(v) for v in values])

    def put(
        self, segment: Segment, keys: Sequence[torch.Tensor], values: Sequence[torch.Tensor], extras: KeyExtras = NO_EXTRAS
    ) -> int:
        """Store ``segment``'s KV (per layer ``[len(segment), kv_heads, head_dim]``, keys rotated
        for positions ``0 ..``); chunks already cached are skipped. Returns the tokens newly
        stored (fewer when the pool is full: the rest is skipped)."""
        n = len(segment)
        if len(keys) != self.num_layers or len(values) != self.num_layers:
            raise ValueError(f"segment KV has {len(keys)}/{len(values)} layers; the model {self.num_layers}")
        want = (n, self.kv_heads, self.head_dim)
        if any(tuple(t.shape) != want for t in (*keys, *values)):
            raise ValueError(f"segment KV: expected per-layer tensors of shape {want}")
        spans = self.spans(segment, extras)
        cached = self._storage.batched_contains([s.key for s in spans])
        todo = spans[cached:]
        stored = 0
        for span in todo:
            a, b = span.start - segment.start, span.end - segment.start
            obj = self._storage.allocate(self._shape(b - a), self.dtype, MemoryFormat.KV_2LTD)
            if obj is None:
                logger.debug("segment store: pool full, %d tokens of a segment not stored", n - a)
                break
            try:
                assert obj.tensor is not None
                kv = obj.tensor.view(2, self.num_layers, b - a, self.kv_heads, self.head_dim)
                for li in range(self.num_layers):
                    kv[0, li].copy_(keys[li][a:b])
                    kv[1, li].copy_(values[li][a:b])
                self._storage.batched_put([span.key], [obj])
            finally:
                obj.ref_count_down()
            stored += b - a
        return stored

    def _shape(self, n: int) -> tuple[int, int, int, int]:
        return (2, self.num_layers, n, self.kv_heads * self.head_dim)
