"""Disk tier throughput against the raw disk, for the Llama-3-8B chunk shape.

Llama-3-8B: 32 layers, 8 KV heads, head size 128, bf16, 256-token chunks, so one
KV_2LTD chunk is [2, 32, 256, 1024] bf16 = 32 MiB.

Measured in the same run, on the same directory, alternating in rounds (median shown):
- raw write: one file, the same bytes written sequentially in chunk-sized writes from
  the same memory, then fdatasync; buffered and O_DIRECT, the faster one is the limit;
- tier store-to-durable: ``submit_put`` of every chunk, then ``flush()`` (every entry
  file fdatasync'ed, renamed, the directory fsync'ed);
- raw read: the raw file read back sequentially after dropping its page cache,
  buffered and O_DIRECT, the faster one is the limit;
- tier cold retrieve: page cache of every entry file dropped (posix_fadvise
  DONTNEED), then every chunk read back and verified, one by one (``get_blocking``)
  and all prefetched at once (``get_non_blocking``).
Then the index rebuild of a directory with ``--scan-entries`` small entries.

Usage: lmcache bench disk -- [--dir DIR] [--gib 1] [--rounds 3] [--o-direct]
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import tempfile
import time

import torch

from lmcache.bench.limits import LLAMA3_8B
from lmcache.utils import CacheEngineKey
from lmcache.v1.config import LMCacheEngineConfig
from lmcache.v1.memory_management import MemoryFormat, MemoryObj
from lmcache.v1.storage_backend.disk_file import drop_page_cache, entry_file_name, entry_header, write_entry
from lmcache.v1.storage_backend.local_cpu_backend import LocalCPUBackend
from lmcache.v1.storage_backend.local_disk_backend import LocalDiskBackend
from lmcache.v1.storage_backend.storage_manager import StorageManager

CHUNK = 256
SHAPE = (2, LLAMA3_8B.num_layers, CHUNK, LLAMA3_8B.hidden)
DTYPE = LLAMA3_8B.dtype


def _view(obj: MemoryObj) -> memoryview:
    return memoryview(obj.byte_array.numpy())


def raw_write(path: str, objs: list[MemoryObj], o_direct: bool) -> float:
    flags = os.O_WRONLY | os.O_CREAT | os.O_TRUNC | (os.O_DIRECT if o_direct else 0)
    t0 = time.perf_counter()
    fd = os.open(path, flags, 0o600)
    for obj in objs:
        os.write(fd, _view(obj))
    os.fdatasync(fd)
    os.close(fd)
    return time.perf_counter() - t0


def raw_read(path: str, objs: list[MemoryObj], o_direct: bool) -> float:
    drop_page_cache(path)
    t0 = time.perf_counter()
    fd = os.open(path, os.O_RDONLY | (os.O_DIRECT if o_direct else 0))
    for obj in objs:
        os.readv(fd, [_view(obj)])
    os.close(fd)
    return time.perf_counter() - t0


def tier_store(disk: LocalDiskBackend, keys: list[CacheEngineKey], objs: list[MemoryObj]) -> float:
    t0 = time.perf_counter()
    for key, obj in zip(keys, objs):
        disk.submit_put(key, obj)
    assert disk.flush(600), "flush timed out"
    return time.perf_counter() - t0


def drop_tier_cache(disk: LocalDiskBackend, keys: list[CacheEngineKey]) -> None:
    for key in keys:
        drop_page_cache(os.path.join(disk.directory, entry_file_name(key.to_string())))


def tier_read(disk: LocalDiskBackend, keys: list[CacheEngineKey], prefetch: bool) -> float:
    drop_tier_cache(disk, keys)
    t0 = time.perf_counter()
    if prefetch:
        objs = [f.result() for f in [disk.get_non_blocking(k) for k in keys]]
    else:
        objs = []
        for key in keys:
            obj = disk.get_blocking(key)
            objs.append(obj)
            if obj is not None:
                obj.ref_count_down()  # the next read reuses the memory, as retrieve does
    elapsed = time.perf_counter() - t0
    assert all(o is not None for o in objs), "a stored chunk missed"
    if prefetch:
        for obj in objs:
            obj.ref_count_down()
    return elapsed


def bench_scan(root: str, n: int, local_cpu: LocalCPUBackend) -> tuple[float, float, int]:
    """Seconds to open a tier over ``n`` small entries: warm, then with file pages dropped."""
    directory = os.path.join(root, "scan")
    os.makedirs(directory, mode=0o700, exist_ok=True)
    payload = torch.zeros(2 * 4 * 16 * 8, dtype=torch.uint8)
    obj = MemoryObj.from_tensor(payload.view(torch.bfloat16).view(2, 4, 16, 4), MemoryFormat.KV_2LTD)
    for i in range(n):
        key = CacheEngineKey("meta-llama/Meta-Llama-3-8B", 1, 0, i, "bfloat16").to_string()
        write_entry(
            os.path.join(directory, entry_file_name(key)),
            entry_header(key, obj.meta, obj.byte_array),
            obj.byte_array,
            o_direct=False,
            sync=False,
        )
    cfg = LMCacheEngineConfig.from_dict({"local_disk": root, "max_local_disk_size": 64})
    times = []
    for cold in (False, True):
        if cold:
            for name in os.listdir(directory):
                drop_page_cache(os.path.join(directory, name))
        t0 = time.perf_counter()
        disk = LocalDiskBackend(cfg, local_cpu, namespace="scan")
        times.append(time.perf_counter() - t0)
        found = len(disk)
        disk.close()
    shutil.rmtree(directory)
    return times[0], times[1], found


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--dir", default=None, help="directory on the disk to test (default: a temp dir under /tmp)")
    ap.add_argument("--gib", type=float, default=1.0, help="data per round")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--o-direct", action="store_true", help="tier and raw runs use O_DIRECT")
    ap.add_argument("--write-threads", type=int, default=None, help="extra_config.local_disk_write_threads")
    ap.add_argument("--read-threads", type=int, default=None, help="extra_config.local_disk_read_threads")
    ap.add_argument("--scan-entries", type=int, default=10_000)
    args = ap.parse_args(argv)
    torch.set_num_threads(1)

    root = tempfile.mkdtemp(prefix="lmcache-bench-disk-", dir=args.dir)
    chunk_bytes = 2 * LLAMA3_8B.num_layers * CHUNK * LLAMA3_8B.hidden * DTYPE.itemsize
    n = max(1, int(args.gib * (1 << 30)) // chunk_bytes)
    total = n * chunk_bytes
    cfg = LMCacheEngineConfig.from_dict(
        {
            "max_local_cpu_size": (2 * n + 2) * chunk_bytes / (1 << 30),
            "local_disk": root,
            "max_local_disk_size": 2 * total / (1 << 30) + 0.1,
            "extra_config": {
                "local_disk_o_direct": args.o_direct,
                **({"local_disk_write_threads": args.write_threads} if args.write_threads else {}),
                **({"local_disk_read_threads": args.read_threads} if args.read_threads else {}),
            },
        }
    )
    manager = StorageManager(cfg)
    disk = manager.lower[0]
    assert isinstance(disk, LocalDiskBackend)
    print(
        f"dir={root} chunk={chunk_bytes / (1 << 20):.0f} MiB x {n} = {total / (1 << 30):.2f} GiB per round, "
        f"o_direct={disk.o_direct} write_threads={disk.options.write_threads} read_threads={disk.options.read_threads}"
    )

    src = torch.randint(0, 256, (chunk_bytes,), dtype=torch.uint8)
    objs = []
    for i in range(n):
        obj = manager.allocate(SHAPE, DTYPE, MemoryFormat.KV_2LTD)
        assert obj is not None
        obj.byte_array.copy_(src)
        obj.byte_array[:8] = i  # distinct chunks
        objs.append(obj)

    raw_path = os.path.join(root, "raw.bin")
    res: dict[str, list[float]] = {
        k: []
        for k in (
            "raw_write_buffered",
            "raw_write_direct",
            "store",
            "raw_read_buffered",
            "raw_read_direct",
            "get",
            "prefetch",
        )
    }

    def gbps(seconds: float) -> float:
        return total / seconds / 1e9

    def raw_writes() -> None:
        res["raw_write_buffered"].append(gbps(raw_write(raw_path, objs, False)))
        res["raw_write_direct"].append(gbps(raw_write(raw_path, objs, True)))

    def raw_reads() -> None:
        res["raw_read_buffered"].append(gbps(raw_read(raw_path, objs, False)))
        res["raw_read_direct"].append(gbps(raw_read(raw_path, objs, True)))

    ratios: dict[str, list[float]] = {"store": [], "get": [], "prefetch": []}
    for r in range(args.rounds):
        keys = [CacheEngineKey("meta-llama/Meta-Llama-3-8B", 1, 0, (r << 32) | i, "bfloat16") for i in range(n)]
        # alternate which goes first so that drift in the shared disk's speed cancels out
        if r % 2 == 0:
            raw_writes()
            res["store"].append(gbps(tier_store(disk, keys, objs)))
            raw_reads()
            res["get"].append(gbps(tier_read(disk, keys, prefetch=False)))
            res["prefetch"].append(gbps(tier_read(disk, keys, prefetch=True)))
        else:
            res["store"].append(gbps(tier_store(disk, keys, objs)))
            raw_writes()
            res["prefetch"].append(gbps(tier_read(disk, keys, prefetch=True)))
            res["get"].append(gbps(tier_read(disk, keys, prefetch=False)))
            raw_reads()
        raw_w = max(res["raw_write_buffered"][-1], res["raw_write_direct"][-1])
        raw_r = max(res["raw_read_buffered"][-1], res["raw_read_direct"][-1])
        ratios["store"].append(res["store"][-1] / raw_w)
        ratios["get"].append(res["get"][-1] / raw_r)
        ratios["prefetch"].append(res["prefetch"][-1] / raw_r)
        for key in keys:
            disk.remove(key)
        os.unlink(raw_path)
        print(f"round {r}: " + " ".join(f"{k}={v[-1]:.2f}" for k, v in res.items()) + " GB/s")
    for obj in objs:
        obj.ref_count_down()
    stats = disk.stats.snapshot()
    scan = bench_scan(root, args.scan_entries, manager.local_cpu) if args.scan_entries else None
    manager.close()

    med = {k: statistics.median(v) for k, v in res.items()}
    rmed = {k: statistics.median(v) for k, v in ratios.items()}
    print(f"medians over {args.rounds} rounds; raw = the faster of buffered and O_DIRECT in each round;")
    print("ratio = median of the per-round tier/raw ratios")
    print(
        f"raw sequential write + fdatasync      buffered {med['raw_write_buffered']:.2f} GB/s, O_DIRECT {med['raw_write_direct']:.2f} GB/s"
    )
    print(f"tier store-to-durable (flush)         {med['store']:.2f} GB/s  ratio {rmed['store']:.2f} x raw write")
    print(
        f"raw sequential read, cold             buffered {med['raw_read_buffered']:.2f} GB/s, O_DIRECT {med['raw_read_direct']:.2f} GB/s"
    )
    print(f"tier cold retrieve, get_blocking      {med['get']:.2f} GB/s  ratio {rmed['get']:.2f} x raw read")
    print(f"tier cold retrieve, prefetched        {med['prefetch']:.2f} GB/s  ratio {rmed['prefetch']:.2f} x raw read")
    print(
        f"tier counters: corrupt={stats['corrupt_entries']} write_errors={stats['write_errors']} "
        f"dropped={stats['puts_dropped_queue_full']} evictions={stats['evictions']}"
    )

    if scan is not None:
        warm, cold, found = scan
        print(f"index rebuild: {found} entries in {warm:.3f} s warm, {cold:.3f} s with file pages dropped")
    shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    main()
