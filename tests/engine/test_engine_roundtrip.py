"""Engine store -> wipe -> retrieve round trips on real paged KV tensors, every layout."""

from __future__ import annotations

import pytest
import torch

from lmcache.v1.cache_engine import LMCacheEngineBuilder
from lmcache.v1.config import LMCacheEngineConfig
from lmcache.v1.layerwise import layer_keys
from lmcache.v1.testing import LAYOUT_NAMES, KVSpec, make_connector, make_engine, make_metadata, random_kv_caches, random_slot_mapping

CHUNK = 16


def token_vectors(layer: torch.Tensor, spec: KVSpec, slot: int) -> list[torch.Tensor]:
    """Reference decode (docs/architecture.md, "KV layouts"), independent of the connector's layout table."""
    b, n = divmod(slot, spec.block_size)
    if spec.layout == "vllm_cpu":
        nb, h, bs, two_d = layer.shape
        d = two_d // 2
        page = layer.reshape(nb, h, 2 * bs * d)
        k = page[..., : bs * d].reshape(nb, h, d, bs)
        v = page[..., bs * d :].reshape(nb, h, bs, d)
        return [k[b, :, :, n], v[b, :, n, :]]
    if spec.layout == "flash_attn":
        return [layer[0, b, n], layer[1, b, n]]
    if spec.layout == "flashinfer":
        return [layer[b, 0, n], layer[b, 1, n]]
    if spec.layout == "mla_cpu":
        return [layer[b, 0, n]]
    return [layer[b, n]]


def assert_same_tokens(kv_a, slots_a, kv_b, slots_b, spec, count):
    for la, lb in zip(kv_a, kv_b):
        for i in range(count):
            for va, vb in zip(token_vectors(la, spec, int(slots_a[i])), token_vectors(lb, spec, int(slots_b[i]))):
                assert torch.equal(va.contiguous().view(torch.uint8), vb.contiguous().view(torch.uint8))


def written_slots(kv, spec) -> set[int]:
    out = set()
    for layer in kv:
        for slot in range(spec.num_blocks * spec.block_size):
            if any(bool((v.contiguous().view(torch.uint8) != 0).any()) for v in token_vectors(layer, spec, slot)):
                out.add(slot)
    return out


