"""What the adapter reads off a vLLM request: the key extras that isolate its cached
chunks, and the slot mapping of its blocks.

Stateless. Reads vLLM objects by attribute only (duck typing), so unit tests can pass
small fakes.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import numpy as np

from lmcache.integration.vllm.vllm_compat import mm_feature_identifier
from lmcache.v1.request import KeyExtras

if TYPE_CHECKING:
    import torch


def request_key_extras(request: Any) -> dict[str, Any]:
    """Per-request key extras: ``cache_salt``, and LoRA / multimodal hashes as ``extra_keys``.

    Two requests share cached chunks only when these agree (tenant isolation via the
    salt; a LoRA adapter or an image changes the KV of identical placeholder tokens).
    """
    salt = getattr(request, "cache_salt", None)
    keys: list[str] = []
    lora = getattr(request, "lora_request", None)
    if lora is not None:
        name = getattr(lora, "lora_name", None) or getattr(lora, "lora_int_id", None)
        keys.append(f"lora={name}")
    for feature in getattr(request, "mm_features", None) or ():
        ident = mm_feature_identifier(feature)
        if ident:
            keys.append(f"mm={ident}")
    return KeyExtras.build(cache_salt=str(salt) if salt else None, extra_keys=keys or None).as_kwargs()


def slot_mapping(block_ids: Sequence[int], block_size: int, num_tokens: int) -> np.ndarray:
    """``slot[i] = block_ids[i // block_size] * block_size + i % block_size`` for ``i < num_tokens``.

    Tokens past the allocated blocks get -1 (the copy paths skip negative slots).
    """
    if block_size <= 0:
        raise ValueError(f"block_size={block_size}: expected > 0")
    out = np.full(num_tokens, -1, dtype=np.int64)
    blocks = np.asarray(block_ids, dtype=np.int64)
    covered = min(num_tokens, len(blocks) * block_size)
    if covered:
        idx = np.arange(covered)
        out[:covered] = blocks[idx // block_size] * block_size + idx % block_size
    return out


def group_slot_mapping(block_ids: Sequence[Sequence[int]], block_size: int, num_tokens: int) -> np.ndarray:
    """:func:`slot_mapping` of each KV cache group's blocks: 1-D for one group, else one row
    per group (``[groups, num_tokens]``; vLLM's hybrid KV cache manager)."""
    if len(block_ids) == 1:
        return slot_mapping(block_ids[0], block_size, num_tokens)
    if not block_ids:
        raise ValueError("block_ids: expected one block list per KV cache group, got none")
    return np.stack([slot_mapping(ids, block_size, num_tokens) for ids in block_ids])


def blocks_of_tokens(slots: np.ndarray | torch.Tensor, block_size: int, start: int, end: int) -> set[int]:
    """Block ids holding tokens ``[start, end)`` (from their slots; negative slots ignored)."""
    part = np.asarray(slots[start:end])
    part = part[part >= 0]
    return set((part // block_size).tolist())
