"""Machine limits measured inside a benchmark run (the denominators of our ratios), and the
model KV shape the benchmarks measure them on."""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

GB = 1e9


@dataclass(frozen=True)
class KVShape:
    """A model's KV cache per token and layer. The field names are ``KVSpec``'s
    (``lmcache.v1.testing``): ``KVSpec(**shape.kv_args(), block_size=..., ...)``."""

    num_layers: int
    num_heads: int  # KV heads
    head_size: int
    dtype: torch.dtype = torch.bfloat16

    @property
    def hidden(self) -> int:
        """Elements of one token's K (or V) in one layer."""
        return self.num_heads * self.head_size

    def kv_args(self) -> dict[str, Any]:
        return {"num_layers": self.num_layers, "num_heads": self.num_heads, "head_size": self.head_size,
                "dtype": self.dtype}


# Llama-3-8B: 32 layers, 8 KV heads of 128, bf16 (128 KiB of KV per token).
LLAMA3_8B = KVShape(num_layers=32, num_heads=8, head_size=128)


def memcpy_gbps(src: torch.Tensor, reps: int) -> float:
    """numpy copy of ``src``'s bytes into a reused 256 MiB buffer, piecewise (memory bound).

    The destination is touched once before timing, so this is the speed of copying into
    already-faulted memory, which is what the cache pool gives. Best of ``reps``.
    """
    flat = src.reshape(-1).view(torch.uint8).numpy()
    piece = 256 << 20
    dst = np.empty(min(piece, flat.size), dtype=np.uint8)
    np.copyto(dst, flat[: dst.size])
    best = float("inf")
    for _ in range(reps):
        t0 = time.perf_counter()
        for off in range(0, flat.size, piece):
            part = flat[off : off + piece]
            np.copyto(dst[: part.size], part)
        best = min(best, time.perf_counter() - t0)
    return flat.size / best / GB


def torch_copy_seconds(dst: torch.Tensor, src: torch.Tensor, reps: int) -> float:
    """Best-of-``reps`` seconds of torch's own ``dst.copy_(src)`` (one warm-up first).

    Between a CUDA tensor and pinned host memory this is one DMA transfer on the
    current stream (``non_blocking=True``, then a synchronize), i.e. torch's pinned-memory
    copy bandwidth: the limit for moving KV between the GPU and a pinned pool. On CPU
    tensors it is a plain memcpy.
    """
    cuda = dst.is_cuda or src.is_cuda

    def once() -> float:
        if cuda:
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        dst.copy_(src, non_blocking=cuda)
        if cuda:
            torch.cuda.synchronize()
        return time.perf_counter() - t0

    once()
    return min(once() for _ in range(max(1, reps)))
