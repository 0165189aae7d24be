"""Disk tier space is booked when a write is submitted, so a lookup never promises what a
load cannot deliver (queued writes never evict what a lookup just reported).

Real files in a temp directory, real writer threads; nothing is mocked.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import textwrap

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from lmcache.utils import CacheEngineKey
from lmcache.v1.config import LMCacheEngineConfig
from lmcache.v1.memory_management import GiB, MemoryFormat, PoolAllocator
from lmcache.v1.storage_backend.cache_policy import make_policy
from lmcache.v1.storage_backend.disk_file import PAGE, entry_file_name
from lmcache.v1.storage_backend.local_cpu_backend import LocalCPUBackend
from lmcache.v1.storage_backend.local_disk_backend import LocalDiskBackend
from lmcache.v1.testing import KVSpec, make_engine, random_kv_caches, random_slot_mapping

N_KEYS = 8


def key(i: int) -> CacheEngineKey:
    return CacheEngineKey("m", 1, 0, i, torch.uint8)


def pages(i: int) -> int:
    """Payload pages of entry ``i`` (1 to 3), so entries differ in size."""
    return 1 + i % 3


def payload(i: int, gen: int) -> torch.Tensor:
    return torch.full((pages(i) * PAGE,), (i * 31 + gen) % 251, dtype=torch.uint8)


class Harness:
    """A disk tier plus a model of what each key should read back as."""

    def __init__(self, root, capacity_pages: int) -> None:
        cfg = LMCacheEngineConfig.from_dict(
            {"local_disk": str(root), "max_local_disk_size": capacity_pages * PAGE / GiB, "local_cpu": False}
        )
        self.cpu = LocalCPUBackend(PoolAllocator(16 << 20), make_policy("LRU"))
        self.disk = LocalDiskBackend(cfg, self.cpu)
        self.gen = [0] * N_KEYS  # the generation last submitted per key (bytes depend on it)

    def put(self, i: int) -> None:
        self.gen[i] += 1
        obj = self.cpu.allocate((pages(i) * PAGE,), torch.uint8, MemoryFormat.BINARY)
        assert obj is not None
        obj.tensor.copy_(payload(i, self.gen[i]))
        self.disk.submit_put(key(i), obj)
        obj.ref_count_down()

    def promised(self) -> set[int]:
        return {i for i in range(N_KEYS) if self.disk.contains(key(i))}

    def check_readable(self, keys: set[int]) -> None:
        for i in keys:
            obj = self.disk.get_blocking(key(i))
            assert obj is not None, f"key {i} was promised by contains() but does not load"
            try:
                # a key already on disk keeps its first value (puts of present keys are no-ops)
                assert any(torch.equal(obj.tensor, payload(i, g)) for g in range(1, self.gen[i] + 1))
            finally:
                obj.ref_count_down()

    def check_accounting(self) -> None:
        d = self.disk
        assert d.used_bytes + d.reserved_bytes <= d.capacity_bytes
        assert d.reserved_bytes >= 0

    def close(self) -> None:
        self.disk.close()
        self.cpu.close()


ops = st.lists(
    st.one_of(
        st.tuples(st.just("put"), st.integers(0, N_KEYS - 1)),
        st.tuples(st.just("remove"), st.integers(0, N_KEYS - 1)),
        st.tuples(st.just("pin"), st.integers(0, N_KEYS - 1)),
        st.tuples(st.just("unpin"), st.integers(0, N_KEYS - 1)),
        st.tuples(st.just("flush"), st.just(0)),
    ),
    min_size=1,
    max_size=25,
)


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(ops=ops, capacity_pages=st.integers(4, 14))
def test_lookups_never_exceed_what_loads(tmp_path_factory, ops, capacity_pages) -> None:
    h = Harness(tmp_path_factory.mktemp("disk"), capacity_pages)
    try:
        for op, i in ops:
            if op == "put":
                h.put(i)
            elif op == "remove":
                h.disk.remove(key(i))
            elif op == "pin":
                h.disk.contains(key(i), pin=True)
            elif op == "unpin":
                h.disk.unpin(key(i))
            else:
                before = h.promised()
                assert h.disk.flush(30)
                # writes landing evict nothing a lookup reported (no write fails here)
                assert h.promised() == before
            h.check_accounting()
            promised = h.promised()
            h.check_readable(promised)
        assert h.disk.flush(30)
        h.check_accounting()
        assert h.disk.reserved_bytes == 0
        h.check_readable(h.promised())
    finally:
        h.close()


def test_a_queued_write_evicts_at_submit_not_when_it_lands(tmp_path) -> None:
    h = Harness(tmp_path, capacity_pages=2 * (PAGE + PAGE) // PAGE)  # two 1-page entries (header + payload)
    try:
        h.put(0)
        assert h.disk.flush(30)  # one at a time: two writer threads may land them in either order
        h.put(3)
        assert h.disk.flush(30)
        assert h.promised() == {0, 3}
        h.put(6)  # a third 1-page entry: evicts key 0 (LRU) now, before anything is written
        assert h.promised() == {3, 6}  # key 0's file may still exist: it is not adopted back
        assert h.disk.flush(30)
        assert h.promised() == {3, 6}
        h.check_readable({3, 6})
        files = {n for n in os.listdir(h.disk.directory) if n.endswith(".lmc")}
        assert files == {entry_file_name(key(i).to_string()) for i in (3, 6)}  # the writer unlinked key 0's file
        h.put(0)  # evicted and stored again: the new file is kept
        assert h.disk.flush(30)
        assert h.promised() == {0, 6}
        h.check_readable({0, 6})
    finally:
        h.close()


def test_a_sequence_that_does_not_fit_keeps_its_head(tmp_path) -> None:
    h = Harness(tmp_path, capacity_pages=3 * 2)  # three 1-page entries
    try:
        objs = []
        for j in range(5):
            obj = h.cpu.allocate((PAGE,), torch.uint8, MemoryFormat.BINARY)
            obj.tensor.fill_(j)
            objs.append(obj)
        keys = [key(100 + j) for j in range(5)]
        h.disk.batched_submit_put(keys, objs)  # head first; only three fit
        for obj in objs:
            obj.ref_count_down()
        assert [h.disk.contains(k) for k in keys] == [True, True, True, False, False]
        assert h.disk.stats.snapshot()["puts_rejected_no_space"] == 2
        assert h.disk.flush(30)
        assert [h.disk.contains(k) for k in keys] == [True, True, True, False, False]
    finally:
        h.close()


def test_engine_lookup_right_after_store_matches_the_retrieve(tmp_path) -> None:
    """Issue 15 item 5: a disk tier for ~6 chunks, two 6-chunk prompts. Right after the
    second store the lookup of the first already says what a load will deliver."""
    spec = KVSpec(num_layers=2, num_heads=2, head_size=8, num_blocks=64, block_size=16)
    chunk = 16
    entry = PAGE + 2 * spec.num_layers * chunk * spec.hidden * 4  # header page + float32 payload
    cfg = LMCacheEngineConfig.from_dict(
        {
            "chunk_size": chunk,
            "local_cpu": False,  # the CPU pool only stages: lookups are answered by the disk tier
            "max_local_cpu_size": 0.01,
            "local_disk": str(tmp_path),
            "max_local_disk_size": 6.5 * entry / GiB,
        }
    )
    engine = make_engine(spec, cfg)
    try:
        kv = random_kv_caches(spec, seed=1)
        p1, p2 = list(range(96)), list(range(1000, 1096))
        assert engine.store(p1, kvcaches=kv, slot_mapping=random_slot_mapping(spec, 96, seed=1)) == 96
        assert engine.storage_manager.flush(30)
        assert engine.lookup(p1) == 96
        assert engine.store(p2, kvcaches=kv, slot_mapping=random_slot_mapping(spec, 96, seed=2)) == 96
        promised = engine.lookup(p1)  # before the second prompt's writes land
        assert promised < 96
        assert engine.storage_manager.flush(30)
        assert engine.lookup(p1) == promised
        out = [torch.zeros_like(t) for t in kv]
        got = engine.retrieve(p1, kvcaches=out, slot_mapping=random_slot_mapping(spec, 96, seed=3))
        assert int(got.sum()) == promised
        assert engine.lookup(p2) == 96
    finally:
        engine.close()


# ---------------------------------------------------------------------- a filesystem that fills and frees up
_REGROW_CHILD = textwrap.dedent(
    """
    import json, os, sys, torch
    import lmcache.v1.storage_backend.local_disk_backend as ldb
    import lmcache.v1.storage_backend.disk_writer as disk_writer
    from lmcache.utils import CacheEngineKey
    from lmcache.v1.config import LMCacheEngineConfig
    from lmcache.v1.memory_management import MemoryFormat, PoolAllocator
    from lmcache.v1.storage_backend.cache_policy import make_policy
    from lmcache.v1.storage_backend.local_cpu_backend import LocalCPUBackend

    mnt = sys.argv[1]
    ballast = os.path.join(mnt, "ballast")
    with open(ballast, "wb") as f:  # another user of the filesystem takes most of it
        f.write(b"x" * (1536 << 10))
    cfg = LMCacheEngineConfig.from_dict({"local_disk": mnt + "/cache", "max_local_disk_size": 1})
    cpu = LocalCPUBackend(PoolAllocator(64 << 20), make_policy("LRU"))
    disk = ldb.LocalDiskBackend(cfg, cpu)
    def put(i):
        obj = cpu.allocate((64, 1024), torch.uint8, MemoryFormat.BINARY)
        obj.tensor.fill_(i % 251)
        disk.submit_put(CacheEngineKey("m", 1, 0, i, torch.uint8), obj)
        obj.ref_count_down()
        assert disk.flush(30)
    for i in range(10):
        put(i)
    out = {"lowered": disk.capacity_bytes, "after_full": len(disk)}
    os.unlink(ballast)  # the other user frees its space
    disk_writer._REGROW_INTERVAL = 0.0  # check the free space at the next write (normally every 5 s)
    for i in range(10, 40):
        put(i)
    good = 0
    for k in disk.keys():
        obj = disk.get_blocking(k)
        good += obj is not None and bool((obj.tensor == k.chunk_hash % 251).all())
        if obj is not None:
            obj.ref_count_down()
    out.update(disk.stats.snapshot(), regrown=disk.capacity_bytes, indexed=len(disk), good=good)
    disk.close()
    print(json.dumps(out))
    """
)


def test_capacity_lowered_by_a_full_filesystem_grows_back(tmp_path) -> None:
    if shutil.which("unshare") is None:
        pytest.skip("unshare is not available")
    mnt = tmp_path / "mnt"
    mnt.mkdir()
    script = tmp_path / "child.py"
    script.write_text(_REGROW_CHILD)
    cmd = [
        "unshare", "-rm", "sh", "-c",
        'mount -t tmpfs -o size=2m,mode=0700 tmpfs "$1" || exit 77; exec "$2" "$3" "$1"',
        "sh", str(mnt), sys.executable, str(script),
    ]  # fmt: skip
    proc = subprocess.run(cmd, check=False, capture_output=True, text=True, timeout=120)
    if proc.returncode == 77 or "unshare failed" in proc.stderr or "Operation not permitted" in proc.stderr:
        pytest.skip(f"cannot mount a private tmpfs here: {proc.stderr.strip()[:200]}")
    assert proc.returncode == 0, proc.stderr
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    # ~0.5 MiB left for the tier while the ballast is there, ~2 MiB after it is gone (68 KiB entries)
    assert out["disk_full_events"] >= 1 and out["lowered"] < 600 << 10
    assert out["regrown"] > 1 << 20 and out["indexed"] > out["after_full"]
    assert out["writes_completed"] == 40 and out["indexed"] == out["good"]
