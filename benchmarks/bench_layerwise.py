"""Layerwise vs bulk store and retrieve on the Llama-3-8B KV shape (CPU tier), ratios against limits.

Shape: 32 layers, 8 KV heads, head 128, bf16, chunk 256, 8192 tokens (1 GiB of KV), per
layout given (default flash_attn and vllm_cpu). Both paths run in one process, interleaved
rep by rep (the order alternates), so a loaded machine slows both alike:

* bulk: ``engine.store`` / ``engine.retrieve`` (all layers of all chunks, one copy call);
* layerwise: ``engine.store_layer`` / ``engine.retrieve_layer`` driven through all their
  calls. "First layer" is the time until layer 0 is usable: for a store, until the first
  ``next()`` returns (layer 0 copied and published); for a retrieve, until the second
  ``next()`` returns (set-up + layer 0 in the paged cache: the forward pass may start).

Ratios (of the best times, and the median of the per-rep ratios), with their targets:

* first layer / (bulk time / num_layers)  <= 1.15  (1.0 = a layer costs exactly its share of bulk);
* layerwise total / bulk total            <= 1.05.

Also printed: numpy memcpy of the same bytes (the machine's limit) and each path's GB/s.
Uses the native kernels when built (else the torch fallback).

Usage: python benchmarks/bench_layerwise.py [--tokens 8192] [--layouts flash_attn,vllm_cpu] [--reps 5]
       [--clock wall|thread]
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

import torch

from lmcache.bench.limits import GB, LLAMA3_8B, memcpy_gbps
from lmcache.v1.config import LMCacheEngineConfig
from lmcache.v1.gpu_connector import copy_ops
from lmcache.v1.testing import KVSpec, make_engine, random_kv_caches, random_slot_mapping

FIRST_LIMIT = 1.15
TOTAL_LIMIT = 1.05
clock = time.perf_counter  # --clock thread: time.thread_time (CPU time of this thread; steadier on a loaded machine)


def engine_for(spec: KVSpec, kv_bytes: int, layerwise: bool):
    cfg = LMCacheEngineConfig.from_dict(
        {"chunk_size": 256, "max_local_cpu_size": kv_bytes * 1.05 / (1 << 30), "use_layerwise": layerwise}
    )
    return make_engine(spec, cfg)


def clear(engine) -> None:
    sm = engine.storage_manager
    for key in sm.local_cpu.keys():
        sm.remove(key)


def bulk_once(engine, kv, out, slots, tokens) -> tuple[float, float]:
    """(store s, retrieve s) of one bulk round trip."""
    t0 = clock()
    assert engine.store(tokens, kvcaches=kv, slot_mapping=slots) == len(tokens)
    t1 = clock()
    assert int(engine.retrieve(tokens, kvcaches=out, slot_mapping=slots).sum()) == len(tokens)
    t2 = clock()
    clear(engine)
    return t1 - t0, t2 - t1


def layerwise_once(engine, kv, out, slots, tokens) -> tuple[float, float, float, float]:
    """(store s, store first-layer s, retrieve s, retrieve first-layer s) of one layerwise round trip."""
    t0 = clock()
    gen = engine.store_layer(tokens, kvcaches=kv, slot_mapping=slots)
    next(gen)  # layer 0 copied and published
    s_first = clock() - t0
    for _ in gen:
        pass
    s_total = clock() - t0

    t0 = clock()
    gen = engine.retrieve_layer(tokens, kvcaches=out, slot_mapping=slots)
    next(gen)  # set-up
    next(gen)  # layer 0 in the paged cache: the forward pass may start
    r_first = clock() - t0
    mask = None
    for mask in gen:
        pass
    r_total = clock() - t0
    assert mask is not None and int(mask.sum()) == len(tokens)
    clear(engine)
    return s_total, s_first, r_total, r_first


def verdict(value: float, limit: float) -> str:
    return "ok" if value <= limit else f"MISS by {value / limit - 1:.1%}"


def run_layout(layout: str, n: int, reps: int) -> dict[str, list[float]]:
    spec = KVSpec(**LLAMA3_8B.kv_args(), block_size=16, num_blocks=(n + 15) // 16, layout=layout)
    layers = spec.num_layers
    kv = random_kv_caches(spec, seed=0)
    out = [torch.zeros_like(t) for t in kv]
    slots = random_slot_mapping(spec, n, seed=1)
    tokens = torch.randint(0, 128000, (n,), generator=torch.Generator().manual_seed(2))
    kv_bytes = n * layers * 2 * spec.hidden * spec.dtype.itemsize
    whole = torch.empty(0, dtype=torch.uint8).set_(kv[0].untyped_storage())
    mc = memcpy_gbps(whole[:kv_bytes], max(3, reps))

    bulk = engine_for(spec, kv_bytes, layerwise=False)
    lw = engine_for(spec, kv_bytes, layerwise=True)
    rows: dict[str, list[float]] = {k: [] for k in ("bs", "br", "ls", "lsf", "lr", "lrf")}
    try:
        bulk_once(bulk, kv, out, slots, tokens)  # warm-up: pool slabs, page faults, key caches
        layerwise_once(lw, kv, out, slots, tokens)
        for rep in range(reps):
            if rep % 2:
                ls, lsf, lr, lrf = layerwise_once(lw, kv, out, slots, tokens)
                bs, br = bulk_once(bulk, kv, out, slots, tokens)
            else:
                bs, br = bulk_once(bulk, kv, out, slots, tokens)
                ls, lsf, lr, lrf = layerwise_once(lw, kv, out, slots, tokens)
            for k, v in zip(rows, (bs, br, ls, lsf, lr, lrf)):
                rows[k].append(v)
    finally:
        bulk.close()
        lw.close()

    ratios = {
        "retrieve first layer / (bulk / layers)": [f / (b / layers) for f, b in zip(rows["lrf"], rows["br"])],
        "retrieve total / bulk": [t / b for t, b in zip(rows["lr"], rows["br"])],
        "store first layer / (bulk / layers)": [f / (b / layers) for f, b in zip(rows["lsf"], rows["bs"])],
        "store total / bulk": [t / b for t, b in zip(rows["ls"], rows["bs"])],
    }
    kernels = "native" if copy_ops.native_enabled() else "torch fallback"
    print(
        f"== layout {layout}: Llama-3-8B KV ({layers} layers, {spec.num_heads} KV heads, head {spec.head_size}, bf16), {n} tokens, chunk 256, "
        f"{kv_bytes / GB:.3f} GB; kernels: {kernels}; torch threads 1; {reps} interleaved reps after 1 warm-up"
    )
    print(f"   memcpy (machine limit, reused dst) : {mc:6.2f} GB/s; clock: {clock.__name__}")
    for name, key in (("bulk retrieve", "br"), ("layerwise retrieve", "lr"), ("bulk store", "bs"), ("layerwise store", "ls")):
        best = min(rows[key])
        print(
            f"   {name:<34}: best {best * 1e3:7.1f} ms  median {statistics.median(rows[key]) * 1e3:7.1f} ms  "
            f"{kv_bytes / best / GB:6.2f} GB/s = {kv_bytes / best / GB / mc:.2f} x memcpy"
        )
    for name, key in (("layerwise retrieve, first layer", "lrf"), ("layerwise store, first layer", "lsf")):
        print(f"   {name:<34}: best {min(rows[key]) * 1e3:7.2f} ms  median {statistics.median(rows[key]) * 1e3:7.2f} ms")
    bests = {
        "retrieve first layer / (bulk / layers)": min(rows["lrf"]) / (min(rows["br"]) / layers),
        "retrieve total / bulk": min(rows["lr"]) / min(rows["br"]),
        "store first layer / (bulk / layers)": min(rows["lsf"]) / (min(rows["bs"]) / layers),
        "store total / bulk": min(rows["ls"]) / min(rows["bs"]),
    }
    for name, vals in ratios.items():
        limit = FIRST_LIMIT if "first" in name else TOTAL_LIMIT
        best, med = bests[name], statistics.median(vals)
        print(
            f"   ratio {name:<38}: of bests {best:.3f}  median of reps {med:.3f}  (limit {limit:.2f}: "
            f"{verdict(best, limit)} / {verdict(med, limit)})"
        )
    return ratios


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tokens", type=int, default=8192)
    parser.add_argument("--layouts", default="flash_attn,vllm_cpu", help="comma-separated: flash_attn, flashinfer, vllm_cpu")
    parser.add_argument("--reps", type=int, default=5)
    parser.add_argument(
        "--clock",
        choices=["wall", "thread"],
        default="wall",
        help="wall: perf_counter (default); thread: CPU time of this thread (copies run on it), which "
        "leaves out time the thread waited for a core on a loaded machine",
    )
    args = parser.parse_args()
    global clock
    clock = time.thread_time if args.clock == "thread" else time.perf_counter
    torch.set_num_threads(1)
    for layout in args.layouts.split(","):
        run_layout(layout.strip(), args.tokens, args.reps)


if __name__ == "__main__":
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    main()
