"""ECCacheEngine: the encoder cache, one tensor per multimodal item.

A multimodal encoder (e.g. a vision tower) turns one item (an image, an audio clip)
into one ``[num_tokens, dim]`` tensor. vLLM names each item by an ``mm_hash`` string
that depends only on the item's content, so the same image in two requests -- or in
two processes -- has the same ``mm_hash``. This engine stores those tensors in its
own :class:`StorageManager` (namespace ``"ec"``: CPU, then disk and remote as the
config names them) so the encoder can be skipped the next time.

There is no chunking and no paged copy: an entry is exactly one tensor, keyed by
:func:`ec_cache_key`. The engine speaks tensors and ``mm_hash`` strings only;
everything about vLLM lives in ``lmcache.integration.vllm.vllm_ec_adapter``.
"""

from __future__ import annotations

import logging
import threading
from dataclasses import dataclass

import torch
import xxhash

from lmcache.log_once import LogOnce
from lmcache.v1.keys import CacheEngineKey
from lmcache.v1.config import LMCacheEngineConfig
from lmcache.v1.memory_management import MemoryFormat
from lmcache.v1.metadata import dtype_name
from lmcache.v1.stats import CacheStats
from lmcache.v1.storage_backend.storage_manager import StorageManager

logger = logging.getLogger(__name__)

EC_NAMESPACE = "ec"
EC_WORLD_SIZE = 1
"""Sentinel: every tensor-parallel rank computes the same encoder output, so all ranks share one entry."""
EC_WORKER_ID = 0
"""Sentinel, see :data:`EC_WORLD_SIZE`."""

_ERRORS = (OSError, RuntimeError, ValueError)


def stable_u64_from_str(text: str) -> int:
    """64-bit xxh3 of the UTF-8 bytes of ``text``.

    Identical across processes, restarts and machines (unlike Python's ``hash``,
    which changes with ``PYTHONHASHSEED``).
    """
    return xxhash.xxh3_64_intdigest(text.encode("utf-8"))


def ec_cache_key(model_name: str, mm_hash: str, encoder_dtype: torch.dtype) -> CacheEngineKey:
    """The storage key of one encoder output.

    Fields: ``model_name``; sentinel ``world_size`` 1 and ``worker_id`` 0 (TP ranks
    share entries); ``chunk_hash`` = :func:`stable_u64_from_str` of ``mm_hash``;
    ``dtype`` = the encoder's output dtype (not the KV cache dtype, so changing KV
    quantization keeps EC entries valid); no request configs.
    """
    return CacheEngineKey(
        model_name, EC_WORLD_SIZE, EC_WORKER_ID, stable_u64_from_str(mm_hash), dtype_name(encoder_dtype), ()
    )


@dataclass(slots=True)
class ECStats(CacheStats):
    """Counters of one encoder cache (or of several sharing this object).

    A :class:`CacheStats` so that the storage manager counts its evictions here;
    ``load_errors`` counts tier failures that were turned into misses.
    """

    lookups: int = 0
    """``contains`` calls."""
    lookup_hits: int = 0
    """``contains`` calls that answered True."""
    hits: int = 0
    """``get`` calls that returned a tensor."""
    misses: int = 0
    """``get`` calls that returned None (including failures)."""
    puts: int = 0
    """``put`` calls that stored a new entry."""
    put_existing: int = 0
    """``put`` calls for an entry already resident in the CPU tier (nothing copied)."""
    put_failures: int = 0
    """``put`` calls that returned False: no pool memory even after eviction."""

    def snapshot(self) -> dict[str, int]:
        """The EC counters plus ``evictions`` and ``load_errors`` (the unused KV counters are left out)."""
        with self._lock:
            return {name: getattr(self, name) for name in _EC_COUNTERS}


_EC_COUNTERS = (
    "lookups",
    "lookup_hits",
    "hits",
    "misses",
    "puts",
    "put_existing",
    "put_failures",
    "evictions",
    "load_errors",
)


def _as_dtype(encoder_dtype: torch.dtype | str) -> torch.dtype:
    if isinstance(encoder_dtype, torch.dtype):
        return encoder_dtype
    if isinstance(encoder_dtype, str):
        dtype = getattr(torch, encoder_dtype.removeprefix("torch."), None)
        if isinstance(dtype, torch.dtype):
            return dtype
    raise TypeError(f"encoder_dtype={encoder_dtype!r}: expected a torch.dtype or its name (e.g. 'bfloat16')")


