"""Token sequence -> chunk keys.

Chunk hashes are chained: ``h_i = H(h_{i-1} || tokens[i*C:(i+1)*C])`` with ``H`` =
BLAKE2b-128 over the tokens as little-endian int32. ``h_{-1}`` is a seed that folds in
the namespace (format version, model, world size, worker, KV dtype, layout, chunk
size) and the per-request extras (cache_salt, request configs, extra keys such as
multimodal hashes or a LoRA name). The result does not depend on PYTHONHASHSEED, the
process or the machine, so disk and remote tiers can share entries safely.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Iterator, Mapping, Sequence

import numpy as np
import torch

from lmcache.utils import CacheEngineKey

if TYPE_CHECKING:
    from lmcache.v1.config import LMCacheEngineConfig
    from lmcache.v1.metadata import LMCacheEngineMetadata

KEY_FORMAT_VERSION = "lmcache-key-v1"
_INT32_MIN, _INT32_MAX = -(2**31), 2**31 - 1

TokenInput = Sequence[int] | np.ndarray | torch.Tensor


@dataclass(frozen=True, slots=True)
class ChunkSpan:
    """One chunk of a token sequence: ``tokens[start:end]`` has key ``key``."""

    start: int
    end: int
    key: CacheEngineKey


def tokens_to_array(tokens: TokenInput) -> np.ndarray:
    """Token ids as a contiguous little-endian int32 array (no per-token Python loop)."""
    if isinstance(tokens, torch.Tensor):
        if tokens.dim() != 1 or tokens.is_floating_point():
            raise ValueError(f"tokens: expected a 1-D integer tensor, got shape {tuple(tokens.shape)} {tokens.dtype}")
        arr = tokens.detach().to("cpu").numpy()
    elif isinstance(tokens, np.ndarray):
        arr = tokens
    else:
        arr = np.asarray(tokens) if len(tokens) else np.zeros(0, dtype=np.int64)
    if arr.ndim != 1 or (arr.size and arr.dtype.kind not in "iu"):
        raise ValueError(f"tokens: expected a 1-D sequence of integers, got dtype {arr.dtype} ndim {arr.ndim}")
    if arr.dtype != np.dtype("<i4"):
        if arr.size and (int(arr.min()) < _INT32_MIN or int(arr.max()) > _INT32_MAX):
            raise ValueError("tokens: token ids must fit in int32")
        arr = arr.astype("<i4")
    return np.ascontiguousarray(arr)


def _mask_start(mask: torch.Tensor | np.ndarray | Sequence[bool] | None, n: int, chunk_size: int) -> int:
    """Index of the first True in a False-prefix/True-suffix mask (validated)."""
    if mask is None:
        return 0
    m = mask.detach().to("cpu").numpy() if isinstance(mask, torch.Tensor) else np.asarray(mask)
    m = m.astype(bool, copy=False)
    if m.shape != (n,):
        raise ValueError(f"mask: expected shape ({n},) to match tokens, got {tuple(m.shape)}")
    num_false = int(n - np.count_nonzero(m))
    if num_false and m[:num_false].any() or not m[num_false:].all():
        raise ValueError("mask: expected a run of False followed only by True")
    if num_false % chunk_size:
        raise ValueError(
            f"mask: the False prefix has {num_false} tokens; expected a multiple of chunk_size={chunk_size}"
        )
    return num_false


class ChunkedTokenDatabase:
    """Splits token sequences into fixed-size chunks and names each with a chained key.

    Stateless apart from config; safe to call from any thread.
    """

    def __init__(self, config: LMCacheEngineConfig, metadata: LMCacheEngineMetadata) -> None:
        self.chunk_size = config.chunk_size
        self.save_unfull_chunk = config.save_unfull_chunk
        self.metadata = metadata
        self._namespace = "|".join(
            [
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
        ).encode()

    def _seed(
        self,
        cache_salt: str | None,
        request_configs: Mapping[str, object] | None,
        extra_keys: Sequence[str] | None,
    ) -> bytes:
        h = hashlib.blake2b(self._namespace, digest_size=16)
        if cache_salt:
            h.update(b"|salt=" + str(cache_salt).encode())
        for name, value in sorted((request_configs or {}).items()):
            h.update(f"|cfg={name}={value}".encode())
        for item in extra_keys or ():
            h.update(b"|extra=" + str(item).encode())
        return h.digest()

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
        """Like :meth:`process_tokens` but returns a list of :class:`ChunkSpan`."""
        arr = tokens_to_array(tokens)
        n = arr.shape[0]
        first = _mask_start(mask, n, self.chunk_size)
        partial = self.save_unfull_chunk if include_partial is None else include_partial
        stop = n if partial else n - n % self.chunk_size
        md = self.metadata
        req = tuple(sorted((str(k), str(v)) for k, v in (request_configs or {}).items()))
        prev = self._seed(cache_salt, request_configs, extra_keys)
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
