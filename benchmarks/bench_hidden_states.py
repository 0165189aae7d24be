"""HiddenStateStore throughput: store/retrieve of one [8192, 4096] float32 tensor.

Prints GB/s of ``store_hidden_states`` and ``retrieve_hidden_states`` next to the
machine's own limits measured in the same run:

* numpy memcpy of the same bytes into a reused buffer (the ceiling for a store, which
  copies into already-touched pool pages);
* numpy memcpy into freshly allocated memory (the ceiling for a retrieve, which by
  contract returns a new tensor the caller owns, so its pages are touched for the
  first time).

Usage: ``python benchmarks/bench_hidden_states.py [--tokens 8192] [--dim 4096] [--repeats 9]``
"""

from __future__ import annotations

import argparse
import statistics
import time

import numpy as np
import torch

from lmcache.v1.config import LMCacheEngineConfig
from lmcache.v1.memory_management import GiB
from lmcache.v1.testing import KVSpec, make_engine, random_kv_caches, random_slot_mapping


def _timed(fn, repeats: int) -> list[float]:
    out = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        out.append(time.perf_counter() - t0)
    return out


def _line(name: str, nbytes: int, secs: list[float], limit_gbs: float, limit_name: str) -> str:
    best = nbytes / min(secs) / 1e9
    med = nbytes / statistics.median(secs) / 1e9
    return f"{name:<28} best {best:6.2f} GB/s  median {med:6.2f} GB/s  = {med / limit_gbs:5.2f}x {limit_name}"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, default=8192)
    parser.add_argument("--dim", type=int, default=4096)
    parser.add_argument("--repeats", type=int, default=9)
    args = parser.parse_args()
    torch.set_num_threads(1)

    n, dim, repeats = args.tokens, args.dim, args.repeats
    hidden = torch.randn((n, dim), dtype=torch.float32)
    nbytes = hidden.numel() * hidden.element_size()
    src = hidden.numpy()

    # the store: KV geometry is tiny (only its presence matters for retrieval)
    spec = KVSpec(num_layers=1, num_heads=1, head_size=2, num_blocks=(n + 15) // 16, block_size=16)
    pool_gib = 2.5 * nbytes / GiB  # room for two copies: steady state reuses freed pool pages
    cfg = LMCacheEngineConfig.from_dict(
        {
            "chunk_size": 256,
            "max_local_cpu_size": 0.05,
            "enable_hidden_state_cache": True,
            "max_hidden_state_cpu_size": pool_gib,
        }
    )
    engine = make_engine(spec, cfg)
    hs = engine.hidden_state_store
    assert hs is not None
    tokens = [(i * 131) % 50000 for i in range(n)]
    engine.store(tokens, kvcaches=random_kv_caches(spec), slot_mapping=random_slot_mapping(spec, n))

    # a new salt per store gives new keys, so each call really copies (older copies get evicted)
    salt = iter(range(1_000_000))
    for _ in range(4):  # until every pool page has been written once (steady state)
        hs.store_hidden_states(tokens, hidden, cache_salt=f"warm{next(salt)}")
    hs.store_hidden_states(tokens, hidden)
    out = hs.retrieve_hidden_states(tokens)
    assert out is not None and out.shape == (n, dim) and torch.equal(out, hidden)
    del out

    def retrieve() -> None:
        got = hs.retrieve_hidden_states(tokens)
        assert got is not None and got.shape[0] == n

    # interleaved, so the limits and the store see the same load on this shared machine
    reused = np.empty_like(src)
    np.copyto(reused, src)  # touch once
    secs: dict[str, list[float]] = {"reused": [], "fresh": [], "store": [], "retrieve": []}
    for _ in range(repeats):
        secs["reused"] += _timed(lambda: np.copyto(reused, src), 1)
        secs["store"] += _timed(lambda: hs.store_hidden_states(tokens, hidden, cache_salt=f"s{next(salt)}"), 1)
        secs["fresh"] += _timed(lambda: np.copyto(np.empty_like(src), src), 1)
        secs["retrieve"] += _timed(retrieve, 1)
    engine.close()
    lim_reused = nbytes / statistics.median(secs["reused"]) / 1e9
    lim_fresh = nbytes / statistics.median(secs["fresh"]) / 1e9
    store_secs, retrieve_secs = secs["store"], secs["retrieve"]

    print(f"hidden states [{n}, {dim}] float32 = {nbytes / 1e6:.0f} MB, chunk 256, torch threads 1, {repeats} runs")
    print(f"{'numpy memcpy, reused buffer':<28} median {lim_reused:6.2f} GB/s  (limit for store)")
    print(f"{'numpy memcpy, fresh buffer':<28} median {lim_fresh:6.2f} GB/s  (limit for retrieve: new tensor)")
    print(_line("store_hidden_states", nbytes, store_secs, lim_reused, "memcpy reused"))
    print(_line("retrieve_hidden_states", nbytes, retrieve_secs, lim_reused, "memcpy reused"))
    print(_line("retrieve_hidden_states", nbytes, retrieve_secs, lim_fresh, "memcpy fresh"))


if __name__ == "__main__":
    main()
