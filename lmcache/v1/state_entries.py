"""Recurrent-state entries: a hybrid model's Mamba / linear-attention state at a chunk boundary.

A hybrid model (Mamba2 + attention: Granite 4, Jamba, Nemotron-H; gated delta net +
attention: Qwen3-Next) cannot resume from cached KV alone: its recurrent layers also need
their state after the cached prefix. vLLM keeps that state per request in blocks of its
Mamba cache group. lmcache stores it beside the KV, as its own entry:

* **Key**: the key of the KV chunk that *ends* at the boundary, with the request config
  ``("entry", "recurrent-state")`` added (:func:`state_key`): same model, rank, salt and
  token prefix as the chunk, another entry. So a state is found only for the exact prefix
  (and tenant) it was computed from.
* **Value**: one opaque byte row per recurrent layer, ``[num_layers, row_bytes]`` uint8
  (``MemoryFormat.BINARY`` with the rows flattened), stored in the engine's own storage
  manager: CPU tier, then disk and remote as configured, in the versioned, checksummed
  entry format every entry has.
* **Lookup**: states exist only at some boundaries (vLLM keeps the state of a step's last
  boundary), so :func:`latest_state` probes candidate boundaries from the longest down and
  returns the first that has one; a hit without its state is a miss at that boundary,
  never a partial restore.

Thread-safety: the functions call the storage manager, which is thread-safe. Memory: a
put copies the caller's rows into pool memory (the caller keeps its tensor); a get
returns a new tensor the caller owns.
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Sequence
from typing import Any

import torch

from lmcache.v1.keys import CacheEngineKey
from lmcache.v1.memory_management import MemoryFormat

logger = logging.getLogger(__name__)

STATE_CONFIG = ("entry", "recurrent-state")
"""The request config that turns a KV chunk key into the key of the state at its end."""

_ERRORS = (OSError, RuntimeError, ValueError)


def state_key(chunk_key: CacheEngineKey) -> CacheEngineKey:
    """The key of the recurrent state after the chunk ``chunk_key`` names."""
    configs = tuple(sorted(set(chunk_key.request_configs) | {STATE_CONFIG}))
    return dataclasses.replace(chunk_key, request_configs=configs)


def boundary_key(engine: Any, tokens: Sequence[int], boundary: int, extras: dict[str, Any]) -> CacheEngineKey:
    """The state key at ``boundary`` (a multiple of the engine's chunk size, at most
    ``len(tokens)``) for ``tokens`` and key ``extras`` (ValueError otherwise)."""
    chunk = engine.config.chunk_size
    if boundary <= 0 or boundary % chunk or boundary > len(tokens):
        raise ValueError(
            f"boundary={boundary}: expected a positive multiple of chunk_size={chunk} within {len(tokens)} tokens"
        )
    pk = engine.prefix_keys(list(tokens[:boundary]), **extras)
    return state_key(pk.keys[boundary // chunk - 1])


def latest_state(engine: Any, tokens: Sequence[int], boundaries: Sequence[int], extras: dict[str, Any]) -> int:
    """The longest of ``boundaries`` with a stored state for ``tokens`` (0: none). Probes
    keys only (no payload read); a failing tier counts as a miss."""
    chunk = engine.config.chunk_size
    cands = sorted({int(b) for b in boundaries if 0 < int(b) <= len(tokens) and int(b) % chunk == 0}, reverse=True)
    if not cands:
        return 0
    pk = engine.prefix_keys(list(tokens[: cands[0]]), **extras)
    for b in cands:
        try:
            if engine.storage_manager.contains(state_key(pk.keys[b // chunk - 1])) is not None:
                return b
        except _ERRORS as exc:
            logger.debug("lmcache: state lookup failed (%s: %s); a miss", type(exc).__name__, exc)
            return 0
    return 0


def put_state(engine: Any, key: CacheEngineKey, rows: torch.Tensor) -> bool:
    """Store ``rows`` (``[num_layers, row_bytes]`` uint8, any device) under ``key``; False
    when the pool has no room even after eviction (not stored). True when already stored."""
    if rows.dtype != torch.uint8 or rows.dim() != 2:
        raise ValueError(f"rows: {rows.dtype} of shape {tuple(rows.shape)}; expected [num_layers, row_bytes] uint8")
    sm = engine.storage_manager
    if sm.is_resident(key):
        return True
    obj = sm.allocate((rows.numel(),), torch.uint8, MemoryFormat.BINARY)
    if obj is None:
        return False
    try:
        dst = obj.tensor
        assert dst is not None, "a freshly allocated MemoryObj has a tensor"
        dst.copy_(rows.reshape(-1))
        sm.put(key, obj)
    finally:
        obj.ref_count_down()
    return True


def get_state(engine: Any, key: CacheEngineKey, shape: tuple[int, int]) -> torch.Tensor | None:
    """The rows stored under ``key`` as a new ``shape`` uint8 tensor, or None (a miss: not
    stored, unreadable, or of another size)."""
    try:
        obj = engine.storage_manager.get(key)
    except _ERRORS as exc:
        logger.debug("lmcache: state read failed (%s: %s); a miss", type(exc).__name__, exc)
        return None
    if obj is None:
        return None
    try:
        src = obj.tensor
        if src is None or src.dtype != torch.uint8 or src.numel() != shape[0] * shape[1]:
            return None
        return src.reshape(shape).clone()
    finally:
        obj.ref_count_down()
