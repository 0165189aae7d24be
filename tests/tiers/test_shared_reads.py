"""A lower-tier read in flight is shared: a second reader of the same key (a duplicated prompt's
prefetch, a layerwise load beside it) joins it instead of reading the disk entry again, every
reader owns one reference of the same object, and the entry is in the CPU tier before the read
leaves the in-flight table (real disk tier; its reads held at a gate to make them overlap)."""

from __future__ import annotations

import threading
from concurrent.futures import Future, ThreadPoolExecutor

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from lmcache.v1.config import LMCacheEngineConfig
from lmcache.v1.keys import CacheEngineKey
from lmcache.v1.memory_management import ALIGN, MemoryFormat
from lmcache.v1.storage_backend.shared_reads import SharedReads
from lmcache.v1.storage_backend.storage_manager import StorageManager
from lmcache.v1.tiers import Tier


def key(i: int) -> CacheEngineKey:
    return CacheEngineKey("m", 1, 0, 1000 + i, "uint8")


class Count:
    """A counter a test can wait on."""

    def __init__(self) -> None:
        self.n = 0
        self.cond = threading.Condition()

    def add(self) -> None:
        with self.cond:
            self.n += 1
            self.cond.notify_all()

    def wait_for(self, n: int) -> None:
        with self.cond:
            assert self.cond.wait_for(lambda: self.n >= n, timeout=30), (self.n, n)


class GatedReads:
    """Counts the disk tier's reads and the readers that joined one in flight, and holds the
    reads' results until :meth:`open`."""

    def __init__(self, sm: StorageManager) -> None:
        self.disk = sm.lower[0]
        self.real = self.disk.get_non_blocking
        self.reads: list[CacheEngineKey] = []
        self.started, self.joined = Count(), Count()
        self.gate = threading.Event()
        self.disk.get_non_blocking = self.get_non_blocking  # type: ignore[method-assign]
        on_join = sm._reads._on_join

        def joined() -> None:
            on_join()
            self.joined.add()

        sm._reads._on_join = joined

    def get_non_blocking(self, k: CacheEngineKey) -> Future:
        self.reads.append(k)
        self.started.add()
        real, out = self.real(k), Future()

        def forward() -> None:
            self.gate.wait(30)
            try:
                out.set_result(real.result(timeout=30))
            except Exception as exc:  # noqa: BLE001 - handed on as the read's outcome
                out.set_exception(exc)

        threading.Thread(target=forward, daemon=True).start()
        return out

    def open(self) -> None:
        self.gate.set()


@pytest.fixture
def sm(tmp_path):
    cfg = LMCacheEngineConfig.from_dict(
        {
            "chunk_size": 16,
            "max_local_cpu_size": 0.05,
            "local_disk": str(tmp_path / "disk"),
            "max_local_disk_size": 0.05,
        }
    )
    manager = StorageManager(cfg)
    yield manager
    manager.close()


def on_disk_only(sm: StorageManager, n: int) -> list[CacheEngineKey]:
    keys = [key(i) for i in range(n)]
    for i, k in enumerate(keys):
        obj = sm.allocate((ALIGN,), torch.uint8, MemoryFormat.BINARY)
        obj.tensor.fill_(i + 1)
        sm.batched_put([k], [obj])
        obj.ref_count_down()
    assert sm.flush(30)
    for k in keys:
        sm.local_cpu.remove(k)
    assert sm.allocator.used_bytes == 0
    return keys


