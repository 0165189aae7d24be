"""Hostile blend prompts: many separators, tiny segments. A prompt is bounded in the segments
it is split into (``blend_max_segments``) and in how short a stored segment may be
(``blend_min_segment_tokens``); segment stores re-rotate once per layer, not per segment."""

from __future__ import annotations

import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from lmcache.integration.vllm.blend_planner import BlendPlanner, BlendRules
from lmcache.integration.vllm.blend_worker import BlendRunner
from lmcache.integration.vllm.connector_metadata import SegmentRef
from lmcache.v1.blend import BlendConfig
from lmcache.v1.blend.segments import Segment, find_separators


import pytest

from tests.blend.helpers import SEP
from tests.blend.test_blend_connector import LAYERS, rnd
from tests.vllm_adapter.test_vllm_connector_unit import FakeRequest


@pytest.fixture(autouse=True)
def _hermetic(hermetic_env):
    """No ``LMCACHE_*`` variable of the caller's environment reaches the config (conftest)."""


def many_segments(n_segments: int, seg_len: int = 1) -> list[int]:
    """``seg_len`` tokens, SEP, repeated: a prompt that is almost only separators."""
    out: list[int] = []
    for i in range(n_segments):
        out += [10 + (i + j) % 200 for j in range(seg_len)] + SEP
    return out


def test_a_prompt_of_thousands_of_separators_is_neither_blended_nor_split():
    planner = BlendPlanner(BlendRules(tuple(SEP), max_segments=64))
    prompt = many_segments(8000)  # 32k tokens, 8,000 one-token segments
    assert len(prompt) == 32000
    assert planner.segments(prompt) == [] and planner.refused_prompts == 1
    assert len(planner.segments(many_segments(64, seg_len=20))) == 64  # at the limit: split


def test_short_segments_are_not_cached():
    planner = BlendPlanner(BlendRules(tuple(SEP), min_segment_tokens=16))
    prompt = rnd(15, 1) + SEP + rnd(16, 2) + SEP + rnd(3, 3)
    assert [(s.start, s.end) for s in planner.segments(prompt)] == [(18, 34)]


@given(tokens=st.lists(st.sampled_from([7, 8, 9, 10]), max_size=300), min_len=st.integers(1, 20),
       max_segs=st.integers(1, 40))
@settings(max_examples=300, deadline=None)
def test_segments_are_bounded_in_count_and_length(tokens, min_len, max_segs):
    planner = BlendPlanner(BlendRules(tuple(SEP), min_segment_tokens=min_len, max_segments=max_segs))
    bounds = [(s.start, s.end) for s in planner.segments(tokens)]
    assert len(bounds) <= max_segs
    cuts = set(find_separators(tokens, SEP))
    prev_end = 0
    for a, b in bounds:
        assert prev_end <= a < b <= len(tokens) and b - a >= min_len
        assert not any(c in cuts for c in range(a, b - len(SEP) + 1))  # no separator inside
        prev_end = b


