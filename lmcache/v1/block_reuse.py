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
from lmcache.v1.request import KeyExtras

if TYPE_CHECKING:
    from lmcache.v1.config import LMCacheEngineConfig
    from lmcache.v1.metadata import LMCacheEngineMetadata
    from lmcache.v1.storage_backend.storage_manager import StorageManager
    from lmcache.v1.token_database import ChunkedTokenDatabase, ChunkSpan

__all__ = ["BlockHit", "BlockIndex", "BlockReuse", "DEFAULT_MAX_ENTRIES"]

DEFAULT_MAX_ENTRIES = 1 << 18
"""Index entries kept at most (about 40 MB); the oldest registrations go first."""


@dataclass(frozen=True, slots=True)
class BlockHit:
    """The first ``num_tokens`` tokens of the entry ``key`` continue the request."""

    key: CacheEngineKey
    num_tokens: int


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
    """Block-granular reuse for one engine: tail lengths, registration and probes.

    Mechanism only: the bulk transfer path decides when to call it. Built by
    :meth:`create`, which returns None when the feature is off or has nothing to do.
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

    def register(self, tokens: np.ndarray, extras: KeyExtras, spans: Sequence[ChunkSpan], prev_key: dict[int, CacheEngineKey]) -> None:
        """Index the block prefixes of the cached ``spans`` (stored, found or loaded) that
        the index does not know yet.

        ``prev_key[start]`` is the key of the chunk ending at ``start`` when the caller
        has it (otherwise the chain digest is recomputed from the tokens). A whole
        chunk's prefixes stop one block short (its full length is its own key); a tail
        entry's include its own length."""
        b, c = self.block_size, self.chunk_size
        for span in spans:
            length = span.end - span.start
            last = length - b if length == c else length - length % b
            if last < b or self.index.knows(span.key):
                continue
            prev = self.prev_digest(tokens, extras, span.start // c, prev_key.get(span.start))
            self.index.add(span.key, self.token_database.block_digests(tokens[span.start : span.start + last], prev, b), b)

    # ------------------------------------------------------------------ probe side
    def prefix_hashes(self, chunk_tokens: np.ndarray, prev: bytes) -> list[int]:
        """Key hashes of the block-aligned prefixes of the first missing chunk's tokens
        (``chunk_tokens``: at most one chunk; ``prev``: what that chunk chains on)."""
        usable = min(len(chunk_tokens), self.chunk_size - 1)
        usable -= usable % self.block_size
        if usable <= 0 or not len(self.index):
            return []
        return self.token_database.block_digests(chunk_tokens[:usable], prev, self.block_size)

    def best(self, hashes: Sequence[int], search_range: frozenset[str] | None = None) -> BlockHit | None:
        """The longest indexed prefix whose entry is still cached (any tier, or one of the
        tiers named by ``search_range``), or None."""
        for hit in self.index.candidates(hashes):
            if self.storage_manager.contains(hit.key, search_range) is not None:
                return hit
        return None

    def prev_digest(self, tokens: np.ndarray, extras: KeyExtras, chunk_index: int, prev: CacheEngineKey | None) -> bytes:
        """What chunk ``chunk_index`` chains on (``prev``: the key of the chunk before it, if known)."""
        if prev is not None:
            return prev.chunk_hash.to_bytes(16, "little")
        return self.token_database.chain_digest(tokens, chunk_index, extras)
