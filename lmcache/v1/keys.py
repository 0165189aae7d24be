"""Cache keys shared by every tier.

A :class:`CacheEngineKey` names one chunk of KV for one model shard. Its string form is
stable across processes and machines, because the disk and remote tiers use it as a
file name / remote key. :class:`LayerCacheEngineKey` adds the layer index used by the
layerwise pipeline.

Also importable from :mod:`lmcache.utils` (LMCache 0.5.6's module path).

Hashing and equality: every dict and set of the cache (the tiers' indexes, the eviction
policies) probes with keys, a 32k-token lookup 128 times. When the optional native module
``lmcache._keyhash`` is built, the key classes derive from its ``KeyBase``, whose
``__hash__``/``__eq__`` run in C on the same fields as the pure-Python methods below (and
give the same hash values), so a probe runs no Python code. ``LMCACHE_NATIVE_HASH=0`` at
import time keeps the Python methods.
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any
from urllib.parse import quote, unquote

import torch

_SEP = "@"

try:  # optional native module (setup.py): C-level __hash__/__eq__ for the key classes
    from lmcache import _keyhash as _native
except ImportError:  # pragma: no cover - depends on the build
    _native = None
NATIVE_KEY_OPS = _native is not None and os.environ.get("LMCACHE_NATIVE_HASH", "1") != "0"
"""True when the key classes hash and compare in C (``lmcache._keyhash.KeyBase``)."""
_KeyBase: type = _native.KeyBase if NATIVE_KEY_OPS else object


def _key_dtypes() -> dict[torch.dtype, str]:
    dtypes = [
        torch.float64, torch.float32, torch.float16, torch.bfloat16,
        torch.int64, torch.int32, torch.int16, torch.int8, torch.uint8, torch.bool,
    ]
    for name in ("float8_e4m3fn", "float8_e4m3fnuz", "float8_e5m2", "float8_e5m2fnuz"):
        if hasattr(torch, name):
            dtypes.append(getattr(torch, name))
    return {d: str(d).removeprefix("torch.") for d in dtypes}


KEY_DTYPE_NAMES: dict[torch.dtype, str] = _key_dtypes()
"""The dtypes a key may name, and the text used for each in key strings."""
_DTYPE_BY_NAME: dict[str, torch.dtype] = {name: d for d, name in KEY_DTYPE_NAMES.items()}
# LMCache 0.5.6 spells the float8 types "fp8_..."; accepted on input.
_DTYPE_BY_NAME.update({"fp8" + name[len("float8"):]: d for name, d in list(_DTYPE_BY_NAME.items()) if name.startswith("float8")})
# dtype or name -> dtype, for the per-key check (one dict lookup on the hot path)
_DTYPE_LOOKUP: dict[object, torch.dtype] = {**{d: d for d in KEY_DTYPE_NAMES}, **_DTYPE_BY_NAME}


def key_dtype(value: object) -> torch.dtype:
    """``value`` (a torch.dtype or its name, e.g. ``"bfloat16"``) as a supported key dtype.

    Raises ValueError for an unsupported dtype or an unknown name."""
    if isinstance(value, torch.dtype):
        if value in KEY_DTYPE_NAMES:
            return value
    elif isinstance(value, str):
        found = _DTYPE_BY_NAME.get(value.removeprefix("torch."))
        if found is not None:
            return found
    raise ValueError(
        f"Unsupported dtype in CacheEngineKey: dtype={value!r}; expected one of "
        f"{', '.join(sorted(_DTYPE_BY_NAME))} (a torch.dtype or its name)"
    )


def _request_configs(value: object) -> tuple[tuple[str, str], ...]:
    """Key request configs as a sorted tuple of ``(name, value)`` string pairs."""
    if value is None:
        return ()
    if isinstance(value, Mapping):
        return tuple(sorted((str(k), str(v)) for k, v in value.items()))
    if isinstance(value, tuple) and all(
        isinstance(p, tuple) and len(p) == 2 and isinstance(p[0], str) and isinstance(p[1], str) for p in value
    ):
        return value
    raise TypeError(
        f"request_configs={value!r}: expected a mapping of str to str or a tuple of (name, value) string pairs"
    )


@dataclass(frozen=True, slots=True, eq=False)
class CacheEngineKey(_KeyBase):
    """Key of one KV chunk (all layers) of one worker.

    ``chunk_hash`` is the chained 128-bit hash of the chunk's tokens (see
    :mod:`lmcache.v1.token_database`). ``dtype`` is a ``torch.dtype`` (a name such as
    ``"bfloat16"`` is accepted and converted; an unsupported dtype raises ValueError).
    ``request_configs`` is a sorted tuple of ``(name, value)`` string pairs that a
    request folds into the key (e.g. a tag); a mapping is accepted and converted.
    """

    model_name: str
    world_size: int
    worker_id: int
    chunk_hash: int
    dtype: torch.dtype
    request_configs: tuple[tuple[str, str], ...] = ()

    def __post_init__(self) -> None:
        dtype = self.dtype
        try:
            found = _DTYPE_LOOKUP.get(dtype)  # type: ignore[call-overload]
        except TypeError:  # unhashable
            found = None
        if found is None:
            found = key_dtype(dtype)  # raises
        if found is not dtype:
            object.__setattr__(self, "dtype", found)
        if self.request_configs.__class__ is not tuple:
            object.__setattr__(self, "request_configs", _request_configs(self.request_configs))

    # Keys are looked up in dicts on every store/retrieve/lookup; these compare the
    # 128-bit chunk hash first instead of building field tuples as dataclass eq does.
    # With the native module, KeyBase does the same in C (registered below).
    if not NATIVE_KEY_OPS:

        def __eq__(self, other: object) -> bool:
            if other.__class__ is not self.__class__:
                return NotImplemented
            return self is other or _same_chunk(self, other)  # type: ignore[arg-type]

        def __hash__(self) -> int:
            return hash((self.chunk_hash, self.worker_id))

    def to_string(self) -> str:
        """Stable text form: ``model@world@worker@hash@dtype[@k=v&k=v]``."""
        parts = [
            quote(self.model_name, safe=""),
            str(self.world_size),
            str(self.worker_id),
            f"{self.chunk_hash:032x}",
            KEY_DTYPE_NAMES[self.dtype],
        ]
        if self.request_configs:
            parts.append(
                "&".join(f"{quote(k, safe='')}={quote(v, safe='')}" for k, v in self.request_configs)
            )
        return _SEP.join(parts)

    @staticmethod
    def from_string(text: str) -> CacheEngineKey:
        """Inverse of :meth:`to_string`. Raises ValueError on malformed input."""
        parts = text.split(_SEP)
        if len(parts) not in (5, 6):
            raise ValueError(f"malformed cache key {text!r}: expected 5 or 6 '@'-separated fields")
        req: tuple[tuple[str, str], ...] = ()
        if len(parts) == 6:
            pairs = []
            for item in parts[5].split("&"):
                name, eq, value = item.partition("=")
                if not eq:
                    raise ValueError(f"malformed request config {item!r} in cache key {text!r}")
                pairs.append((unquote(name), unquote(value)))
            req = tuple(pairs)
        try:
            return CacheEngineKey(
                unquote(parts[0]), int(parts[1]), int(parts[2]), int(parts[3], 16), key_dtype(unquote(parts[4])), req
            )
        except ValueError as exc:
            raise ValueError(f"malformed cache key {text!r}: {exc}") from None

    def split_layers(self, num_layers: int) -> list[LayerCacheEngineKey]:
        """The ``num_layers`` per-layer keys of this chunk, layer 0 first."""
        if num_layers <= 0:
            raise ValueError(f"num_layers must be > 0, got {num_layers}")
        return [
            LayerCacheEngineKey(
                self.model_name,
                self.world_size,
                self.worker_id,
                self.chunk_hash,
                self.dtype,
                self.request_configs,
                layer_id,
            )
            for layer_id in range(num_layers)
        ]

    # ------------------------------------------------------------------ LMCache 0.5.6 surface
    @property
    def chunk_hash_hex(self) -> str:
        """``chunk_hash`` in lower-case hex without padding (LMCache's spelling; the key
        string pads it to 32 digits)."""
        return f"{self.chunk_hash:x}"

    def get_first_layer(self) -> LayerCacheEngineKey:
        """The layer-0 key of this chunk."""
        return LayerCacheEngineKey(
            self.model_name, self.world_size, self.worker_id, self.chunk_hash, self.dtype, self.request_configs, 0
        )

    def with_new_worker_id(self, new_worker_id: int) -> CacheEngineKey:
        """The same key for another worker (same class; a layer key keeps its layer)."""
        return dataclasses.replace(self, worker_id=new_worker_id)

    def to_dict(self) -> dict[str, Any]:
        """Plain (JSON/msgpack-friendly) fields; inverse of :meth:`from_dict`.

        ``dtype`` is its name, ``request_configs`` a ``{name: value}`` mapping and
        ``__type__`` the class name."""
        out: dict[str, Any] = {
            "__type__": type(self).__name__,
            "model_name": self.model_name,
            "world_size": self.world_size,
            "worker_id": self.worker_id,
            "chunk_hash": self.chunk_hash,
            "dtype": KEY_DTYPE_NAMES[self.dtype],
        }
        if self.request_configs:
            out["request_configs"] = dict(self.request_configs)
        return out

    @staticmethod
    def from_dict(data: Mapping[str, Any]) -> CacheEngineKey:
        """Rebuild a key (a layer key if ``__type__`` or ``layer_id`` says so); ValueError
        naming the field on malformed input."""
        if not isinstance(data, Mapping):
            raise TypeError(f"key dict: expected a mapping, got {type(data).__name__}")
        kind = data.get("__type__", "CacheEngineKey")
        layered = kind == "LayerCacheEngineKey" or "layer_id" in data
        if kind not in ("CacheEngineKey", "LayerCacheEngineKey"):
            raise ValueError(f"key dict: __type__={kind!r}; expected 'CacheEngineKey' or 'LayerCacheEngineKey'")
        fields: list[Any] = []
        for name, typ in (("model_name", str), ("world_size", int), ("worker_id", int), ("chunk_hash", int)):
            value = data.get(name)
            if not isinstance(value, typ) or isinstance(value, bool):
                raise ValueError(f"key dict: {name}={value!r}; expected {typ.__name__}")
            fields.append(value)
        fields.append(key_dtype(data.get("dtype")))
        req = data.get("request_configs") or {}
        if not isinstance(req, Mapping):
            raise ValueError(f"key dict: request_configs={req!r}; expected a mapping")
        fields.append(_request_configs(req))
        if not layered:
            return CacheEngineKey(*fields)
        layer = data.get("layer_id")
        if not isinstance(layer, int) or isinstance(layer, bool) or layer < 0:
            raise ValueError(f"key dict: layer_id={layer!r}; expected an int >= 0")
        return LayerCacheEngineKey(*fields, layer)


@dataclass(frozen=True, slots=True, eq=False)
class LayerCacheEngineKey(CacheEngineKey):
    """Key of one layer of one KV chunk (layerwise pipeline)."""

    layer_id: int = 0

    if not NATIVE_KEY_OPS:

        def __eq__(self, other: object) -> bool:
            if other.__class__ is not self.__class__:
                return NotImplemented
            return self is other or (self.layer_id == other.layer_id and _same_chunk(self, other))  # type: ignore[attr-defined]

        def __hash__(self) -> int:
            return hash((self.chunk_hash, self.worker_id, self.layer_id))

    def to_string(self) -> str:
        return f"{CacheEngineKey.to_string(self)}{_SEP}L{self.layer_id}"

    def to_dict(self) -> dict[str, Any]:
        out = CacheEngineKey.to_dict(self)
        out["layer_id"] = self.layer_id
        return out

    @staticmethod
    def from_string(text: str) -> LayerCacheEngineKey:
        head, sep, layer = text.rpartition(_SEP)
        if not sep or not layer.startswith("L") or not layer[1:].isdigit():
            raise ValueError(f"malformed layer cache key {text!r}: missing '@L<layer>' suffix")
        base = CacheEngineKey.from_string(head)
        return LayerCacheEngineKey(
            base.model_name,
            base.world_size,
            base.worker_id,
            base.chunk_hash,
            base.dtype,
            base.request_configs,
            int(layer[1:]),
        )

    def base_key(self) -> CacheEngineKey:
        """The whole-chunk key this layer key was split from."""
        return CacheEngineKey(
            self.model_name, self.world_size, self.worker_id, self.chunk_hash, self.dtype, self.request_configs
        )


def _same_chunk(a: CacheEngineKey, b: CacheEngineKey) -> bool:
    """Field equality of two keys, the 128-bit chunk hash first (it almost always decides)."""
    return (
        a.chunk_hash == b.chunk_hash
        and a.worker_id == b.worker_id
        and a.world_size == b.world_size
        and a.model_name == b.model_name
        and a.dtype == b.dtype
        and a.request_configs == b.request_configs
    )


_CHUNK_FIELDS = ("chunk_hash", "worker_id", "world_size", "model_name", "dtype", "request_configs")
if NATIVE_KEY_OPS:
    # the fields _same_chunk compares and the hash tuples above, in the same order
    _native.register_key_type(
        CacheEngineKey,
        tuple(getattr(CacheEngineKey, f) for f in _CHUNK_FIELDS),
        (CacheEngineKey.chunk_hash, CacheEngineKey.worker_id),
    )
    _native.register_key_type(
        LayerCacheEngineKey,
        tuple(getattr(LayerCacheEngineKey, f) for f in ("layer_id", *_CHUNK_FIELDS)),
        (LayerCacheEngineKey.chunk_hash, LayerCacheEngineKey.worker_id, LayerCacheEngineKey.layer_id),
    )


def parse_cache_key(text: str) -> CacheEngineKey:
    """Parse either key form from its string."""
    tail = text.rpartition(_SEP)[2]
    if tail.startswith("L") and tail[1:].isdigit():
        return LayerCacheEngineKey.from_string(text)
    return CacheEngineKey.from_string(text)
