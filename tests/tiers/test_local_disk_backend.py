"""LocalDiskBackend: persistence, verification, eviction, concurrency, failures.

Everything runs on real files (pytest's tmp_path); restarts run in fresh processes
where the point is a new process; disk-full and read-only filesystems are real tmpfs
mounts inside a private user+mount namespace (skipped where unshare is unavailable).
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import stat
import subprocess
import sys
import textwrap
import threading

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from lmcache.utils import CacheEngineKey, LayerCacheEngineKey
from lmcache.v1.config import ConfigError, LMCacheEngineConfig
from lmcache.v1.memory_management import MemoryFormat, MemoryObj, PoolAllocator
from lmcache.v1.storage_backend.cache_policy import make_policy
from lmcache.v1.storage_backend.disk_file import PAGE, entry_file_name
from lmcache.v1.storage_backend.local_cpu_backend import LocalCPUBackend
from lmcache.v1.storage_backend.local_disk_backend import LocalDiskBackend
from lmcache.v1.testing import KVSpec, make_engine, random_kv_caches, random_slot_mapping

LOGGER = "lmcache.v1.storage_backend.local_disk_backend"
SHAPE = (2, 2, 16, 64)  # KV_2LTD, 8 KiB in bf16
DTYPE = torch.bfloat16
ENTRY_BYTES = PAGE + 2 * 2 * 16 * 64 * 2  # header page + payload


def key(i: int, model: str = "m") -> CacheEngineKey:
    return CacheEngineKey(model, 1, 0, i, "bfloat16")


def disk_config(path, size_gib: float = 0.01, **extra) -> LMCacheEngineConfig:
    data = {"local_disk": f"file://{path}", "max_local_disk_size": size_gib}
    if "cache_policy" in extra:
        data["cache_policy"] = extra.pop("cache_policy")
    if extra:
        data["extra_config"] = {f"local_disk_{k}": v for k, v in extra.items()}
    return LMCacheEngineConfig.from_dict(data)


def expected_bytes(i: int, shape=SHAPE, dtype=DTYPE) -> torch.Tensor:
    n = torch.Size(shape).numel() * dtype.itemsize
    g = torch.Generator().manual_seed(i)
    return torch.randint(0, 256, (n,), generator=g, dtype=torch.uint8)


class Tiers:
    """A CPU tier plus disk tiers opened on one directory; closes everything at the end."""

    def __init__(self, root) -> None:
        self.root = root
        self.cpu = LocalCPUBackend(PoolAllocator(64 << 20), make_policy("LRU"))
        self.opened: list[LocalDiskBackend] = []

    def disk(self, size_gib: float = 0.01, namespace: str = "kv", **extra) -> LocalDiskBackend:
        backend = LocalDiskBackend(disk_config(self.root, size_gib, **extra), self.cpu, namespace=namespace)
        self.opened.append(backend)
        return backend

    def obj(self, i: int, shape=SHAPE, dtype=DTYPE) -> MemoryObj:
        obj = self.cpu.allocate(shape, dtype, MemoryFormat.KV_2LTD)
        assert obj is not None
        obj.byte_array.copy_(expected_bytes(i, shape, dtype))
        return obj

    def put(self, disk: LocalDiskBackend, i: int, k: CacheEngineKey | None = None, **kw) -> None:
        obj = self.obj(i, **kw)
        disk.submit_put(k if k is not None else key(i), obj)
        obj.ref_count_down()

    def close(self) -> None:
        for backend in self.opened:
            backend.close()
        self.cpu.close()


@pytest.fixture
def tiers(tmp_path):
    t = Tiers(tmp_path / "cache")
    yield t
    t.close()


def read_back(disk: LocalDiskBackend, k: CacheEngineKey) -> torch.Tensor | None:
    obj = disk.get_blocking(k)
    if obj is None:
        return None
    data = obj.byte_array.clone()
    obj.ref_count_down()
    return data


def entry_path(disk: LocalDiskBackend, k: CacheEngineKey) -> str:
    return os.path.join(disk.directory, entry_file_name(k.to_string()))


# ---------------------------------------------------------------------- round trips
@pytest.mark.parametrize("o_direct", [False, True])
@pytest.mark.parametrize(
    "shape,dtype",
    [(SHAPE, torch.bfloat16), ((2, 3, 7, 5), torch.float32), ((1, 2, 33, 17), torch.float16), ((3000,), torch.uint8)],
)
def test_round_trip_is_bit_identical(tiers, o_direct, shape, dtype):
    disk = tiers.disk(o_direct=o_direct)
    tiers.put(disk, 1, shape=shape, dtype=dtype)
    assert disk.contains(key(1))
    assert disk.flush(30)
    obj = disk.get_blocking(key(1))
    assert obj is not None and obj.ref_count == 1
    assert obj.shape == shape and obj.dtype == dtype and obj.fmt is MemoryFormat.KV_2LTD
    assert torch.equal(obj.byte_array, expected_bytes(1, shape, dtype))
    obj.ref_count_down()
    assert tiers.cpu.allocator.used_bytes == 0  # the tier dropped its reference after the write


def test_o_direct_with_unaligned_memory(tiers):
    disk = tiers.disk(o_direct=True)
    raw = torch.empty(3 * PAGE + 1, dtype=torch.uint8)
    data = expected_bytes(5, (2, 2, 16, 33))
    raw[1 : 1 + data.numel()] = data
    obj = MemoryObj.from_tensor(raw[1 : 1 + data.numel()], MemoryFormat.BINARY)
    assert obj.byte_array.data_ptr() % PAGE != 0
    disk.submit_put(key(5), obj)
    assert disk.flush(30)
    assert torch.equal(read_back(disk, key(5)), data)


def test_o_direct_refused_falls_back_to_buffered(tiers, monkeypatch, caplog):
    import lmcache.v1.storage_backend.local_disk_backend as mod

    monkeypatch.setattr(mod, "o_direct_supported", lambda directory: False)
    with caplog.at_level(logging.WARNING, logger=LOGGER):
        disk = tiers.disk(o_direct=True)
    assert not disk.o_direct
    assert sum("O_DIRECT" in r.getMessage() for r in caplog.records) == 1
    tiers.put(disk, 2)
    assert disk.flush(30)
    assert torch.equal(read_back(disk, key(2)), expected_bytes(2))


def test_put_is_visible_at_once_and_readable_before_the_write_finishes(tiers):
    disk = tiers.disk()
    for i in range(20):
        tiers.put(disk, i)
        assert disk.contains(key(i))  # queued or on disk, never a gap
        assert torch.equal(read_back(disk, key(i)), expected_bytes(i))
    assert disk.flush(30)
    s = disk.stats.snapshot()
    assert s["puts_accepted"] + s["puts_dropped_queue_full"] == 20
    assert s["writes_completed"] == s["puts_accepted"]


def test_layer_keys_and_request_configs_round_trip(tiers):
    disk = tiers.disk()
    base = CacheEngineKey("org/model a", 2, 1, 2**127 + 3, "bfloat16", (("cache_salt", "x y"),))
    keys = [base, *base.split_layers(3)]
    for i, k in enumerate(keys):
        tiers.put(disk, i, k)
    assert disk.flush(30)
    again = tiers.disk()
    assert set(again.keys()) == set(keys)
    assert any(isinstance(k, LayerCacheEngineKey) for k in again.keys())
    for i, k in enumerate(keys):
        assert torch.equal(read_back(again, k), expected_bytes(i))


def test_files_and_directory_are_private_and_namespaced(tiers):
    kv = tiers.disk(namespace="kv")
    ec = tiers.disk(namespace="ec")
    tiers.put(kv, 1)
    tiers.put(ec, 2, key(1))  # same key, other namespace, other bytes
    assert kv.flush(30) and ec.flush(30)
    assert kv.directory != ec.directory
    for disk in (kv, ec):
        assert stat.S_IMODE(os.stat(disk.directory).st_mode) == 0o700
        path = entry_path(disk, key(1))
        assert stat.S_IMODE(os.stat(path).st_mode) == 0o600
        assert len(os.path.basename(path)) == 32 + len(".lmc")
    assert torch.equal(read_back(kv, key(1)), expected_bytes(1))
    assert torch.equal(read_back(ec, key(1)), expected_bytes(2))


def test_remove_and_pins(tiers):
    disk = tiers.disk()
    tiers.put(disk, 1)
    assert disk.flush(30)
    assert disk.remove(key(1))
    assert not os.path.exists(entry_path(disk, key(1)))
    assert not disk.contains(key(1)) and not disk.remove(key(1))
    assert read_back(disk, key(1)) is None
    assert not disk.unpin(key(1))


def test_get_non_blocking(tiers):
    disk = tiers.disk()
    for i in range(4):
        tiers.put(disk, i)
    assert disk.flush(30)
    futures = [disk.get_non_blocking(key(i)) for i in range(5)]
    objs = [f.result(timeout=30) for f in futures]
    assert objs[4] is None
    for i, obj in enumerate(objs[:4]):
        assert torch.equal(obj.byte_array, expected_bytes(i))
        obj.ref_count_down()


# ---------------------------------------------------------------------- restart
def test_restart_rebuilds_the_index_and_removes_dead_writers_temp_files(tiers):
    disk = tiers.disk()
    for i in range(6):
        tiers.put(disk, i)
    assert disk.flush(30)
    disk.close()
    stale = os.path.join(disk.directory, "0" * 32 + ".deadbeef01.7.tmp")  # owner without a lock: gone
    with open(stale, "wb") as f:
        f.write(b"half an entry")
    foreign = os.path.join(disk.directory, "notes.txt")  # not ours: left alone
    with open(foreign, "w") as f:
        f.write("keep me")
    again = tiers.disk()
    s = again.stats.snapshot()
    assert s["indexed_at_start"] == 6 and s["temp_files_removed"] == 1 and s["corrupt_entries"] == 0
    assert not os.path.exists(stale) and os.path.exists(foreign)
    assert again.used_bytes == 6 * ENTRY_BYTES
    for i in range(6):
        assert torch.equal(read_back(again, key(i)), expected_bytes(i))


def test_temp_files_of_a_live_owner_survive_a_scan(tiers):
    live = tiers.disk()
    tmp = os.path.join(live.directory, f"{'1' * 32}.{live.owner_token}.1.tmp")
    with open(tmp, "wb") as f:
        f.write(b"in progress")
    other = tiers.disk()
    assert os.path.exists(tmp)
    assert other.stats.snapshot()["temp_files_removed"] == 0


def test_restart_with_a_smaller_limit_evicts_the_oldest(tiers):
    disk = tiers.disk()
    for i in range(8):
        tiers.put(disk, i)
    assert disk.flush(30)
    disk.close()
    for i in range(8):  # the scan orders by modification time: make it unambiguous
        t = 1_700_000_000_000_000_000 + i * 1_000_000_000
        os.utime(entry_path(disk, key(i)), ns=(t, t))
    small = tiers.disk(size_gib=3.5 * ENTRY_BYTES / (1 << 30))
    assert len(small) == 3 and small.used_bytes <= small.capacity_bytes
    assert set(small.keys()) == {key(5), key(6), key(7)}
    assert small.stats.snapshot()["evictions"] == 5
    assert len([n for n in os.listdir(small.directory) if n.endswith(".lmc")]) == 3


_ENGINE_CHILD = textwrap.dedent(
    """
    import sys, torch
    from lmcache.v1.config import LMCacheEngineConfig
    from lmcache.v1.testing import KVSpec, make_engine, random_kv_caches, random_slot_mapping
    spec = KVSpec(layout="flash_attn", dtype=torch.bfloat16, num_blocks=16, block_size=8)
    cfg = LMCacheEngineConfig.from_dict({"chunk_size": 16, "max_local_cpu_size": 0.05,
                                         "local_disk": sys.argv[1], "max_local_disk_size": 0.05})
    engine = make_engine(spec, cfg)
    kv = random_kv_caches(spec, seed=11)
    tokens = torch.arange(1000, 1096)
    stored = engine.store(tokens, kvcaches=kv, slot_mapping=random_slot_mapping(spec, 96, seed=12))
    engine.close()  # finishes the queued disk writes
    print(stored)
    """
)


def gather(kv: list[torch.Tensor], slots: torch.Tensor) -> torch.Tensor:
    """flash_attn layout [2, blocks, block_size, heads, head] -> [layers, 2, tokens, heads, head]."""
    return torch.stack([layer.flatten(1, 2)[:, slots] for layer in kv])


@pytest.mark.slow  # a second process
def test_restart_persistence_in_a_new_process(tmp_path):
    """A store in one process is retrieved bit-identical by a new engine in another."""
    root = tmp_path / "cache"
    out = subprocess.run(
        [sys.executable, "-c", _ENGINE_CHILD, str(root)], check=False, capture_output=True, text=True, timeout=120
    )
    assert out.returncode == 0, out.stderr
    assert int(out.stdout.split()[-1]) == 96

    spec = KVSpec(layout="flash_attn", dtype=torch.bfloat16, num_blocks=16, block_size=8)
    cfg = LMCacheEngineConfig.from_dict(
        {"chunk_size": 16, "max_local_cpu_size": 0.05, "local_disk": str(root), "max_local_disk_size": 0.05}
    )
    engine = make_engine(spec, cfg)
    try:
        tokens = torch.arange(1000, 1096)
        assert engine.lookup(tokens) == 96
        kv = [torch.zeros_like(t) for t in random_kv_caches(spec, seed=11)]
        slots = random_slot_mapping(spec, 96, seed=99)  # other slots than the writer's
        assert bool(engine.retrieve(tokens, kvcaches=kv, slot_mapping=slots).all())
        original = gather(random_kv_caches(spec, seed=11), random_slot_mapping(spec, 96, seed=12))
        assert torch.equal(gather(kv, slots).view(torch.uint8), original.view(torch.uint8))
    finally:
        engine.close()


def test_engine_serves_from_disk_after_cpu_eviction_and_in_a_new_engine(tmp_path):
    spec = KVSpec(layout="flash_attn", dtype=torch.float16, num_blocks=16, block_size=8)
    cfg = LMCacheEngineConfig.from_dict(
        {"chunk_size": 16, "max_local_cpu_size": 0.05, "local_disk": str(tmp_path), "max_local_disk_size": 0.05}
    )
    kv = random_kv_caches(spec, seed=3)
    slots = random_slot_mapping(spec, 64, seed=4)
    tokens = torch.arange(64)
    engine = make_engine(spec, cfg)
    assert engine.store(tokens, kvcaches=kv, slot_mapping=slots) == 64
    assert engine.storage_manager.flush(30)
    keys = engine.keys(tokens)
    for k in keys:  # the CPU tier loses everything
        assert engine.storage_manager.local_cpu.remove(k)
    out = [torch.zeros_like(t) for t in kv]
    assert bool(engine.retrieve(tokens, kvcaches=out, slot_mapping=slots).all())
    assert torch.equal(gather(out, slots), gather(kv, slots))
    assert all(engine.storage_manager.local_cpu.contains(k) for k in keys)  # hits were promoted
    engine.close()

    fresh = make_engine(spec, cfg)
    out = [torch.zeros_like(t) for t in kv]
    assert fresh.lookup(tokens) == 64
    assert bool(fresh.retrieve(tokens, kvcaches=out, slot_mapping=slots).all())
    assert torch.equal(gather(out, slots), gather(kv, slots))
    fresh.close()


# ---------------------------------------------------------------------- corruption
def _flip(path: str, offset: int) -> None:
    with open(path, "r+b") as f:
        f.seek(offset)
        b = f.read(1)
        f.seek(offset)
        f.write(bytes([b[0] ^ 0x01]))


def _truncate(path: str, offset: int) -> None:
    os.truncate(path, offset)


def _swap(path: str, other: str) -> None:
    shutil.copyfile(other, path)


def _append(path: str) -> None:
    with open(path, "ab") as f:
        f.write(b"x")


@pytest.mark.parametrize(
    "damage",
    [
        pytest.param(lambda p, o: _flip(p, PAGE + 100), id="payload-byte"),
        pytest.param(lambda p, o: _flip(p, 10), id="header-byte"),
        pytest.param(lambda p, o: _flip(p, PAGE - 100), id="header-padding"),
        pytest.param(lambda p, o: _flip(p, PAGE - 1), id="header-checksum"),
        pytest.param(lambda p, o: _truncate(p, PAGE + 10), id="truncated"),
        pytest.param(lambda p, o: _truncate(p, 0), id="empty"),
        pytest.param(lambda p, o: _swap(p, o), id="other-entrys-file"),
        pytest.param(lambda p, o: _append(p), id="appended"),
    ],
)
@pytest.mark.parametrize("when", ["on-read", "at-restart"])
def test_corruption_is_a_counted_miss(tiers, damage, when):
    disk = tiers.disk()
    tiers.put(disk, 1)
    tiers.put(disk, 2)
    assert disk.flush(30)
    path = entry_path(disk, key(1))
    damage(path, entry_path(disk, key(2)))
    if when == "at-restart":  # the scan reads headers only: payload damage is found by the read
        disk = tiers.disk()
    assert read_back(disk, key(1)) is None
    assert disk.stats.snapshot()["corrupt_entries"] == 1
    assert not os.path.exists(path) and not disk.contains(key(1))
    assert torch.equal(read_back(disk, key(2)), expected_bytes(2))  # the neighbour is untouched


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(offset=st.integers(0, ENTRY_BYTES - 1), bit=st.integers(0, 7))
def test_any_single_bit_flip_is_detected(tmp_path_factory, offset, bit):
    t = Tiers(tmp_path_factory.mktemp("flip"))
    try:
        disk = t.disk()
        t.put(disk, 7)
        assert disk.flush(30)
        path = entry_path(disk, key(7))
        with open(path, "r+b") as f:
            f.seek(offset)
            b = f.read(1)[0]
            f.seek(offset)
            f.write(bytes([b ^ (1 << bit)]))
        assert read_back(disk, key(7)) is None
        assert disk.stats.snapshot()["corrupt_entries"] == 1
    finally:
        t.close()


# ---------------------------------------------------------------------- size limit
@pytest.mark.parametrize("policy", ["LRU", "FIFO", "LFU"])
def test_size_limit_evicts_only_what_is_needed(tiers, policy):
    disk = tiers.disk(size_gib=4 * ENTRY_BYTES / (1 << 30), cache_policy=policy)
    for i in range(4):
        tiers.put(disk, i)
        assert disk.flush(30)
    assert len(disk) == 4 and disk.stats.snapshot()["evictions"] == 0
    obj = disk.get_blocking(key(0))  # a hit on the oldest
    obj.ref_count_down()
    tiers.put(disk, 4)
    assert disk.flush(30)
    assert len(disk) == 4 and disk.used_bytes <= disk.capacity_bytes
    assert disk.stats.snapshot()["evictions"] == 1
    survivors = set(disk.keys())
    expected_victim = {"LRU": key(1), "FIFO": key(0), "LFU": key(1)}[policy]
    assert expected_victim not in survivors and key(4) in survivors
    names = {n for n in os.listdir(disk.directory) if n.endswith(".lmc")}
    assert names == {entry_file_name(k.to_string()) for k in survivors}


def test_entry_larger_than_the_tier_is_rejected_without_evicting(tiers):
    disk = tiers.disk(size_gib=3 * ENTRY_BYTES / (1 << 30))
    tiers.put(disk, 1)
    assert disk.flush(30)
    big = (2, 2, 128, 64)  # 64 KiB payload > the 36 KiB tier
    tiers.put(disk, 2, shape=big)
    assert disk.flush(30)
    s = disk.stats.snapshot()
    assert s["puts_rejected_too_large"] == 1 and s["evictions"] == 0
    assert not disk.contains(key(2)) and disk.contains(key(1))


def test_unstorable_dtype_is_a_counted_write_error_that_frees_its_space(tiers):
    disk = tiers.disk(size_gib=ENTRY_BYTES / (1 << 30))
    odd = MemoryObj.from_tensor(torch.zeros(8, dtype=torch.complex64), MemoryFormat.BINARY)
    disk.submit_put(key(1), odd)
    assert disk.flush(30)
    assert disk.stats.snapshot()["write_errors"] == 1 and not disk.contains(key(1))
    assert odd.ref_count == 1  # the tier gave its reference back
    tiers.put(disk, 2)  # the whole tier is free again
    assert disk.flush(30) and disk.contains(key(2))


def test_pinned_entries_are_never_evicted(tiers):
    disk = tiers.disk(size_gib=2 * ENTRY_BYTES / (1 << 30))
    for i in range(2):
        tiers.put(disk, i)
    assert disk.flush(30)
    assert disk.contains(key(0), pin=True) and disk.contains(key(1), pin=True)
    tiers.put(disk, 2)
    assert disk.flush(30)
    assert disk.stats.snapshot()["puts_rejected_no_space"] == 1
    assert set(disk.keys()) == {key(0), key(1)}
    assert disk.unpin(key(0))
    tiers.put(disk, 3)
    assert disk.flush(30)
    assert set(disk.keys()) == {key(1), key(3)}


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(
    ops=st.lists(
        st.tuples(st.sampled_from(["put", "get", "remove", "restart"]), st.integers(0, 7), st.integers(0, 3)),
        min_size=1,
        max_size=30,
    )
)
def test_model_based_puts_gets_removes_restarts(tmp_path_factory, ops):
    """Against a dict model: a hit always returns the bytes last put; the limit always holds."""
    t = Tiers(tmp_path_factory.mktemp("model"))
    capacity = 5 * ENTRY_BYTES
    try:
        disk = t.disk(size_gib=capacity / (1 << 30))
        model: dict[int, int] = {}  # key -> seed of the bytes last put
        for op, k, version in ops:
            seed = k * 10 + version
            if op == "put":
                if not disk.contains(key(k)):  # present keys are not rewritten (like the engine)
                    t.put(disk, seed, key(k))
                    model[k] = seed
            elif op == "get":
                data = read_back(disk, key(k))
                if data is not None:
                    assert k in model and torch.equal(data, expected_bytes(model[k]))
            elif op == "remove":
                disk.remove(key(k))
                model.pop(k, None)
            else:
                disk.close()
                disk = t.disk(size_gib=capacity / (1 << 30))
            assert disk.flush(30)
            assert disk.used_bytes <= capacity
            names = {n for n in os.listdir(disk.directory) if n.endswith(".lmc")}
            assert names == {entry_file_name(x.to_string()) for x in disk.keys()}
        assert disk.stats.snapshot()["corrupt_entries"] == 0
    finally:
        t.close()


# ---------------------------------------------------------------------- concurrency
def test_concurrent_readers_and_writers(tiers):
    disk = tiers.disk(size_gib=0.02, write_threads=3, read_threads=3, queue_depth=16)
    n_writers, per_writer = 3, 40
    errors: list[BaseException] = []
    done = threading.Event()

    def writer(w: int) -> None:
        try:
            for j in range(per_writer):
                tiers.put(disk, w * 1000 + j)
        except BaseException as exc:  # noqa: BLE001 - reported below
            errors.append(exc)

    def reader() -> None:
        try:
            while not done.is_set():
                for w in range(n_writers):
                    for j in range(0, per_writer, 7):
                        k = key(w * 1000 + j)
                        fut = disk.get_non_blocking(k) if j % 2 else None
                        obj = fut.result(timeout=30) if fut is not None else disk.get_blocking(k)
                        if obj is not None:
                            assert torch.equal(obj.byte_array, expected_bytes(w * 1000 + j))
                            obj.ref_count_down()
        except BaseException as exc:  # noqa: BLE001 - reported below
            errors.append(exc)

    readers = [threading.Thread(target=reader) for _ in range(3)]
    writers = [threading.Thread(target=writer, args=(w,)) for w in range(n_writers)]
    for t in readers + writers:
        t.start()
    for t in writers:
        t.join()
    assert disk.flush(60)
    done.set()
    for t in readers:
        t.join()
    assert not errors, errors
    s = disk.stats.snapshot()
    assert s["puts_accepted"] + s["puts_dropped_queue_full"] == n_writers * per_writer
    assert s["writes_completed"] == s["puts_accepted"] and s["corrupt_entries"] == 0
    for k in disk.keys():
        assert torch.equal(read_back(disk, k), expected_bytes(k.chunk_hash))


# ---------------------------------------------------------------------- bad paths
def test_path_that_is_a_file_is_a_config_error(tmp_path, tiers):
    f = tmp_path / "file"
    f.write_text("x")
    for bad in (f, f / "sub"):
        with pytest.raises(ConfigError, match="local_disk"):
            LocalDiskBackend(disk_config(bad), tiers.cpu)


@pytest.mark.parametrize(
    "extra,match",
    [
        ({"local_disk_o_direct": "maybe"}, "local_disk_o_direct"),
        ({"local_disk_write_threads": 0}, "local_disk_write_threads"),
        ({"local_disk_queue_depth": "many"}, "local_disk_queue_depth"),
    ],
)
def test_bad_options_are_config_errors(tmp_path, tiers, extra, match):
    cfg = LMCacheEngineConfig.from_dict({"local_disk": str(tmp_path), "max_local_disk_size": 1, "extra_config": extra})
    with pytest.raises(ConfigError, match=match):
        LocalDiskBackend(cfg, tiers.cpu)


def test_bad_namespace_and_empty_path(tmp_path, tiers):
    with pytest.raises(ValueError, match="namespace"):
        LocalDiskBackend(disk_config(tmp_path), tiers.cpu, namespace="../kv")
    cfg = disk_config(tmp_path)
    cfg.local_disk = "file://"
    with pytest.raises(ConfigError, match="local_disk"):
        LocalDiskBackend(cfg, tiers.cpu)


@pytest.mark.skipif(os.geteuid() == 0, reason="root ignores directory permissions")
def test_unwritable_directory_is_a_config_error(tmp_path, tiers):
    parent = tmp_path / "ro"
    parent.mkdir(mode=0o500)
    with pytest.raises(ConfigError, match="local_disk"):
        LocalDiskBackend(disk_config(parent / "cache"), tiers.cpu)


def test_directory_removed_at_run_time_disables_the_tier(tmp_path, caplog):
    spec = KVSpec(layout="flash_attn", dtype=torch.float32, num_blocks=16, block_size=8)
    cfg = LMCacheEngineConfig.from_dict(
        {"chunk_size": 16, "max_local_cpu_size": 0.05, "local_disk": str(tmp_path / "c"), "max_local_disk_size": 0.05}
    )
    engine = make_engine(spec, cfg)
    disk = engine.storage_manager.lower[0]
    kv = random_kv_caches(spec, seed=5)
    try:
        assert engine.store(torch.arange(32), kvcaches=kv, slot_mapping=random_slot_mapping(spec, 32, seed=1)) == 32
        assert disk.flush(30)
        shutil.rmtree(tmp_path / "c")
        with caplog.at_level(logging.WARNING, logger=LOGGER):
            for start in (100, 200, 300):  # writes fail: the tier turns itself off once
                tokens = torch.arange(start, start + 32)
                assert engine.store(tokens, kvcaches=kv, slot_mapping=random_slot_mapping(spec, 32, seed=2)) == 32
                assert disk.flush(30)
        assert disk.disabled_reason is not None and "removed" in disk.disabled_reason
        assert [r.levelname for r in caplog.records if "disabled" in r.getMessage()] == ["ERROR"]
        assert disk.get_blocking(engine.keys(torch.arange(32))[0]) is None
        out = [torch.zeros_like(t) for t in kv]  # the engine still serves from memory
        slots = random_slot_mapping(spec, 32, seed=2)
        assert bool(engine.retrieve(torch.arange(300, 332), kvcaches=out, slot_mapping=slots).all())
    finally:
        engine.close()


# ---------------------------------------------------------------------- real full / read-only filesystems
_NS_CHILD = textwrap.dedent(
    """
    import json, logging, subprocess, sys, torch
    from lmcache.utils import CacheEngineKey
    from lmcache.v1.config import ConfigError, LMCacheEngineConfig
    from lmcache.v1.memory_management import MemoryFormat, PoolAllocator
    from lmcache.v1.storage_backend.cache_policy import make_policy
    from lmcache.v1.storage_backend.local_cpu_backend import LocalCPUBackend
    from lmcache.v1.storage_backend.local_disk_backend import LocalDiskBackend

    class Count(logging.Handler):
        def __init__(self):
            super().__init__(logging.WARNING)
            self.messages = []
        def emit(self, record):
            self.messages.append(record.getMessage())
    counter = Count()
    logging.getLogger("lmcache").addHandler(counter)
    scenario, mnt = sys.argv[1], sys.argv[2]
    cfg = LMCacheEngineConfig.from_dict({"local_disk": mnt + "/cache", "max_local_disk_size": 1})
    cpu = LocalCPUBackend(PoolAllocator(64 << 20), make_policy("LRU"))
    out = {}
    if scenario == "ro-start":
        subprocess.run(["mount", "-o", "remount,ro", mnt], check=True)
        try:
            LocalDiskBackend(cfg, cpu)
            out["error"] = None
        except ConfigError as exc:
            out["error"] = str(exc)
        print(json.dumps(out)); sys.exit(0)
    disk = LocalDiskBackend(cfg, cpu)
    def put(i):
        obj = cpu.allocate((64, 1024), torch.uint8, MemoryFormat.BINARY)
        obj.tensor.fill_(i % 251)
        disk.submit_put(CacheEngineKey("m", 1, 0, i, "uint8"), obj)
        obj.ref_count_down()
        disk.flush(30)
    for i in range(4):
        put(i)
    if scenario == "ro":
        subprocess.run(["mount", "-o", "remount,ro", mnt], check=True)
    for i in range(4, 40):
        put(i)
    good = 0
    for k in disk.keys():
        obj = disk.get_blocking(k)
        good += obj is not None and bool((obj.tensor == k.chunk_hash % 251).all())
        if obj is not None:
            obj.ref_count_down()
    last = disk.get_blocking(CacheEngineKey("m", 1, 0, 39, "uint8"))
    out.update(disk.stats.snapshot(), disabled=disk.disabled_reason, indexed=len(disk), good=good,
               messages=counter.messages, capacity=disk.capacity_bytes, last_readable=last is not None)
    if last is not None:
        last.ref_count_down()
    disk.close()
    print(json.dumps(out))
    """
)


def _run_in_private_tmpfs(tmp_path, scenario: str, size: str = "1m") -> dict:
    """Run the child scenario on a real tmpfs of ``size`` mounted in a private namespace."""
    if shutil.which("unshare") is None:
        pytest.skip("unshare is not available")
    mnt = tmp_path / "mnt"
    mnt.mkdir()
    script = tmp_path / "child.py"
    script.write_text(_NS_CHILD)
    cmd = [
        "unshare", "-rm", "sh", "-c",
        f'mount -t tmpfs -o size={size},mode=0700 tmpfs "$1" || exit 77; exec "$2" "$3" "$4" "$1"',
        "sh", str(mnt), sys.executable, str(script), scenario,
    ]  # fmt: skip
    proc = subprocess.run(cmd, check=False, capture_output=True, text=True, timeout=120)
    if proc.returncode == 77 or "unshare failed" in proc.stderr or "Operation not permitted" in proc.stderr:
        pytest.skip(f"cannot mount a private tmpfs here: {proc.stderr.strip()[:200]}")
    assert proc.returncode == 0, proc.stderr
    return json.loads(proc.stdout.strip().splitlines()[-1])


def test_disk_full_lowers_capacity_and_keeps_caching_with_one_log_line(tmp_path):
    # max_local_disk_size is 1 GiB on a 1 MiB filesystem: ~15 of the 40 entries fit at once
    out = _run_in_private_tmpfs(tmp_path, "full")
    assert out["disabled"] is None  # a full disk is not fatal
    assert out["disk_full_events"] >= 1
    assert out["capacity"] < 1 << 20  # lowered to what the filesystem gives
    assert out["writes_completed"] == 40  # it kept caching: every write after the first ENOSPC landed
    assert out["evictions"] > 0 and out["last_readable"]
    assert out["indexed"] == out["writes_completed"] - out["evictions"] == out["good"]
    logged = [m for m in out["messages"] if "can be used" not in m]  # minus the start-up free-space warning
    assert len(logged) == 1 and "filesystem full" in logged[0]


def test_read_only_at_run_time_disables_the_tier(tmp_path):
    out = _run_in_private_tmpfs(tmp_path, "ro")
    assert out["disabled"] is not None and out["writes_completed"] == 4
    assert out["indexed"] == 0 and out["corrupt_entries"] == 0
    logged = [m for m in out["messages"] if "can be used" not in m]
    assert len(logged) == 1 and "disabled" in logged[0]


def test_read_only_at_start_is_a_config_error(tmp_path):
    out = _run_in_private_tmpfs(tmp_path, "ro-start")
    assert out["error"] is not None and "local_disk" in out["error"]


# ---------------------------------------------------------------------- shared directory, live
def test_entries_written_by_another_tier_after_start_are_found(tiers):
    reader = tiers.disk()  # opened (and scanned) before the writer writes anything
    writer = tiers.disk()
    assert not reader.contains(key(7))
    tiers.put(writer, 7)
    assert writer.flush(10)
    assert reader.contains(key(7))  # found through the file, without a restart
    assert torch.equal(read_back(reader, key(7)), expected_bytes(7))
    assert reader.stats.snapshot()["adopted"] == 1
    tiers.put(writer, 8)
    assert writer.flush(10)
    assert torch.equal(read_back(reader, key(8)), expected_bytes(8))  # get alone finds it too
    # a file holding another key under this key's name is not adopted
    os.replace(entry_path(writer, key(8)), entry_path(writer, key(9)))
    assert not tiers.disk().contains(key(9))


def test_batched_contains_is_the_per_key_prefix(tiers):
    """Indexed, pending and another writer's entries count; the first absent key ends it."""
    reader = tiers.disk()
    writer = tiers.disk()
    for i in (0, 1):
        tiers.put(reader, i)  # pending or indexed in the reader
    assert reader.flush(10)
    tiers.put(reader, 2)  # maybe still pending
    tiers.put(writer, 3)  # only on disk for the reader (found through the file)
    assert writer.flush(10)
    tiers.put(reader, 5)
    keys = [key(i) for i in range(7)]
    assert reader.batched_contains(keys) == 4  # key 3 adopted from the writer's file here
    assert reader.stats.snapshot()["adopted"] == 1
    assert next((i for i, k in enumerate(keys) if not reader.contains(k)), len(keys)) == 4
    assert reader.batched_contains(tuple(keys[:4])) == 4 and reader.batched_contains(iter(keys[5:])) == 1
    assert reader.batched_contains([]) == 0
    assert reader.batched_contains(keys, pin=True) == 4
    reader.close()
    assert reader.batched_contains(keys) == 0
