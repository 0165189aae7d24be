"""Remote tier on a real standalone redis-server: URLs, config, round trips, sharing.

Run as a script, this module is the "engine B" process of the two-process test:
``python test_remote_backend.py retrieve <url> <out.pt>`` retrieves a known prompt
from the remote tier into empty KV caches and saves what it got.
"""

from __future__ import annotations

import json
import logging
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tests.native_build import child_env
from tests.redis_fixtures import RedisServer

from lmcache.utils import CacheEngineKey, LayerCacheEngineKey  # noqa: E402
from lmcache.v1.config import ConfigError, LMCacheEngineConfig  # noqa: E402
from lmcache.v1.memory_management import MemoryFormat, MemoryObj  # noqa: E402
from lmcache.v1.storage_backend import create_lower_backends  # noqa: E402
from lmcache.v1.storage_backend.connector import mask_url, parse_remote_url  # noqa: E402
from lmcache.v1.storage_backend.remote_backend import RemoteBackend, RemoteOptions  # noqa: E402
from lmcache.v1.storage_backend.storage_manager import StorageManager  # noqa: E402
from lmcache.v1.testing import KVSpec, make_engine, random_kv_caches, random_slot_mapping  # noqa: E402

FLUSH_S = 30.0
SHARE_SPEC = KVSpec(num_layers=2, num_heads=2, head_size=16, num_blocks=32, block_size=16, dtype=torch.bfloat16,
                    layout="flash_attn")
SHARE_TOKENS = list(range(1000, 1000 + 96))  # 6 chunks of 16
SHARE_SEED = 7


def remote_config(url: str, **extra) -> LMCacheEngineConfig:
    data = {"chunk_size": 16, "max_local_cpu_size": 0.0625, "remote_url": url, "remote_timeout": 2.0}
    data.update(extra)
    return LMCacheEngineConfig.from_dict(data)


def make_manager(url: str, **extra) -> StorageManager:
    return StorageManager(remote_config(url, **extra), pool_bytes=64 << 20)


def remote_of(sm: StorageManager) -> RemoteBackend:
    (backend,) = sm.lower
    assert isinstance(backend, RemoteBackend)
    return backend


def random_obj(sm: StorageManager, shape, dtype=torch.float32, fmt=MemoryFormat.KV_2LTD, seed=0) -> MemoryObj:
    obj = sm.allocate(shape, dtype, fmt)
    assert obj is not None
    g = torch.Generator().manual_seed(seed)
    obj.byte_array.copy_(torch.randint(0, 256, (obj.get_size(),), generator=g, dtype=torch.uint8))
    return obj


def key(i: int, model: str = "m") -> CacheEngineKey:
    return CacheEngineKey(model, 1, 0, i, "float32")


# ---------------------------------------------------------------------- URLs and config
@pytest.mark.parametrize(
    "url, scheme, nodes, path, db",
    [
        ("redis://h:1234/3", "redis", (("h", 1234),), None, 3),
        ("redis://h", "redis", (("h", 6379),), None, 0),
        ("rediss://u:pw@h:7000", "rediss", (("h", 7000),), None, 0),
        ("unix:///run/redis.sock?db=2", "unix", (), "/run/redis.sock", 2),
        ("redis-cluster://a:1,b:2,[::1]:3", "redis-cluster", (("a", 1), ("b", 2), ("::1", 3)), None, 0),
    ],
)
def test_parse_remote_url(url, scheme, nodes, path, db):
    addr = parse_remote_url(url)
    assert (addr.scheme, addr.nodes, addr.path, addr.db) == (scheme, nodes, path, db)
    assert addr.cluster == scheme.endswith("-cluster")
    assert addr.tls == scheme.startswith("rediss")


@pytest.mark.parametrize(
    "url, words",
    [
        ("memcached://h:1", "unsupported scheme"),
        ("redis://a:1,b:2", "cluster scheme"),
        ("redis://h:notaport", "not an integer"),
        ("redis://h:70000", "out of range"),
        ("redis-cluster://a:1/2", "database 0"),
        ("unix://relative.sock", "absolute socket path"),
        ("redis://:s3cret@h:x", "not an integer"),
    ],
)
def test_parse_remote_url_rejects(url, words):
    with pytest.raises(ValueError, match=words) as info:
        parse_remote_url(url)
    assert "s3cret" not in str(info.value)


