"""Block-granular reuse: a shared block-aligned prefix is reused block by block, bit-exact."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from lmcache.v1.block_reuse import BlockIndex
from lmcache.v1.config import LMCacheEngineConfig
from lmcache.v1.metadata import LMCacheEngineMetadata
from lmcache.v1.request import KeyExtras, TransferRequest
from lmcache.v1.testing import LAYOUT_NAMES, KVSpec, make_engine, random_kv_caches, random_slot_mapping
from tests.engine.test_engine_roundtrip import assert_same_tokens, written_slots

CHUNK = 32
BLOCK = 8


def _cfg(**extra) -> LMCacheEngineConfig:
    return LMCacheEngineConfig.from_dict({"chunk_size": CHUNK, "max_local_cpu_size": 0.1, **extra})


def _tokens(rng: np.random.Generator, n: int) -> list[int]:
    return [int(t) for t in rng.integers(10, 30000, n)]


def _setup(seed: int, layout: str, num_blocks: int, *, kv_seed: int):
    """(rng, spec, engine with block size BLOCK, random paged KV) of one test."""
    spec = KVSpec(layout=layout, num_blocks=num_blocks, block_size=BLOCK)
    engine = make_engine(spec, _cfg(), block_size=BLOCK)
    return np.random.default_rng(seed), spec, engine, random_kv_caches(spec, seed=kv_seed)


def stored_length(n: int, chunk: int = CHUNK, block: int = BLOCK) -> int:
    """What a store of ``n`` tokens keeps: whole chunks, then the tail cut to whole blocks."""
    return n - (n % chunk) % block


def expected_hit(n_a: int, common: int, n_b: int, block: int, exact_tails: bool) -> int:
    """Model of lookup(B) after store(A): B shares ``common`` leading tokens with A."""
    if exact_tails and common == n_a == n_b:
        return n_a  # B is A: its exact partial chunk key hits
    full_a = n_a // CHUNK * CHUNK
    tail = n_a - full_a if exact_tails else stored_length(n_a, CHUNK, block) - full_a
    covered = full_a + tail - tail % block  # what the chunk keys and the block index reach
    h = min(common, n_b, full_a) // CHUNK * CHUNK  # whole chunks that hit
    rest = min(common, n_b, covered) - h
    return h + max(0, rest - rest % block)


def test_block_digests_are_partial_chunk_keys():
    """Every block prefix hash is the key a partial chunk of that length gets (same formula)."""
    spec = KVSpec(layout="flash_attn", num_blocks=16, block_size=BLOCK)
    engine = make_engine(spec, _cfg(), block_size=BLOCK)
    db = engine.token_database
    arr = np.arange(1000, 1000 + 3 * CHUNK, dtype=np.int32)
    extras = KeyExtras.build("salt", None, None)
    prev = db.chain_digest(arr, 2, extras)
    hashes = db.block_digests(arr[2 * CHUNK :], prev, BLOCK)
    assert len(hashes) == CHUNK // BLOCK
    for k, h in enumerate(hashes):
        end = 2 * CHUNK + (k + 1) * BLOCK
        spans = db.spans_of(arr[:end], 0, extras, include_partial=True)
        assert spans[-1].key.chunk_hash == h
    engine.close()


@pytest.mark.parametrize("layout", LAYOUT_NAMES)
def test_shared_prefix_inside_a_chunk_is_reused_bit_exact(layout):
    """B shares 2 chunks + 2 blocks + 3 tokens with A: B reuses 2 chunks + 2 blocks, taken
    from the first blocks of A's third (whole) chunk, and nothing else is written."""
    rng = np.random.default_rng(1)
    spec = KVSpec(layout=layout, num_blocks=40, block_size=BLOCK)
    engine = make_engine(spec, _cfg(), block_size=BLOCK)
    kv = random_kv_caches(spec, seed=1)
    a = _tokens(rng, 4 * CHUNK + 5)
    slots_a = random_slot_mapping(spec, len(a), seed=2)
    assert engine.store(a, kvcaches=kv, slot_mapping=slots_a) == stored_length(len(a))
    shared = 2 * CHUNK + 2 * BLOCK + 3
    b = a[:shared] + _tokens(rng, 40)
    hit = 2 * CHUNK + 2 * BLOCK
    assert engine.lookup(b) == hit

    kv2 = [torch.zeros_like(t) for t in kv]
    slots_b = random_slot_mapping(spec, hit, seed=3)
    ret = engine.retrieve(b[:hit], kvcaches=kv2, slot_mapping=slots_b)
    assert int(ret.sum()) == hit and bool(ret.all())
    assert_same_tokens(kv, slots_a, kv2, slots_b, spec, hit)
    assert written_slots(kv2, spec) <= {int(s) for s in slots_b}
    assert engine.stats.block_hit_tokens == 2 * BLOCK
    engine.close()


