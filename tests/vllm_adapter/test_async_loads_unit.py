"""Asynchronous loads without vLLM: the planner's hand-off (offer -> alloc -> metadata) and
the worker's prefetch bookkeeping (deadline, references held and released)."""

from __future__ import annotations

import threading
import time
from contextlib import contextmanager
from types import SimpleNamespace
from typing import Iterator

import numpy as np
import torch

from lmcache.integration.vllm import async_loads
from lmcache.integration.vllm.async_loads import AsyncLoads, CopyResult, PendingLoad
from lmcache.integration.vllm.connector_metadata import LoadSpec, ReqMeta
from lmcache.integration.vllm.request_tracker import PlannerConfig, RequestPlanner
from lmcache.v1.stats import CacheStats
from lmcache.v1.tiers import Tier

from tests.vllm_adapter.test_vllm_connector_unit import FakeRequest, sched_output

CHUNK, BLOCK = 16, 8


def test_an_accepted_async_offer_is_a_load_in_the_next_metadata_only():
    planner = RequestPlanner(PlannerConfig(CHUNK, BLOCK))
    req = FakeRequest("r", list(range(100, 170)))
    assert planner.offer(req, 0, 64) == 64
    planner.get("r").async_offer = True
    blocks = list(range(20, 29))
    assert planner.on_alloc(req, 64, [blocks])
    (meta,) = planner.build(sched_output())  # the request is not scheduled: it waits
    assert meta.load_async and meta.load == LoadSpec(0, 64, 64) and meta.save is None
    assert list(meta.slot_mapping[:3]) == [160, 161, 162] and len(meta.token_ids) == 64
    assert planner.build(sched_output()) == []  # once
    # scheduled after the load: no second load, the loaded chunks are not stored again
    out = planner.build(sched_output(new=[("r", blocks, 64)], num_scheduled={"r": 6}))
    assert all(m.load is None for m in out) and all(m.save is None or m.save.skip >= 64 for m in out)


def test_a_synchronous_offer_and_a_refused_async_offer_stay_synchronous():
    planner = RequestPlanner(PlannerConfig(CHUNK, BLOCK))
    req = FakeRequest("r", list(range(100, 170)))
    planner.offer(req, 0, 64)
    assert not planner.on_alloc(req, 64, [list(range(9))])  # not offered asynchronously
    planner.offer(req, 0, 64)
    planner.get("r").async_offer = True
    assert not planner.on_alloc(req, 0, [list(range(9))])  # vLLM took nothing
    assert planner.build(sched_output()) == []


def test_a_request_finished_before_the_metadata_still_reaches_the_worker():
    """vLLM frees an aborted waiting request's blocks only when the worker reports its load."""
    planner = RequestPlanner(PlannerConfig(CHUNK, BLOCK))
    req = FakeRequest("gone", list(range(100, 170)))
    planner.offer(req, 0, 48)
    planner.get("gone").async_offer = True
    planner.on_alloc(req, 48, [list(range(9))])
    planner.finish("gone")
    (meta,) = planner.build(sched_output())
    assert meta.req_id == "gone" and meta.load_async


class _Obj:
    def __init__(self) -> None:
        self.refs = 1

    def ref_count_down(self) -> None:
        self.refs -= 1


