"""Faults of the remote tier against a real redis-server: the engine degrades, never hangs.

Timeouts are short (``remote_timeout`` 0.5 s) and every bound below is the timeout
plus generous slack for a loaded 2-core machine: they prove "no hang", not speed.
"""

from __future__ import annotations

import logging
import threading
import time

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from lmcache.v1.config import LMCacheEngineConfig
from lmcache.v1.storage_backend.connector.breaker import CircuitBreaker, ExponentialBackoff
from lmcache.v1.storage_backend.entry_format import decode_header
from lmcache.v1.testing import KVSpec, make_engine, random_kv_caches, random_slot_mapping
from tests.redis_fixtures import RedisServer
from tests.remote_fixtures import FAST, FLUSH_S, key, random_obj, remote_of

TIMEOUT = 0.5
SLACK = 3.0  # scheduling noise on a shared machine; a hang would be unbounded
SPEC = KVSpec(num_layers=2, num_heads=2, head_size=8, num_blocks=64, block_size=16)


def engine_config(url: str, **extra) -> LMCacheEngineConfig:
    data = {"chunk_size": 16, "max_local_cpu_size": 0.0625, "remote_url": url, "remote_timeout": TIMEOUT,
            "extra_config": FAST}
    data.update(extra)
    return LMCacheEngineConfig.from_dict(data)


def bounded(fn, *args, limit: float = TIMEOUT + SLACK, **kwargs):
    """Run fn, assert it returned within ``limit`` seconds, return its result."""
    t0 = time.monotonic()
    out = fn(*args, **kwargs)
    took = time.monotonic() - t0
    assert took < limit, f"{getattr(fn, '__name__', fn)} took {took:.2f}s (limit {limit:.1f}s)"
    return out


def remote_warnings(caplog) -> list[str]:
    return [r.getMessage() for r in caplog.records
            if r.levelno >= logging.WARNING and r.name.startswith("lmcache.v1.storage_backend")]


# ---------------------------------------------------------------------- breaker policy
@given(initial=st.floats(0.001, 1.0), factor=st.floats(1.0, 4.0), cap_mult=st.floats(1.0, 100.0),
       n=st.integers(0, 200))
def test_backoff_grows_to_its_cap(initial, factor, cap_mult, n):
    b = ExponentialBackoff(initial, initial * cap_mult, factor)
    assert initial <= b.delay(n) <= b.maximum
    assert b.delay(n) <= b.delay(n + 1)
    assert b.delay(0) == initial


def test_breaker_trips_once_and_resets():
    br = CircuitBreaker(ExponentialBackoff(0.1, 0.4))
    assert br.allow() and br.trip() and not br.trip() and not br.allow()
    assert br.next_delay() == 0.1
    br.probe_failed()
    br.probe_failed()
    br.probe_failed()
    assert br.next_delay() == 0.4
    assert not br.wait_closed(0.0)
    assert br.reset() and br.allow() and not br.reset() and br.wait_closed(0.0)
    with pytest.raises(ValueError, match="initial"):
        ExponentialBackoff(0.0, 1.0)