def test_multi_turn_chat_reuses_every_stored_block():
    """Each turn extends the previous prompt: the whole block-aligned previous prompt is reused."""
    rng, spec, engine, kv = _setup(2, "vllm_cpu", 200, kv_seed=4)
    prompt: list[int] = _tokens(rng, 21)
    stored = 0
    for turn in range(6):
        assert engine.lookup(prompt) == stored, f"turn {turn}"
        slots = random_slot_mapping(spec, len(prompt), seed=turn)
        if stored:
            kv2 = [torch.zeros_like(t) for t in kv]
            ret = engine.retrieve(prompt[:stored], kvcaches=kv2, slot_mapping=slots[:stored])
            assert bool(ret.all())
            kv_turn = [t.clone() for t in kv]
            engine.store(prompt, kvcaches=kv_turn, slot_mapping=slots)
        else:
            engine.store(prompt, kvcaches=kv, slot_mapping=slots)
        stored = stored_length(len(prompt))
        prompt = prompt + _tokens(rng, int(rng.integers(5, 60)))  # answer + next message
    engine.close()


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    n_a=st.integers(1, 5 * CHUNK),
    shared_frac=st.floats(0, 1),
    extra_b=st.integers(0, 2 * CHUNK),
    block=st.sampled_from([4, 8, 16]),
    exact_tails=st.booleans(),
)
def test_lookup_and_retrieve_match_the_shared_blocks(n_a, shared_frac, extra_b, block, exact_tails):
    """lookup(B) = the stored, block-aligned part of the prefix B shares with A (or A's exact
    tail with save_unfull_chunk), and retrieve writes exactly those tokens, bit-exact."""
    rng = np.random.default_rng(n_a * 7 + extra_b)
    spec = KVSpec(layout="flash_attn", num_blocks=60, block_size=block)
    engine = make_engine(spec, _cfg(save_unfull_chunk=exact_tails), block_size=block)
    kv = random_kv_caches(spec, seed=5)
    a = _tokens(rng, n_a)
    slots_a = random_slot_mapping(spec, n_a, seed=6)
    engine.store(a, kvcaches=kv, slot_mapping=slots_a)
    shared = int(shared_frac * n_a)
    b = a[:shared] + [t + 1 for t in a[shared : shared + extra_b]]  # diverges right after `shared`
    expected = expected_hit(n_a, shared, len(b), block, exact_tails)
    got = engine.lookup(b)
    assert got == expected, (n_a, shared, len(b))
    if got:
        kv2 = [torch.zeros_like(t) for t in kv]
        slots_b = random_slot_mapping(spec, got, seed=7)
        ret = engine.retrieve(b[:got], kvcaches=kv2, slot_mapping=slots_b)
        assert int(ret.sum()) == got
        assert_same_tokens(kv, slots_a, kv2, slots_b, spec, got)
    engine.close()


def test_gone_entry_is_a_miss_not_wrong_kv():
    """When the entry a block prefix points at is removed, lookup and retrieve fall back
    to the whole chunks (nothing stale is written)."""
    rng, spec, engine, kv = _setup(3, "flash_attn", 40, kv_seed=8)
    a = _tokens(rng, 3 * CHUNK)
    engine.store(a, kvcaches=kv, slot_mapping=random_slot_mapping(spec, len(a), seed=9))
    b = a[: CHUNK + 3 * BLOCK] + _tokens(rng, 20)
    assert engine.lookup(b) == CHUNK + 3 * BLOCK
    assert engine.storage_manager.remove(engine.keys(a)[1])
    assert engine.lookup(b) == CHUNK
    kv2 = [torch.zeros_like(t) for t in kv]
    slots_b = random_slot_mapping(spec, CHUNK + 3 * BLOCK, seed=10)
    ret = engine.retrieve(b[: CHUNK + 3 * BLOCK], kvcaches=kv2, slot_mapping=slots_b)
    assert int(ret.sum()) == CHUNK and bool(ret[:CHUNK].all())
    engine.close()


