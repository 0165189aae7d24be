"""Remote tier on a real 3-master Redis Cluster (redis-cluster:// URLs)."""

from __future__ import annotations

import logging

import pytest
import redis
import torch

from tests.redis_fixtures import RedisClusterProcs
from tests.remote_fixtures import (
    FAST,
    FLUSH_S,
    SHARE_TOKENS,
    assert_shared_kv_identical,
    key,
    random_obj,
    remote_of,
    retrieve_in_fresh_process,
    store_shared_prompt,
)

pytestmark = pytest.mark.slow  # a real 3-master Redis Cluster per module


def test_cluster_roundtrip_spreads_keys_over_all_masters(redis_cluster: RedisClusterProcs, remote_manager):
    sm = remote_manager(redis_cluster.url)
    rb = remote_of(sm)
    assert rb.available
    objs = [random_obj(sm, (64, 1024), seed=i) for i in range(24)]  # 256 KiB each
    keys = [key(i) for i in range(24)]
    sm.batched_put(keys, objs)
    assert sm.flush(FLUSH_S)
    sizes = [server.client().dbsize() for server in redis_cluster.servers]
    assert sum(sizes) == 24 and all(n > 0 for n in sizes), sizes
    assert rb.batched_contains(keys) == 24
    assert rb.batched_contains(keys[:5] + [key(999)] + keys[5:]) == 5
    for k, o in zip(keys, objs):
        got = rb.get_blocking(k)
        assert got is not None and torch.equal(got.byte_array, o.byte_array)
        got.ref_count_down()
        o.ref_count_down()
    assert rb.stats.hits == 24 and rb.stats.errors == 0


def test_cluster_follows_moved_redirects(redis_cluster: RedisClusterProcs, remote_manager):
    sm = remote_manager(redis_cluster.url)
    rb = remote_of(sm)
    obj = random_obj(sm, (1024,), seed=5)
    rb.submit_put(key(1), obj)
    assert rb.flush(FLUSH_S)
    rc: redis.RedisCluster = rb.connector._topology._rc
    rkey = rb.remote_key(key(1)).encode()
    slot = rc.keyslot(rkey)
    owner = rc.get_node_from_key(rkey)
    wrong = next(n for n in rc.get_primaries() if n.name != owner.name)
    # Make the client's slot map stale: the real server answers MOVED.
    rc.nodes_manager.slots_cache[slot] = [wrong]
    got = rb.get_blocking(key(1))
    assert got is not None and torch.equal(got.byte_array, obj.byte_array)
    got.ref_count_down()
    rc.nodes_manager.slots_cache[slot] = [wrong]
    assert rb.batched_contains([key(1)]) == 1
    rc.nodes_manager.slots_cache[slot] = [wrong]
    rb.submit_put(key(1), obj)
    assert rb.flush(FLUSH_S)
    stats = rb.stats.snapshot()
    assert (stats["writes_completed"], stats["hits"], stats["errors"], stats["breaker_open"]) == (2, 1, 0, 0)
    obj.ref_count_down()


def test_two_engine_processes_share_one_cluster(redis_cluster: RedisClusterProcs, tmp_path):
    kv = store_shared_prompt(redis_cluster.url)
    report = retrieve_in_fresh_process(redis_cluster.url, tmp_path / "kv.pt")
    assert report["lookup"] == len(SHARE_TOKENS)
    assert report["retrieved"] == len(SHARE_TOKENS)
    assert report["remote"]["hits"] == len(SHARE_TOKENS) // 16
    assert_shared_kv_identical(kv, tmp_path / "kv.pt")


def test_cluster_wrong_password_disables_tier_with_one_log_line(redis_cluster: RedisClusterProcs, caplog,
                                                               remote_manager):
    secret = "cluster-s3cret"
    for server in redis_cluster.servers:
        server.client().config_set("requirepass", secret)
    try:
        caplog.set_level(logging.INFO, logger="lmcache")
        sm = remote_manager(redis_cluster.url, remote_password="not-" + secret)
        rb = remote_of(sm)
        assert rb.disabled_reason is not None and not rb.available
        assert rb.batched_contains([key(1)]) == 0 and rb.get_blocking(key(1)) is None
        errors = [r for r in caplog.records if r.levelno >= logging.WARNING and "remote tier" in r.getMessage()]
        assert len(errors) == 1 and "rejected the credentials" in errors[0].getMessage()
        assert secret not in caplog.text
        sm.close()
        assert remote_of(remote_manager(redis_cluster.url, remote_password=secret)).available
    finally:
        for server in redis_cluster.servers:
            redis.Redis(host="127.0.0.1", port=server.port, password=secret).config_set("requirepass", "")


