"""Typed requests: every public call's arguments, validated once.

The public entry points (``LMCacheEngine.store/retrieve/lookup/lookup_unpin/
store_layer/retrieve_layer/keys``, ``HiddenStateStore``, the GPU connectors) turn their
arguments into the objects below; nothing under them looks at raw keyword arguments
again, and nothing under them re-validates (the native kernels still bound-check their
run ends as defence in depth).

* :class:`KeyExtras` - what a request folds into its chunk keys besides the tokens:
  ``cache_salt`` (tenant isolation), ``request_configs`` (name -> scalar) and
  ``extra_keys`` (e.g. a LoRA name, multimodal hashes). :meth:`KeyExtras.encode` is
  injective: two different extras never give the same bytes.
* :class:`TransferRequest` - tokens (as int32), mask start, key extras and the call's
  :class:`~lmcache.v1.gpu_connector.paged_kv.PagedKV` (None for lookups). The paged KV
  is validated by the connector that copies it (:meth:`KVConnector.bind
  <lmcache.v1.gpu_connector.protocol.KVConnector.bind>`), which knows the layout, dtype
  and hidden size; its checks live in :mod:`lmcache.v1.gpu_connector.paged_kv`. The
  connectors import this module, so it names the paged KV only through
  :class:`BoundKV`, the part a request reads (``TransferRequest[PagedKV]`` for the
  precise type).
* LMCache 0.5.6's arguments: a mask of bools or of numbers that are each 0 or 1
  (:func:`mask_bools`), tier names for ``search_range``/``location`` (:func:`tier_names`,
  :data:`TIER_NAMES`), chunks named by caller hashes (:class:`ChunkHashes`) and the
  store/retrieve arguments LMCache passes on that are accepted and unused
  (:data:`LMCACHE_COPY_ARG_NAMES`).

Bad input raises ``TypeError`` (wrong type) or ``ValueError`` (wrong value), naming the
argument, the value and what was expected. Unknown keyword arguments raise TypeError.

Two switches of the optional native module ``lmcache._keyhash`` live here, both read
once at import: ``LMCACHE_NATIVE_SCANS=0`` keeps token conversion and slot-mapping scans
(:func:`tokens_to_array`, :func:`native_int_stats`) on numpy/torch, and
``LMCACHE_NATIVE_HASH=0`` keeps chunk hashing (:mod:`lmcache.v1.token_database`) on
hashlib (the key classes read the same variable, :mod:`lmcache.v1.keys`).

Thread-safety: the objects are immutable; building one has no side effects.
"""

from __future__ import annotations

import math
import os
import struct
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Generic, Protocol, TypeVar

import numpy as np
import torch

if TYPE_CHECKING:
    from lmcache.v1.chunk_span import ChunkSpan

TokenInput = Sequence[int] | np.ndarray | torch.Tensor
MaskInput = torch.Tensor | np.ndarray | Sequence[bool | int | float] | None

KEY_EXTRA_NAMES = ("cache_salt", "request_configs", "extra_keys")
COPY_ARG_NAMES = ("kvcaches", "slot_mapping")
_INT32_MIN, _INT32_MAX = -(2**31), 2**31 - 1
_INT64_MIN, _INT64_MAX = -(2**63), 2**63 - 1
_SLOT_DTYPES = (torch.int32, torch.int64)
_I4 = np.dtype("<i4")  # a dtype object, not a string: numpy parses no format per call (~10 us with cold caches)


def _short(value: object, limit: int = 80) -> str:
    text = repr(value)
    return text if len(text) <= limit else text[: limit - 3] + "..."


def reject_unknown(kwargs: Mapping[str, Any], allowed: Sequence[str], where: str) -> None:
    """TypeError naming the first keyword argument of ``kwargs`` not in ``allowed``."""
    for name in kwargs:
        if name not in allowed:
            raise TypeError(f"{where}() got an unexpected keyword argument {name!r} (expected one of {', '.join(allowed)})")


# ---------------------------------------------------------------------- key extras
def _lp(data: bytes) -> bytes:
    """Length-prefixed bytes (8-byte little-endian length)."""
    return struct.pack("<Q", len(data)) + data