def test_salted_requests_never_share_blocks():
    rng, spec, engine, kv = _setup(4, "flash_attn", 40, kv_seed=11)
    a = _tokens(rng, 2 * CHUNK)
    engine.store(a, kvcaches=kv, slot_mapping=random_slot_mapping(spec, len(a)), cache_salt="tenant-a")
    b = a[: CHUNK + BLOCK] + _tokens(rng, 9)
    assert engine.lookup(b, cache_salt="tenant-a") == CHUNK + BLOCK
    assert engine.lookup(b, cache_salt="tenant-b") == 0
    assert engine.lookup(b) == 0
    engine.close()


@pytest.mark.parametrize(
    "how",
    ["config_off", "no_block_size", "layerwise"],
)
def test_whole_chunks_only_when_off(how):
    rng = np.random.default_rng(5)
    spec = KVSpec(layout="flash_attn", num_blocks=40, block_size=BLOCK)
    cfg = _cfg(block_granular_reuse=how != "config_off", use_layerwise=how == "layerwise")
    engine = make_engine(spec, cfg, block_size=None if how == "no_block_size" else BLOCK)
    kv = random_kv_caches(spec, seed=12)
    a = _tokens(rng, 2 * CHUNK + 20)
    engine.store(a, kvcaches=kv, slot_mapping=random_slot_mapping(spec, len(a)))
    assert engine.lookup(a[: CHUNK + 2 * BLOCK] + [1, 2, 3]) == CHUNK
    assert engine.lookup(a) == 2 * CHUNK
    engine.close()


def test_repeated_lookup_reuses_block_hashes():
    rng, spec, engine, kv = _setup(6, "flash_attn", 40, kv_seed=13)
    a = _tokens(rng, 2 * CHUNK)
    engine.store(a, kvcaches=kv, slot_mapping=random_slot_mapping(spec, len(a)))
    b = a[: CHUNK + BLOCK] + _tokens(rng, 30)
    pk = engine.prefix_keys(b)
    assert engine.lookup_prefix(pk) == CHUNK + BLOCK
    assert list(pk.block_hashes) == [1]
    assert engine.lookup_prefix(pk) == CHUNK + BLOCK
    engine.close()


