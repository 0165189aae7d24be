"""Token sequence -> chunk keys.

Chunk hashes are chained: ``h_i = H(h_{i-1} || tokens[i*C:(i+1)*C])`` with ``H`` =
BLAKE2b-128 over the tokens as little-endian int32. ``h_{-1}`` is a seed that folds in
the namespace (format version, model, world size, worker, KV dtype, layout, chunk
size) and the per-request extras (cache_salt, request configs, extra keys such as
multimodal hashes or a LoRA name), every field length-prefixed or type-tagged
(:meth:`KeyExtras.encode`) so that two different namespaces or extras never give the
same seed. The result does not depend on PYTHONHASHSEED, the process or the machine, so
disk and remote tiers can share entries safely.

Hashing runs in the optional native module ``lmcache._keyhash`` (built by setup.py from
csrc/keyhash.c) when it is importable: it reads a Python token list (or an int32 array)
directly, converting and hashing every chunk in one pass, and builds the keys without
running their ``__init__``. Without it (or when it declines an input it does not handle,
e.g. a list holding numpy scalars) the hashlib path below computes the same keys.
``LMCACHE_NATIVE_HASH=0`` at import forces the hashlib path.

The spans it returns are :class:`~lmcache.v1.chunk_span.ChunkSpan` (defined there, below
the request types, and re-exported here).
"""

from __future__ import annotations

import hashlib
import threading
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Iterator, Mapping, Sequence

import numpy as np
import torch

from lmcache.v1.chunk_span import ChunkSpan
from lmcache.v1.keys import CacheEngineKey
from lmcache.v1.request import ChunkHashes, KeyExtras, mask_start, native_hash_enabled, tokens_to_array

try:  # optional native module (setup.py); identical keys without it
    from lmcache import _keyhash as _native_keyhash
except ImportError:  # pragma: no cover - depends on the build
    _native_keyhash = None

__all__ = [
    "KEY_FORMAT_VERSION",
    "ChunkSpan",
    "ChunkedTokenDatabase",
    "PrefixKeys",
    "TokenInput",
    "native_hashing",
    "tokens_to_array",
]

if TYPE_CHECKING:
    from lmcache.v1.config import LMCacheEngineConfig
    from lmcache.v1.metadata import LMCacheEngineMetadata

KEY_FORMAT_VERSION = "lmcache-key-v2"
"""v2: namespace fields and key extras are length-prefixed (injective); v1 joined them with '|'."""

TokenInput = Sequence[int] | np.ndarray | torch.Tensor


def native_hashing() -> bool:
    """True when keys are hashed by the native module (built, and not disabled by env)."""
    return _native_keyhash is not None and native_hash_enabled()


# Slot descriptors of CacheEngineKey: keys are built with object.__new__ and these
# setters (what the frozen dataclass __init__ stores, minus its per-key checks: every
# value below is normalised once per database).
_KEY_HASH_FIELD = CacheEngineKey.chunk_hash


@dataclass(frozen=True, slots=True)
class PrefixKeys:
    """Chunk keys of a whole token sequence: ``keys[i]`` names ``tokens[i*C:min((i+1)*C, n)]``."""

    num_tokens: int
    chunk_size: int
    keys: list[CacheEngineKey]
    tokens: TokenInput | None = field(default=None, repr=False, compare=False)
    """The tokens the keys were made from (block-granular reuse hashes a missing chunk's blocks)."""
    extras: KeyExtras | None = field(default=None, repr=False, compare=False)
    block_hashes: dict[int, list[int]] = field(default_factory=dict, repr=False, compare=False)
    """Chunk index -> its block-prefix hashes, kept for repeated lookups of the same request."""

    def end(self, count: int) -> int:
        """Number of tokens covered by the first ``count`` keys."""
        return min(count * self.chunk_size, self.num_tokens)


