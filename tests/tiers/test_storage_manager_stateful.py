"""Hypothesis state machine: StorageManager + LocalCPUBackend against a dict model."""

from __future__ import annotations

import pytest
import torch
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from lmcache.utils import CacheEngineKey
from lmcache.v1.config import LMCacheEngineConfig
from lmcache.v1.memory_management import ALIGN, MemoryFormat
from lmcache.v1.storage_backend.storage_manager import StorageManager

POOL = 16 * ALIGN
KEYS = [CacheEngineKey("m", 1, 0, i, "uint8") for i in range(12)]
key_ids = st.integers(0, len(KEYS) - 1)


def make_manager(policy: str) -> StorageManager:
    cfg = LMCacheEngineConfig.from_dict({"chunk_size": 16, "cache_policy": policy})
    return StorageManager(cfg, lower_backends=[], pool_bytes=POOL)


class StorageMachine(RuleBasedStateMachine):
    policy = "LRU"

    def __init__(self) -> None:
        super().__init__()
        self.sm = make_manager(self.policy)
        self.model: dict[int, int] = {}  # key id -> fill byte (what a hit must return)
        self.pins: dict[int, int] = {}  # key id -> pin count

    def _sync_evictions(self) -> None:
        for k in list(self.model):
            if not self.sm.contains(KEYS[k]):
                assert self.pins.get(k, 0) == 0, "a pinned entry was evicted"
                del self.model[k]

    @rule(k=key_ids, pages=st.integers(1, 6), fill=st.integers(0, 255), give=st.booleans())
    def put(self, k, pages, fill, give):
        """``give``: the caller's reference goes to L1 (the layerwise store's publish);
        otherwise L1 takes its own and the caller drops its. Same model either way; the
        teardown's empty pool proves neither leaks nor frees twice."""
        obj = self.sm.allocate((pages * ALIGN,), torch.uint8, MemoryFormat.BINARY)
        self._sync_evictions()
        if obj is None:
            return  # skipped store: allowed only when pinned/used entries block eviction
        obj.tensor.fill_(fill)
        self.sm.batched_put([KEYS[k]], [obj], give=give)
        if not give:
            obj.ref_count_down()
        if k not in self.model:
            self.model[k] = fill  # an existing key keeps its first value

    @rule(k=key_ids)
    def get(self, k):
        obj = self.sm.get(KEYS[k])
        if k in self.model:
            assert obj is not None
            assert int(obj.tensor[0]) == self.model[k] and bool((obj.tensor == self.model[k]).all())
        else:
            assert obj is None
        if obj is not None:
            obj.ref_count_down()

    @rule(ks=st.lists(key_ids, min_size=1, max_size=5))
    def batched_contains_is_prefix(self, ks):
        keys = [KEYS[k] for k in ks]
        n = self.sm.batched_contains(keys)
        expected = 0
        for k in ks:
            if k not in self.model:
                break
            expected += 1
        assert n == expected

    @rule(k=key_ids)
    def pin(self, k):
        if self.sm.contains(KEYS[k], pin=True):
            assert k in self.model
            self.pins[k] = self.pins.get(k, 0) + 1

    @precondition(lambda self: any(self.pins.values()))
    @rule(data=st.data())
    def unpin(self, data):
        k = data.draw(st.sampled_from([k for k, n in self.pins.items() if n]))
        assert self.sm.unpin(KEYS[k])
        self.pins[k] -= 1

    @rule(k=key_ids)
    def remove(self, k):
        removed = self.sm.remove(KEYS[k])
        assert removed == (k in self.model)
        self.model.pop(k, None)
        self.pins.pop(k, None)

    @invariant()
    def pool_within_limit(self):
        assert 0 <= self.sm.allocator.used_bytes <= POOL

    @invariant()
    def model_matches_residency(self):
        assert set(self.model) == {k for k in range(len(KEYS)) if KEYS[k] in set(self.sm.local_cpu.keys())}

    def teardown(self):
        for k in list(self.model):
            for _ in range(self.pins.get(k, 0)):
                self.sm.unpin(KEYS[k])
            self.sm.remove(KEYS[k])
        assert self.sm.allocator.used_bytes == 0, "reference counts did not return to baseline"
        self.sm.close()


class FIFOMachine(StorageMachine):
    policy = "FIFO"


class LFUMachine(StorageMachine):
    policy = "LFU"


TestLRU = StorageMachine.TestCase
TestFIFO = FIFOMachine.TestCase
TestLFU = LFUMachine.TestCase
for case in (TestLRU, TestFIFO, TestLFU):
    case.settings = settings(max_examples=60, stateful_step_count=40, deadline=None)


@pytest.mark.parametrize("policy", ["LRU", "FIFO", "LFU"])
def test_tail_evicted_before_head(policy):
    sm = make_manager(policy)
    seq = KEYS[:4]  # one request of four chunks
    objs = [sm.allocate((4 * ALIGN,), torch.uint8, MemoryFormat.BINARY) for _ in seq]
    sm.batched_put(seq, objs)
    for o in objs:
        o.ref_count_down()
    extra = sm.allocate((4 * ALIGN,), torch.uint8, MemoryFormat.BINARY)  # forces one eviction
    assert extra is not None
    assert [sm.contains(k) for k in seq] == ["LocalCPUBackend"] * 3 + [None]  # the holder's name, else None
    extra.ref_count_down()
    sm.close()


def test_pinned_never_evicted_and_full_pool_skips():
    sm = make_manager("LRU")
    objs = [sm.allocate((8 * ALIGN,), torch.uint8, MemoryFormat.BINARY) for _ in range(2)]
    sm.batched_put(KEYS[:2], objs)
    for o in objs:
        o.ref_count_down()
    assert sm.batched_contains(KEYS[:2], pin=True) == 2
    assert sm.allocate((ALIGN,), torch.uint8, MemoryFormat.BINARY) is None  # nothing evictable
    assert sm.batched_contains(KEYS[:2]) == 2
    sm.unpin(KEYS[0])
    obj = sm.allocate((ALIGN,), torch.uint8, MemoryFormat.BINARY)
    assert obj is not None and not sm.contains(KEYS[0]) and sm.contains(KEYS[1])
    obj.ref_count_down()
    sm.close()