def test_block_reuse_answers_from_requests_and_spans():
    """The one entry point: what a store writes, what it indexes, and what a lookup and a
    retrieve of a request sharing 1 chunk + 2 blocks find (the engine hashes nothing)."""
    spec = KVSpec(layout="flash_attn", num_blocks=40, block_size=BLOCK)
    engine = make_engine(spec, _cfg(), block_size=BLOCK)
    blocks = engine.transfer.ctx.blocks
    assert blocks is not None and not len(blocks.index)
    extras = KeyExtras.build(None, None, None)
    a = np.arange(100, 100 + 2 * CHUNK + BLOCK + 3, dtype=np.int32)
    req_a = TransferRequest(a, 0, extras)
    spans = blocks.store_spans(req_a)
    assert [(s.start, s.end) for s in spans] == [(0, CHUNK), (CHUNK, 2 * CHUNK), (2 * CHUNK, 2 * CHUNK + BLOCK)]
    assert spans == engine.token_database.spans_of(a[: 2 * CHUNK + BLOCK], 0, extras, include_partial=True)
    blocks.register(req_a, spans)
    assert len(blocks.index) == 2 * (CHUNK // BLOCK - 1) + 1  # whole chunks stop a block short; the tail counts
    b = np.concatenate([a[: CHUNK + 2 * BLOCK], np.full(CHUNK, 7, dtype=np.int32)])
    req_b = TransferRequest(b, 0, extras)
    b_spans = engine.token_database.spans_of(b, 0, extras)
    probe = blocks.retrieve_candidates(req_b, b_spans, 1)
    assert probe.start == CHUNK
    assert [(h.key, h.num_tokens) for h in probe.hits] == [(spans[1].key, 2 * BLOCK), (spans[1].key, BLOCK)]
    assert blocks.retrieve_candidates(req_b, b_spans[:1], 1).start == CHUNK
    pk = engine.prefix_keys(b.tolist())
    assert blocks.lookup_tokens(pk, 1) == 0  # nothing is in the tiers: the index alone is no hit
    engine.close()


def test_block_index_is_bounded_oldest_first():
    spec = KVSpec(layout="flash_attn", num_blocks=4, block_size=BLOCK)
    engine = make_engine(spec, _cfg(), block_size=BLOCK)
    k1, k2 = engine.keys(list(range(2 * CHUNK)))
    index = BlockIndex(max_entries=5)
    index.add(k1, [1, 2, 3], BLOCK)
    assert index.knows(k1) and not index.knows(k2)
    index.add(k2, [4, 5, 6], BLOCK)  # 6 > 5: the oldest entry goes, with all its prefixes
    assert len(index) == 3 and not index.knows(k1) and index.knows(k2)
    assert index.candidates([1, 2, 3]) == []
    assert [(h.key, h.num_tokens) for h in index.candidates([4, 5])] == [(k2, 2 * BLOCK), (k2, BLOCK)]
    index.add(k1, [7, 5], BLOCK)  # k1 takes prefix 5 over; dropping k2 later keeps it
    index.add(k2, [8], BLOCK)
    assert [(h.key, h.num_tokens) for h in index.candidates([7, 5])] == [(k1, 2 * BLOCK), (k1, BLOCK)]
    with pytest.raises(ValueError, match="max_entries"):
        BlockIndex(0)
    engine.close()


@pytest.mark.parametrize("bad", [0, -8, 24, 8.0, "8"])
def test_metadata_block_size_is_validated(bad):
    with pytest.raises(ValueError, match="block_size"):
        LMCacheEngineMetadata("m", 1, 0, "vllm", torch.float16, (2, 2, CHUNK, 2, 8), False, bad)


def test_gone_longest_match_falls_back_to_a_shorter_one():
    """Two entries share 2 blocks of chunk 1; the one sharing 3 blocks with B is removed:
    B then reuses 2 blocks from the other, bit-exact."""
    rng, spec, engine, kv = _setup(7, "vllm_cpu", 60, kv_seed=14)
    a = _tokens(rng, 2 * CHUNK)
    a2 = a[: CHUNK + 2 * BLOCK] + _tokens(rng, CHUNK - 2 * BLOCK)
    slots_a = random_slot_mapping(spec, len(a), seed=15)
    engine.store(a, kvcaches=kv, slot_mapping=slots_a)
    engine.store(a2, kvcaches=kv, slot_mapping=slots_a)  # same KV for the shared tokens
    b = a[: CHUNK + 3 * BLOCK] + _tokens(rng, 5)
    assert engine.lookup(b) == CHUNK + 3 * BLOCK
    assert engine.storage_manager.remove(engine.keys(a)[1])
    assert engine.lookup(b) == CHUNK + 2 * BLOCK
    kv2 = [torch.zeros_like(t) for t in kv]
    slots_b = random_slot_mapping(spec, len(b), seed=16)
    ret = engine.retrieve(b, kvcaches=kv2, slot_mapping=slots_b)
    assert int(ret.sum()) == CHUNK + 2 * BLOCK
    assert_same_tokens(kv, slots_a, kv2, slots_b, spec, CHUNK + 2 * BLOCK)
    engine.close()


@pytest.mark.parametrize("how", ["retrieve", "store"])
def test_entries_of_another_engine_are_indexed_when_served(tmp_path, how):
    """A second engine on the same disk tier (a restart) knows no block prefixes until it
    serves the prompt: a retrieve of its chunks, or a store that finds them cached."""
    rng = np.random.default_rng(8)
    spec = KVSpec(layout="flash_attn", num_blocks=40, block_size=BLOCK)
    cfg = _cfg(local_disk=str(tmp_path), max_local_disk_size=0.1)
    kv = random_kv_caches(spec, seed=17)
    a = _tokens(rng, 2 * CHUNK)
    slots = random_slot_mapping(spec, len(a), seed=18)
    first = make_engine(spec, cfg, block_size=BLOCK)
    first.store(a, kvcaches=kv, slot_mapping=slots)
    assert first.storage_manager.flush(timeout=30)
    first.close()
    second = make_engine(spec, cfg, block_size=BLOCK)
    b = a[: CHUNK + BLOCK] + _tokens(rng, 9)
    assert second.lookup(a) == 2 * CHUNK  # whole chunks: from the disk tier
    assert second.lookup(b) == CHUNK  # no block index yet
    if how == "store":
        assert second.store(a, kvcaches=kv, slot_mapping=slots) == 0  # all cached: nothing copied
    else:
        scratch = [torch.zeros_like(t) for t in kv]
        assert bool(second.retrieve(a, kvcaches=scratch, slot_mapping=slots).all())
    assert second.lookup(b) == CHUNK + BLOCK
    kv2 = [torch.zeros_like(t) for t in kv]
    slots_b = random_slot_mapping(spec, CHUNK + BLOCK, seed=19)
    ret = second.retrieve(b[: CHUNK + BLOCK], kvcaches=kv2, slot_mapping=slots_b)
    assert bool(ret.all())
    assert_same_tokens(kv, slots, kv2, slots_b, spec, CHUNK + BLOCK)
    second.close()