def test_many_separators_through_the_adapter_store_no_segments(mini):
    """A prompt of 300 one-token segments is served as a normal prompt: no blend, no segment
    entries, counted; the worker's step is not spent on hundreds of segments."""
    before = len(list(mini.engine.storage_manager.backends[0].keys()))
    prompt = many_segments(300)
    out = mini.serve(FakeRequest("sep-flood", prompt))
    assert out["external"] == 0 and not out["errors"]
    assert mini.engine.stats.blend_requests == 0
    assert mini.scheduler.scheduler.snapshot()["scheduler_blend_refused_prompts"] == 1
    stored = len(list(mini.engine.storage_manager.backends[0].keys())) - before
    assert stored <= -(-len(prompt) // 16)  # at most the prompt's own prefix chunks (CHUNK = 16), no segments


def test_segment_store_rotates_once_for_every_layer(mini, model):
    """Five segments stored from the paged cache: one re-rotation call for all segments and
    layers (the layers side by side as heads), and the stored keys equal those re-rotated
    segment by segment, one layer at a time."""
    calls = []

    class Counting:
        def __init__(self, inner):
            self.inner = inner

        def rerotate(self, keys, old, new):
            calls.append(tuple(keys.shape[:2]))
            return self.inner.rerotate(keys, old, new)

    runner = BlendRunner(Counting(model), mini.engine.segments, BlendConfig((0.15,), (1,)))
    prompt = []
    refs = []
    for d in range(5):
        start = len(prompt)
        doc = rnd(20 + d, 50 + d)
        prompt += doc + SEP
        refs.append(SegmentRef(start, start + len(doc)))
    n = len(prompt)
    slots = torch.arange(n)
    req = type("Req", (), {"token_ids": torch.tensor(prompt), "slot_mapping": slots, "key_extras": {}})()
    assert runner.store_segments(req, refs, mini.kv) == sum(r.end - r.start for r in refs)
    from lmcache.v1.gpu_connector.layouts import component_tensors

    heads = component_tensors(mini.kv[0])[0].shape[2]
    assert calls == [(sum(r.end - r.start for r in refs), LAYERS * heads)]

    for ref in refs[1:]:
        seg = Segment(ref.start, ref.end, tuple(prompt[ref.start : ref.end]))
        got = mini.engine.segments.get(seg, len(seg))
        k_view, _ = component_tensors(mini.kv[2])
        bs = k_view.shape[1]
        s = slots[ref.start : ref.end]
        want = model.rerotate(k_view[s // bs, s % bs], torch.arange(ref.start, ref.end), torch.arange(len(seg)))
        torch.testing.assert_close(got.keys[2], want)


def test_the_segments_op_refuses_more_segments_than_any_scheduler_asks_for(mini):
    from lmcache.integration.vllm.lookup_service import LookupClient
    from lmcache.integration.vllm.naming import socket_path
    from lmcache.v1.config import MAX_BLEND_SEGMENTS

    settings = mini.worker.settings
    client = LookupClient([socket_path(settings.socket_dir, settings.engine_id, 0)], timeout=5.0)
    try:
        prompt = list(range(10, 10 + 2 * (MAX_BLEND_SEGMENTS + 1)))
        bounds = [(2 * i, 2 * i + 1) for i in range(MAX_BLEND_SEGMENTS + 1)]
        assert client.lookup_segments(prompt, bounds) is None  # an error reply: a miss
        assert f"at most {MAX_BLEND_SEGMENTS}" in (client.last_error or "")
        assert client.lookup_segments(prompt, bounds[:MAX_BLEND_SEGMENTS]) == [0] * MAX_BLEND_SEGMENTS
    finally:
        client.close()


def test_only_a_first_segment_ended_by_the_separator_is_stored(mini):
    """A prompt without a separator is ordinary traffic (no second copy as a segment); a
    document followed by the separator is stored; a document after a separator is not
    (its KV depends on the text before it)."""
    doc = rnd(40, 77)
    mini.serve(FakeRequest("plain", list(doc)))
    assert mini.engine.stats.blend_stored_segment_tokens == 0
    mini.serve(FakeRequest("after", rnd(20, 78) + SEP + list(doc) + SEP))
    assert mini.engine.stats.blend_stored_segment_tokens == 20  # the first segment only
    mini.serve(FakeRequest("alone", list(doc) + SEP))
    assert mini.engine.stats.blend_stored_segment_tokens == 60


def test_sink_tokens_of_each_reused_segment_are_recomputed(mini, model):
    """``blend_sink_tokens``: the first K cached tokens of every reused segment get no cached
    KV (the blend computes them); the rest keep exactly the KV they get without it."""
    from lmcache.integration.vllm.connector_metadata import BlendSpec
    from lmcache.v1.request import KeyExtras

    runner = BlendRunner(model, mini.engine.segments, BlendConfig((0.15,), (1,)))
    prompt, refs = [], []
    for d in range(3):
        start = len(prompt)
        doc = rnd(30 + d, 70 + d)
        prompt += doc + SEP
        refs.append(SegmentRef(start, start + len(doc)))
    req = type("Req", (), {"token_ids": torch.tensor(prompt), "slot_mapping": torch.arange(len(prompt)),
                           "key_extras": {}})()  # fmt: skip
    runner.store_segments(req, refs, mini.kv)
    # the same documents in another order, each after different text
    order = [2, 0, 1]
    moved, spec_refs = rnd(5, 99), []
    for i in order:
        start = len(moved)
        moved += prompt[refs[i].start : refs[i].end] + SEP
        spec_refs.append(SegmentRef(start, start + refs[i].end - refs[i].start, cached=refs[i].end - refs[i].start))
    spec = BlendSpec(len(moved), tuple(spec_refs))
    tokens = torch.tensor(moved)
    extras = KeyExtras.from_kwargs({})
    plain = runner._reused(tokens, spec, extras, torch.device("cpu"))
    runner.sink_tokens = 4
    sunk = runner._reused(tokens, spec, extras, torch.device("cpu"))
    want = plain.mask.clone()
    for r in spec_refs:
        want[r.start : r.start + 4] = False
    assert torch.equal(sunk.mask, want) and int((plain.mask & ~sunk.mask).sum()) == 4 * len(spec_refs)
    for li in range(LAYERS):
        torch.testing.assert_close(sunk.keys[li][want], plain.keys[li][want], rtol=0, atol=1e-6)
        assert torch.equal(sunk.values[li][want], plain.values[li][want])
    runner.sink_tokens = 1000  # longer than every segment: nothing reused
    assert runner._reused(tokens, spec, extras, torch.device("cpu")) is None