# ---------------------------------------------------------------------- server killed
def test_server_killed_mid_run(redis_server: RedisServer, caplog):
    caplog.set_level(logging.INFO, logger="lmcache")
    engine = make_engine(SPEC, engine_config(redis_server.url))
    kv = random_kv_caches(SPEC, seed=1)
    slots = random_slot_mapping(SPEC, 64, seed=1)
    p1, p2, p3 = list(range(64)), list(range(500, 564)), list(range(900, 964))
    try:
        rb = remote_of(engine.storage_manager)
        assert engine.store(p1, kvcaches=kv, slot_mapping=slots) == 64
        assert engine.storage_manager.flush(FLUSH_S)
        # writes in flight while the server dies
        engine.store(p2, kvcaches=kv, slot_mapping=slots)
        redis_server.kill()
        assert bounded(engine.storage_manager.flush, FLUSH_S)
        # the engine keeps serving from L1, lookups and stores do not raise or hang
        assert bounded(engine.lookup, p1) == 64
        assert bounded(engine.lookup, p3) == 0
        out = [torch.zeros_like(t) for t in kv]
        assert bool(bounded(engine.retrieve, p1, kvcaches=out, slot_mapping=slots).all())
        assert bounded(engine.store, p3, kvcaches=kv, slot_mapping=slots) == 64
        assert bounded(engine.storage_manager.flush, FLUSH_S)
        stats = rb.stats.snapshot()
        assert stats["breaker_open"] == 1 and not rb.available
        assert stats["puts_skipped_unavailable"] >= 1
        # while open, every call is answered at once without touching the network
        rejects = stats["breaker_rejects"]
        assert bounded(rb.get_blocking, key(1), limit=0.5) is None
        assert rb.stats.breaker_rejects == rejects + 1
        # the server comes back on the same port: the tier reconnects by itself
        redis_server.restart()
        assert rb.wait_available(30)
        assert rb.stats.reconnects == 1
        assert engine.lookup(p2) == 64  # from L1; the remote copy may or may not have been written
    finally:
        engine.close()
    warnings = remote_warnings(caplog)
    assert sum("unavailable" in w for w in warnings) == 1, warnings
    assert "reachable again" in caplog.text


def test_local_tiers_serve_and_remote_refills_after_restart(redis_server: RedisServer):
    a = make_engine(SPEC, engine_config(redis_server.url))
    kv = random_kv_caches(SPEC, seed=4)
    slots = random_slot_mapping(SPEC, 64, seed=4)
    prompt = list(range(2000, 2064))
    try:
        redis_server.kill()
        assert bounded(a.store, prompt, kvcaches=kv, slot_mapping=slots) == 64  # L1 only
        redis_server.restart()
        rb = remote_of(a.storage_manager)
        assert rb.wait_available(30)
        other = list(range(3000, 3064))
        assert a.store(other, kvcaches=kv, slot_mapping=slots) == 64
        assert a.storage_manager.flush(FLUSH_S)
        assert rb.batched_contains(a.keys(other)) == 4
        # connections that died with the server were replaced without a second outage
        assert (rb.stats.breaker_open, rb.stats.reconnects, rb.stats.writes_completed) == (1, 1, 4)
    finally:
        a.close()
    b = make_engine(SPEC, engine_config(redis_server.url))
    try:
        out = [torch.zeros_like(t) for t in kv]
        assert bool(b.retrieve(other, kvcaches=out, slot_mapping=slots).all())
        assert b.lookup(prompt) == 0  # was stored while the server was down: never reached it
    finally:
        b.close()


def test_server_down_at_start_then_comes_up(redis_server: RedisServer, caplog, remote_manager):
    caplog.set_level(logging.INFO, logger="lmcache")
    redis_server.stop()
    sm = bounded(remote_manager, redis_server.url, remote_timeout=TIMEOUT, extra_config=FAST)
    rb = remote_of(sm)
    assert not rb.available and rb.disabled_reason is None
    assert rb.batched_contains([key(1)]) == 0
    redis_server.restart()
    assert rb.wait_available(30)
    obj = random_obj(sm, (128,))
    rb.submit_put(key(1), obj)
    assert rb.flush(FLUSH_S) and rb.contains(key(1))
    obj.ref_count_down()


