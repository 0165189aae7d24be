"""Remote tier on a real standalone redis-server: round trips, stats, promotion, namespaces,
write budget, credentials, TLS, and two engine processes sharing one server.

Configuration without a server: ``test_remote_config.py``; outages and hostile values:
``test_remote_faults.py``; Redis Cluster: ``test_remote_cluster.py``. The shared set-up
(managers, keys, random objects) is :mod:`tests.remote_fixtures`.
"""

from __future__ import annotations

import logging

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from lmcache.utils import CacheEngineKey, LayerCacheEngineKey
from lmcache.v1.memory_management import MemoryFormat
from lmcache.v1.storage_backend import create_lower_backends
from lmcache.v1.storage_backend.remote_backend import MAX_PLAIN_KEY
from lmcache.v1.storage_backend.storage_manager import StorageManager
from tests.redis_fixtures import RedisServer
from tests.remote_fixtures import (
    FLUSH_S,
    SHARE_TOKENS,
    assert_shared_kv_identical,
    key,
    make_manager,
    random_obj,
    remote_config,
    remote_of,
    retrieve_in_fresh_process,
    store_shared_prompt,
)


# ---------------------------------------------------------------------- round trips
@settings(max_examples=12, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(
    shape=st.lists(st.integers(1, 9), min_size=1, max_size=4).map(tuple),
    dtype=st.sampled_from([torch.float32, torch.bfloat16, torch.float16, torch.uint8, torch.float8_e4m3fn]),
    fmt=st.sampled_from(list(MemoryFormat)),
    seed=st.integers(0, 2**31 - 1),
)
def test_roundtrip_is_bit_identical(redis_server, shape, dtype, fmt, seed):
    sm = make_manager(redis_server.url)
    try:
        rb = remote_of(sm)
        obj = random_obj(sm, shape, dtype, fmt, seed)
        k = key(seed)
        rb.submit_put(k, obj)
        assert rb.flush(FLUSH_S)
        assert obj.ref_count == 1, "the tier must drop its reference after the write"
        got = rb.get_blocking(k)
        assert got is not None and got.ref_count == 1
        assert (got.shape, got.dtype, got.fmt) == (tuple(shape), dtype, fmt)
        assert torch.equal(got.byte_array, obj.byte_array)
        got.ref_count_down()
        obj.ref_count_down()
    finally:
        sm.close()


@pytest.mark.parametrize("via", ["tcp", "unix"])
def test_large_values_and_stats(redis_server, via, remote_manager):
    url = redis_server.url if via == "tcp" else redis_server.unix_url
    sm = remote_manager(url)
    rb = remote_of(sm)
    objs = [random_obj(sm, (2, 4, 256, 256), seed=i) for i in range(4)]  # 2 MiB each
    keys = [key(i) for i in range(4)]
    sm.batched_put(keys, objs)
    assert sm.flush(FLUSH_S)
    for k, o in zip(keys, objs):
        got = rb.get_non_blocking(k).result(timeout=FLUSH_S)
        assert got is not None and torch.equal(got.byte_array, o.byte_array)
        got.ref_count_down()
        o.ref_count_down()
    assert rb.get_blocking(key(99)) is None
    stats = rb.stats.snapshot()
    assert stats["writes_completed"] == 4 and stats["hits"] == 4 and stats["misses"] == 1
    assert stats["errors"] == 0 and stats["corrupt_entries"] == 0
    assert stats["bytes_written"] == stats["bytes_read"] > 4 * (2 << 20)
    sm.close()
    assert sm.allocator.used_bytes == 0


def test_batched_contains_is_prefix_one_command_per_key(redis_server, remote_manager):
    sm = remote_manager(redis_server.url)
    rb = remote_of(sm)
    objs = [random_obj(sm, (8,), seed=i) for i in range(6)]
    present = [0, 1, 2, 4, 5]  # 3 missing
    for i in present:
        rb.submit_put(key(i), objs[i])
    assert rb.flush(FLUSH_S)
    client = redis_server.client()
    before = int(client.info("stats")["total_commands_processed"])
    assert rb.batched_contains([key(i) for i in range(6)]) == 3
    after = int(client.info("stats")["total_commands_processed"])
    assert after - before == 6 + 1  # six pipelined EXISTS (+ our INFO)
    assert rb.batched_contains([key(4), key(5)]) == 2
    assert rb.batched_contains([]) == 0
    assert rb.contains(key(0)) and not rb.contains(key(3))
    assert rb.remove(key(0)) and not rb.contains(key(0)) and not rb.remove(key(0))
    for o in objs:
        o.ref_count_down()


def test_hit_is_promoted_into_cpu_tier(redis_server, remote_manager):
    writer = remote_manager(redis_server.url)
    reader = remote_manager(redis_server.url)
    obj = random_obj(writer, (4, 64), seed=3)
    writer.put(key(5), obj)
    assert writer.flush(FLUSH_S)
    assert not reader.local_cpu.contains(key(5))
    assert reader.batched_contains([key(5)]) == 1
    got = reader.get(key(5))
    assert got is not None and torch.equal(got.byte_array, obj.byte_array)
    assert reader.local_cpu.contains(key(5)), "a remote hit must be promoted into L1"
    got.ref_count_down()
    obj.ref_count_down()
    assert remote_of(reader).stats.hits == 1


def test_namespaces_and_layer_keys_are_separate(redis_server, remote_manager):
    sm = remote_manager(redis_server.url)
    ec = create_lower_backends(sm.config, sm.local_cpu, namespace="ec")[0]
    try:
        rb = remote_of(sm)
        obj = random_obj(sm, (16,), seed=1)
        lkey = LayerCacheEngineKey("m", 1, 0, 42, "float32", (), 3)
        rb.submit_put(lkey, obj)
        assert rb.flush(FLUSH_S)
        assert rb.remote_key(lkey) == "lmcache:v1:kv:" + lkey.to_string()
        assert redis_server.client().exists(rb.remote_key(lkey))
        assert not ec.contains(lkey) and ec.get_blocking(lkey) is None
        assert not rb.contains(lkey.base_key())
        got = rb.get_blocking(lkey)
        assert got is not None and torch.equal(got.byte_array, obj.byte_array)
        got.ref_count_down()
        obj.ref_count_down()
    finally:
        ec.close()


@pytest.mark.parametrize("length", [100, MAX_PLAIN_KEY + 1, 20_000, 200_000])
def test_keys_of_any_length_round_trip_under_a_short_redis_key(redis_server, length, remote_manager):
    """A key's string form has no length limit; its Redis key stays short and still unique."""
    sm = remote_manager(redis_server.url)
    remote = remote_of(sm)
    long_key = CacheEngineKey("m", 1, 0, 77, "float32", (("tag", "x" * length),))
    rkey = remote.remote_key(long_key)
    assert len(rkey) < 600
    obj = random_obj(sm, (3, 16), seed=2)
    remote.submit_put(long_key, obj)
    assert remote.flush(FLUSH_S)
    assert remote.batched_contains([long_key]) == 1
    got = remote.get_blocking(long_key)
    assert got is not None and torch.equal(got.byte_array, obj.byte_array)
    other = CacheEngineKey("m", 1, 0, 77, "float32", (("tag", "y" * length),))
    assert remote.remote_key(other) != rkey and remote.get_blocking(other) is None
    got.ref_count_down()
    obj.ref_count_down()


def test_write_budget_drops_instead_of_blocking(redis_server, remote_manager):
    sm = remote_manager(redis_server.url, extra_config={"remote_max_inflight_mb": 1, "remote_workers": 1})
    rb = remote_of(sm)
    objs = [random_obj(sm, (256, 1024), seed=i) for i in range(8)]  # 1 MiB each
    for i, o in enumerate(objs):
        rb.submit_put(key(i), o)
    assert rb.flush(FLUSH_S)
    stats = rb.stats.snapshot()
    assert stats["writes_completed"] >= 1 and stats["puts_dropped_inflight_full"] >= 1
    assert stats["writes_completed"] + stats["puts_dropped_inflight_full"] == 8
    assert all(o.ref_count == 1 for o in objs)
    for o in objs:
        o.ref_count_down()


def test_password_from_config_works_and_is_never_logged(redis_server_factory, caplog):
    secret = "correct-horse-battery"
    server: RedisServer = redis_server_factory(password=secret)
    caplog.set_level(logging.DEBUG, logger="lmcache")
    url = f"redis://default:{secret}@127.0.0.1:{server.port}"
    for cfg in (remote_config(server.url, remote_password=secret), remote_config(url)):
        sm = StorageManager(cfg, pool_bytes=16 << 20)
        try:
            rb = remote_of(sm)
            assert rb.available and rb.disabled_reason is None
            obj = random_obj(sm, (32,))
            rb.submit_put(key(1), obj)
            assert rb.flush(FLUSH_S)
            got = rb.get_blocking(key(1))
            assert got is not None
            got.ref_count_down()
            obj.ref_count_down()
        finally:
            sm.close()
    assert "remote tier connected" in caplog.text
    assert secret not in caplog.text


def test_tls(redis_server_factory, remote_manager):
    server: RedisServer = redis_server_factory(tls=True)
    sm = remote_manager(server.tls_url, extra_config={"remote_tls_ca_certs": server.ca_cert})
    rb = remote_of(sm)
    assert rb.available, rb.stats.snapshot()
    obj = random_obj(sm, (64, 1024), seed=2)
    rb.submit_put(key(1), obj)
    assert rb.flush(FLUSH_S)
    got = rb.get_blocking(key(1))
    assert got is not None and torch.equal(got.byte_array, obj.byte_array)
    got.ref_count_down()
    obj.ref_count_down()


# ---------------------------------------------------------------------- two processes
@pytest.mark.slow  # a second process
def test_two_engine_processes_share_one_redis(redis_server, tmp_path):
    kv = store_shared_prompt(redis_server.url)
    report = retrieve_in_fresh_process(redis_server.url, tmp_path / "kv.pt")
    assert report["retrieved"] == len(SHARE_TOKENS)
    assert report["remote"]["hits"] == len(SHARE_TOKENS) // 16
    assert report["remote"]["corrupt_entries"] == 0
    assert_shared_kv_identical(kv, tmp_path / "kv.pt")