def _encode_scalar(value: object) -> bytes:
    """Type-tagged, injective encoding of a request-config value."""
    if value is None:
        return b"n"
    if isinstance(value, bool):
        return b"b1" if value else b"b0"
    if isinstance(value, int):
        return b"i" + _lp(str(value).encode())
    if isinstance(value, float):
        return b"f" + struct.pack("<d", value)
    assert isinstance(value, str), "validated by KeyExtras.build"
    return b"s" + _lp(value.encode("utf-8", "surrogatepass"))


@dataclass(frozen=True, slots=True)
class KeyExtras:
    """What a request folds into its chunk keys besides the tokens (immutable, validated).

    ``request_configs`` is kept sorted by name; ``config_strings`` is the
    ``(name, str(value))`` form carried by :class:`~lmcache.v1.keys.CacheEngineKey`.
    An empty ``cache_salt`` means no salt.
    """

    cache_salt: str | None = None
    request_configs: tuple[tuple[str, str | int | float | bool | None], ...] = ()
    extra_keys: tuple[str | int, ...] = ()

    @classmethod
    def build(
        cls,
        cache_salt: object = None,
        request_configs: object = None,
        extra_keys: object = None,
    ) -> KeyExtras:
        """Validate raw values (``None`` = absent). Raises TypeError/ValueError."""
        if cache_salt is None and request_configs is None and extra_keys is None:
            return NO_EXTRAS
        if cache_salt is not None and not isinstance(cache_salt, str):
            raise TypeError(f"cache_salt={_short(cache_salt)}: expected a str or None")
        configs: tuple[tuple[str, Any], ...] = ()
        if request_configs is not None:
            if not isinstance(request_configs, Mapping):
                raise TypeError(
                    f"request_configs={_short(request_configs)}: expected a mapping of str to str/int/float/bool/None"
                )
            for name, value in request_configs.items():
                if not isinstance(name, str):
                    raise TypeError(f"request_configs: key {_short(name)} is not a str")
                if value is not None and not isinstance(value, (str, int, float, bool)):
                    raise TypeError(
                        f"request_configs[{name!r}]={_short(value)}: expected a str, int, float, bool or None"
                    )
                if isinstance(value, float) and not math.isfinite(value):
                    raise ValueError(f"request_configs[{name!r}]={value!r}: expected a finite number")
            configs = tuple(sorted(request_configs.items(), key=lambda kv: kv[0]))
        keys: tuple[str | int, ...] = ()
        if extra_keys is not None:
            if isinstance(extra_keys, (str, bytes, bytearray)) or not isinstance(extra_keys, Sequence):
                raise TypeError(
                    f"extra_keys={_short(extra_keys)}: expected a list or tuple of str/int (a bare string would be "
                    "split into characters)"
                )
            for i, item in enumerate(extra_keys):
                if isinstance(item, bool) or not isinstance(item, (str, int)):
                    raise TypeError(f"extra_keys[{i}]={_short(item)}: expected a str or int")
            keys = tuple(extra_keys)
        salt = cache_salt or None
        if salt is None and not configs and not keys:
            return NO_EXTRAS
        return cls(salt, configs, keys)

    @classmethod
    def from_kwargs(cls, kwargs: Mapping[str, Any]) -> KeyExtras:
        """The extras among ``kwargs`` (other names are ignored here)."""
        if not kwargs:
            return NO_EXTRAS
        return cls.build(kwargs.get("cache_salt"), kwargs.get("request_configs"), kwargs.get("extra_keys"))

    @property
    def config_strings(self) -> tuple[tuple[str, str], ...]:
        return tuple((name, str(value)) for name, value in self.request_configs)

    def encode(self) -> bytes:
        """Injective byte encoding: each field tagged and length-prefixed, in a fixed order."""
        if self is NO_EXTRAS or (self.cache_salt is None and not self.request_configs and not self.extra_keys):
            return b""
        out = [b"salt", _lp((self.cache_salt or "").encode("utf-8", "surrogatepass")) if self.cache_salt else b"-"]
        out.append(b"cfg" + struct.pack("<Q", len(self.request_configs)))
        for name, value in self.request_configs:
            out.append(_lp(name.encode("utf-8", "surrogatepass")) + _encode_scalar(value))
        out.append(b"xk" + struct.pack("<Q", len(self.extra_keys)))
        for item in self.extra_keys:
            out.append(_encode_scalar(item))
        return b"".join(out)

    def as_kwargs(self) -> dict[str, Any]:
        """Keyword-argument form (for calls that take ``cache_salt=...`` etc.)."""
        out: dict[str, Any] = {}
        if self.cache_salt is not None:
            out["cache_salt"] = self.cache_salt
        if self.request_configs:
            out["request_configs"] = dict(self.request_configs)
        if self.extra_keys:
            out["extra_keys"] = list(self.extra_keys)
        return out