_new = object.__new__
_set_start, _set_end, _set_key = ChunkSpan.start.__set__, ChunkSpan.end.__set__, ChunkSpan.key.__set__  # type: ignore[attr-defined]


def _span(start: int, end: int, key: CacheEngineKey) -> ChunkSpan:
    """``ChunkSpan(start, end, key)`` for validated values, set through the slots: a request
    builds one per chunk, and the frozen dataclass ``__init__`` costs 1.7 x more."""
    span = _new(ChunkSpan)
    _set_start(span, start)
    _set_end(span, end)
    _set_key(span, key)
    return span


class _RecentDigests:
    """The chained digests of the last few token arrays :meth:`ChunkedTokenDatabase.spans_of`
    hashed, so that a later request sharing a chunk-aligned prefix (with the same seed)
    hashes only the rest: vLLM stores a request right after retrieving its prefix, and a
    chat turn extends the previous one. Exact, not probabilistic: the reused chunks' tokens
    are compared byte for byte (``lmcache._keyhash.common_prefix``). Holds a copy of each
    remembered array's bytes: at most ``MAX_ENTRIES`` arrays and ``MAX_BYTES`` of tokens
    (4 bytes each; a longer array is not remembered). Thread-safe (one lock)."""

    MAX_ENTRIES = 8
    MAX_BYTES = 16 << 20

    __slots__ = ("_chunk", "_entries", "_lock")

    def __init__(self, chunk_size: int) -> None:
        self._chunk = chunk_size
        self._entries: list[tuple[bytes, bytes, bytes]] = []  # (seed, token bytes, digests), newest first
        self._lock = threading.Lock()

    def reuse(self, seed: bytes, arr: np.ndarray) -> tuple[bytes, bool]:
        """Digests of the longest run of ``arr``'s leading full chunks some remembered array
        with the same ``seed`` shares (b"" when none), and whether one of them holds
        exactly ``arr`` (nothing new to remember)."""
        c, n = self._chunk, arr.shape[0]
        best = b""
        if not arr.flags.c_contiguous:  # compared as a buffer: a strided view is simply not reused
            return best, False
        with self._lock:
            entries = list(self._entries)
        for e_seed, e_tokens, e_digests in entries:
            if e_seed != seed:
                continue
            same = _native_keyhash.common_prefix(e_tokens, arr)
            if same == n == len(e_tokens) // 4:
                return e_digests[: 16 * (n // c)], True
            chunks = min(same // c, len(e_tokens) // (4 * c))
            if 16 * chunks > len(best):
                best = e_digests[: 16 * chunks]
        return best, False

    def remember(self, seed: bytes, arr: np.ndarray, digests: bytes) -> None:
        """Keep ``arr``'s bytes and chained digests (the oldest entry goes)."""
        if arr.shape[0] < self._chunk or 4 * arr.shape[0] > self.MAX_BYTES:
            return
        entry = (seed, arr.tobytes(), digests)
        with self._lock:
            entries = self._entries
            entries.insert(0, entry)
            del entries[self.MAX_ENTRIES :]
            total = 0
            for i, (_, tokens, _) in enumerate(entries):
                total += len(tokens)
                if total > self.MAX_BYTES:
                    del entries[i:]
                    break


class ChunkedTokenDatabase:
    """Splits token sequences into fixed-size chunks and names each with a chained key.

    Stateless apart from config and a cache of recent digests (:class:`_RecentDigests`,
    exact); safe to call from any thread.
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

        md = metadata
        template = CacheEngineKey(md.model_name, md.world_size, md.worker_id, 0, md.kv_dtype, ())
        self._key_fields = {
            "model_name": template.model_name,
            "world_size": template.world_size,
            "worker_id": template.worker_id,
            "dtype": template.dtype,
        }
        self._fixed_cache: dict[tuple[tuple[str, str], ...], tuple[tuple[Any, Any], ...]] = {}
        self._seed_cache: dict[bytes, bytes] = {}
        self._recent = _RecentDigests(self.chunk_size)

    def _seed(self, extras: KeyExtras) -> bytes:
        code = extras.encode()  # the cache key: exact (1, 1.0 and True are equal values but encode apart)
        seed = self._seed_cache.get(code)
        if seed is None:
            seed = hashlib.blake2b(self._namespace + code, digest_size=16).digest()
            if len(self._seed_cache) < 64:
                self._seed_cache[code] = seed
        return seed

    def chain_digest(self, arr: np.ndarray, chunk_index: int, extras: KeyExtras) -> bytes:
        """The digest chunk ``chunk_index`` of ``arr`` chains on: the seed for chunk 0,
        else the digest of chunk ``chunk_index - 1`` (validated int32 ``arr``)."""
        seed = self._seed(extras)
        if chunk_index == 0:
            return seed
        head = np.ascontiguousarray(arr[: chunk_index * self.chunk_size])
        got = self._digests(head, seed, False)
        digests = got[1] if got is not None else self._digests_py(head, seed, False)
        return digests[-16:]

    def block_prefix_hashes(
        self, arr: np.ndarray, start: int, stop: int, extras: KeyExtras, block: int, prev: CacheEngineKey | None
    ) -> list[int]:
        """Key hashes of the block-aligned prefixes of ``arr[start:stop]`` (validated int32
        ``arr``; ``start`` a chunk boundary, ``stop - start`` at most one chunk), as
        :meth:`block_digests` gives them. ``prev``: the key of the chunk ending at ``start``
        when the caller has it; otherwise what that chunk chains on is recomputed from
        ``arr[:start]`` (:meth:`chain_digest`)."""
        if prev is not None:
            digest = prev.chunk_hash.to_bytes(16, "little")
        else:
            digest = self.chain_digest(arr, start // self.chunk_size, extras)
        return self.block_digests(arr[start:stop], digest, block)

    @staticmethod
    def block_digests(arr: np.ndarray, prev: bytes, block: int) -> list[int]:
        """Key hashes of the block-aligned prefixes of one chunk's tokens ``arr``.

        Entry ``k`` is the ``chunk_hash`` a (partial) chunk holding ``arr[:(k + 1) * block]``
        gets when it chains on ``prev`` (see :meth:`chain_digest`): the same formula as
        every chunk key, so ``block_digests(arr, prev, len(arr))[0]`` is that chunk's own
        key hash. One incremental BLAKE2b pass (the state is copied at each block end)."""
        raw = memoryview(np.ascontiguousarray(arr, dtype="<i4").tobytes())
        h = hashlib.blake2b(prev, digest_size=16)
        step = 4 * block
        out = []
        for end in range(step, len(raw) + 1, step):
            h.update(raw[end - step : end])
            out.append(int.from_bytes(h.copy().digest(), "little"))
        return out

    def _fixed_fields(self, req: tuple[tuple[str, str], ...]) -> tuple[tuple[Any, Any], ...]:
        """((slot descriptor, value), ...) shared by every key with request configs ``req``."""
        fixed = self._fixed_cache.get(req)
        if fixed is None:
            values = dict(self._key_fields)
            values["request_configs"] = CacheEngineKey(
                values["model_name"], values["world_size"], values["worker_id"], 0, values["dtype"], req
            ).request_configs
            fixed = tuple((getattr(CacheEngineKey, name), value) for name, value in values.items())
            if len(self._fixed_cache) < 64:
                self._fixed_cache[req] = fixed
        return fixed

    def _digests(self, tokens: object, seed: bytes, partial: bool) -> tuple[int, bytes] | None:
        """(num_tokens, 16-byte chained digests) of tokens, or None when native hashing declines."""
        if not native_hashing():
            return None
        return _native_keyhash.hash_chunks(tokens, seed, self.chunk_size, partial)

    def _digests_py(self, arr: np.ndarray, seed: bytes, partial: bool) -> bytes:
        """The hashlib path of :meth:`_digests` over a validated int32 array."""
        n = arr.shape[0]
        stop = n if partial else n - n % self.chunk_size
        raw = arr.tobytes()
        prev = seed
        out = bytearray()
        blake2b = hashlib.blake2b
        for start in range(0, stop, self.chunk_size):
            end = min(start + self.chunk_size, n)
            prev = blake2b(prev + raw[start * 4 : end * 4], digest_size=16).digest()
            out += prev
        return bytes(out)

    def _keys(self, digests: bytes, extras: KeyExtras, first_chunk: int) -> list[CacheEngineKey]:
        fixed = self._fixed_fields(extras.config_strings)
        if native_hashing():
            return _native_keyhash.make_keys(CacheEngineKey, fixed, _KEY_HASH_FIELD, digests, first_chunk)
        new = object.__new__
        set_hash = _KEY_HASH_FIELD.__set__
        keys = []
        for i in range(first_chunk, len(digests) // 16):
            key = new(CacheEngineKey)
            for descr, value in fixed:
                descr.__set__(key, value)
            set_hash(key, int.from_bytes(digests[16 * i : 16 * i + 16], "little"))
            keys.append(key)
        return keys

    def prefix_keys(self, tokens: TokenInput, extras: KeyExtras, include_partial: bool | None = None) -> PrefixKeys:
        """Keys of every chunk of ``tokens`` (validated here; a Python list is hashed
        natively without building an array). Raises like :func:`tokens_to_array`."""
        partial = self.save_unfull_chunk if include_partial is None else include_partial
        seed = self._seed(extras)
        got = self._digests(tokens, seed, partial) if isinstance(tokens, (list, tuple)) else None
        if got is None:
            arr = tokens_to_array(tokens)
            got = self._digests(arr, seed, partial)
            if got is None:
                got = (arr.shape[0], self._digests_py(arr, seed, partial))
        n, digests = got
        return PrefixKeys(n, self.chunk_size, self._keys(digests, extras, 0), tokens, extras)

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
        seed = self._seed(extras)
        c = self.chunk_size
        native = native_hashing()
        head, known = self._recent.reuse(seed, arr) if native else (b"", False)  # digests of a shared prefix
        rest = arr[len(head) // 16 * c :]
        prev = head[-16:] if head else seed
        got = self._digests(rest, prev, partial)
        digests = head + (got[1] if got is not None else self._digests_py(rest, prev, partial))
        if native and not known:
            self._recent.remember(seed, arr, digests)
        first_chunk = -(-first // c)
        keys = self._keys(digests, extras, first_chunk)
        return [_span(i * c, min(i * c + c, n), key) for i, key in enumerate(keys, first_chunk)]

    def hashed_spans(self, chunks: ChunkHashes, first: int, extras: KeyExtras) -> list[ChunkSpan]:
        """Spans of chunks named by the caller (LMCache's ``hashes``/``offsets``), from the
        first one starting at or after token ``first`` (the mask's False prefix).

        Key ``i`` is BLAKE2b-128 of the request seed (namespace and extras, as for
        tokens) and ``chunks.encode(i)``, under its own personalisation, so no token
        chunk and no other hash or length gives the same key."""
        seed = self._seed(extras)
        blake2b = hashlib.blake2b
        digests = b"".join(
            blake2b(seed + chunks.encode(i), digest_size=16, person=_HASHED_PERSON).digest()
            for i in range(len(chunks.hashes))
        )
        spans = []
        start = 0
        for key, size in zip(self._keys(digests, extras, 0), chunks.offsets):
            if start >= first:
                spans.append(_span(start, start + size, key))
            start += size
        return spans


_HASHED_PERSON = b"lmcache-hashes"
"""BLAKE2b personalisation of caller-hashed chunk keys (token chunk keys use none)."""


def _lp(data: bytes) -> bytes:
    """Length-prefixed bytes (8-byte little-endian length)."""
    return len(data).to_bytes(8, "little") + data
