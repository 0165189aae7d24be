"""Crash safety of the disk tier: kill -9 a writer process mid-store, again and again.

A child process stores batches of 1 MiB entries through LocalDiskBackend in a loop,
printing when a batch is queued and when ``flush()`` made it durable. After a random
number of durable batches the parent waits for the next "queued" line and sends
SIGKILL, so the kill lands while writes are in flight, then opens the directory the way a restarted engine does and
checks that every visible entry reads back bit-identical, that nothing made durable
was lost, and that the dead writer's temp files are gone.
"""

from __future__ import annotations

import os
import random
import signal
import subprocess
import sys
import textwrap

import pytest
import torch

from lmcache.v1.config import LMCacheEngineConfig
from lmcache.v1.memory_management import PoolAllocator
from lmcache.v1.storage_backend.cache_policy import make_policy
from lmcache.v1.storage_backend.local_cpu_backend import LocalCPUBackend
from lmcache.v1.storage_backend.local_disk_backend import LocalDiskBackend

pytestmark = pytest.mark.slow  # writer processes killed mid-store, several rounds

SHAPE = (2, 8, 64, 512)  # fp16: 1 MiB per entry
ROUNDS = 6

_WRITER = textwrap.dedent(
    """
    import sys, torch
    from lmcache.utils import CacheEngineKey
    from lmcache.v1.config import LMCacheEngineConfig
    from lmcache.v1.memory_management import MemoryFormat, PoolAllocator
    from lmcache.v1.storage_backend.cache_policy import make_policy
    from lmcache.v1.storage_backend.local_cpu_backend import LocalCPUBackend
    from lmcache.v1.storage_backend.local_disk_backend import LocalDiskBackend

    root, first = sys.argv[1], int(sys.argv[2])
    cfg = LMCacheEngineConfig.from_dict({"local_disk": root, "max_local_disk_size": 1,
                                         "extra_config": {"local_disk_queue_depth": 8}})
    cpu = LocalCPUBackend(PoolAllocator(64 << 20), make_policy("LRU"))
    disk = LocalDiskBackend(cfg, cpu)
    print("ready", flush=True)
    i = first
    while True:
        batch = []
        for _ in range(8):
            obj = cpu.allocate(SHAPE, torch.float16, MemoryFormat.KV_2LTD)
            g = torch.Generator().manual_seed(i)
            obj.byte_array.copy_(torch.randint(0, 256, (obj.get_size(),), generator=g, dtype=torch.uint8))
            batch.append((CacheEngineKey("m", 1, 0, i, "float16"), obj))
            i += 1
        for key, obj in batch:
            disk.submit_put(key, obj)
            obj.ref_count_down()
        print("submitted", i, flush=True)  # the writers are busy now
        disk.flush()
        print("durable", i, flush=True)
    """
).replace("SHAPE", repr(SHAPE))


def _expected(i: int, nbytes: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(i)
    return torch.randint(0, 256, (nbytes,), generator=g, dtype=torch.uint8)


def test_kill_9_mid_store_leaves_only_verified_entries(tmp_path):
    root = tmp_path / "cache"
    cfg = LMCacheEngineConfig.from_dict({"local_disk": str(root), "max_local_disk_size": 1})
    cpu = LocalCPUBackend(PoolAllocator(64 << 20), make_policy("LRU"))
    rng = random.Random(1234)
    durable: set[int] = set()
    try:
        for r in range(ROUNDS):
            first = r * 100_000
            child = subprocess.Popen(
                [sys.executable, "-c", _WRITER, str(root), str(first)],
                stdout=subprocess.PIPE,
                stderr=subprocess.DEVNULL,
                text=True,
            )
            try:
                assert child.stdout is not None
                assert child.stdout.readline().strip() == "ready"
                flushed = first
                batches = rng.randint(1, 3)
                while True:
                    what, count = child.stdout.readline().split()
                    if what == "durable":
                        flushed = int(count)
                        batches -= 1
                    elif batches == 0:
                        break
                os.kill(child.pid, signal.SIGKILL)  # a batch was just queued: its writes are in flight
            finally:
                child.kill()
                child.wait(timeout=60)
            assert child.returncode == -signal.SIGKILL
            durable.update(range(first, flushed))

            disk = LocalDiskBackend(cfg, cpu)  # the restart
            try:
                stats = disk.stats.snapshot()
                assert stats["corrupt_entries"] == 0
                leftovers = [n for n in os.listdir(disk.directory) if n.endswith(".tmp")]
                assert leftovers == [], leftovers
                visible = {k.chunk_hash for k in disk.keys()}
                assert durable <= visible, sorted(durable - visible)[:5]  # nothing flushed was lost
                for k in disk.keys():
                    obj = disk.get_blocking(k)
                    assert obj is not None, k
                    assert torch.equal(obj.byte_array, _expected(k.chunk_hash, obj.get_size()))
                    obj.ref_count_down()
                assert disk.stats.snapshot()["corrupt_entries"] == 0
            finally:
                disk.close()
    finally:
        cpu.close()
