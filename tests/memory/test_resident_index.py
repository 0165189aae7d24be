"""ResidentIndex: a hypothesis state machine against a plain model, per eviction policy.

Invariants: the booked bytes never exceed the capacity, a pinned or busy entry is never
evicted, a failed reservation changes nothing, and the chunks of a sequence inserted
tail first (as tiers do) are evicted tail before head.
"""

from __future__ import annotations

import pytest
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from lmcache.v1.storage_backend.cache_policy import make_policy
from lmcache.v1.storage_backend.resident_index import ResidentIndex

CAPACITY = 40
keys = st.integers(0, 11)
sizes = st.integers(1, 12)


class IndexMachine(RuleBasedStateMachine):
    policy = "LRU"

    def __init__(self) -> None:
        super().__init__()
        self.busy: set[int] = set()
        self.index: ResidentIndex[int, str] = ResidentIndex(
            make_policy(self.policy), CAPACITY, busy=lambda v: int(v[1:]) in self.busy
        )
        self.model: dict[int, int] = {}  # key -> size
        self.pins: dict[int, int] = {}
        self.booked: list[int] = []

    def _state(self) -> tuple:
        return (sorted(self.index.keys()), self.index.used, self.index.reserved, list(self.index.policy.victims()))

    def _forget(self, evicted: list[tuple[int, str]]) -> None:
        for key, value in evicted:
            assert value == f"v{key}"
            assert self.pins.get(key, 0) == 0, "a pinned entry was evicted"
            assert key not in self.busy, "a busy entry was evicted"
            del self.model[key]
            self.pins.pop(key, None)

    @rule(nbytes=sizes, key=keys)
    def reserve_and_commit(self, nbytes, key):
        before = self._state()
        evicted = self.index.reserve(nbytes)
        if evicted is None:
            assert self._state() == before, "a failed reservation changed the index"
            free = CAPACITY - self.index.used - self.index.reserved
            evictable = sum(s for k, s in self.model.items() if not self.pins.get(k) and k not in self.busy)
            assert nbytes > CAPACITY or free + evictable < nbytes, "room was there but the reservation failed"
            return
        self._forget(evicted)
        if key in self.model:  # a rewrite: the reservation is cancelled instead
            self.index.release(nbytes)
            return
        assert self.index.commit(key, f"v{key}", nbytes, nbytes) is None
        self.model[key] = nbytes

    @rule(nbytes=sizes)
    def reserve_and_hold(self, nbytes):
        evicted = self.index.reserve(nbytes)
        if evicted is not None:
            self._forget(evicted)
            self.booked.append(nbytes)

    @precondition(lambda self: self.booked)
    @rule()
    def release(self):
        self.index.release(self.booked.pop())

    @rule(key=keys)
    def touch(self, key):
        assert self.index.touch(key) == (key in self.model)

    @rule(key=keys)
    def pin(self, key):
        if self.index.pin(key):
            self.pins[key] = self.pins.get(key, 0) + 1
        else:
            assert key not in self.model

    @precondition(lambda self: any(self.pins.values()))
    @rule(data=st.data())
    def unpin(self, data):
        key = data.draw(st.sampled_from(sorted(k for k, n in self.pins.items() if n)))
        assert self.index.unpin(key)
        self.pins[key] -= 1

    @rule(key=keys)
    def toggle_busy(self, key):
        self.busy ^= {key}

    @rule(key=keys)
    def remove(self, key):
        assert (self.index.pop(key) is not None) == (key in self.model)
        self.model.pop(key, None)
        self.pins.pop(key, None)

    @invariant()
    def matches_model(self):
        assert sorted(self.index.keys()) == sorted(self.model)
        assert self.index.used == sum(self.model.values())
        assert self.index.reserved == sum(self.booked)
        assert self.index.used + self.index.reserved <= CAPACITY
        assert len(self.index.policy) == len(self.model)
        for key in self.model:
            assert self.index.pins(key) == self.pins.get(key, 0)


class FIFOIndexMachine(IndexMachine):
    policy = "FIFO"


class LFUIndexMachine(IndexMachine):
    policy = "LFU"


@pytest.mark.parametrize("machine", [IndexMachine, FIFOIndexMachine, LFUIndexMachine], ids=["LRU", "FIFO", "LFU"])
def test_resident_index_state_machine(machine):
    machine.TestCase.settings = settings(max_examples=60, stateful_step_count=40, deadline=None)
    machine.TestCase().runTest()


@pytest.mark.parametrize("policy", ["LRU", "FIFO", "LFU"])
def test_sequence_tail_is_evicted_before_head(policy):
    index: ResidentIndex[str, int] = ResidentIndex(make_policy(policy), 4)
    seq = ["head", "c1", "c2", "tail"]
    for key in reversed(seq):  # tiers insert tail first
        assert index.reserve(1) == []
        index.commit(key, 0, 1, 1)
    index.touch_sequence(seq)  # a hit on the whole sequence keeps the order
    evicted = [k for k, _ in index.reserve(3)]
    assert evicted == ["tail", "c2", "c1"]
    assert index.keys() == ["head"]


def test_make_room_is_all_or_nothing():
    index: ResidentIndex[int, int] = ResidentIndex(make_policy("LRU"))
    for key in range(3):
        index.insert(key, key, 10)
    index.pin(1)
    assert index.make_room(25) is None  # only 20 bytes are evictable
    assert index.keys() == [0, 1, 2] and index.used == 30
    assert [k for k, _ in index.make_room(15)] == [0, 2]
    assert index.keys() == [1]


def test_capacity_must_be_positive():
    with pytest.raises(ValueError, match="capacity=0"):
        ResidentIndex(make_policy("LRU"), 0)


def test_storage_errors_share_the_lmcache_root():
    from lmcache.errors import LMCacheError
    from lmcache.v1.storage_backend.connector.errors import (
        RemoteAuthError,
        RemoteError,
        RemoteUnavailable,
        RemoteWrongType,
    )
    from lmcache.v1.storage_backend.connector.resp import ReplyError
    from lmcache.v1.storage_backend.entry_format import CorruptEntryError

    for cls in (CorruptEntryError, RemoteError, RemoteUnavailable, RemoteAuthError, RemoteWrongType, ReplyError):
        assert issubclass(cls, LMCacheError), cls
    assert issubclass(CorruptEntryError, ValueError)  # callers' ``except ValueError`` still match
    assert issubclass(ReplyError, RemoteError)
