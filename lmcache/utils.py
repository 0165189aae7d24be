"""LMCache 0.5.6's module path for the cache keys; they live in :mod:`lmcache.v1.keys`."""

from lmcache.v1.keys import (
    KEY_DTYPE_NAMES,
    CacheEngineKey,
    LayerCacheEngineKey,
    key_dtype,
    parse_cache_key,
)

__all__ = ["KEY_DTYPE_NAMES", "CacheEngineKey", "LayerCacheEngineKey", "key_dtype", "parse_cache_key"]