_secret = st.text(st.characters(blacklist_characters="@/?#%", blacklist_categories=("Cs",)), min_size=1, max_size=20)


@given(user=st.sampled_from(["", "alice"]), pw=_secret,
       scheme=st.sampled_from(["redis", "rediss", "redis-cluster"]))
def test_mask_url_hides_any_password(user, pw, scheme):
    url = f"{scheme}://{user}:{pw}@host:6379"
    assert mask_url(url) == f"{scheme}://{user}:***@host:6379"
    addr = parse_remote_url(url)
    assert addr.password == pw and addr.nodes == (("host", 6379),)
    assert repr(addr) == f"RemoteAddress({scheme}://host:6379, db=0, username={user or None!r}, password=***)"
    assert mask_url("redis://host:1/0") == "redis://host:1/0"


def test_config_credentials_from_env_and_never_in_repr(monkeypatch):
    monkeypatch.setenv("LMCACHE_REMOTE_URL", "redis://127.0.0.1:1")
    monkeypatch.setenv("LMCACHE_REMOTE_USERNAME", "alice")
    monkeypatch.setenv("LMCACHE_REMOTE_PASSWORD", "hunter2-secret")
    monkeypatch.delenv("LMCACHE_CONFIG_FILE", raising=False)
    cfg = LMCacheEngineConfig.load()
    assert (cfg.remote_username, cfg.remote_password) == ("alice", "hunter2-secret")
    assert "hunter2-secret" not in repr(cfg)
    assert LMCacheEngineConfig.from_dict({}).remote_password is None


@pytest.mark.parametrize(
    "extra, words",
    [
        ({"remote_workers": 0}, "remote_workers"),
        ({"remote_max_inflight_mb": "lots"}, "remote_max_inflight_mb"),
        ({"remote_backoff_initial": -1}, "remote_backoff_initial"),
        ({"remote_backoff_initial": 5, "remote_backoff_max": 1}, "remote_backoff_max"),
        ({"remote_tls_cert_reqs": "maybe"}, "remote_tls_cert_reqs"),
        ({"remote_key_prefix": "a b"}, "remote_key_prefix"),
    ],
)
def test_remote_options_reject_bad_values(extra, words):
    cfg = remote_config("redis://127.0.0.1:1", extra_config=extra)
    with pytest.raises(ValueError, match=words):
        RemoteOptions.from_config(cfg, 1 << 30)


def test_malformed_url_is_a_clear_error_at_start():
    cfg = remote_config("redis://:pw-not-logged@a:1,b:2")
    with pytest.raises(ConfigError, match="remote_url=.*cluster scheme") as info:
        StorageManager(cfg, pool_bytes=1 << 20)
    assert "pw-not-logged" not in str(info.value)


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
def test_large_values_and_stats(redis_server, via):
    url = redis_server.url if via == "tcp" else redis_server.unix_url
    sm = make_manager(url)
    try:
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
    finally:
        sm.close()
    assert sm.allocator.used_bytes == 0


def test_batched_contains_is_prefix_one_command_per_key(redis_server):
    sm = make_manager(redis_server.url)
    try:
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
    finally:
        sm.close()


def test_hit_is_promoted_into_cpu_tier(redis_server):
    writer = make_manager(redis_server.url)
    reader = make_manager(redis_server.url)
    try:
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
    finally:
        writer.close()
        reader.close()


def test_namespaces_and_layer_keys_are_separate(redis_server):
    cfg = remote_config(redis_server.url)
    sm = StorageManager(cfg, pool_bytes=64 << 20)
    ec = create_lower_backends(cfg, sm.local_cpu, namespace="ec")[0]
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
        sm.close()


def test_write_budget_drops_instead_of_blocking(redis_server):
    sm = make_manager(redis_server.url, extra_config={"remote_max_inflight_mb": 1, "remote_workers": 1})
    try:
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
    finally:
        sm.close()


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


