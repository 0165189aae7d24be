"""Splitting a prompt on the separator's token ids, and position-free segment keys."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from lmcache.v1.blend.segments import Segment, SegmentKeys, find_separators, split_segments
from lmcache.v1.config import LMCacheEngineConfig
from lmcache.v1.metadata import LMCacheEngineMetadata
from lmcache.v1.request import KeyExtras
from lmcache.v1.token_database import ChunkedTokenDatabase

SEP = [7, 8, 7]
A, B, C = list(range(100, 120)), list(range(200, 213)), list(range(300, 305))


def make_keys(chunk_size: int = 8) -> tuple[SegmentKeys, ChunkedTokenDatabase]:
    cfg = LMCacheEngineConfig.from_dict({"chunk_size": chunk_size})
    md = LMCacheEngineMetadata("org/model", 1, 0, "vllm", torch.bfloat16, (2, 2, chunk_size, 2, 8))
    db = ChunkedTokenDatabase(cfg, md)
    return SegmentKeys(db), db


def seg_tokens(prompt: list[int]) -> list[tuple[int, ...]]:
    return [s.tokens for s in split_segments(prompt, SEP)]


def test_segments_and_their_start_positions():
    prompt = A + SEP + B + SEP + C
    segs = split_segments(prompt, SEP)
    assert segs == [
        Segment(0, 20, tuple(A)),
        Segment(23, 36, tuple(B)),
        Segment(39, 44, tuple(C)),
    ]
    for s in segs:
        assert prompt[s.start : s.end] == list(s.tokens) and len(s) == len(s.tokens)


def test_no_separator_is_one_segment_and_empty_input_none():
    assert seg_tokens(A) == [tuple(A)]
    assert split_segments([], SEP) == []
    assert split_segments(SEP, SEP) == []


def test_separator_at_either_end_and_repeated_gives_no_empty_segment():
    assert seg_tokens(A + SEP) == [tuple(A)]
    assert seg_tokens(SEP + A) == [tuple(A)]
    assert seg_tokens(A + SEP + SEP + B + SEP) == [tuple(A), tuple(B)]


def test_overlapping_separator_matches_leftmost_first():
    # 7 8 7 8 7: the first match consumes 7 8 7; the remaining "8 7" is segment text
    assert find_separators([1, 7, 8, 7, 8, 7, 2], SEP) == [1]
    assert seg_tokens([1, 7, 8, 7, 8, 7, 2]) == [(1,), (8, 7, 2)]


def test_partial_separator_is_text():
    assert seg_tokens(A + [7, 8] + B) == [tuple(A + [7, 8] + B)]


def test_bad_separator():
    with pytest.raises(TypeError):
        split_segments(A, [])
    with pytest.raises(TypeError):
        split_segments(A, " # # ")  # type: ignore[arg-type]
    with pytest.raises(TypeError):
        split_segments(A, [7.0])  # type: ignore[list-item]


def test_reordered_segments_have_the_same_keys_at_other_offsets():
    keys, _ = make_keys()
    first = split_segments(A + SEP + B + SEP + C, SEP)
    second = split_segments(C + SEP + B + SEP + A, SEP)
    by_tokens = {s.tokens: [sp.key for sp in keys.spans(s)] for s in first}
    for s in second:
        spans = keys.spans(s)
        assert [sp.key for sp in spans] == by_tokens[s.tokens]
        assert spans[0].start == s.start and spans[-1].end == s.end  # prompt positions
        assert all(b.start == a.end for a, b in zip(spans, spans[1:]))


def test_a_missing_middle_segment_leaves_the_others_found():
    keys, _ = make_keys()
    stored = {sp.key for s in split_segments(A + SEP + B + SEP + C, SEP) for sp in keys.spans(s)}
    other = list(range(400, 411))
    segs = split_segments(A + SEP + other + SEP + C, SEP)
    found = [all(sp.key in stored for sp in keys.spans(s)) for s in segs]
    assert found == [True, False, True]


def test_segment_chunks_chain_from_the_segment_seed():
    keys, db = make_keys(chunk_size=8)
    seg = split_segments(A, SEP)[0]  # 20 tokens: chunks of 8, 8 and a partial 4
    spans = keys.spans(seg)
    assert [(s.start, s.end) for s in spans] == [(0, 8), (8, 16), (16, 20)]
    changed = split_segments([999] + A[1:], SEP)[0]
    assert all(a.key != b.key for a, b in zip(spans, keys.spans(changed)))  # a change in chunk 0 changes all
    prefix = db.prefix_keys(A, KeyExtras(), include_partial=True).keys
    assert not {s.key for s in spans} & set(prefix)  # never a prompt-prefix key


def test_extras_and_namespace_separate_segment_keys():
    keys, _ = make_keys()
    seg = split_segments(A, SEP)[0]
    plain = [s.key for s in keys.spans(seg)]
    salted = [s.key for s in keys.spans(seg, KeyExtras.build(cache_salt="tenant"))]
    assert not set(plain) & set(salted)
    other_chunk, _ = make_keys(chunk_size=4)
    assert not set(plain) & {s.key for s in other_chunk.spans(seg)}


@settings(max_examples=200, deadline=None)
@given(st.lists(st.sampled_from([1, 2, 7, 8]), max_size=40))
def test_segments_and_separators_tile_the_prompt(prompt):
    segs = split_segments(prompt, SEP)
    cuts = find_separators(prompt, SEP)
    covered = [False] * len(prompt)
    for s in segs:
        assert s.tokens and prompt[s.start : s.end] == list(s.tokens)
        assert not find_separators(list(s.tokens), SEP)  # no separator inside a segment
    for piece in [(s.start, s.end) for s in segs] + [(c, c + len(SEP)) for c in cuts]:
        for i in range(*piece):
            assert not covered[i]
            covered[i] = True
    assert all(covered)