NO_EXTRAS = KeyExtras()
"""The extras of a request that has none (shared instance)."""


# ---------------------------------------------------------------------- tokens and masks
try:  # optional native module (setup.py); the numpy path gives the same arrays without it
    from lmcache._keyhash import int_stats as _int_stats
    from lmcache._keyhash import tokens_int32 as _tokens_int32
    from lmcache._keyhash import tokens_int32_at as _tokens_int32_at
except ImportError:  # pragma: no cover - depends on the build
    _tokens_int32 = _tokens_int32_at = _int_stats = None


_NATIVE_HASH = os.environ.get("LMCACHE_NATIVE_HASH", "1") != "0"
"""False when ``LMCACHE_NATIVE_HASH=0`` was set at import (tests switch this attribute)."""
_NATIVE_SCANS = os.environ.get("LMCACHE_NATIVE_SCANS", "1") != "0"
"""False when ``LMCACHE_NATIVE_SCANS=0`` was set at import (tests switch this attribute)."""


def native_hash_enabled() -> bool:
    """False when ``LMCACHE_NATIVE_HASH=0`` asks for the hashlib chunk-hashing path.
    Read once at import, like the key classes' switch in :mod:`lmcache.v1.keys` (reading
    ``os.environ`` on every request cost ~40 us with cold caches)."""
    return _NATIVE_HASH


def _native_int32(tokens: object) -> np.ndarray | None:
    """``tokens`` (an exact list / tuple of ints, or an int64 array) as int32 in one C pass
    that also checks the range; None when the native module is missing, disabled
    (``LMCACHE_NATIVE_SCANS=0``) or declines the input."""
    if _tokens_int32 is None or not _NATIVE_SCANS:
        return None
    raw = _tokens_int32(tokens)
    return None if raw is None else np.frombuffer(raw, _I4)


def _native_address(t: torch.Tensor, dtype: torch.dtype | None = None) -> int | None:
    """The data address of a contiguous 1-D int32/int64 CPU tensor with at least one element,
    when the native scans are built and enabled (they read it directly, no numpy view).
    ``dtype``: ``t.dtype`` when the caller has read it already. Each tensor attribute is
    read once, and only as far as needed: with cold caches (right after a large copy) the
    first call into torch costs 10-15 us and each further distinct one a few."""
    if _int_stats is None or not _NATIVE_SCANS:
        return None
    if (dtype or t.dtype) not in _SLOT_DTYPES or not t.is_cpu or t.layout != torch.strided:
        return None
    shape = t.shape
    if len(shape) != 1 or not shape[0] or t.stride(0) != 1:
        return None
    return t.data_ptr()


def native_int_stats(t: torch.Tensor, n: int, dtype: torch.dtype | None = None) -> tuple[int, int] | None:
    """``(largest, index of the first negative or n)`` of the first ``n`` (>= 1) entries of
    ``t`` in one C pass; None when the native module is missing or disabled
    (``LMCACHE_NATIVE_SCANS=0``) or ``t`` is not a contiguous 1-D int32/int64 CPU tensor
    (the caller then scans with numpy or torch). ``dtype``: ``t.dtype`` when already read."""
    addr = _native_address(t, dtype)
    if addr is None:
        return None
    return _int_stats(addr, n, (dtype or t.dtype).itemsize)


