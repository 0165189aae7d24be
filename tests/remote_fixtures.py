"""Shared set-up of the remote-tier tests (``tests/tiers/test_remote_*.py``).

* :func:`remote_config` / :func:`make_manager`: a small engine config and a
  :class:`StorageManager` whose only lower tier is the remote one at ``url``.
* :func:`remote_manager` (fixture, registered in ``tests/conftest.py``): the same manager
  from a factory that closes every manager it made when the test ends.
* :func:`remote_of`, :func:`random_obj`, :func:`key`: the tier, a random pool object, a key.
* The two-process share check (engine A stores, a fresh interpreter retrieves):
  :func:`store_shared_prompt`, :func:`retrieve_in_fresh_process`,
  :func:`assert_shared_kv_identical`. Run as ``python -m tests.remote_fixtures retrieve
  <url> <out.pt>``, this module is that second process.

The Redis servers themselves come from :mod:`tests.redis_fixtures`.
"""

from __future__ import annotations

import json
import subprocess
import sys
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
import torch

from lmcache.utils import CacheEngineKey
from lmcache.v1.config import LMCacheEngineConfig
from lmcache.v1.memory_management import MemoryFormat, MemoryObj
from lmcache.v1.storage_backend.remote_backend import RemoteBackend
from lmcache.v1.storage_backend.storage_manager import StorageManager
from lmcache.v1.testing import KVSpec, make_engine, random_kv_caches, random_slot_mapping
from tests.native_build import REPO, child_env

FLUSH_S = 30.0
"""Bound for a flush: generous, it proves "no hang", not speed."""
FAST = {"remote_backoff_initial": 0.05, "remote_backoff_max": 0.5}
"""``extra_config`` of a tier that probes a lost server often (outage tests)."""

SHARE_SPEC = KVSpec(num_layers=2, num_heads=2, head_size=16, num_blocks=32, block_size=16, dtype=torch.bfloat16,
                    layout="flash_attn")
SHARE_TOKENS = list(range(1000, 1000 + 96))  # 6 chunks of 16
SHARE_SEED = 7


def remote_config(url: str, **extra) -> LMCacheEngineConfig:
    data = {"chunk_size": 16, "max_local_cpu_size": 0.0625, "remote_url": url, "remote_timeout": 2.0}
    data.update(extra)
    return LMCacheEngineConfig.from_dict(data)


def make_manager(url: str, **extra) -> StorageManager:
    """A manager with a 64 MiB pool; the caller closes it (or use :func:`remote_manager`)."""
    return StorageManager(remote_config(url, **extra), pool_bytes=64 << 20)


@pytest.fixture
def remote_manager() -> Iterator[Callable[..., StorageManager]]:
    """``remote_manager(url, **config)``: :func:`make_manager`, closed after the test.

    Request it after the server fixture (``redis_server, remote_manager``) so the managers
    close before their server stops. Closing one early in the test is fine."""
    made: list[StorageManager] = []

    def make(url: str, **extra) -> StorageManager:
        sm = make_manager(url, **extra)
        made.append(sm)
        return sm

    yield make
    for sm in reversed(made):
        sm.close()


def remote_of(sm: StorageManager) -> RemoteBackend:
    (backend,) = sm.lower
    assert isinstance(backend, RemoteBackend)
    return backend


def random_obj(sm: StorageManager, shape, dtype=torch.float32, fmt=MemoryFormat.KV_2LTD, seed=0) -> MemoryObj:
    """A pool object of random bytes; the caller owns its one reference."""
    obj = sm.allocate(shape, dtype, fmt)
    assert obj is not None
    g = torch.Generator().manual_seed(seed)
    obj.byte_array.copy_(torch.randint(0, 256, (obj.get_size(),), generator=g, dtype=torch.uint8))
    return obj


def key(i: int, model: str = "m") -> CacheEngineKey:
    return CacheEngineKey(model, 1, 0, i, "float32")


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
        [sys.executable, "-m", "tests.remote_fixtures", "retrieve", url, str(out)],
        capture_output=True, text=True, timeout=300, env=env, cwd=REPO,
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
        sys.exit("usage: python -m tests.remote_fixtures retrieve <remote_url> <out.pt>")