# ---------------------------------------------------------------------- slow server
def test_paused_server_timeouts_are_honoured(redis_server: RedisServer, remote_manager):
    sm = remote_manager(redis_server.url, remote_timeout=TIMEOUT, extra_config=FAST)
    rb = remote_of(sm)
    objs = [random_obj(sm, (256, 1024), seed=i) for i in range(3)]  # 1 MiB each
    for i, o in enumerate(objs):
        rb.submit_put(key(i), o)
    assert rb.flush(FLUSH_S)
    redis_server.pause()  # SIGSTOP: connections stay open, nothing is answered
    try:
        assert bounded(rb.get_blocking, key(0)) is None
        assert rb.stats.breaker_open == 1
        assert bounded(rb.batched_contains, [key(0), key(1)], limit=0.5) == 0
        assert bounded(rb.get_non_blocking(key(1)).result, limit=0.5) is None
        for i, o in enumerate(objs):
            bounded(rb.submit_put, key(10 + i), o, limit=0.5)
        assert bounded(rb.flush, FLUSH_S)
        assert all(o.ref_count == 1 for o in objs)
    finally:
        redis_server.resume()
    assert rb.wait_available(30)
    got = rb.get_blocking(key(2))
    assert got is not None and torch.equal(got.byte_array, objs[2].byte_array)
    got.ref_count_down()
    for o in objs:
        o.ref_count_down()


def test_paused_server_during_writes_and_close(redis_server: RedisServer, remote_manager):
    sm = remote_manager(redis_server.url, remote_timeout=TIMEOUT, extra_config=FAST)
    objs = [random_obj(sm, (512, 1024), seed=i) for i in range(6)]  # 2 MiB each
    redis_server.pause()
    try:
        for i, o in enumerate(objs):
            sm.put(key(i), o)
        assert bounded(sm.flush, FLUSH_S, limit=2 * TIMEOUT + SLACK)  # writers time out, the rest skip
        stats = remote_of(sm).stats.snapshot()
        assert stats["breaker_open"] == 1 and stats["writes_completed"] == 0
        assert stats["write_errors"] + stats["puts_skipped_unavailable"] == 6
        for o in objs:
            o.ref_count_down()
        bounded(sm.close)
    finally:
        redis_server.resume()


# ---------------------------------------------------------------------- bad values
@pytest.mark.parametrize("damage", ["payload_bit", "header_bit", "truncated", "garbage", "empty", "extended"])
def test_corrupted_value_is_a_miss_and_is_dropped(redis_server: RedisServer, damage: str, caplog, remote_manager):
    sm = remote_manager(redis_server.url)
    rb = remote_of(sm)
    obj = random_obj(sm, (64, 64), seed=1)
    rb.submit_put(key(1), obj)
    assert rb.flush(FLUSH_S)
    client = redis_server.client()
    rkey = rb.remote_key(key(1))
    value = bytearray(client.get(rkey))
    hlen = decode_header(value).header_len
    if damage == "payload_bit":
        value[hlen + 1000] ^= 0x10
    elif damage == "header_bit":
        value[12] ^= 0x01
    elif damage == "truncated":
        value = value[: len(value) - 100]
    elif damage == "garbage":
        value = bytearray(b"\x80\x04\x95 not an entry, and never unpickled" * 10)
    elif damage == "empty":
        value = bytearray()
    else:
        value += b"trailing"
    client.set(rkey, bytes(value))
    assert rb.contains(key(1))
    assert rb.get_blocking(key(1)) is None
    assert rb.stats.corrupt_entries == 1 and rb.stats.hits == 0
    assert not rb.contains(key(1)), "a corrupt entry is deleted"
    assert sm.allocator.used_bytes == obj.get_size(), "the failed read must return its pool memory"
    # the tier still works afterwards
    rb.submit_put(key(1), obj)
    assert rb.flush(FLUSH_S)
    got = rb.get_blocking(key(1))
    assert got is not None and torch.equal(got.byte_array, obj.byte_array)
    got.ref_count_down()
    obj.ref_count_down()
    sm.close()
    assert sm.allocator.used_bytes == 0, "no pool memory leaked by failed reads"
    assert sum("invalid entry" in w for w in remote_warnings(caplog)) == 1


