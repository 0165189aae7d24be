"""Hardening issue (#13), remote tier: items 9 (wrong Redis type) and 13 (long keys)."""

from __future__ import annotations


import pytest
import torch


from lmcache.utils import CacheEngineKey  # noqa: E402
from lmcache.v1.storage_backend.remote_backend import MAX_PLAIN_KEY  # noqa: E402
from tests.v1.test_remote_backend import FLUSH_S, key, make_manager, random_obj, remote_of  # noqa: E402


@pytest.mark.parametrize("kind", ["list", "hash", "set"])
def test_item9_key_of_another_redis_type_is_deleted_and_rewritten(redis_server, kind):
    sm = make_manager(redis_server.url)
    try:
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
    finally:
        sm.close()


@pytest.mark.parametrize("length", [100, MAX_PLAIN_KEY + 1, 20_000, 200_000])
def test_item13_keys_of_any_length_hit(redis_server, length):
    sm = make_manager(redis_server.url)
    try:
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
    finally:
        sm.close()
