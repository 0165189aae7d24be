"""Prompt -> segments (documents) separated by a separator, and position-free segment keys.

A blended prompt is written as ``doc1 SEP doc2 SEP ... SEP question`` where ``SEP`` is a
separator string (LMCache's default ``" # # "``). Its token ids are given by the caller,
who tokenizes the separator *without* special tokens. :func:`split_segments` cuts a
token sequence at every (non-overlapping, leftmost-first) occurrence of those ids: the
separators belong to no segment, and an empty segment (two separators in a row, or one at
either end) is skipped.

Keys. A segment's KV is computed on its own, from position 0, so it is the same wherever
the segment appears later: its keys must not depend on what precedes it. :class:`SegmentKeys`
names a segment's chunks with the token database's formula (BLAKE2b-128 chained over
``chunk_size``-token chunks, see :mod:`lmcache.v1.token_database`) but chained from a
*segment seed* instead of the prompt's seed: ``BLAKE2b(prompt seed, person="lmcache-segment")``.
The prompt seed already folds in the namespace (model, shard, dtype, layout, chunk size) and
the request's extras (cache_salt, request configs, extra keys), so segments of different
tenants or models never share keys, and the personalisation keeps segment keys apart from
prefix keys of the same tokens. The last chunk of a segment is usually partial and is
always keyed.

Tokenizer caveat: with BPE tokenizers the separator's tokens can merge with neighbouring
text (``"end # #"`` may tokenize differently from ``"end"`` + ``" # # "``), and a document's
first token may change with the character before it (a leading space). Then the separator
is not found, or a document's ids differ from those it was cached with, and the segment is
simply a miss. Callers should put the separator between documents exactly as it was
tokenized (e.g. tokenize the documents and the separator separately and join the ids).
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from typing import Sequence

import numpy as np

from lmcache.v1.keys import CacheEngineKey
from lmcache.v1.request import NO_EXTRAS, KeyExtras
from lmcache.v1.token_database import ChunkedTokenDatabase, ChunkSpan, TokenInput, tokens_to_array

__all__ = ["DEFAULT_SEPARATOR", "Segment", "SegmentKeys", "find_separators", "split_segments"]

DEFAULT_SEPARATOR = " # # "
"""LMCache's default ``blend_special_str`` (to be tokenized by the caller, without special tokens)."""

_SEGMENT_PERSON = b"lmcache-segment"


MAX_LEAD_BYTES = 256
"""Longest segment lead (see :class:`Segment`)."""


@dataclass(frozen=True, slots=True)
class Segment:
    """``prompt[start:end]``, a run of tokens between separators (never empty).

    ``lead``: text that came right before ``start`` and belongs to the segment's key but not
    to its cached tokens (the integration keys a document from its second word on, with the
    first word's text as the lead: the first word's tokens depend on what precedes it in a
    BPE tokenizer, the rest do not). Empty: the key covers ``tokens`` alone."""

    start: int
    end: int
    tokens: tuple[int, ...]
    lead: bytes = b""

    def __post_init__(self) -> None:
        if len(self.lead) > MAX_LEAD_BYTES:
            raise ValueError(f"segment lead of {len(self.lead)} bytes; expected at most {MAX_LEAD_BYTES}")

    def __len__(self) -> int:
        return self.end - self.start


def _separator(separator: Sequence[int]) -> np.ndarray:
    if isinstance(separator, (str, bytes)) or not isinstance(separator, Sequence) or not separator:
        raise TypeError(f"separator={separator!r}: expected a non-empty list of token ids")
    if any(isinstance(t, bool) or not isinstance(t, (int, np.integer)) for t in separator):
        raise TypeError(f"separator={separator!r}: expected token ids (ints)")
    return tokens_to_array(list(separator))


def find_separators(tokens: TokenInput, separator: Sequence[int]) -> list[int]:
    """Start positions of the separator's occurrences in ``tokens`` (leftmost first, not
    overlapping). Raises TypeError/ValueError for bad tokens or separator."""
    sep = _separator(separator)
    arr = tokens_to_array(tokens)
    m = sep.shape[0]
    if arr.shape[0] < m:
        return []
    windows = np.lib.stride_tricks.sliding_window_view(arr, m)
    hits = np.flatnonzero((windows == sep).all(axis=1))
    found: list[int] = []
    next_free = 0
    for h in hits.tolist():
        if h >= next_free:
            found.append(h)
            next_free = h + m
    return found


def split_segments(tokens: TokenInput, separator: Sequence[int]) -> list[Segment]:
    """The non-empty segments of ``tokens`` between separators, in prompt order.

    Without a separator the whole (non-empty) sequence is one segment."""
    arr = tokens_to_array(tokens)
    m = len(separator)
    cuts = find_separators(arr, separator)
    bounds = [(0, cuts[0])] if cuts else []
    bounds += [(a + m, b) for a, b in zip(cuts, cuts[1:])]
    bounds.append((cuts[-1] + m if cuts else 0, arr.shape[0]))
    return [Segment(s, e, tuple(arr[s:e].tolist())) for s, e in bounds if e > s]


class SegmentKeys:
    """Position-free chunk keys of segments (see the module docstring for the formula).

    Uses the database's namespace, chunk size and key fields; stateless otherwise and
    safe from any thread."""

    def __init__(self, db: ChunkedTokenDatabase) -> None:
        self._db = db
        md = db.metadata
        self._fields = (md.model_name, md.world_size, md.worker_id, md.kv_dtype)

    @property
    def chunk_size(self) -> int:
        return self._db.chunk_size

    def seed(self, extras: KeyExtras = NO_EXTRAS, lead: bytes = b"") -> bytes:
        """The 16-byte digest every segment's first chunk chains on (``lead`` folded in,
        length-prefixed, when not empty)."""
        prompt_seed = self._db.chain_digest(np.zeros(0, dtype=np.int32), 0, extras)
        if lead:
            prompt_seed += b"lead" + len(lead).to_bytes(4, "little") + lead
        return hashlib.blake2b(prompt_seed, digest_size=16, person=_SEGMENT_PERSON).digest()

    def spans(self, segment: Segment, extras: KeyExtras = NO_EXTRAS) -> list[ChunkSpan]:
        """One span per chunk of ``segment`` (the last one possibly partial), with prompt
        positions (``segment.start`` + offset) and keys that do not depend on them."""
        arr = tokens_to_array(list(segment.tokens))
        c = self._db.chunk_size
        prev = self.seed(extras, segment.lead)
        model, world, worker, dtype = self._fields
        configs = extras.config_strings
        spans = []
        for off in range(0, arr.shape[0], c):
            chunk = arr[off : off + c]
            chunk_hash = ChunkedTokenDatabase.block_digests(chunk, prev, chunk.shape[0])[0]
            prev = chunk_hash.to_bytes(16, "little")
            key = CacheEngineKey(model, world, worker, chunk_hash, dtype, configs)
            spans.append(ChunkSpan(segment.start + off, segment.start + off + chunk.shape[0], key))
        return spans
