"""Static facts about the model shard an engine serves."""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True, slots=True)
class LMCacheEngineMetadata:
    """What the engine needs to know about the model shard it caches.

    ``kv_shape`` is ``(num_layers, 2 or 1, chunk_size, num_kv_heads, head_size)``; the
    second entry is 1 for MLA (one latent vector per token), 2 otherwise. ``fmt`` names
    the framework layout family (e.g. ``"vllm"``).
    """

    model_name: str
    world_size: int
    worker_id: int
    fmt: str
    kv_dtype: torch.dtype
    kv_shape: tuple[int, int, int, int, int]
    use_mla: bool = False

    def __post_init__(self) -> None:
        if not isinstance(self.model_name, str) or not self.model_name:
            raise ValueError(f"model_name={self.model_name!r}: expected a non-empty string")
        if self.world_size <= 0 or not 0 <= self.worker_id < self.world_size:
            raise ValueError(
                f"worker_id={self.worker_id!r}, world_size={self.world_size!r}: expected 0 <= worker_id < world_size"
            )
        if len(self.kv_shape) != 5 or any(int(d) <= 0 for d in self.kv_shape):
            raise ValueError(
                f"kv_shape={self.kv_shape!r}: expected 5 positive ints "
                "(num_layers, 2 or 1, chunk_size, num_kv_heads, head_size)"
            )
        expected_kv = 1 if self.use_mla else 2
        if self.kv_shape[1] != expected_kv:
            raise ValueError(f"kv_shape[1]={self.kv_shape[1]!r}: expected {expected_kv} (use_mla={self.use_mla})")
        if not isinstance(self.kv_dtype, torch.dtype):
            raise TypeError(f"kv_dtype={self.kv_dtype!r}: expected a torch.dtype")

    @property
    def num_layers(self) -> int:
        return self.kv_shape[0]

    @property
    def num_kv(self) -> int:
        """2 for K and V, 1 for MLA."""
        return self.kv_shape[1]

    @property
    def hidden_dim(self) -> int:
        """Elements per token per layer per K/V: num_kv_heads * head_size."""
        return self.kv_shape[3] * self.kv_shape[4]

    @property
    def dtype_name(self) -> str:
        return dtype_name(self.kv_dtype)


def dtype_name(dtype: torch.dtype) -> str:
    """``torch.bfloat16`` -> ``"bfloat16"`` (stable text used in keys and file headers)."""
    return str(dtype).removeprefix("torch.")
