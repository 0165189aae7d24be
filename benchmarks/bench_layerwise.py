"""Layerwise vs bulk retrieve on the Llama-3-8B KV shape, against this machine's memcpy speed.

Shape: 32 layers, 8 KV heads, head 128, bf16, chunk 256, 8192 tokens (1 GiB of KV).
Measured in one run, with the native kernels when built (else the torch fallback):

* bulk retrieve: ``engine.retrieve`` (all layers of all chunks, then one copy call);
* layerwise retrieve: ``engine.retrieve_layer`` driven for all ``num_layers + 2`` calls;
  total time, and the time until layer 0 is in the paged cache (setup call + first
  layer call), i.e. when the forward pass could start; ideally ~1/num_layers of bulk;
* the same for stores (``store`` vs ``store_layer``), for reference;
* numpy memcpy of the same bytes into a reused buffer: the machine's limit.

Ratios printed: layerwise/bulk total, first-layer/bulk (vs 1/num_layers), and each
path's GB/s against memcpy. Timings are the best of ``--reps`` after one warm-up.

Usage: python benchmarks/bench_layerwise.py [--tokens 8192] [--layout flash_attn] [--reps 3]
"""

from __future__ import annotations

import argparse
import os
import time

import torch

from lmcache.v1.config import LMCacheEngineConfig
from lmcache.v1.gpu_connector import copy_ops
from lmcache.v1.testing import KVSpec, make_engine, random_kv_caches, random_slot_mapping

from limits import GB, memcpy_gbps  # noqa: E402 - benchmarks/ is on sys.path when run as a script


def engine_for(spec: KVSpec, kv_bytes: int, layerwise: bool):
    cfg = LMCacheEngineConfig.from_dict(
        {"chunk_size": 256, "max_local_cpu_size": kv_bytes * 1.05 / (1 << 30), "use_layerwise": layerwise}
    )
    return make_engine(spec, cfg)


def time_bulk(spec, kv, out, slots, tokens, kv_bytes, reps) -> tuple[float, float]:
    """(best store s, best retrieve s) of the bulk path."""
    engine = engine_for(spec, kv_bytes, layerwise=False)
    store_t, retr_t = [], []
    try:
        for _ in range(reps + 1):
            t0 = time.perf_counter()
            assert engine.store(tokens, kvcaches=kv, slot_mapping=slots) == len(tokens)
            store_t.append(time.perf_counter() - t0)
            t0 = time.perf_counter()
            assert int(engine.retrieve(tokens, kvcaches=out, slot_mapping=slots).sum()) == len(tokens)
            retr_t.append(time.perf_counter() - t0)
            for key in engine.keys(tokens):
                engine.storage_manager.remove(key)
    finally:
        engine.close()
    return min(store_t[1:]), min(retr_t[1:])


def time_layerwise(spec, kv, out, slots, tokens, kv_bytes, reps) -> tuple[float, float, float, float]:
    """(best store s, best first-layer-stored s, best retrieve s, best first-layer-loaded s)."""
    engine = engine_for(spec, kv_bytes, layerwise=True)
    store_t, store_first, retr_t, retr_first = [], [], [], []
    try:
        for _ in range(reps + 1):
            t0 = time.perf_counter()
            gen = engine.store_layer(tokens, kvcaches=kv, slot_mapping=slots)
            next(gen)  # allocation + layer 0 copied and published
            store_first.append(time.perf_counter() - t0)
            for _ in gen:
                pass
            store_t.append(time.perf_counter() - t0)

            t0 = time.perf_counter()
            gen = engine.retrieve_layer(tokens, kvcaches=out, slot_mapping=slots)
            next(gen)  # setup
            next(gen)  # layer 0 in the paged cache: the forward pass may start
            retr_first.append(time.perf_counter() - t0)
            mask = None
            for mask in gen:
                pass
            retr_t.append(time.perf_counter() - t0)
            assert mask is not None and int(mask.sum()) == len(tokens)
            for key in engine.storage_manager.local_cpu.keys():
                engine.storage_manager.remove(key)
    finally:
        engine.close()
    return min(store_t[1:]), min(store_first[1:]), min(retr_t[1:]), min(retr_first[1:])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tokens", type=int, default=8192)
    parser.add_argument("--layout", default="flash_attn", choices=["flash_attn", "flashinfer", "vllm_cpu"])
    parser.add_argument("--reps", type=int, default=3)
    args = parser.parse_args()
    torch.set_num_threads(1)

    spec = KVSpec(
        num_layers=32,
        num_heads=8,
        head_size=128,
        block_size=16,
        num_blocks=(args.tokens + 15) // 16,
        dtype=torch.bfloat16,
        layout=args.layout,
    )
    n, layers = args.tokens, spec.num_layers
    kv = random_kv_caches(spec, seed=0)
    out = [torch.zeros_like(t) for t in kv]
    slots = random_slot_mapping(spec, n, seed=1)
    tokens = torch.randint(0, 128000, (n,), generator=torch.Generator().manual_seed(2))
    kv_bytes = n * layers * 2 * spec.hidden * spec.dtype.itemsize
    whole = torch.empty(0, dtype=torch.uint8).set_(kv[0].untyped_storage())

    mc = memcpy_gbps(whole[:kv_bytes], args.reps)
    b_store, b_retr = time_bulk(spec, kv, out, slots, tokens, kv_bytes, args.reps)
    l_store, l_store_first, l_retr, l_first = time_layerwise(spec, kv, out, slots, tokens, kv_bytes, args.reps)

    kernels = "native" if copy_ops.native_enabled() else "torch fallback"
    print(f"shape: Llama-3-8B KV ({layers} layers, 8 KV heads, head 128, bf16), {n} tokens, "
          f"layout {args.layout}, chunk 256, {kv_bytes / GB:.3f} GB; kernels: {kernels}; "
          f"torch threads 1; best of {args.reps} after 1 warm-up")
    print(f"memcpy (machine limit, reused dst)     : {mc:6.2f} GB/s")
    print(f"bulk retrieve                          : {b_retr * 1e3:8.1f} ms  {kv_bytes / b_retr / GB:6.2f} GB/s "
          f"= {kv_bytes / b_retr / GB / mc:.2f} x memcpy")
    print(f"layerwise retrieve, total              : {l_retr * 1e3:8.1f} ms  {kv_bytes / l_retr / GB:6.2f} GB/s "
          f"= {kv_bytes / l_retr / GB / mc:.2f} x memcpy")
    print(f"layerwise retrieve, first layer loaded : {l_first * 1e3:8.1f} ms")
    print(f"ratio layerwise/bulk retrieve total    : {l_retr / b_retr:.3f}")
    print(f"ratio first layer / bulk retrieve      : {l_first / b_retr:.4f}  (1/num_layers = {1 / layers:.4f}; "
          f"{l_first / b_retr * layers:.2f} x ideal)")
    print(f"bulk store                             : {b_store * 1e3:8.1f} ms  {kv_bytes / b_store / GB:6.2f} GB/s "
          f"= {kv_bytes / b_store / GB / mc:.2f} x memcpy")
    print(f"layerwise store, total                 : {l_store * 1e3:8.1f} ms  {kv_bytes / l_store / GB:6.2f} GB/s "
          f"= {kv_bytes / l_store / GB / mc:.2f} x memcpy")
    print(f"layerwise store, first layer published : {l_store_first * 1e3:8.1f} ms "
          f"(includes allocating all {layers} layers upfront)")
    print(f"ratio layerwise/bulk store total       : {l_store / b_store:.3f}")


if __name__ == "__main__":
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    main()
