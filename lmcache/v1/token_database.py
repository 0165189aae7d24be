"""Token sequence -> chunk keys.

Chunk hashes are chained: ``h_i = H(h_{i-1} || tokens[i*C:(i+1)*C])`` with ``H`` =
BLAKE2b-128 over the tokens as little-endian int32. ``h_{-1}`` is a seed that folds in
the namespace (format version, model, world size, worker, KV dtype, layout, chunk
size) and the per-request extras (cache_salt, request configs, extra keys such as
multimodal hashes or a LoRA name), every field length-prefixed or type-tagged
(:meth:`KeyExtras.encode`) so that two different namespaces or extras never give the
same seed. The result does not depend on PYTHONHASHSEED, the process or the machine, so
disk and remote tiers can share entries safely.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Iterator, Mapping, Sequence

import numpy as np
import torch

from lmcache.v1.keys import CacheEngineKey
from lmcache.v1.request import KeyExtras, mask_start, tokens_to_array

__all__ = ["KEY_FORMAT_VERSION", "ChunkSpan", "ChunkedTokenDatabase", "TokenInput", "tokens_to_array"]

if TYPE_CHECKING:
    from lmcache.v1.config import LMCacheEngineConfig
    from lmcache.v1.metadata import LMCacheEngineMetadata

KEY_FORMAT_VERSION = "lmcache-key-v2"
"""v2: namespace fields and key extras are length-prefixed (injective); v1 joined them with '|'."""

TokenInput = Sequence[int] | np.ndarray | torch.Tensor


@dataclass(frozen=True, slots=True)
class ChunkSpan:
    """One chunk of a token sequence: ``tokens[start:end]`` has key ``key``."""

    start: int
    end: int
    key: CacheEngineKey


class ChunkedTokenDatabase:
    """Splits token sequences into fixed-size chunks and names each with a chained key.

    Stateless apart from config; safe to call from any thread.
    """

    def __init__(self, config: LMCacheEngineConfig, metadata: LMCacheEngineMetadata) -> None:
        self.chunk_size = config.chunk_size
        self.save_unfull_chunk = config.save_unfull_chunk
        self.metadata = metadata
        self._namespace = b"".join(
            _lp(str(part).encode("utf-8", "surrogatepass"))
            for part in [
                KEY_FORMAT_VERSION,
                metadata.model_name,
                str(metadata.world_size),
                str(metadata.worker_id),
                metadata.dtype_name,
                metadata.fmt,
                "mla" if metadata.use_mla else "kv",
                "x".join(str(d) for d in metadata.kv_shape[:2] + metadata.kv_shape[3:]),
                str(self.chunk_size),
            ]
        )

    def _seed(self, extras: KeyExtras) -> bytes:
        return hashlib.blake2b(self._namespace + extras.encode(), digest_size=16).digest()

    def process_tokens(
        self,
        tokens: TokenInput,
        mask: torch.Tensor | np.ndarray | Sequence[bool] | None = None,
        **extras: Any,
    ) -> Iterator[tuple[int, int, CacheEngineKey]]:
        """Yield ``(start, end, key)`` for each chunk of ``tokens`` selected by ``mask``.

        ``mask`` must be False for a prefix whose length is a multiple of chunk_size
        (chunks the caller already has) and True after it; those leading chunks are
        hashed but not yielded. A trailing partial chunk is yielded only when
        ``save_unfull_chunk`` is true (or ``include_partial`` overrides it). ``extras``
        are the keyword arguments of :meth:`spans`.
        """
        for span in self.spans(tokens, mask, **extras):
            yield span.start, span.end, span.key

    def spans(
        self,
        tokens: TokenInput,
        mask: torch.Tensor | np.ndarray | Sequence[bool] | None = None,
        *,
        cache_salt: str | None = None,
        request_configs: Mapping[str, object] | None = None,
        extra_keys: Sequence[str] | None = None,
        include_partial: bool | None = None,
    ) -> list[ChunkSpan]:
        """Like :meth:`process_tokens` but returns a list of :class:`ChunkSpan`.

        Raises TypeError/ValueError for bad tokens, mask or extras (see :mod:`lmcache.v1.request`).
        """
        arr = tokens_to_array(tokens)
        first = mask_start(mask, arr.shape[0], self.chunk_size)
        return self.spans_of(arr, first, KeyExtras.build(cache_salt, request_configs, extra_keys), include_partial)

    def spans_of(
        self, arr: np.ndarray, first: int, extras: KeyExtras, include_partial: bool | None = None
    ) -> list[ChunkSpan]:
        """Spans of validated input: int32 tokens, mask start (multiple of chunk_size), extras."""
        n = arr.shape[0]
        partial = self.save_unfull_chunk if include_partial is None else include_partial
        stop = n if partial else n - n % self.chunk_size
        md = self.metadata
        req = extras.config_strings
        prev = self._seed(extras)
        raw = arr.tobytes()
        out: list[ChunkSpan] = []
        for start in range(0, stop, self.chunk_size):
            end = min(start + self.chunk_size, n)
            prev = hashlib.blake2b(prev + raw[start * 4 : end * 4], digest_size=16).digest()
            if start >= first:
                key = CacheEngineKey(
                    md.model_name, md.world_size, md.worker_id, int.from_bytes(prev, "little"), md.kv_dtype, req
                )
                out.append(ChunkSpan(start, end, key))
        return out


def _lp(data: bytes) -> bytes:
    """Length-prefixed bytes (8-byte little-endian length)."""
    return len(data).to_bytes(8, "little") + data
