"""Machine limits measured inside a benchmark run (the denominators of our ratios)."""

from __future__ import annotations

import time

import numpy as np
import torch

GB = 1e9


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
