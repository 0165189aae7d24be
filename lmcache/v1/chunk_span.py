"""One chunk of a token sequence and its cache key: :class:`ChunkSpan`.

The token database (:mod:`lmcache.v1.token_database`) cuts a request's tokens into
spans; a request (:class:`~lmcache.v1.request.TransferRequest`) may carry them, and the
transfer paths copy KV span by span. The type lives here, below both, so that a
request never imports the token database that imports it. Still importable from
:mod:`lmcache.v1.token_database`.

Thread-safety: a span is immutable.
"""

from __future__ import annotations

from dataclasses import dataclass

from lmcache.v1.keys import CacheEngineKey

__all__ = ["ChunkSpan"]


@dataclass(frozen=True, slots=True)
class ChunkSpan:
    """One chunk of a token sequence: ``tokens[start:end]`` has key ``key``."""

    start: int
    end: int
    key: CacheEngineKey