def test_tls(redis_server_factory):
    server: RedisServer = redis_server_factory(tls=True)
    sm = make_manager(server.tls_url, extra_config={"remote_tls_ca_certs": server.ca_cert})
    try:
        rb = remote_of(sm)
        assert rb.available, rb.stats.snapshot()
        obj = random_obj(sm, (64, 1024), seed=2)
        rb.submit_put(key(1), obj)
        assert rb.flush(FLUSH_S)
        got = rb.get_blocking(key(1))
        assert got is not None and torch.equal(got.byte_array, obj.byte_array)
        got.ref_count_down()
        obj.ref_count_down()
    finally:
        sm.close()


# ---------------------------------------------------------------------- two processes
def share_config(url: str) -> LMCacheEngineConfig:
    return remote_config(url, max_local_cpu_size=0.0625)


def store_shared_prompt(url: str) -> list[torch.Tensor]:
    """Engine A: store SHARE_TOKENS' KV through the remote tier; returns the source caches."""
    kv = random_kv_caches(SHARE_SPEC, seed=SHARE_SEED)
    slots = random_slot_mapping(SHARE_SPEC, len(SHARE_TOKENS), seed=SHARE_SEED)
    engine = make_engine(SHARE_SPEC, share_config(url))
    try:
        assert engine.store(SHARE_TOKENS, kvcaches=kv, slot_mapping=slots) == len(SHARE_TOKENS)
        assert engine.storage_manager.flush(FLUSH_S)
        (rb,) = engine.storage_manager.lower
        assert rb.stats.writes_completed == len(SHARE_TOKENS) // 16
    finally:
        engine.close()
    return kv


def retrieve_in_fresh_process(url: str, out: Path) -> dict:
    """Engine B in a new interpreter; returns its JSON report."""
    env = child_env(PYTHONHASHSEED="123")  # key hashes must not depend on it
    res = subprocess.run(
        [sys.executable, __file__, "retrieve", url, str(out)],
        capture_output=True, text=True, timeout=300, env=env,
    )
    assert res.returncode == 0, res.stdout + res.stderr
    return json.loads(res.stdout.strip().splitlines()[-1])


def assert_shared_kv_identical(kv: list[torch.Tensor], out: Path) -> None:
    slots = random_slot_mapping(SHARE_SPEC, len(SHARE_TOKENS), seed=SHARE_SEED)
    got = torch.load(out, weights_only=True)
    for src, dst in zip(kv, got):
        nb, bs = SHARE_SPEC.num_blocks, SHARE_SPEC.block_size
        want = src.reshape(2, nb * bs, -1)[:, slots]
        have = dst.reshape(2, nb * bs, -1)[:, slots]
        assert torch.equal(want.view(torch.int16), have.view(torch.int16)), "KV is not bit-identical"
        mask = torch.ones(nb * bs, dtype=torch.bool)
        mask[slots] = False
        assert not dst.reshape(2, nb * bs, -1)[:, mask].any(), "retrieve wrote outside the prompt's slots"


def test_two_engine_processes_share_one_redis(redis_server, tmp_path):
    kv = store_shared_prompt(redis_server.url)
    report = retrieve_in_fresh_process(redis_server.url, tmp_path / "kv.pt")
    assert report["retrieved"] == len(SHARE_TOKENS)
    assert report["remote"]["hits"] == len(SHARE_TOKENS) // 16
    assert report["remote"]["corrupt_entries"] == 0
    assert_shared_kv_identical(kv, tmp_path / "kv.pt")


def _child_retrieve(url: str, out: str) -> None:
    kv = [torch.zeros_like(t) for t in random_kv_caches(SHARE_SPEC, seed=SHARE_SEED)]
    slots = random_slot_mapping(SHARE_SPEC, len(SHARE_TOKENS), seed=SHARE_SEED)
    engine = make_engine(SHARE_SPEC, share_config(url))
    try:
        hit = engine.lookup(SHARE_TOKENS)
        ret = engine.retrieve(SHARE_TOKENS, kvcaches=kv, slot_mapping=slots)
        (rb,) = engine.storage_manager.lower
        torch.save(kv, out)
        print(json.dumps({"lookup": hit, "retrieved": int(ret.sum()), "remote": rb.stats.snapshot()}))
    finally:
        engine.close()


if __name__ == "__main__":
    if len(sys.argv) == 4 and sys.argv[1] == "retrieve":
        _child_retrieve(sys.argv[2], sys.argv[3])
    else:
        sys.exit(f"usage: {sys.argv[0]} retrieve <remote_url> <out.pt>")