def tokens_to_array(tokens: object) -> np.ndarray:
    """Token ids as a contiguous little-endian int32 array (no per-token Python loop).

    Raises TypeError for something that is not a sequence/array/tensor of integers and
    ValueError for integers outside int32 or a wrong rank.
    """
    if isinstance(tokens, torch.Tensor):
        dtype = tokens.dtype
        if tokens.dim() != 1 or dtype.is_floating_point or dtype.is_complex or dtype == torch.bool:
            raise ValueError(f"tokens: expected a 1-D integer tensor, got shape {tuple(tokens.shape)} {dtype}")
        addr = _native_address(tokens, dtype)
        if addr is not None:
            raw = _tokens_int32_at(addr, tokens.shape[0], dtype.itemsize)
            if raw is not None:
                return np.frombuffer(raw, _I4)
        try:
            arr = tokens.numpy()  # a CPU tensor without grad: a view, one call
        except (RuntimeError, TypeError):
            arr = tokens.detach().to("cpu").numpy()
    elif isinstance(tokens, np.ndarray):
        arr = tokens
    elif isinstance(tokens, (str, bytes, bytearray)) or not isinstance(tokens, Sequence):
        raise TypeError(f"tokens: expected a sequence, array or tensor of ints, got {type(tokens).__name__}")
    elif not len(tokens):
        arr = np.zeros(0, dtype=np.int32)
    else:
        got = _native_int32(tokens)  # one C pass; None when it declines (then the checks below)
        if got is not None:
            return got
        if any(isinstance(t, bool) for t in tokens[:1]):
            raise ValueError("tokens: expected integers, got bools")
        try:
            arr = np.asarray(tokens)
        except (OverflowError, ValueError, TypeError) as exc:
            raise ValueError(f"tokens: expected a 1-D sequence of int32 integers ({exc})") from None
    if arr.ndim != 1 or (arr.size and arr.dtype.kind not in "iu"):
        raise ValueError(f"tokens: expected a 1-D sequence of integers, got dtype {arr.dtype} ndim {arr.ndim}")
    if arr.dtype == np.int64 and (got := _native_int32(arr)) is not None:
        return got
    if arr.dtype != np.dtype("<i4"):
        if arr.size and (int(arr.min()) < _INT32_MIN or int(arr.max()) > _INT32_MAX):
            raise ValueError("tokens: token ids must fit in int32")
        arr = arr.astype("<i4")
    return np.ascontiguousarray(arr)


def _number(value: object) -> str:
    """A mask value for an error message (floats without float32 noise: 0.1, nan, 2)."""
    return f"{value:g}" if isinstance(value, (float, np.floating)) else repr(value)


def _mask_array(mask: object) -> np.ndarray:
    """``mask`` as a numpy array of bools, numbers or nothing else (TypeError otherwise)."""
    if isinstance(mask, torch.Tensor):
        dtype = mask.dtype
        if dtype.is_complex:
            raise TypeError(f"mask: expected a bool, integer or float tensor, got dtype {dtype}")
        m = mask.detach().to("cpu")
        if dtype.is_floating_point and dtype not in (torch.float32, torch.float64):
            m = m.to(torch.float32)  # bfloat16/float8 have no numpy form; 0, 1 and NaN stay exact
        return m.numpy()
    if isinstance(mask, np.ndarray):
        if mask.dtype != np.bool_ and mask.dtype.kind not in "iuf":
            raise TypeError(f"mask: expected a bool, integer or float array, got dtype {mask.dtype}")
        return mask
    if isinstance(mask, Sequence) and not isinstance(mask, (str, bytes, bytearray)):
        for i, v in enumerate(mask):
            if not isinstance(v, (bool, int, float, np.bool_, np.integer, np.floating)):
                raise TypeError(f"mask[{i}]={_short(v)}: expected a bool or the number 0 or 1")
            if v != 0 and v != 1:  # NaN compares unequal to both
                raise ValueError(f"mask: value {_number(v)} at index {i}; expected only 0 or 1 (or bools)")
        return np.fromiter((bool(v) for v in mask), dtype=np.bool_, count=len(mask))
    raise TypeError(f"mask: expected a bool (or 0/1) tensor, array or sequence, got {type(mask).__name__}")


def mask_bools(mask: object) -> np.ndarray:
    """``mask`` as a numpy bool array (its shape is the caller's to check): bools as given,
    numbers only when each is exactly 0 or 1 (LMCache users build masks with
    ``torch.ones(n)`` and zero a prefix). Any other value, NaN included, is a ValueError
    naming the first bad value and its index; a non-numeric type is a TypeError."""
    m = _mask_array(mask)
    if m.dtype == np.bool_:
        return m
    bad = (m != 0) & (m != 1)  # NaN compares unequal to both
    if bad.any():
        where = np.unravel_index(int(np.argmax(bad)), m.shape)
        index = where[0] if len(where) == 1 else tuple(int(i) for i in where)
        raise ValueError(f"mask: value {_number(m[where].item())} at index {index}; expected only 0 or 1 (or bools)")
    return m != 0


