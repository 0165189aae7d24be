"""Remote-tier throughput through our RemoteBackend, next to raw redis-py on the same server.

For each value size (1 MiB and 4 MiB by default), in one run against one loopback
redis-server, interleaved and repeated (median reported):

* raw redis-py + hiredis, one command at a time: ``SET k <bytes>`` / ``GET k``
  (timed passes overwrite keys written by a warm-up pass: steady state),
  the target: our tier should reach >= 0.8 of it,
* our tier: ``submit_put`` of pool objects then ``flush`` (async writers, entry
  header + xxh3 checksum + zero-copy send), with 1 writer and with the default 2;
  ``get_blocking`` one by one (zero-copy receive into pool memory + verification),
* ``redis-benchmark`` SET/GET of the same size, 1 client, no pipelining: the
  server's own limit on this machine (C client).

Then the tier's ``get`` of the largest size once more, with the native socket reader
(``lmcache._sockread``: the GIL released for a whole value) and with the Python
``recv_into`` loop, alone and beside a thread that keeps the GIL busy (as vLLM's step
loop does beside a prefetch), over the raw redis-py GET alone.

Usage: lmcache bench remote -- [--sizes-mib 1,4] [--total-mib 256] [--reps 3] [--url redis://...]
Without --url a private redis-server is started on a free loopback port and stopped after.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import re
import shutil
import statistics
import subprocess
import threading
import time
from typing import Iterator

import torch

from lmcache.bench.limits import GB
from lmcache.utils import CacheEngineKey
from lmcache.v1.config import LMCacheEngineConfig
from lmcache.v1.memory_management import MemoryFormat, MemoryObj, PoolAllocator
from lmcache.v1.storage_backend.cache_policy import make_policy
from lmcache.v1.storage_backend.local_cpu_backend import LocalCPUBackend
from lmcache.v1.storage_backend.remote_backend import RemoteBackend
from lmcache.v1.testing_redis import RedisServer, RedisUnavailable

MiB = 1 << 20


def raw_redis(url: str):
    import redis

    return redis.Redis.from_url(url, socket_timeout=30, protocol=2)


def raw_set_get(client, size: int, n: int, tag: str) -> tuple[float, float]:
    """(SET GB/s, GET GB/s) of n distinct values, one command at a time."""
    values = [os.urandom(size) for _ in range(min(n, 4))]
    t0 = time.perf_counter()
    for i in range(n):
        client.set(f"raw:{tag}:{i}", values[i % len(values)])
    t_set = time.perf_counter() - t0
    t0 = time.perf_counter()
    for i in range(n):
        v = client.get(f"raw:{tag}:{i}")
        assert v is not None and len(v) == size
    t_get = time.perf_counter() - t0
    return n * size / t_set / GB, n * size / t_get / GB


def tier_put_get(backend: RemoteBackend, local: LocalCPUBackend, size: int, n: int, tag: int) -> tuple[float, float]:
    """(put GB/s incl. flush, get GB/s) through the tier, n values of ``size`` bytes."""
    objs: list[MemoryObj] = []
    noise = torch.randint(0, 256, (size + n,), dtype=torch.uint8, generator=torch.Generator().manual_seed(tag))
    for i in range(n):
        obj = local.allocate((size // 4,), torch.float32, MemoryFormat.BINARY)
        assert obj is not None, "pool too small for the benchmark"
        obj.byte_array.copy_(noise[i : i + size])  # distinct contents per value
        objs.append(obj)
    t0 = time.perf_counter()
    for k, o in zip(bench_keys(tag, n), objs):
        backend.submit_put(k, o)
    assert backend.flush(300), "flush timed out"
    t_put = time.perf_counter() - t0
    for o in objs:
        o.ref_count_down()
    return n * size / t_put / GB, tier_get(backend, size, n, tag)


def bench_keys(tag: int, n: int) -> list[CacheEngineKey]:
    return [CacheEngineKey("bench", 1, 0, (tag << 32) + i, "float32") for i in range(n)]


def tier_get(backend: RemoteBackend, size: int, n: int, tag: int) -> float:
    """GB/s of ``get_blocking`` of the n values :func:`tier_put_get` wrote with ``tag``, one by one."""
    t0 = time.perf_counter()
    for k in bench_keys(tag, n):
        got = backend.get_blocking(k)
        assert got is not None, "tier miss in the benchmark"
        got.ref_count_down()
    return n * size / (time.perf_counter() - t0) / GB


@contextlib.contextmanager
def busy_python_thread() -> Iterator[None]:
    """A thread that holds the GIL between its switch intervals (pure Python work)."""
    stop = threading.Event()

    def spin() -> None:
        x = 0
        while not stop.is_set():
            for _ in range(1000):
                x += 1

    t = threading.Thread(target=spin, daemon=True)
    t.start()
    try:
        yield
    finally:
        stop.set()
        t.join()


def reader_comparison(url: str, size: int, n: int, reps: int, pool_bytes: int, raw_get: float) -> None:
    """The tier's get with the native socket reader and with the Python loop, alone and
    beside a GIL-busy thread (GB/s, median of ``reps``), over raw redis-py's GET alone."""
    from lmcache.v1.storage_backend.connector import resp

    native = resp._sockread
    backend, local = make_backend(url, 1, pool_bytes)
    try:
        tier_put_get(backend, local, size, n, 7)  # writes the keys; the timed gets read them
        rows = []
        for label, reader in (("native reader", native), ("Python loop", None)):
            if label == "native reader" and native is None:
                rows.append((label, float("nan"), float("nan")))
                continue
            resp._sockread = reader
            alone = statistics.median(tier_get(backend, size, n, 7) for _ in range(reps))
            with busy_python_thread():
                busy = statistics.median(tier_get(backend, size, n, 7) for _ in range(reps))
            rows.append((label, alone, busy))
    finally:
        resp._sockread = native
        backend.close()
        local.close()
    print(f"\ntier get of {size // MiB} MiB values, one by one (GB/s; / raw redis-py GET alone {raw_get:.2f} GB/s):")
    for label, alone, busy in rows:
        print(f"  {label:<14} alone {alone:5.2f} ({alone / raw_get:4.2f} x) | beside a GIL-busy thread "
              f"{busy:5.2f} ({busy / raw_get:4.2f} x)")
    if native is None:
        print("  (lmcache._sockread is not built: pip install -e . builds it with a C compiler)")


