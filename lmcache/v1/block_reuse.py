"""Block-granular reuse: cached KV is reused down to the serving engine's block size.

Chunks (``chunk_size`` tokens, 256 by default) are the unit of storage, but vLLM can
start computing at any block boundary (16 or 128 tokens). Without this module a
request reuses only whole chunks: a multi-turn chat loses up to ``chunk_size - 1``
tokens of every earlier turn, and two prompts that share a 1000-token system prompt
share only 768 tokens of it. Two mechanisms close that gap:

1. **Block-aligned tails.** A store keeps the trailing partial chunk at its
   block-aligned length (the tokens after the last whole block are not stored), so the
   next turn of a conversation, whose prompt extends this one, finds it.
   ``save_unfull_chunk: true`` keeps the exact tail instead (LMCache's behaviour).
2. **A block index** (:class:`BlockIndex`): for every chunk it stores, the engine
   records the key hash of each block-aligned prefix of the chunk's tokens, chained
   exactly like a chunk key (``H(previous chunk's digest || tokens[:L])``), mapped to
   (the chunk's key, ``L``). Lookup and retrieve probe the whole chunks as before and,
   at the first chunk that misses, hash the request's block-aligned prefixes of that
   chunk in one incremental pass and take the longest one the index knows whose entry
   is still cached. A retrieve then copies the first ``L`` tokens of that entry.

Keys do not change (an entry is found by its chunk key as before), so engines with
different block sizes, or without this feature, share every tier's entries. The index
lives in process memory only: after a restart, or for entries another process wrote
to a shared disk or remote tier, reuse is whole chunks (plus exact tails) until this
process serves the chunk again (a retrieve that loads it, or a store that finds it).

Cost: registering a chunk hashes its tokens once more (about 20 us per 256-token chunk
at block size 16, 5 us at block size 128: 0.6% / 0.1% of a Llama-3-8B-sized store); a
retrieve that ends in a block prefix of a longer entry copies those tokens once more in
CPU memory. Memory: at most ``chunk_size / block_size - 1`` index entries per cached
chunk, and never more than ``max_entries`` (about 150 bytes each; the chunks indexed
longest ago are dropped first), plus at most one block-aligned tail entry per stored
prompt in the tiers (an ordinary entry, evicted like any other).

Threads: :class:`BlockIndex` is thread-safe (lookups run on vLLM's scheduler thread,
stores on the worker thread). Nothing here blocks except the tiers' ``contains``.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np

from lmcache.v1.keys import CacheEngineKey
from lmcache.v1.request import KeyExtras, TransferRequest, tokens_to_array

if TYPE_CHECKING:
    from lmcache.v1.config import LMCacheEngineConfig
    from lmcache.v1.metadata import LMCacheEngineMetadata
    from lmcache.v1.storage_backend.storage_manager import StorageManager
    from lmcache.v1.token_database import ChunkedTokenDatabase, ChunkSpan, PrefixKeys

__all__ = ["BlockCandidates", "BlockHit", "BlockIndex", "BlockReuse", "DEFAULT_MAX_ENTRIES"]

DEFAULT_MAX_ENTRIES = 1 << 18
"""Index entries kept at most (about 40 MB); the oldest registrations go first."""


@dataclass(frozen=True, slots=True)
class BlockHit:
    """The first ``num_tokens`` tokens of the entry ``key`` continue the request."""

    key: CacheEngineKey
    num_tokens: int


@dataclass(frozen=True, slots=True)
class BlockCandidates:
    """Where a retrieve's block-granular part starts (token ``start``, a chunk boundary
    when there are candidates) and the indexed entries holding a block-aligned prefix of
    the chunk there, longest first."""

    start: int
    hits: list[BlockHit]


class BlockIndex:
    """Bounded map: block-prefix key hash -> (stored entry's key, prefix length). Thread-safe.

    Entries are kept and dropped per stored chunk (oldest registration first), so an entry
    the index knows (:meth:`knows`) has all its block prefixes indexed."""

    def __init__(self, max_entries: int = DEFAULT_MAX_ENTRIES) -> None:
        if type(max_entries) is not int or max_entries <= 0:
            raise ValueError(f"max_entries={max_entries!r}: expected a positive int")
        self.max_entries = max_entries
        self._by_hash: dict[int, BlockHit] = {}
        self._by_key: OrderedDict[CacheEngineKey, tuple[int, ...]] = OrderedDict()
        self._size = 0
        self._lock = threading.Lock()

    def knows(self, key: CacheEngineKey) -> bool:
        """Whether ``key``'s block prefixes are indexed (and mark it recently used)."""
        with self._lock:
            if key not in self._by_key:
                return False
            self._by_key.move_to_end(key)
            return True

    def add(self, key: CacheEngineKey, hashes: Sequence[int], block: int) -> None:
        """Record ``hashes[k]`` as the prefix of ``(k + 1) * block`` tokens of entry ``key``."""
        with self._lock:
            self._drop(key)
            for k, h in enumerate(hashes):
                self._by_hash[h] = BlockHit(key, (k + 1) * block)
            self._by_key[key] = tuple(hashes)
            self._size += len(hashes)
            while self._size > self.max_entries and self._by_key:
                self._drop(next(iter(self._by_key)))

    def _drop(self, key: CacheEngineKey) -> None:
        hashes = self._by_key.pop(key, None)
        if hashes is None:
            return
        self._size -= len(hashes)
        for h in hashes:
            hit = self._by_hash.get(h)
            if hit is not None and hit.key == key:  # a later entry may have taken the prefix over
                del self._by_hash[h]

    def candidates(self, hashes: Sequence[int]) -> list[BlockHit]:
        """The known prefixes among ``hashes`` (``hashes[k]``: ``k + 1`` blocks), longest first."""
        with self._lock:
            found = [self._by_hash.get(h) for h in reversed(hashes)]
        return [hit for hit in found if hit is not None]

    def __len__(self) -> int:
        """Indexed block prefixes."""
        return len(self._by_hash)


class BlockReuse:
    """Block-granular reuse for one engine: the one object the engine and the bulk path ask.

    Built by :meth:`create` (None when the feature is off or has nothing to do) and
    handed to the transfer context once. It owns the block index and every block-prefix
    hash (computed through the token database's key formula); callers pass requests and
    chunk spans and get answers:

    * :meth:`store_spans`: what a store writes (the trailing partial chunk cut to whole blocks);
    * :meth:`register`: index the block prefixes of chunks a store or retrieve found cached;
    * :meth:`lookup_tokens`: how many tokens of a lookup's first missing chunk are cached;
    * :meth:`retrieve_candidates`: where a retrieve's block-granular part starts, and the
      entries holding a prefix of it (longest first: :class:`BlockCandidates`).

    Mechanism only: the bulk transfer path decides when to call it and moves the KV.
    """

    def __init__(
        self,
        token_database: ChunkedTokenDatabase,
        storage_manager: StorageManager,
        block_size: int,
        *,
        max_entries: int = DEFAULT_MAX_ENTRIES,
    ) -> None:
        chunk = token_database.chunk_size
        if type(block_size) is not int or block_size <= 0 or chunk % block_size or block_size >= chunk:
            raise ValueError(
                f"block_size={block_size!r}: expected a positive int that divides chunk_size={chunk} and is smaller"
            )
        self.token_database = token_database
        self.storage_manager = storage_manager
        self.block_size = block_size
        self.chunk_size = chunk
        self.exact_tails = bool(token_database.save_unfull_chunk)
        self.index = BlockIndex(max_entries)

    @classmethod
    def create(
        cls,
        config: LMCacheEngineConfig,
        metadata: LMCacheEngineMetadata,
        token_database: ChunkedTokenDatabase,
        storage_manager: StorageManager,
    ) -> BlockReuse | None:
        """The engine's block reuse: None unless ``block_granular_reuse`` is on, the
        metadata names a block size, that size is below the chunk size, and the bulk
        path is used (the layerwise path reuses whole chunks and exact tails)."""
        block = metadata.block_size
        if not config.block_granular_reuse or block is None or block >= config.chunk_size or config.use_layerwise:
            return None
        if config.chunk_size % block:
            return None
        return cls(token_database, storage_manager, block)

    # ------------------------------------------------------------------ store side
    def store_length(self, num_tokens: int) -> int:
        """Tokens of a store request to keep: the trailing partial chunk cut to whole
        blocks (all of them with ``save_unfull_chunk``)."""
        if self.exact_tails:
            return num_tokens
        return num_tokens - (num_tokens % self.chunk_size) % self.block_size

    def store_spans(self, req: TransferRequest) -> list[ChunkSpan]:
        """The spans a store of ``req`` (chunks named by tokens) writes: whole chunks, then
        the trailing partial chunk at :meth:`store_length`."""
        assert req.spans is None, "chunks named by hashes have no tokens to cut"
        keep = self.store_length(req.num_tokens)
        return self.token_database.spans_of(req.tokens[:keep], req.mask_start, req.extras, include_partial=True)

    def register(self, req: TransferRequest, spans: Sequence[ChunkSpan], chain: Sequence[ChunkSpan] | None = None) -> None:
        """Index the block prefixes of ``spans`` of ``req`` (cached: stored, found or
        loaded) that the index does not know yet. Requests whose chunks are named by
        hashes are skipped (they have no tokens).

        ``chain`` (default ``spans``): spans of the request whose keys give what each of
        ``spans`` chains on (the key of the span ending where it starts); otherwise that
        digest is recomputed from the tokens. A whole chunk's prefixes stop one block
        short (its full length is its own key); a tail entry's include its own length."""
        if req.spans is not None:
            return
        b, c = self.block_size, self.chunk_size
        prev_key = {s.end: s.key for s in (spans if chain is None else chain)}
        for span in spans:
            length = span.end - span.start
            last = length - b if length == c else length - length % b
            if last < b or self.index.knows(span.key):
                continue
            hashes = self.token_database.block_prefix_hashes(
                req.tokens, span.start, span.start + last, req.extras, b, prev_key.get(span.start)
            )
            self.index.add(span.key, hashes, b)

    # ------------------------------------------------------------------ probe side
    def lookup_tokens(self, pk: PrefixKeys, found: int, search_range: frozenset[str] | None = None) -> int:
        """Cached tokens of chunk ``found`` of ``pk`` (the first whole chunk that missed) at
        block granularity: the longest indexed block prefix whose entry is still cached
        (in the tiers ``search_range`` names; None: all); 0 when none. The prefix hashes
        are kept in ``pk.block_hashes`` for a repeated lookup of the same keys."""
        if pk.tokens is None or pk.extras is None or not len(self.index):
            return 0
        hashes = pk.block_hashes.get(found)
        if hashes is None:
            start = found * pk.chunk_size
            chunk = tokens_to_array(pk.tokens[start : start + pk.chunk_size])
            hashes = self._probe_hashes(chunk, 0, pk.extras, pk.keys[found - 1] if found else None)
            pk.block_hashes[found] = hashes
        hit = self.best(hashes, search_range)
        return hit.num_tokens if hit is not None else 0

    def retrieve_candidates(self, req: TransferRequest, spans: Sequence[ChunkSpan], num_hit: int) -> BlockCandidates:
        """The block-granular part of a retrieve of ``req`` whose first ``num_hit`` ``spans``
        were retrieved: it starts where they end, and its candidates are the indexed entries
        holding a block-aligned prefix of the chunk there, longest first (not checked
        against the tiers: the caller reads them in order and takes the first it gets).
        No candidates when that point is not a chunk boundary or is the request's end."""
        start = spans[num_hit].start if num_hit < len(spans) else (spans[-1].end if spans else req.mask_start)
        if start % self.chunk_size or start >= req.num_tokens:
            return BlockCandidates(start, [])
        prev = spans[num_hit - 1].key if num_hit else None
        return BlockCandidates(start, self.index.candidates(self._probe_hashes(req.tokens, start, req.extras, prev)))

    def best(self, hashes: Sequence[int], search_range: frozenset[str] | None = None) -> BlockHit | None:
        """The longest indexed prefix whose entry is still cached (any tier, or one of the
        tiers named by ``search_range``), or None."""
        for hit in self.index.candidates(hashes):
            if self.storage_manager.contains(hit.key, search_range) is not None:
                return hit
        return None

    def _probe_hashes(self, tokens: np.ndarray, start: int, extras: KeyExtras, prev: CacheEngineKey | None) -> list[int]:
        """Key hashes of the block-aligned prefixes of the chunk of ``tokens`` at ``start``
        (at most ``chunk_size - 1`` tokens: a whole chunk is found by its own key); ``prev``:
        the key of the chunk before it, if known. [] when the index is empty."""
        usable = min(len(tokens) - start, self.chunk_size - 1)
        usable -= usable % self.block_size
        if usable <= 0 or not len(self.index):
            return []
        return self.token_database.block_prefix_hashes(tokens, start, start + usable, extras, self.block_size, prev)