def mask_start(mask: MaskInput, n: int, chunk_size: int) -> int:
    """Number of leading False entries of a False-prefix/True-suffix mask (validated).

    ``None`` means all True. The mask is a tensor, array or sequence of shape ``(n,)``
    holding bools, or numbers that are each exactly 0 or 1 (:func:`mask_bools`); its
    False (0) prefix must be a multiple of ``chunk_size``.
    """
    if mask is None:
        return 0
    m = mask_bools(mask)
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


# ---------------------------------------------------------------------- LMCache 0.5.6 arguments
TIER_NAMES = ("LocalCPUBackend", "LocalDiskBackend", "RemoteBackend")
"""The tiers by the names LMCache 0.5.6 gives its backends, as ``search_range``,
``location`` and ``locations`` take them (L1 CPU pool, L2 disk, L3 remote)."""

LMCACHE_COPY_ARG_NAMES = ("req_id", "offset", "vllm_cached_tokens", "transfer_spec")
"""Keyword arguments LMCache 0.5.6's vLLM adapter passes to ``store``/``retrieve``/
``store_layer``/``retrieve_layer``, which LMCache hands to its connector or its logs.
Accepted and type-checked here, not used (docs/migrating_from_lmcache.md says why)."""


def tier_names(value: object, field: str = "search_range", valid: Sequence[str] = TIER_NAMES) -> frozenset[str] | None:
    """The tier names ``value`` selects, validated; None selects every tier.

    ``value`` is None, one name, or a list/tuple/set of names (LMCache's meaning: an
    empty one selects every tier, like None). A name outside ``valid`` is a ValueError
    listing the valid ones; a known tier that is not configured simply holds nothing.
    """
    if value is None:
        return None
    names: tuple[object, ...]
    if isinstance(value, str):
        names = (value,)
    elif isinstance(value, (Sequence, set, frozenset)) and not isinstance(value, (bytes, bytearray)):
        names = tuple(value)
    else:
        raise TypeError(f"{field}={_short(value)}: expected a backend name or a list of them ({', '.join(valid)})")
    for name in names:
        if not isinstance(name, str):
            raise TypeError(f"{field}: {_short(name)} is not a backend name (a str); valid: {', '.join(valid)}")
        if name not in valid:
            raise ValueError(f"{field}: unknown backend {name!r}; expected one of {', '.join(valid)}")
    return frozenset(names) if names else None


def _count(value: object, field: str) -> int:
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)):
        raise TypeError(f"{field}={_short(value)}: expected a non-negative int")
    if value < 0:
        raise ValueError(f"{field}={value}: expected a non-negative int")
    return int(value)


def check_lmcache_copy_args(kwargs: Mapping[str, Any]) -> None:
    """Type-check the :data:`LMCACHE_COPY_ARG_NAMES` present in ``kwargs`` (then unused):
    ``offset``/``vllm_cached_tokens`` non-negative ints, ``req_id`` a str or int;
    ``transfer_spec`` (LMCache's disaggregated-prefill spec) may be anything."""
    for field in ("offset", "vllm_cached_tokens"):
        if kwargs.get(field) is not None:
            _count(kwargs[field], field)
    req_id = kwargs.get("req_id")
    if req_id is not None and (isinstance(req_id, bool) or not isinstance(req_id, (str, int))):
        raise TypeError(f"req_id={_short(req_id)}: expected a str or int")


def check_lookup_id(lookup_id: object) -> str | None:
    """``lookup_id`` (LMCache: the request id a pinned lookup is released by) validated."""
    if lookup_id is not None and (isinstance(lookup_id, bool) or not isinstance(lookup_id, (str, int))):
        raise TypeError(f"lookup_id={_short(lookup_id)}: expected a str (a request id) or None")
    return None if lookup_id is None else str(lookup_id)


def slots_from_list(slots: list[object]) -> torch.Tensor:
    """A list of slot numbers (LMCache's form with ``hashes``) as an int64 tensor; every
    entry must be an int (bools and floats raise TypeError, values beyond int64 ValueError).
    The tensor is then checked like any slot mapping
    (:func:`~lmcache.v1.gpu_connector.paged_kv.check_slot_mapping`)."""
    for i, slot in enumerate(slots):
        if isinstance(slot, bool) or not isinstance(slot, (int, np.integer)):
            raise TypeError(f"slot_mapping[{i}]={_short(slot)}: expected an int")
        if not _INT64_MIN <= slot <= _INT64_MAX:
            raise ValueError(f"slot_mapping[{i}]={slot}: outside int64")
    return torch.tensor(slots, dtype=torch.int64)