def test_two_batched_gets_of_the_same_keys_read_the_disk_once(sm):
    keys = on_disk_only(sm, 3)
    gated = GatedReads(sm)
    with ThreadPoolExecutor(2) as pool:
        first = pool.submit(sm.batched_get, keys)
        gated.started.wait_for(3)
        second = pool.submit(sm.batched_get, keys)
        gated.joined.wait_for(3)
        assert sm.stats.snapshot()["shared_reads"] == 3
        gated.open()
        a, b = first.result(30), second.result(30)
    assert len(gated.reads) == 3 and set(gated.reads) == set(keys)  # one disk read per key
    assert [o is p for o, p in zip(a, b)] == [True] * 3  # the same objects
    for i, obj in enumerate(a):
        assert bool((obj.tensor == i + 1).all())
        assert obj.get_ref_count() == 3  # each reader's + the CPU tier's
    for obj in a + b:
        obj.ref_count_down()
    assert all(sm.is_resident(k) for k in keys)
    assert all(o.get_ref_count() == 1 for o in a)  # the CPU tier's only: nothing leaked


def test_a_read_after_the_shared_one_settled_finds_the_cpu_tier(sm):
    keys = on_disk_only(sm, 2)
    gated = GatedReads(sm)
    gated.open()
    objs = sm.batched_get(keys)
    again = sm.batched_get(keys)
    assert len(gated.reads) == 2 and again == objs
    for obj in objs + again:
        obj.ref_count_down()


def test_a_miss_answers_every_joined_reader_with_none_and_holds_nothing(sm):
    gated = GatedReads(sm)
    futures = [sm.get_non_blocking(key(7)) for _ in range(3)]
    gated.open()
    assert [f.result(30) for f in futures] == [None, None, None]
    assert gated.reads == [key(7)] and sm.allocator.used_bytes == 0
    assert len(sm._reads) == 0


class Obj:
    """A reference-counted stand-in for a MemoryObj (what SharedReads hands on)."""

    def __init__(self) -> None:
        self.refs = 1
        self.lock = threading.Lock()

    def ref_count_up(self) -> None:
        with self.lock:
            assert self.refs > 0
            self.refs += 1

    def ref_count_down(self) -> None:
        with self.lock:
            assert self.refs > 0
            self.refs -= 1


@settings(max_examples=200)
@given(st.lists(st.tuples(st.sampled_from(["read", "finish"]), st.integers(0, 3), st.booleans()), max_size=40))
def test_shared_reads_one_read_per_key_in_flight_and_one_reference_per_reader(ops):
    """Any interleaving of reads and read completions (hit or miss) over four keys: the tier is
    read once per key while a read is in flight, every reader is answered once with the read's
    object (or None), and each owns exactly one reference (plus the settled one)."""
    started: dict[int, tuple[Future, list[Tier]]] = {}
    starts: list[int] = []
    settled: list[tuple[int, Obj]] = []
    joins = []

    def start(k: int, tiers: list[Tier]) -> Future:
        assert k not in started, "a second read of a key in flight"
        starts.append(k)
        fut: Future = Future()
        started[k] = (fut, tiers)
        return fut

    def settle(k: int, obj: Obj) -> None:
        obj.ref_count_up()  # the CPU tier's reference
        settled.append((k, obj))

    reads: SharedReads[int] = SharedReads(start, settle, on_join=lambda: joins.append(1))
    readers: list[tuple[int, Future, list[Tier]]] = []
    for op, k, hit in ops:
        if op == "read":
            source: list[Tier] = []
            readers.append((k, reads.read(k, source), source))
        elif k in started:
            fut, tiers = started.pop(k)
            obj = Obj() if hit else None
            if obj is not None:
                tiers.append(Tier.DISK)
            fut.set_result(obj)
    for k in list(started):
        started.pop(k)[0].set_result(None)
    assert len(reads) == 0
    assert len(starts) + len(joins) == len(readers)
    by_obj: dict[int, list[tuple[Future, list[Tier]]]] = {}
    for k, fut, source in readers:
        obj = fut.result(0)
        if obj is None:
            assert source == []
            continue
        assert source == [Tier.DISK]
        by_obj.setdefault(id(obj), []).append((fut, source))
    for _, obj in settled:
        assert obj.refs == 1 + len(by_obj.get(id(obj), []))