class ECCacheEngine:
    """Stores and returns multimodal encoder outputs by ``mm_hash``.

    Calling thread: any; all methods are thread-safe (the storage manager and its
    tiers are). ``put`` and ``get`` block for the one copy they make (and ``get``
    for a disk/remote read on an L1 miss); ``contains`` may ask the lower tiers
    (a bounded stat/exists call, no payload read).

    Memory ownership: ``put`` copies the caller's tensor into pool memory and keeps
    no reference to the tensor. ``get`` returns a fresh tensor that the caller owns
    outright -- it never aliases pool memory, so it stays valid after eviction or
    :meth:`close`. Pool references taken internally are released on every path.

    Return meanings (one each): ``contains`` False = not stored in any tier;
    ``put`` False = no pool memory even after eviction (transient, the entry is
    simply not cached); ``get`` None = miss (a failing tier also reads as a miss).
    """

    def __init__(
        self,
        config: LMCacheEngineConfig,
        model_name: str,
        encoder_dtype: torch.dtype | str,
        *,
        stats: ECStats | None = None,
    ) -> None:
        if not isinstance(model_name, str) or not model_name:
            raise ValueError(f"model_name={model_name!r}: expected a non-empty string")
        config.validate()
        self.config = config
        self.model_name = model_name
        self.encoder_dtype = _as_dtype(encoder_dtype)
        self.stats = stats if stats is not None else ECStats()
        self.storage_manager = StorageManager(config, namespace=EC_NAMESPACE, stats=self.stats)
        self._log_once = LogOnce(logger)
        self._close_lock = threading.Lock()
        self._closed = False

    def key(self, mm_hash: str) -> CacheEngineKey:
        """The storage key of ``mm_hash`` for this engine (see :func:`ec_cache_key`)."""
        if not isinstance(mm_hash, str):
            raise TypeError(f"mm_hash={mm_hash!r}: expected a str")
        return ec_cache_key(self.model_name, mm_hash, self.encoder_dtype)

    # ------------------------------------------------------------------ API
    def contains(self, mm_hash: str) -> bool:
        """Whether some tier holds ``mm_hash``. Reads no payload, takes no reference."""
        key = self.key(mm_hash)
        try:
            found = self.storage_manager.contains(key) is not None
        except _ERRORS as exc:
            self._warn_error("contains", exc)
            found = False
        self.stats.add(lookups=1, lookup_hits=int(found))
        return found

    def put(self, mm_hash: str, tensor: torch.Tensor) -> bool:
        """Store a copy of ``tensor`` (any device, any dtype) under ``mm_hash``.

        One ``copy_`` moves the data into pool memory and casts it to the engine's
        encoder dtype. The caller keeps ownership of ``tensor``. Lower tiers are
        written asynchronously (see :meth:`flush`). Storing an ``mm_hash`` that is
        already resident in the CPU tier copies nothing and returns True, so
        concurrent puts of the same item are idempotent.

        Returns True when the entry is stored (or already was), False only when the
        pool has no room even after eviction.
        """
        if not isinstance(tensor, torch.Tensor):
            raise TypeError(f"tensor={type(tensor).__name__}: expected a torch.Tensor for mm_hash={mm_hash!r}")
        if tensor.dim() == 0 or tensor.is_complex() or tensor.dtype == torch.bool:
            raise ValueError(
                f"tensor: shape {tuple(tensor.shape)} dtype {tensor.dtype} for mm_hash={mm_hash!r}; "
                "expected a real-valued tensor with at least one dimension ([num_tokens, dim])"
            )
        key = self.key(mm_hash)
        if self.storage_manager.is_resident(key):
            self.stats.add(put_existing=1)
            return True
        obj = self.storage_manager.allocate(tuple(tensor.shape), self.encoder_dtype, MemoryFormat.EC_TD)
        if obj is None:
            self.stats.add(put_failures=1)
            self._log_once(
                logging.WARNING,
                "full",
                "encoder cache: no pool memory for a %s tensor of shape %s (max_local_cpu_size=%s GiB); "
                "entries that do not fit are not cached (logged once)",
                dtype_name(self.encoder_dtype),
                tuple(tensor.shape),
                self.config.max_local_cpu_size,
            )
            return False
        try:
            dst = obj.tensor
            assert dst is not None, "a freshly allocated MemoryObj has a tensor"
            dst.copy_(tensor.detach())
            self.storage_manager.put(key, obj)
        finally:
            obj.ref_count_down()
        self.stats.add(puts=1)
        return True

    def get(self, mm_hash: str, device: str | torch.device = "cpu") -> torch.Tensor | None:
        """A new tensor on ``device`` holding the entry, or None on a miss.

        A hit in a lower tier is promoted to the CPU tier. The returned tensor is
        owned by the caller and never shares memory with the cache. ``device`` must name
        a torch device (ValueError otherwise).
        """
        key = self.key(mm_hash)
        try:
            device = torch.device(device)
        except (RuntimeError, TypeError):
            raise ValueError(f"device={device!r}: expected a torch device such as 'cpu' or 'cuda:0'") from None
        try:
            obj = self.storage_manager.get(key)
        except _ERRORS as exc:
            self._warn_error("get", exc)
            obj = None
        if obj is None:
            self.stats.add(misses=1)
            return None
        try:
            src = obj.tensor
            if src is None:
                self.stats.add(misses=1)
                return None
            out = torch.empty(src.shape, dtype=self.encoder_dtype, device=device)
            out.copy_(src)
        finally:
            obj.ref_count_down()
        self.stats.add(hits=1)
        return out

    # ------------------------------------------------------------------ lifecycle
    def flush(self, timeout: float | None = None) -> bool:
        """Wait until puts reached the lower tiers; True if all finished in time."""
        return self.storage_manager.flush(timeout)

    @property
    def closed(self) -> bool:
        """Whether :meth:`close` has been called (its tiers are released once it returns)."""
        return self._closed

    def close(self, flush_timeout: float | None = 30.0) -> None:
        """Finish pending lower-tier writes (up to ``flush_timeout`` s), then release all tiers. Idempotent."""
        with self._close_lock:
            if self._closed:
                return
            self._closed = True
        if not self.storage_manager.flush(flush_timeout):
            logger.warning("encoder cache: pending writes did not finish within %s s at close", flush_timeout)
        self.storage_manager.close()

    def _warn_error(self, op: str, exc: BaseException) -> None:
        self.stats.add(load_errors=1)
        self._log_once(logging.WARNING, "error", "encoder cache: %s failed (%s); treated as a miss (logged once)", op, exc)
