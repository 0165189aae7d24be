"""Static facts about the model shard an engine serves."""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True, slots=True)
class LMCacheEngineMetadata:
    """What the engine needs to know about the model shard it caches.

    ``kv_shape`` is ``(num_layers, 2 or 1, chunk_size, num_kv_heads, head_size)``; the
    second entry is 1 for MLA (one latent vector per token), 2 otherwise. ``fmt`` names
    the framework layout family (e.g. ``"vllm"``). ``block_size`` is the serving
    engine's KV page size in tokens (vLLM's ``cache_config.block_size``): when set (and
    ``block_granular_reuse`` is on) cached KV is reused at that granularity, not only in
    whole chunks (see :mod:`lmcache.v1.block_reuse`). None: whole chunks only. It never
    changes keys: engines with different block sizes share entries.
    """

    model_name: str
    world_size: int
    worker_id: int
    fmt: str
    kv_dtype: torch.dtype
    kv_shape: tuple[int, int, int, int, int]
    use_mla: bool = False
    block_size: int | None = None

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
        if self.block_size is not None and (
            type(self.block_size) is not int or self.block_size <= 0 or self.kv_shape[2] % self.block_size
        ):
            raise ValueError(
                f"block_size={self.block_size!r}: expected None or a positive int dividing the chunk size "
                f"{self.kv_shape[2]} (kv_shape[2])"
            )

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


@dataclass(frozen=True, slots=True, init=False)
class LMCacheMetadata(LMCacheEngineMetadata):
    """LMCache 0.5.6's metadata class, with its constructor (field order and defaults).

    ``LMCacheMetadata(model_name, world_size, local_world_size, worker_id,
    local_worker_id, kv_dtype, kv_shape, use_mla=False, role=None,
    served_model_name=None, chunk_size=256, kv_layer_groups_manager=None,
    engine_id=None, kv_connector_extra_config=None, fmt="vllm")``. It is an
    :class:`LMCacheEngineMetadata` (``fmt`` defaults to ``"vllm"``), so the engine takes
    it as is; the LMCache-only fields are kept for callers and never change keys.
    """

    local_world_size: int
    local_worker_id: int
    role: str | None
    served_model_name: str | None
    chunk_size: int
    kv_layer_groups_manager: object | None
    engine_id: str | None
    kv_connector_extra_config: dict | None

    first_rank = 0  # LMCache's class attribute

    def __init__(
        self,
        model_name: str,
        world_size: int,
        local_world_size: int,
        worker_id: int,
        local_worker_id: int,
        kv_dtype: torch.dtype,
        kv_shape: tuple[int, int, int, int, int],
        use_mla: bool = False,
        role: str | None = None,
        served_model_name: str | None = None,
        chunk_size: int = 256,
        kv_layer_groups_manager: object | None = None,
        engine_id: str | None = None,
        kv_connector_extra_config: dict | None = None,
        fmt: str = "vllm",
    ) -> None:
        values = {
            "model_name": model_name,
            "world_size": world_size,
            "worker_id": worker_id,
            "fmt": fmt,
            "kv_dtype": kv_dtype,
            "kv_shape": tuple(kv_shape),
            "use_mla": use_mla,
            "block_size": None,
            "local_world_size": local_world_size,
            "local_worker_id": local_worker_id,
            "role": role,
            "served_model_name": served_model_name,
            "chunk_size": chunk_size,
            "kv_layer_groups_manager": kv_layer_groups_manager,
            "engine_id": engine_id,
            "kv_connector_extra_config": kv_connector_extra_config,
        }
        for name, value in values.items():
            object.__setattr__(self, name, value)
        self.__post_init__()
        if not 0 <= self.local_worker_id < max(self.local_world_size, 1) or self.local_world_size <= 0:
            raise ValueError(
                f"local_worker_id={self.local_worker_id!r}, local_world_size={self.local_world_size!r}: "
                "expected 0 <= local_worker_id < local_world_size"
            )

    def __hash__(self) -> int:  # the dict / manager fields are not hashable
        return hash((self.model_name, self.world_size, self.worker_id, self.kv_dtype, self.kv_shape))

    def is_first_rank(self) -> bool:
        return self.worker_id == self.first_rank

    def get_dtypes(self) -> list[torch.dtype]:
        return [self.kv_dtype]

    def get_shapes(self, num_tokens: int | None = None) -> list[torch.Size]:
        """``[num_kv, num_layers, num_tokens, hidden_dim]`` (one KV group)."""
        tokens = self.chunk_size if num_tokens is None else num_tokens
        return [torch.Size([self.num_kv, self.num_layers, tokens, self.hidden_dim])]

    def get_num_groups(self) -> int:
        return 1