@pytest.mark.parametrize("other", ["namespace", "prefix", "key"])
def test_value_from_another_namespace_is_rejected(redis_server: RedisServer, other: str, remote_manager):
    kv_sm = remote_manager(redis_server.url)
    extra = {"remote_key_prefix": "tenant-b"} if other == "prefix" else {}
    other_sm = remote_manager(redis_server.url, extra_config=extra)
    writer = remote_of(kv_sm)
    if other == "namespace":
        from lmcache.v1.storage_backend import create_lower_backends

        reader = create_lower_backends(other_sm.config, other_sm.local_cpu, namespace="ec")[0]
    else:
        reader = remote_of(other_sm)
    obj = random_obj(kv_sm, (32, 32), seed=3)
    writer.submit_put(key(1), obj)
    assert writer.flush(FLUSH_S)
    client = redis_server.client()
    target = key(2) if other == "key" else key(1)
    target_rkey = (writer if other == "key" else reader).remote_key(target)
    assert target_rkey != writer.remote_key(key(1))
    client.copy(writer.remote_key(key(1)), target_rkey)  # a byte-exact copy under another name
    reader_backend = writer if other == "key" else reader
    assert reader_backend.contains(target)
    assert reader_backend.get_blocking(target) is None
    assert reader_backend.stats.corrupt_entries == 1
    got = writer.get_blocking(key(1))  # the original is untouched
    assert got is not None
    got.ref_count_down()
    obj.ref_count_down()
    if other == "namespace":
        reader.close()


@pytest.mark.parametrize("kind", ["list", "hash", "set"])
def test_value_of_another_redis_type_is_a_miss_deleted_and_rewritten(redis_server: RedisServer, kind: str,
                                                                     remote_manager):
    sm = remote_manager(redis_server.url)
    remote = remote_of(sm)
    rkey = remote.remote_key(key(9))
    client = redis_server.client()
    {"list": lambda: client.rpush(rkey, b"x"), "hash": lambda: client.hset(rkey, "f", "v"),
     "set": lambda: client.sadd(rkey, b"x")}[kind]()
    assert sm.batched_contains([key(9)]) == 1  # EXISTS cannot tell
    assert remote.get_blocking(key(9)) is None
    assert remote.stats.corrupt_entries == 1
    assert not client.exists(rkey), "the foreign value is deleted"
    obj = random_obj(sm, (2, 32), seed=1)
    remote.submit_put(key(9), obj)
    assert remote.flush(FLUSH_S)
    got = remote.get_blocking(key(9))
    assert got is not None and torch.equal(got.byte_array, obj.byte_array)
    got.ref_count_down()
    obj.ref_count_down()


# ---------------------------------------------------------------------- credentials
@pytest.mark.parametrize("given_password", ["wrong-password", None])
def test_wrong_password_disables_tier_with_one_log_line(redis_server_factory, caplog, given_password):
    secret = "the-real-s3cret"
    server: RedisServer = redis_server_factory(password=secret)
    caplog.set_level(logging.DEBUG, logger="lmcache")
    engine = bounded(make_engine, SPEC, engine_config(server.url, remote_password=given_password))
    kv = random_kv_caches(SPEC, seed=2)
    slots = random_slot_mapping(SPEC, 64, seed=2)
    try:
        rb = remote_of(engine.storage_manager)
        assert rb.disabled_reason is not None and not rb.available
        assert rb.stats.auth_failures == 1
        # the engine works on its local tier; the remote one is silent
        assert engine.store(list(range(64)), kvcaches=kv, slot_mapping=slots) == 64
        assert engine.lookup(list(range(64))) == 64 and engine.lookup(list(range(100, 164))) == 0
        assert rb.get_blocking(key(1)) is None and rb.stats.writes_completed == 0
        assert threading.active_count() < 50 and all(t.name != "lmcache-remote-probe" for t in threading.enumerate())
    finally:
        engine.close()
    lines = remote_warnings(caplog)
    assert len(lines) == 1 and "rejected the credentials" in lines[0], lines
    assert secret not in caplog.text and "wrong-password" not in caplog.text
    assert server.client().dbsize() == 0
