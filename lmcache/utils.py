"""Cache keys shared by every tier.

A :class:`CacheEngineKey` names one chunk of KV for one model shard. Its string form is
stable across processes and machines, because the disk and remote tiers use it as a
file name / remote key. :class:`LayerCacheEngineKey` adds the layer index used by the
layerwise pipeline.
"""

from __future__ import annotations

from dataclasses import dataclass
from urllib.parse import quote, unquote

_SEP = "@"


@dataclass(frozen=True, slots=True, eq=False)
class CacheEngineKey:
    """Key of one KV chunk (all layers) of one worker.

    ``chunk_hash`` is the chained 128-bit hash of the chunk's tokens (see
    :mod:`lmcache.v1.token_database`). ``request_configs`` is a sorted tuple of
    ``(name, value)`` string pairs that a request folds into the key (e.g. a tag).
    """

    model_name: str
    world_size: int
    worker_id: int
    chunk_hash: int
    dtype: str
    request_configs: tuple[tuple[str, str], ...] = ()

    # Keys are looked up in dicts on every store/retrieve/lookup; these compare the
    # 128-bit chunk hash first instead of building field tuples as dataclass eq does.
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
            quote(self.dtype, safe=""),
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
                unquote(parts[0]), int(parts[1]), int(parts[2]), int(parts[3], 16), unquote(parts[4]), req
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


@dataclass(frozen=True, slots=True, eq=False)
class LayerCacheEngineKey(CacheEngineKey):
    """Key of one layer of one KV chunk (layerwise pipeline)."""

    layer_id: int = 0

    def __eq__(self, other: object) -> bool:
        if other.__class__ is not self.__class__:
            return NotImplemented
        return self is other or (self.layer_id == other.layer_id and _same_chunk(self, other))  # type: ignore[attr-defined]

    def __hash__(self) -> int:
        return hash((self.chunk_hash, self.worker_id, self.layer_id))

    def to_string(self) -> str:
        return f"{CacheEngineKey.to_string(self)}{_SEP}L{self.layer_id}"

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


def parse_cache_key(text: str) -> CacheEngineKey:
    """Parse either key form from its string."""
    tail = text.rpartition(_SEP)[2]
    if tail.startswith("L") and tail[1:].isdigit():
        return LayerCacheEngineKey.from_string(text)
    return CacheEngineKey.from_string(text)