@pytest.mark.parametrize("layout", LAYOUT_NAMES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("num_tokens", [64, 45])
def test_round_trip_bit_exact(layout, dtype, num_tokens):
    spec = KVSpec(layout=layout, dtype=dtype, num_blocks=12, block_size=8)
    engine = make_engine(spec)
    kv = random_kv_caches(spec, seed=1)
    slots = random_slot_mapping(spec, num_tokens, seed=2)
    tokens = torch.randint(0, 50000, (num_tokens,))
    full = num_tokens // CHUNK * CHUNK
    assert engine.store(tokens, kvcaches=kv, slot_mapping=slots) == full
    assert engine.lookup(tokens) == full

    kv2 = [torch.zeros_like(t) for t in kv]
    slots2 = random_slot_mapping(spec, num_tokens, seed=3)  # other blocks, as after a restart
    ret = engine.retrieve(tokens, kvcaches=kv2, slot_mapping=slots2)
    assert ret.dtype == torch.bool and ret.shape == (num_tokens,)
    assert int(ret.sum()) == full and bool(ret[:full].all())
    assert_same_tokens(kv, slots, kv2, slots2, spec, full)
    assert written_slots(kv2, spec) <= {int(s) for s in slots2[:full]}  # nothing written elsewhere
    stats = engine.stats.snapshot()
    assert stats["hit_tokens"] == full and stats["stored_tokens"] == full
    engine.close()


@pytest.mark.parametrize("layout", ["vllm_cpu", "mla", "mla_cpu"])
def test_unfull_chunk_and_mask(layout):
    spec = KVSpec(layout=layout, num_blocks=12, block_size=8)
    cfg = LMCacheEngineConfig.from_dict({"chunk_size": CHUNK, "max_local_cpu_size": 0.1, "save_unfull_chunk": True})
    engine = make_engine(spec, cfg)
    kv = random_kv_caches(spec)
    slots = random_slot_mapping(spec, 45)
    tokens = list(range(100, 145))
    mask = torch.tensor([False] * CHUNK + [True] * (45 - CHUNK))
    assert engine.store(tokens, mask, kvcaches=kv, slot_mapping=slots) == 45 - CHUNK
    assert engine.lookup(tokens) == 0  # the head chunk was never stored: no prefix
    assert engine.store(tokens, kvcaches=kv, slot_mapping=slots) == CHUNK  # only the missing head
    assert engine.lookup(tokens) == 45

    kv2 = [torch.zeros_like(t) for t in kv]
    ret = engine.retrieve(tokens, mask, kvcaches=kv2, slot_mapping=slots)
    assert ret.tolist() == [False] * CHUNK + [True] * (45 - CHUNK)
    assert_same_tokens(kv, slots[CHUNK:], kv2, slots[CHUNK:], spec, 45 - CHUNK)
    assert written_slots(kv2, spec) == {int(s) for s in slots[CHUNK:]}
    engine.close()


def test_negative_slots():
    spec = KVSpec(num_blocks=12, block_size=8)
    engine = make_engine(spec)
    kv = random_kv_caches(spec)
    slots = random_slot_mapping(spec, 64)
    tokens = list(range(64))
    bad = slots.clone()
    bad[40] = -1
    assert engine.store(tokens, kvcaches=kv, slot_mapping=bad) == 32  # chunks before the bad slot only
    assert engine.store(tokens, kvcaches=kv, slot_mapping=slots) == 32
    kv2 = [torch.zeros_like(t) for t in kv]
    skip = slots.clone()
    skip[:5] = -1  # e.g. tokens the engine does not want written
    ret = engine.retrieve(tokens, kvcaches=kv2, slot_mapping=skip)
    # issue 13 item 12: True only where KV was written (tokens without a slot get nothing)
    assert int(ret.sum()) == 59 and not bool(ret[:5].any())
    assert written_slots(kv2, spec) == {int(s) for s in slots[5:]}
    assert_same_tokens(kv, slots[5:], kv2, slots[5:], spec, 59)
    engine.close()


def test_partial_hit_and_salt():
    spec = KVSpec(num_blocks=12, block_size=8)
    engine = make_engine(spec)
    kv = random_kv_caches(spec)
    slots = random_slot_mapping(spec, 64)
    tokens = list(range(64))
    engine.store(tokens[:32], kvcaches=kv, slot_mapping=slots[:32], cache_salt="alice")
    assert engine.lookup(tokens, cache_salt="alice") == 32
    assert engine.lookup(tokens) == 0 and engine.lookup(tokens, cache_salt="bob") == 0
    kv2 = [torch.zeros_like(t) for t in kv]
    ret = engine.retrieve(tokens, kvcaches=kv2, slot_mapping=slots, cache_salt="alice")
    assert ret.tolist() == [True] * 32 + [False] * 32
    assert int(engine.retrieve(tokens, kvcaches=kv2, slot_mapping=slots).sum()) == 0
    engine.close()


def test_pool_full_skips_store_and_counts():
    spec = KVSpec(num_blocks=64, block_size=16, num_heads=8, head_size=64)
    # 16-token chunk = 2 layers * 2 * 16 * 512 * 4 B = 128 KiB; pool of 300 KiB holds 2 chunks
    cfg = LMCacheEngineConfig.from_dict({"chunk_size": CHUNK, "max_local_cpu_size": 300 / (1 << 20)})
    engine = make_engine(spec, cfg)
    kv = random_kv_caches(spec)
    slots = random_slot_mapping(spec, 64)
    tokens = list(range(64))
    assert engine.lookup(tokens, pin=False) == 0
    engine.store(tokens[:32], kvcaches=kv, slot_mapping=slots[:32])
    assert engine.lookup(tokens[:32], pin=True) == 32
    stored = engine.store(tokens, kvcaches=kv, slot_mapping=slots)  # pinned head cannot be evicted
    assert stored == 0 and engine.stats.snapshot()["store_skipped_chunks"] == 2
    engine.lookup_unpin(tokens[:32])
    assert engine.store(list(range(1000, 1032)), kvcaches=kv, slot_mapping=slots[:32]) == 32
    assert engine.stats.snapshot()["evictions"] >= 2
    engine.close()


def test_builder_registry_and_bad_input():
    spec = KVSpec()
    cfg = LMCacheEngineConfig.from_dict({"chunk_size": CHUNK, "max_local_cpu_size": 0.05})
    md = make_metadata(spec, CHUNK)
    conn = make_connector(spec, CHUNK)
    e1 = LMCacheEngineBuilder.get_or_create("t1", cfg, md, conn)
    assert LMCacheEngineBuilder.get_or_create("t1", cfg, md, conn) is e1
    with pytest.raises(ValueError, match="different metadata"):
        LMCacheEngineBuilder.get_or_create("t1", cfg, make_metadata(spec, CHUNK, "other"), conn)
    with pytest.raises(ValueError, match="kvcaches: expected 2 layer tensors"):
        e1.store(list(range(16)), kvcaches=random_kv_caches(spec)[:1], slot_mapping=torch.arange(16))
    with pytest.raises(ValueError, match="slot_mapping"):
        e1.store(list(range(16)), kvcaches=random_kv_caches(spec), slot_mapping=None)
    LMCacheEngineBuilder.destroy("t1")
    assert LMCacheEngineBuilder.get("t1") is None


@pytest.mark.parametrize("use_native", [False, True])
def test_connector_takes_objects_with_a_tensor_and_names_a_bad_one(use_native, monkeypatch):
    """The bulk connector's public copies take any object with a ``.tensor`` (what a caller of
    LMCache's connector API may pass): the native address path is only for pool objects, the
    rest goes through the tensor path, bit-exact either way. Anything else is a TypeError
    that names the object, never an AttributeError from inside the copy path."""
    from types import SimpleNamespace

    from lmcache.v1.gpu_connector import copy_ops, native

    if use_native and native.load() is None:
        pytest.skip("native kernels are not built")
    monkeypatch.setattr(copy_ops, "USE_NATIVE", use_native)
    spec = KVSpec(num_layers=2, layout="flash_attn")
    conn = make_connector(spec, CHUNK)
    kv = random_kv_caches(spec, seed=3)
    slots = random_slot_mapping(spec, 2 * CHUNK, seed=4)
    starts, ends = [0, CHUNK], [CHUNK, 2 * CHUNK]
    mems = [torch.zeros(tuple(conn.get_shape(CHUNK)), dtype=spec.dtype) for _ in starts]
    conn.batched_from_gpu([SimpleNamespace(tensor=m) for m in mems], starts, ends, kvcaches=kv, slot_mapping=slots)
    out = [torch.zeros_like(t) for t in kv]
    conn.batched_to_gpu([SimpleNamespace(tensor=m) for m in mems], starts, ends, kvcaches=out, slot_mapping=slots)
    assert_same_tokens(kv, slots, out, slots, spec, 2 * CHUNK)
    with pytest.raises(TypeError, match=r"objs\[1\]: expected a MemoryObj.*got str"):
        conn.batched_from_gpu([SimpleNamespace(tensor=mems[0]), "not an object"], starts, ends, kvcaches=kv, slot_mapping=slots)


# ---------------------------------------------------------------------- slot types, holes, bad entries
@pytest.mark.parametrize("dtype", [torch.int32, torch.int64])
def test_int32_and_int64_slot_mappings_round_trip(dtype):
    spec = KVSpec(num_blocks=8, block_size=8)
    engine = make_engine(spec)
    kv = random_kv_caches(spec, seed=3)
    slots = random_slot_mapping(spec, 32).to(dtype)
    assert engine.store(list(range(32)), kvcaches=kv, slot_mapping=slots) == 32
    out = [torch.zeros_like(t) for t in kv]
    assert bool(engine.retrieve(list(range(32)), kvcaches=out, slot_mapping=slots).all())
    for a, b in zip(kv, out):
        flat_a, flat_b = a.reshape(a.shape[0], -1), b.reshape(b.shape[0], -1)
        used = sorted({int(s) // 8 for s in slots})
        assert torch.equal(flat_a[used], flat_b[used])
    engine.close()


@pytest.mark.parametrize("layerwise", [False, True])
def test_retrieve_mask_is_false_for_skipped_slots(layerwise):
    spec = KVSpec(num_blocks=8, block_size=8)
    engine = make_engine(spec, layerwise=layerwise)
    kv = random_kv_caches(spec)
    slots = random_slot_mapping(spec, 32)
    engine.store(list(range(32)), kvcaches=kv, slot_mapping=slots)
    holes = slots.clone()
    holes[[0, 17, 31]] = -1
    ret = engine.retrieve(list(range(32)), kvcaches=[torch.zeros_like(t) for t in kv], slot_mapping=holes)
    assert ret.tolist() == (holes >= 0).tolist()
    engine.close()


@pytest.mark.parametrize("layerwise", [False, True])
def test_stored_entry_of_another_shape_is_a_miss_removed_and_counted(layerwise):
    spec = KVSpec(num_blocks=8, block_size=8)
    engine = make_engine(spec, layerwise=layerwise)
    kv, slots, tokens = random_kv_caches(spec), random_slot_mapping(spec, 32), list(range(32))
    sm = engine.storage_manager
    key = engine.keys(tokens)[0]
    if layerwise:
        per_layer = [layer[0] for layer in layer_keys([key], spec.num_layers)]
        key = per_layer[0]
        shape = (2, 1, CHUNK // 2, spec.hidden)  # well-formed, wrong token count
        for other in per_layer[1:]:  # the other layers are fine: the chunk looks cached
            good = sm.allocate((2, 1, CHUNK, spec.hidden), spec.dtype, engine.gpu_connector.fmt)
            sm.put(other, good)
            good.ref_count_down()
    else:
        shape = (2, spec.num_layers, CHUNK // 2, spec.hidden)
    bad = sm.allocate(shape, spec.dtype, engine.gpu_connector.fmt)
    sm.put(key, bad)
    bad.ref_count_down()
    out = [torch.zeros_like(t) for t in kv]
    for _ in range(2):  # never an exception, every time
        ret = engine.retrieve(tokens, kvcaches=out, slot_mapping=slots)
        assert not bool(ret.any())
    assert engine.stats.corrupt_entries == 1
    assert not sm.contains(key)
    assert engine.store(tokens, kvcaches=kv, slot_mapping=slots) == 32  # the prefix is usable again
    assert bool(engine.retrieve(tokens, kvcaches=out, slot_mapping=slots).all())
    engine.close()