def test_cluster_master_killed_then_back(redis_cluster: RedisClusterProcs, remote_manager):
    sm = remote_manager(redis_cluster.url, remote_timeout=1.0, extra_config=FAST)
    rb = remote_of(sm)
    obj = random_obj(sm, (4096,), seed=9)
    keys = [key(i) for i in range(12)]
    sm.batched_put(keys, [obj] * 12)
    assert sm.flush(FLUSH_S)
    victim = redis_cluster.servers[1]
    victim.kill()
    assert rb.batched_contains(keys) == 0  # connection refused: answers at once
    assert rb.stats.breaker_open == 1
    got = sm.get(keys[0])  # L1 still serves
    assert got is not None
    got.ref_count_down()
    victim.restart()
    redis_cluster._wait_ok()
    assert rb.wait_available(30)
    assert rb.stats.reconnects == 1
    sm.local_cpu.remove(keys[0])
    sm.put(keys[0], obj)  # memory-only servers: the restarted master lost its keys
    assert sm.flush(FLUSH_S)
    assert rb.contains(keys[0])
    obj.ref_count_down()


def _slots_of(server) -> list[int]:
    out = []
    for lo, hi, master, *_ in server.client().execute_command("CLUSTER", "SLOTS"):
        if int(master[1]) == server.port:
            out.extend(range(int(lo), int(hi) + 1))
    return out


def _cluster_state(server) -> str:
    info = server.client().execute_command("CLUSTER", "INFO")
    text = info.decode() if isinstance(info, bytes) else str(info)
    return "ok" if "cluster_state:ok" in text else "fail"


def test_cluster_down_while_ping_works_gives_one_outage_and_one_recovery(redis_cluster: RedisClusterProcs, caplog,
                                                                         remote_manager):
    """Issue 13 item 8: a node answering PING but refusing data (CLUSTERDOWN) must not flap the breaker."""
    import threading

    caplog.set_level(logging.INFO, logger="lmcache")
    sm = remote_manager(redis_cluster.url, remote_timeout=1.0, extra_config={"remote_backoff_initial": 0.02,
                                                                             "remote_backoff_max": 0.05})
    victim = redis_cluster.servers[1]
    slots = _slots_of(victim)
    try:
        rb = remote_of(sm)
        keys = [key(i) for i in range(24)]
        victim.client().execute_command("CLUSTER", "DELSLOTS", *slots)
        pace = threading.Event()
        for _ in range(200):  # wait (bounded) until the victim reports the failure
            if _cluster_state(victim) == "fail":
                break
            pace.wait(0.05)
        assert _cluster_state(victim) == "fail"
        assert victim.client().ping()
        for _ in range(30):  # ~1.5 s of traffic while probes run every <= 50 ms
            rb.batched_contains(keys)
            got = rb.get_blocking(keys[5])
            assert got is None
            pace.wait(0.05)
        assert rb.stats.breaker_open == 1, rb.stats
        victim.client().execute_command("CLUSTER", "ADDSLOTS", *slots)
        redis_cluster._wait_ok()
        assert rb.wait_available(30)
        for _ in range(5):
            rb.batched_contains(keys)
        down = [r for r in caplog.records if "unavailable" in r.getMessage() and "remote tier" in r.getMessage()]
        back = [r for r in caplog.records if "reachable again" in r.getMessage()]
        assert len(down) == 1 and len(back) == 1, [r.getMessage() for r in caplog.records]
        assert rb.stats.breaker_open == 1 and rb.stats.reconnects == 1
    finally:
        if _cluster_state(victim) != "ok":
            victim.client().execute_command("CLUSTER", "ADDSLOTS", *slots)
            redis_cluster._wait_ok()