class _Engine:
    """``prefix_keys`` and a storage manager whose reads wait for ``gate`` (the streamed read:
    the first chunk after ``gate``, the rest after ``gate2`` too)."""

    def __init__(self) -> None:
        self.gate = threading.Event()
        self.gate2 = threading.Event()
        self.gate2.set()
        self.objs = [_Obj(), _Obj()]
        self.config = SimpleNamespace(chunk_size=CHUNK)
        self.stats = CacheStats()
        self.storage_manager = SimpleNamespace(batched_get=self._get, iter_prefix=self._iter)

    def prefix_keys(self, tokens, **extras):
        return SimpleNamespace(chunk_size=CHUNK, keys=[f"k{i}" for i in range(-(-len(tokens) // CHUNK))])

    def _get(self, keys, sources=None):
        self.gate.wait(10)
        out = self.objs[: len(keys)]
        if sources is not None:
            sources.extend(Tier.REMOTE for _ in out)
        return out

    def _iter(self, keys, sources=None):
        self.gate.wait(10)
        rest = self.objs[1 : len(keys)]
        try:
            if sources is not None:  # the first chunk was in the CPU tier, the second came from Redis
                sources.append(Tier.CPU)
            yield self.objs[:1]
            self.gate2.wait(10)
            out, rest = rest, []
            if sources is not None:
                sources.extend(Tier.REMOTE for _ in out)
            yield out
        finally:  # closed early: the reads not yielded are released (as iter_prefix does)
            for obj in rest:
                obj.ref_count_down()


def _req(n: int = 32) -> ReqMeta:
    return ReqMeta("r", np.arange(n, dtype=np.int32), np.arange(n, dtype=np.int64), BLOCK, LoadSpec(0, n, n),
                   load_async=True)  # fmt: skip


def test_a_load_is_ready_when_prefetched_or_at_its_deadline_and_releases_its_references():
    engine = _Engine()
    loads = AsyncLoads(engine, timeout=5.0)
    try:
        loads.start(_req())
        (pending,) = loads._pending.values()
        assert loads.ready(now=pending.started + 1) == []  # still reading, before the deadline
        engine.gate.set()
        pending.future.result(5)
        (ready,) = loads.ready()
        assert not ready.timed_out and len(loads) == 0
        assert engine.stats.prefetch_tokens_remote == 32 and engine.stats.prefetch_tokens_disk == 0
        ready.release()
        assert [o.refs for o in engine.objs] == [0, 0]
        ready.release()  # idempotent
        assert [o.refs for o in engine.objs] == [0, 0]
    finally:
        loads.close()


def _copier(copies: list[tuple[int, int]], copied: threading.Event | None = None):
    def copier(req: ReqMeta, start: int, stop: int) -> torch.Tensor:
        copies.append((start, stop))
        written = torch.zeros(stop, dtype=torch.bool)
        written[start:stop] = True
        if copied is not None:
            copied.set()
        return written

    return copier


@contextmanager
def _settled_load(engine: _Engine, copier) -> Iterator[PendingLoad]:
    """A load with ``copier`` whose reads are not held back, once its prefetch has ended
    (released afterwards)."""
    engine.gate.set()
    loads = AsyncLoads(engine, timeout=5.0)
    try:
        loads.start(_req(), copier)
        (pending,) = loads._pending.values()
        pending.future.result(5)
        (ready,) = loads.ready()
        yield ready
        ready.release()
    finally:
        loads.close()


def _first_chunk_copied(timeout: float) -> tuple[_Engine, AsyncLoads, list[tuple[int, int]]]:
    """A load whose first chunk was copied while its second is still being read."""
    copies: list[tuple[int, int]] = []
    copied = threading.Event()
    engine = _Engine()
    engine.gate2.clear()
    loads = AsyncLoads(engine, timeout=timeout)
    loads.start(_req(), _copier(copies, copied))
    engine.gate.set()
    assert copied.wait(5)
    return engine, loads, copies


def test_the_prefetch_thread_copies_each_batch_as_its_reads_land(monkeypatch):
    """With a copier (CPU KV) the prefetch thread copies the first chunk while the second is
    still being read, then the second; the worker only records the result."""
    monkeypatch.setattr(async_loads, "BACKGROUND_COPY_TOKENS", CHUNK)  # a copy per chunk
    engine, loads, copies = _first_chunk_copied(timeout=5.0)
    try:
        (pending,) = loads._pending.values()
        assert copies == [(0, CHUNK)] and not pending.future.done()  # copied while chunk 2 is read
        engine.gate2.set()
        pending.future.result(5)
        (ready,) = loads.ready()
        assert copies == [(0, CHUNK), (CHUNK, 2 * CHUNK)] and not ready.timed_out
        assert ready.copy.load == ready.req.load and bool(ready.copy.written.all())
        # the first chunk was in the CPU tier already: only the second counts as read from Redis
        assert (engine.stats.prefetch_tokens_remote, engine.stats.prefetch_tokens_disk) == (CHUNK, 0)
        ready.release()
    finally:
        loads.close()

    # batches shorter than BACKGROUND_COPY_TOKENS wait for the next ones (one copy call each)
    monkeypatch.setattr(async_loads, "BACKGROUND_COPY_TOKENS", 2 * CHUNK)
    copies.clear()
    with _settled_load(_Engine(), _copier(copies)) as ready:
        assert copies == [(0, 2 * CHUNK)] and ready.copy.load == ready.req.load


def test_the_deadline_stops_a_background_copy_and_keeps_what_it_copied(monkeypatch):
    """Past the deadline the prefetch thread copies nothing more: the worker takes the part
    copied so far (the rest is recomputed), never waits for the reads."""
    monkeypatch.setattr(async_loads, "BACKGROUND_COPY_TOKENS", CHUNK)  # a copy per chunk
    engine, loads, copies = _first_chunk_copied(timeout=0.5)
    try:
        (pending,) = loads._pending.values()
        (ready,) = loads.ready(now=pending.deadline)  # the second chunk is still being read
        assert ready.timed_out and ready.copy is None
        assert ready.progress.load == LoadSpec(0, 32, CHUNK) and ready.progress.written[:CHUNK].all()
        engine.gate2.set()
        pending.future.result(5)
        assert copies == [(0, CHUNK)] and ready.copy is None  # nothing copied after the deadline
        ready.release()
    finally:
        loads.close()

    engine, copies = _Engine(), []
    loads = AsyncLoads(engine, timeout=0.5)
    try:
        loads.start(_req(), _copier(copies))
        (pending,) = loads._pending.values()
        (ready,) = loads.ready(now=pending.deadline)  # nothing read yet: the worker copies in its step
        assert ready.timed_out and ready.progress is None
        engine.gate.set()
        pending.future.result(5)
        assert copies == [] and ready.copy is None
        ready.release()
    finally:
        loads.close()


def test_a_hit_the_prefetch_finds_nowhere_is_reported_as_nothing_copied():
    copies: list[tuple[int, int]] = []
    engine = _Engine()
    engine.storage_manager.iter_prefix = lambda keys, sources=None: (o for o in ())  # evicted everywhere since the lookup
    with _settled_load(engine, _copier(copies)) as ready:
        assert copies == [] and ready.copy == CopyResult(None)


def test_a_copier_that_raises_is_a_failed_load():
    def broken(req: ReqMeta, start: int, stop: int) -> torch.Tensor:
        raise OSError("copy failed")

    engine = _Engine()
    with _settled_load(engine, broken) as ready:
        assert isinstance(ready.copy.error, OSError) and ready.copy.load == ready.req.load
    assert [o.refs for o in engine.objs] == [0, 0]


def test_the_deadline_waits_for_the_batch_being_copied(monkeypatch):
    """A batch the prefetch thread is copying at the deadline is finished (a memory copy),
    then nothing more is copied."""
    monkeypatch.setattr(async_loads, "BACKGROUND_COPY_TOKENS", CHUNK)  # a copy per chunk
    started, finish = threading.Event(), threading.Event()

    def copier(req: ReqMeta, start: int, stop: int) -> torch.Tensor:
        started.set()
        finish.wait(10)
        return torch.ones(stop, dtype=torch.bool)

    engine = _Engine()
    engine.gate.set()
    engine.gate2.clear()
    loads = AsyncLoads(engine, timeout=0.5)
    try:
        loads.start(_req(), copier)
        (pending,) = loads._pending.values()
        assert started.wait(5)
        got: list = []
        taker = threading.Thread(target=lambda: got.extend(loads.ready(now=pending.deadline + 1)))
        taker.start()
        taker.join(0.2)
        assert taker.is_alive()  # waiting for the batch in flight
        finish.set()
        taker.join(5)
        (ready,) = got
        assert ready.timed_out and ready.progress.load.load_len == CHUNK
        engine.gate2.set()
        pending.future.result(5)
        ready.release()
    finally:
        loads.close()


def test_an_idle_step_waits_for_a_prefetch_to_end_but_not_longer_than_asked():
    """``wait_settled`` (a step that scheduled nothing): returns when a prefetch ends, after the
    timeout while it runs, and at once with nothing pending or a prefetch already done."""
    engine = _Engine()
    loads = AsyncLoads(engine, timeout=30.0)
    try:
        t0 = time.monotonic()
        loads.wait_settled(5.0)  # nothing pending
        assert time.monotonic() - t0 < 1.0
        loads.start(_req())
        (pending,) = loads._pending.values()
        t0 = time.monotonic()
        loads.wait_settled(0.05)  # still reading: the timeout
        assert 0.04 <= time.monotonic() - t0 < 2.0
        threading.Timer(0.05, engine.gate.set).start()
        t0 = time.monotonic()
        loads.wait_settled(10.0)  # the prefetch ends: woken
        assert time.monotonic() - t0 < 5.0 and pending.future.done()
        t0 = time.monotonic()
        loads.wait_settled(5.0)  # one already done: at once
        assert time.monotonic() - t0 < 1.0
        (ready,) = loads.ready()
        ready.release()
    finally:
        loads.close()


def test_a_load_past_its_deadline_is_ready_and_its_late_prefetch_releases_itself():
    engine = _Engine()
    loads = AsyncLoads(engine, timeout=0.5)
    try:
        loads.start(_req())
        (pending,) = loads._pending.values()
        (ready,) = loads.ready(now=pending.deadline)
        assert ready.timed_out
        ready.release()  # the prefetch is still blocked: its objects are released when it ends
        engine.gate.set()
        pending.future.result(5)
        assert [o.refs for o in engine.objs] == [0, 0]
    finally:
        loads.close()


def test_cpu_tier_residency_over_the_lookup_sockets(tmp_path):
    """The scheduler in another process (``vllm serve``) asks each rank what its CPU tier holds."""
    from lmcache.integration.vllm.lookup_service import LookupClient, LookupServer

    def server(rank: int, resident=True) -> LookupServer:
        fn = (lambda tokens, extras, end: min(end, 32 - 16 * rank)) if resident else None
        return LookupServer(str(tmp_path / f"r{rank}.sock"), lambda t, e: len(t), dict, resident=fn)

    servers = [server(0), server(1)]
    client = LookupClient([s.path for s in servers], timeout=1.0)
    try:
        assert client.resident(list(range(40)), {}, 40) == 16  # the minimum over ranks
        assert client.resident(list(range(40)), {}, 8) == 8
        assert client.resident(list(range(40)), {}, 41) is None and "end=41" in (client.last_error or "")
        assert client.resident(list(range(40)), {}, -1) is None
        payload = np.arange(40, dtype="<i4").tobytes()
        for bad in (True, "3", None, 2.0):  # forged bounds are refused by name, never a crash
            reply = servers[0]._server.dispatch({"op": "resident", "end": bad}, payload)
            assert "end=" in reply["error"]
    finally:
        client.close()
        for s in servers:
            s.close()
    old = server(2, resident=False)  # a worker without the op: unknown, so the load stays synchronous
    client = LookupClient([old.path], timeout=1.0)
    try:
        assert client.resident([1, 2, 3], {}, 3) is None
    finally:
        client.close()
        old.close()


def test_a_request_asked_again_after_its_asynchronous_load_gets_no_hit_again():
    """vLLM asks again only when the load failed from the first block (it freed the request's
    blocks): offering the same hit would fail the same way, forever."""
    planner = RequestPlanner(PlannerConfig(CHUNK, BLOCK))
    req = FakeRequest("r", list(range(100, 170)))
    assert planner.offer(req, 0, 64) == 64
    planner.get("r").async_offer = True
    assert planner.on_alloc(req, 64, [list(range(20, 29))])
    planner.build(sched_output())
    assert planner.offer(req, 0, 64) == 0  # the load failed: computed
    assert planner.counters["failed_async_loads"] == 1
    assert planner.offer(req, 0, 64) == 0  # and stays computed


def test_a_loaded_request_preempted_later_is_offered_its_hit_again():
    planner = RequestPlanner(PlannerConfig(CHUNK, BLOCK))
    req = FakeRequest("s", list(range(100, 170)))
    assert planner.offer(req, 0, 64) == 64
    planner.get("s").async_offer = True
    assert planner.on_alloc(req, 64, [list(range(20, 29))])
    planner.build(sched_output())
    planner.build(sched_output(new=[("s", list(range(20, 29)), 64)], num_scheduled={"s": 6}))  # loaded: scheduled
    assert planner.offer(req, 0, 64) == 64  # preempted and back: loaded again
    assert planner.counters["failed_async_loads"] == 0


def test_the_worker_keeps_what_a_stopped_background_copy_wrote_and_recomputes_the_rest():
    """A real engine and KV layout: the prefetch thread copied the first chunk of a load
    when the deadline stopped it; the worker keeps that chunk's KV (equal to the stored
    one), reports the rest's blocks as failed loads and counts one timeout."""
    from lmcache.integration.vllm.async_loads import PendingLoad
    from lmcache.integration.vllm.worker_side import WorkerConnector
    from lmcache.v1.config import LMCacheEngineConfig
    from lmcache.v1.testing import KVSpec, make_engine, random_kv_caches

    spec = KVSpec(num_layers=2, num_heads=2, head_size=8, num_blocks=16, block_size=BLOCK)
    cfg = LMCacheEngineConfig.from_dict({"chunk_size": CHUNK, "max_local_cpu_size": 0.05,
                                         "enable_async_loading": True, "async_load_timeout": 1.0})  # fmt: skip
    engine = make_engine(spec, cfg)
    source, target = random_kv_caches(spec, seed=1), [torch.zeros_like(t) for t in random_kv_caches(spec)]
    n = 3 * CHUNK
    tokens = np.arange(500, 500 + n, dtype=np.int64)
    slots = np.arange(n, dtype=np.int64)  # blocks 0..5, in order
    engine.store(torch.as_tensor(tokens), kvcaches=source, slot_mapping=torch.as_tensor(slots))
    worker = WorkerConnector(engine, layerwise=False)
    worker.register_kv_caches({f"model.layers.{i}.attn": t for i, t in enumerate(target)})
    try:
        req = ReqMeta("r", tokens, slots, BLOCK, LoadSpec(0, n, n), load_async=True)
        written = worker._copy_in_background(req, 0, CHUNK)  # what the prefetch thread did first
        pending = PendingLoad(req, 0.0, 0.0, timed_out=True)
        pending.progress = CopyResult(LoadSpec(0, n, CHUNK), written)
        worker._copy_async(pending, budget=0)
        assert worker.take_load_errors() == {2, 3, 4, 5}  # the blocks after the first chunk
        assert engine.stats.snapshot()["async_load_timeouts"] == 1
        for src, dst in zip(source, target):  # vllm_cpu layout: [blocks, heads, block, 2 * head]
            torch.testing.assert_close(dst[:2], src[:2], rtol=0, atol=0)
            assert not bool(dst[2:6].any())
    finally:
        worker.close_async()
        engine.close()