def redis_benchmark(host: str, port: int, size: int, n: int) -> tuple[float, float] | None:
    """(SET GB/s, GET GB/s) from redis-benchmark with one client, no pipelining; None if missing."""
    exe = shutil.which("redis-benchmark")
    if exe is None:
        return None
    res = subprocess.run(
        [exe, "-h", host, "-p", str(port), "-t", "set,get", "-d", str(size), "-n", str(n), "-c", "1", "-P", "1",
         "-r", str(n), "--csv"],
        capture_output=True, text=True, timeout=600,
    )
    rates = dict(re.findall(r'^"(SET|GET)","([0-9.]+)"', res.stdout, flags=re.M))
    if "SET" not in rates or "GET" not in rates:
        return None
    return float(rates["SET"]) * size / GB, float(rates["GET"]) * size / GB


def make_backend(url: str, workers: int, pool_bytes: int) -> tuple[RemoteBackend, LocalCPUBackend]:
    cfg = LMCacheEngineConfig.from_dict({
        "remote_url": url,
        "remote_timeout": 30,
        "extra_config": {"remote_workers": workers, "remote_max_inflight_mb": pool_bytes // 2 // MiB},
    })
    local = LocalCPUBackend(PoolAllocator(pool_bytes), make_policy("LRU"))
    backend = RemoteBackend(cfg, local, namespace="bench")
    assert backend.available, "cannot reach " + backend.url
    return backend, local


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--sizes-mib", default="1,4")
    ap.add_argument("--total-mib", type=int, default=256, help="bytes moved per measurement")
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--url", default=None)
    args = ap.parse_args(argv)
    torch.set_num_threads(1)

    server = None
    url = args.url
    if url is None:
        try:
            server = RedisServer().start()
        except RedisUnavailable as exc:
            raise SystemExit(f"remote tier benchmark: {exc}; or give a running server with --url redis://HOST:PORT")
        url = server.url
    m = re.match(r"redis://([^:/]+):(\d+)", url)
    host, port = (m.group(1), int(m.group(2))) if m else (None, None)
    try:
        client = raw_redis(url)
        pool_bytes = 2 * args.total_mib * MiB + 64 * MiB
        print(f"remote tier benchmark against {url} (redis-server {client.info()['redis_version']}), "
              f"{args.total_mib} MiB per measurement, median of {args.reps}, torch threads = 1")
        header = f"{'size':>6} | {'op':<4} | {'raw redis-py':>12} | {'tier 1 writer':>13} | {'tier 2 writers':>14} | " \
                 f"{'tier/raw':>8} | {'redis-benchmark':>15} | {'tier/redis-bench':>16}"
        print(header)
        print("-" * len(header))
        for size_mib in (int(s) for s in args.sizes_mib.split(",")):
            size = size_mib * MiB
            n = max(8, args.total_mib // size_mib)
            b1, l1 = make_backend(url, 1, pool_bytes)
            b2, l2 = make_backend(url, 2, pool_bytes)
            try:
                # Warm-up writes every key once: timed runs overwrite them (steady state, the
                # server reuses its memory instead of faulting in fresh pages).
                raw_set_get(client, size, n, "r")
                tier_put_get(b1, l1, size, n, 1)
                tier_put_get(b2, l2, size, n, 2)
                raw, t1, t2 = [], [], []
                for _ in range(args.reps):
                    raw.append(raw_set_get(client, size, n, "r"))
                    t1.append(tier_put_get(b1, l1, size, n, 1))
                    t2.append(tier_put_get(b2, l2, size, n, 2))
                client.flushall()
                rb = redis_benchmark(host, port, size, n) if host else None
                client.flushall()
            finally:
                for closable in (b1, b2, l1, l2):
                    closable.close()
            r_put, r_get = (statistics.median(x[i] for x in raw) for i in (0, 1))
            put1, put2 = (statistics.median(x[0] for x in t) for t in (t1, t2))
            get = statistics.median(x[1] for x in t1 + t2)  # same code path in both backends
            bench = rb if rb else (float("nan"), float("nan"))
            rows = (("put", r_put, f"{put1:>8.2f} GB/s | {put2:>9.2f} GB/s", max(put1, put2), bench[0]),
                    ("get", r_get, f"{get:>20.2f} GB/s (one by one)", get, bench[1]))
            for op, r, cols, tier, ref in rows:
                print(f"{size_mib:>3}MiB | {op:<4} | {r:>9.2f} GB/s | {cols} | "
                      f"{tier / r:>8.2f} | {ref:>10.2f} GB/s | {tier / ref:>16.2f}")
        print("tier/raw: best tier put (async writers, flush included) and one-by-one tier get over raw redis-py "
              "one-by-one; target >= 0.8. redis-benchmark: C client, 1 connection, no pipelining.")
        size = max(int(s) for s in args.sizes_mib.split(",")) * MiB
        reader_comparison(url, size, max(8, args.total_mib * MiB // size), args.reps, pool_bytes, r_get)
    finally:
        if server is not None:
            server.cleanup()


if __name__ == "__main__":
    main()
