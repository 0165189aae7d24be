from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from lmcache.v1.storage_backend.cache_policy import FIFOPolicy, LFUPolicy, LRUPolicy, make_policy
from lmcache.v1.storage_backend.cache_policy.mru import MRUPolicy


def order(policy):
    return list(policy.victims())


def test_lru():
    p = LRUPolicy()
    for k in "abc":
        p.on_insert(k)
    p.on_hit("a")
    assert order(p) == ["b", "c", "a"]
    p.on_remove("c")
    p.on_remove("zz")
    assert order(p) == ["b", "a"] and len(p) == 2


def test_fifo_ignores_hits():
    p = FIFOPolicy()
    for k in "abc":
        p.on_insert(k)
    p.on_hit("a")
    p.on_insert("a")
    assert order(p) == ["a", "b", "c"]


def test_lfu_counts_then_recency():
    p = LFUPolicy()
    for k in "abcd":
        p.on_insert(k)
    p.on_hit("a")
    p.on_hit("a")
    p.on_hit("c")
    assert order(p) == ["b", "d", "c", "a"]
    p.on_remove("b")
    assert order(p) == ["d", "c", "a"]


@pytest.mark.parametrize("name, cls", [("lru", LRUPolicy), ("FIFO", FIFOPolicy), ("Lfu", LFUPolicy)])
def test_make_policy(name, cls):
    assert isinstance(make_policy(name), cls)


def test_make_policy_rejects_unknown():
    with pytest.raises(ValueError, match="cache_policy='ARC'"):
        make_policy("ARC")


@settings(max_examples=60, deadline=None)
@given(
    cls=st.sampled_from([LRUPolicy, MRUPolicy, FIFOPolicy, LFUPolicy]),
    inserted=st.lists(st.integers(0, 9), max_size=12),
    hits=st.lists(st.integers(0, 12), max_size=20),
)
def test_on_hits_is_on_hit_per_key(cls, inserted, hits):
    """The batched hit (one call for a sequence's keys) orders exactly like one call per key,
    unknown keys included."""
    one, many = cls(), cls()
    for p in (one, many):
        for k in inserted:
            p.on_insert(k)
    for k in hits:
        one.on_hit(k)
    many.on_hits(hits)
    assert order(one) == order(many) and len(one) == len(many)
