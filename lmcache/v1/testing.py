"""Helpers for tests, benchmarks and demos: random paged KV caches in every layout.

Not used by the engine itself.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from lmcache.v1.cache_engine import LMCacheEngine
from lmcache.v1.config import LMCacheEngineConfig
from lmcache.v1.gpu_connector.layerwise import (
    LayerwiseGPUConnector,
    VLLMBufferLayerwiseGPUConnector,
    VLLMPagedMemLayerwiseGPUConnector,
)
from lmcache.v1.gpu_connector.paged import VLLMPagedMemGPUConnectorV2
from lmcache.v1.metadata import LMCacheEngineMetadata

LAYOUT_NAMES = ("vllm_cpu", "flash_attn", "flashinfer", "mla", "mla_cpu")


@dataclass(frozen=True, slots=True)
class KVSpec:
    """Model and paged-cache geometry for a synthetic KV cache."""

    num_layers: int = 2
    num_heads: int = 2
    head_size: int = 8
    num_blocks: int = 64
    block_size: int = 16
    dtype: torch.dtype = torch.float32
    layout: str = "vllm_cpu"

    @property
    def use_mla(self) -> bool:
        return self.layout in ("mla", "mla_cpu")

    @property
    def hidden(self) -> int:
        return self.head_size if self.use_mla else self.num_heads * self.head_size

    def layer_shape(self) -> tuple[int, ...]:
        nb, bs, h, d = self.num_blocks, self.block_size, self.num_heads, self.head_size
        return {
            "vllm_cpu": (nb, h, bs, 2 * d),
            "flash_attn": (2, nb, bs, h, d),
            "flashinfer": (nb, 2, bs, h, d),
            "mla": (nb, bs, d),
            "mla_cpu": (nb, 1, bs, d),
        }[self.layout]


def random_kv_caches(spec: KVSpec, *, seed: int = 0, device: str = "cpu") -> list[torch.Tensor]:
    """Per-layer random tensors; vllm-cpu layers are views of one buffer, as in vLLM."""
    g = torch.Generator().manual_seed(seed)
    shape = spec.layer_shape()
    if spec.dtype.is_floating_point and spec.dtype.itemsize >= 2:
        full = torch.randn((spec.num_layers, *shape), generator=g, dtype=torch.float32).to(spec.dtype)
    else:  # fp8 and friends: random bytes, reinterpreted
        nbytes = spec.num_layers * torch.Size(shape).numel() * spec.dtype.itemsize
        full = torch.randint(0, 256, (nbytes,), generator=g, dtype=torch.uint8).view(spec.dtype).view(spec.num_layers, *shape)
    full = full.to(device)
    return [full[i] for i in range(spec.num_layers)]


def random_slot_mapping(spec: KVSpec, num_tokens: int, *, seed: int = 0) -> torch.Tensor:
    """Distinct slots: whole blocks in random order, tokens consecutive within a block."""
    g = torch.Generator().manual_seed(seed)
    blocks_needed = (num_tokens + spec.block_size - 1) // spec.block_size
    if blocks_needed > spec.num_blocks:
        raise ValueError(f"num_tokens={num_tokens} needs {blocks_needed} blocks, spec has {spec.num_blocks}")
    blocks = torch.randperm(spec.num_blocks, generator=g)[:blocks_needed]
    slots = (blocks[:, None] * spec.block_size + torch.arange(spec.block_size)[None, :]).reshape(-1)
    return slots[:num_tokens].to(torch.int64)


def make_connector(
    spec: KVSpec, chunk_size: int, device: str = "cpu", *, layerwise: bool = False, buffered: bool = False
) -> VLLMPagedMemGPUConnectorV2 | LayerwiseGPUConnector:
    """The bulk connector, or with ``layerwise`` the layerwise one (``buffered``: the Buffer variant)."""
    cls = VLLMPagedMemGPUConnectorV2
    if layerwise:
        cls = VLLMBufferLayerwiseGPUConnector if buffered else VLLMPagedMemLayerwiseGPUConnector
    return cls(
        spec.hidden,
        spec.num_layers,
        chunk_size=chunk_size,
        dtype=spec.dtype,
        device=device,
        use_mla=spec.use_mla,
        layout=spec.layout,
    )


def make_metadata(
    spec: KVSpec, chunk_size: int, model_name: str = "test-model", *, block_size: int | None = None
) -> LMCacheEngineMetadata:
    """Metadata of ``spec``; ``block_size`` (None: whole-chunk reuse) enables block-granular reuse."""
    heads = 1 if spec.use_mla else spec.num_heads
    shape = (spec.num_layers, 1 if spec.use_mla else 2, chunk_size, heads, spec.head_size)
    return LMCacheEngineMetadata(model_name, 1, 0, "vllm", spec.dtype, shape, spec.use_mla, block_size)


def make_engine(
    spec: KVSpec,
    config: LMCacheEngineConfig | None = None,
    *,
    model_name: str = "test-model",
    layerwise: bool | None = None,
    buffered: bool = False,
    device: str = "cpu",
    block_size: int | None = None,
) -> LMCacheEngine:
    """A standalone engine (not registered with the builder) for ``spec``.

    ``layerwise`` None follows ``config.use_layerwise``; True/False overrides it (on a
    copy of ``config``) and pairs the engine with the matching connector. ``device`` is
    where the paged KV lives (the connector's device; ``"cuda"`` uses its side streams).
    ``block_size`` goes into the metadata (block-granular reuse; None: whole chunks).
    """
    cfg = config or LMCacheEngineConfig.from_dict({"chunk_size": 16, "max_local_cpu_size": 0.25})
    if layerwise is not None and layerwise != cfg.use_layerwise:
        cfg = cfg.copy()
        cfg.use_layerwise = layerwise
    connector = make_connector(spec, cfg.chunk_size, device, layerwise=cfg.use_layerwise, buffered=buffered)
    return LMCacheEngine(cfg, make_metadata(spec, cfg.chunk_size, model_name, block_size=block_size), connector)