@dataclass(frozen=True, slots=True)
class ChunkHashes:
    """Chunks named by the caller (LMCache's ``hashes`` with ``offsets``): chunk ``i``
    covers the ``offsets[i]`` tokens after chunk ``i - 1`` and is identified by
    ``hashes[i]`` (an int or bytes, e.g. a vLLM block hash: already chained by the
    caller). :meth:`encode` is injective per chunk and folds in its length."""

    hashes: tuple[int | bytes, ...]
    offsets: tuple[int, ...]

    @classmethod
    def build(cls, hashes: object, offsets: object) -> ChunkHashes:
        """Validate raw ``hashes``/``offsets``. Raises TypeError/ValueError."""
        if offsets is None:
            raise ValueError("offsets: missing; hashes= needs offsets= (the number of tokens of each chunk)")
        items = []
        for field, value in (("hashes", hashes), ("offsets", offsets)):
            if isinstance(value, (str, bytes, bytearray, torch.Tensor)) or not isinstance(value, Sequence):
                raise TypeError(f"{field}={_short(value)}: expected a list with one entry per chunk")
            items.append(tuple(value))
        hs, offs = items
        if len(hs) != len(offs):
            raise ValueError(f"hashes/offsets: {len(hs)} hashes and {len(offs)} offsets; expected one offset per hash")
        for i, h in enumerate(hs):
            if isinstance(h, bool) or not isinstance(h, (int, bytes)):
                raise TypeError(f"hashes[{i}]={_short(h)}: expected an int or bytes")
        for i, off in enumerate(offs):
            if _count(off, f"offsets[{i}]") == 0:
                raise ValueError(f"offsets[{i}]=0: expected a positive number of tokens")
        return cls(hs, tuple(int(o) for o in offs))

    @property
    def num_tokens(self) -> int:
        return sum(self.offsets)

    def encode(self, i: int) -> bytes:
        """Tagged, length-prefixed bytes of chunk ``i``: its hash and its length."""
        h = self.hashes[i]
        body = b"b" + _lp(h) if isinstance(h, bytes) else b"i" + _lp(str(h).encode())
        return body + struct.pack("<Q", self.offsets[i])


# ---------------------------------------------------------------------- requests
class BoundKV(Protocol):
    """What a request reads of its validated paged KV: the slot of each token (1-D; with
    per-group slot rows, the primary group's row) and the index of the first unmapped
    (negative) one. The connectors' :class:`~lmcache.v1.gpu_connector.paged_kv.PagedKV`
    has both."""

    @property
    def token_slots(self) -> torch.Tensor: ...

    @property
    def first_unmapped(self) -> int: ...


KV = TypeVar("KV", bound=BoundKV)


@dataclass(frozen=True, slots=True)
class TransferRequest(Generic[KV]):
    """One validated engine call: tokens, mask start, key extras and (for copies) the paged KV.

    Generic in the paged KV's type: a bare ``TransferRequest`` takes any, a connector's
    code may write ``TransferRequest[PagedKV]``."""

    tokens: np.ndarray
    mask_start: int
    extras: KeyExtras
    kv: KV | None = None
    spans: tuple[ChunkSpan, ...] | None = None
    """The chunks of a request keyed by caller-supplied hashes (:class:`ChunkHashes`);
    ``tokens`` is then a placeholder of the right length (zeros) and must not be hashed."""

    @property
    def num_tokens(self) -> int:
        return int(self.tokens.shape[0])

    @property
    def requested_tokens(self) -> int:
        return self.num_tokens - self.mask_start

    def mark_written(self, ret: torch.Tensor, lo: int, hi: int) -> None:
        """Set ``ret[lo:hi]`` True where KV was written: tokens that have a slot (>= 0) in
        ``kv.token_slots`` (the primary group's row when the KV has per-group slot rows)."""
        kv = self.kv
        assert kv is not None, "only copy requests write KV"
        if kv.first_unmapped >= self.num_tokens:  # no negative slot at all
            ret[lo:hi] = True
        else:
            ret[lo:hi] = (kv.token_slots[lo:hi] >= 0).to("cpu")
