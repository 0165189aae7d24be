"""Layerwise store/retrieve: yield counts, bit-exact per-layer round trips in every KV layout,
pipelining (layer i is in storage / in the paged cache before layer i+1 is touched), storage
order (a missing layer-chunk is a miss from there: the mask never covers partial KV), ownership, and the
lower-tier future path. Runs with the torch fallback and, when built, the native kernels.
"""

from __future__ import annotations

import gc
import threading
from concurrent.futures import Future, ThreadPoolExecutor

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from lmcache.utils import CacheEngineKey, LayerCacheEngineKey
from lmcache.v1.cache_engine import LMCacheEngine
from lmcache.v1.config import LMCacheEngineConfig
from lmcache.v1.gpu_connector import copy_ops, native
from lmcache.v1.gpu_connector.layerwise import (
    LayerCopy,
    VLLMBufferLayerwiseGPUConnector,
    VLLMPagedMemLayerwiseGPUConnector,
)
from lmcache.v1.gpu_connector.factory import create_gpu_connector
from lmcache.v1.gpu_connector.paged import VLLMPagedMemGPUConnectorV2
from lmcache.v1.layerwise import layer_keys
from lmcache.v1.memory_management import GiB, MemoryFormat, MemoryObj
from lmcache.v1.storage_backend.abstract_backend import StorageBackend
from lmcache.v1.storage_backend.storage_manager import StorageManager
from lmcache.v1.testing import (
    LAYOUT_NAMES,
    KVSpec,
    make_connector,
    make_engine,
    make_metadata,
    random_kv_caches,
    random_slot_mapping,
)

CHUNK = 16
DTYPES = (torch.float32, torch.bfloat16, torch.float16, torch.float8_e4m3fn)
_INT = {1: torch.uint8, 2: torch.int16, 4: torch.int32}


# ----------------------------------------------------------------------------- fixtures
@pytest.fixture(params=["fallback", "native"])
def kernels(request, monkeypatch):
    """Run a test with the torch fallback (LMCACHE_USE_NATIVE=0) and with native kernels."""
    if request.param == "fallback":
        monkeypatch.setattr(copy_ops, "USE_NATIVE", False)
    else:
        if native.load() is None:
            pytest.skip("native kernels (lmcache._c_ops) are not built")
        monkeypatch.setattr(copy_ops, "USE_NATIVE", True)
    return request.param


def config(**over) -> LMCacheEngineConfig:
    data = {"chunk_size": CHUNK, "max_local_cpu_size": 0.0625, "use_layerwise": True}
    data.update(over)
    return LMCacheEngineConfig.from_dict(data)


def bits(t: torch.Tensor) -> torch.Tensor:
    """Bit-identical integer view, so NaN payloads (fp8 random bytes) compare exactly."""
    return t.view(_INT[t.element_size()])


# ----------------------------------------------------------------------------- an independent layout oracle
def _token_view(layer: torch.Tensor, layout: str, slot: int, block_size: int) -> list[torch.Tensor]:
    """Views of token ``slot``'s K and V (or MLA latent) in one layer, decoded per layout by hand."""
    b, o = divmod(int(slot), block_size)
    if layout == "flash_attn":
        return [layer[0, b, o], layer[1, b, o]]
    if layout == "flashinfer":
        return [layer[b, 0, o], layer[b, 1, o]]
    if layout == "mla":
        return [layer[b, o]]
    if layout == "mla_cpu":
        return [layer[b, 0, o]]
    # vllm_cpu: per (block, head) page [K transposed: head x block | V: block x head]
    h, bs, two_d = layer.shape[1], layer.shape[2], layer.shape[3]
    d = two_d // 2
    page = layer[b].reshape(h, bs * two_d)
    k = page[:, : bs * d].view(h, d, bs)[:, :, o]
    v = page[:, bs * d :].view(h, bs, d)[:, o]
    return [k, v]


def token_kv(layer: torch.Tensor, spec: KVSpec, slot: int) -> torch.Tensor:
    """``[num_kv, hidden]`` of one token in one layer (a copy)."""
    return torch.stack([v.reshape(-1) for v in _token_view(layer, spec.layout, slot, spec.block_size)])


def expected_paged(
    kv: list[torch.Tensor], spec: KVSpec, slots: torch.Tensor, written: torch.Tensor
) -> list[torch.Tensor]:
    """Zero caches holding ``kv``'s vectors exactly at the slots of the ``written`` tokens."""
    out = [torch.zeros_like(t) for t in kv]
    for layer, (src, dst) in enumerate(zip(kv, out)):
        for i in written.nonzero().flatten().tolist():
            for d_view, s_view in zip(
                _token_view(dst, spec.layout, slots[i], spec.block_size),
                _token_view(src, spec.layout, slots[i], spec.block_size),
            ):
                d_view.copy_(s_view)
    return out


def assert_paged_equal(got: list[torch.Tensor], want: list[torch.Tensor]) -> None:
    for layer, (g, w) in enumerate(zip(got, want)):
        assert torch.equal(bits(g), bits(w)), f"layer {layer} differs"


def resident_ok(engine: LMCacheEngine) -> None:
    """Ownership after a finished call: L1 holds exactly one reference per entry, no pins."""
    backend = engine.storage_manager.local_cpu
    for key in backend.keys():
        obj = backend.resident(key)
        assert obj.ref_count == 1 and obj.pin_count == 0, (key, obj)
    # nothing else holds pool memory (4 KiB-aligned allocations)
    assert engine.storage_manager.allocator.used_bytes == sum(
        (o.get_size() + 4095) // 4096 * 4096 for o in backend.resident_objects().values()
    )


def drive_store(gen) -> int:
    n = 0
    for out in gen:
        assert out is None
        n += 1
    return n


def drive_retrieve(gen) -> tuple[int, torch.Tensor]:
    outs = list(gen)
    assert all(o is None for o in outs[:-1])
    return len(outs), outs[-1]


def setup(spec: KVSpec, num_tokens: int, *, seed: int = 0, **cfg):
    engine = make_engine(spec, config(**cfg))
    kv = random_kv_caches(spec, seed=seed)
    slots = random_slot_mapping(spec, num_tokens, seed=seed + 1)
    tokens = torch.arange(1000 + seed, 1000 + seed + num_tokens)
    return engine, kv, slots, tokens


# ----------------------------------------------------------------------------- yield counts
@pytest.mark.parametrize("num_layers", [1, 3, 5])
def test_store_takes_n_plus_1_and_retrieve_n_plus_2_calls(num_layers):
    spec = KVSpec(num_layers=num_layers)
    engine, kv, slots, tokens = setup(spec, 3 * CHUNK)
    gen = engine.store_layer(tokens, kvcaches=kv, slot_mapping=slots)
    assert drive_store(gen) == num_layers + 1
    with pytest.raises(StopIteration):
        next(gen)
    out = [torch.zeros_like(t) for t in kv]
    gen = engine.retrieve_layer(tokens, kvcaches=out, slot_mapping=slots)
    count, mask = drive_retrieve(gen)
    assert count == num_layers + 2
    assert mask.dtype == torch.bool and mask.shape == (3 * CHUNK,) and bool(mask.all())
    engine.close()


@pytest.mark.parametrize("case", ["empty", "all_cached", "all_missing", "short"])
def test_call_counts_hold_when_there_is_nothing_to_do(case):
    spec = KVSpec(num_layers=4)
    engine, kv, slots, tokens = setup(spec, 2 * CHUNK)
    if case == "all_cached":
        engine.store(tokens, kvcaches=kv, slot_mapping=slots)
    if case == "empty":
        tokens, slots = tokens[:0], slots[:0]
    if case == "short":  # below one chunk, save_unfull_chunk off: no chunk at all
        tokens, slots = tokens[: CHUNK - 1], slots[: CHUNK - 1]
    if case != "all_missing":  # nothing new to store
        before = engine.stats.snapshot()["stored_tokens"]
        assert drive_store(engine.store_layer(tokens, kvcaches=kv, slot_mapping=slots)) == 5
        assert engine.stats.snapshot()["stored_tokens"] == before
    out = [torch.zeros_like(t) for t in kv]
    count, mask = drive_retrieve(engine.retrieve_layer(tokens, kvcaches=out, slot_mapping=slots))
    assert count == 6
    assert int(mask.sum()) == (2 * CHUNK if case == "all_cached" else 0)
    resident_ok(engine)
    engine.close()


# ----------------------------------------------------------------------------- bit-exact round trips
@pytest.mark.parametrize("buffered", [False, True], ids=["paged", "buffer"])
@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: str(d).removeprefix("torch."))
@pytest.mark.parametrize("layout", LAYOUT_NAMES)
def test_round_trip_is_bit_exact_for_every_layout_and_dtype(layout, dtype, buffered, kernels):
    spec = KVSpec(num_layers=3, layout=layout, dtype=dtype)
    engine = make_engine(spec, config(save_unfull_chunk=True), buffered=buffered)
    kv = random_kv_caches(spec, seed=3)
    n = 3 * CHUNK + 5
    slots = random_slot_mapping(spec, n, seed=4)
    tokens = torch.arange(n)
    drive_store(engine.store_layer(tokens, kvcaches=kv, slot_mapping=slots))
    assert engine.lookup(tokens) == n

    # the stored objects are one-layer [num_kv, 1, T, hidden] with each token's exact vectors
    keys = layer_keys(engine.keys(tokens), spec.num_layers)
    for layer in range(spec.num_layers):
        for j, key in enumerate(keys[layer]):
            obj = engine.storage_manager.get(key)
            assert obj is not None
            assert obj.fmt is (MemoryFormat.KV_MLA_FMT if spec.use_mla else MemoryFormat.KV_2LTD)
            assert obj.shape == (1 if spec.use_mla else 2, 1, min(CHUNK, n - j * CHUNK), spec.hidden)
            for t in range(obj.shape[2]):
                assert torch.equal(bits(obj.tensor[:, 0, t]), bits(token_kv(kv[layer], spec, slots[j * CHUNK + t])))
            obj.ref_count_down()

    out = [torch.zeros_like(t) for t in kv]
    _, mask = drive_retrieve(engine.retrieve_layer(tokens, kvcaches=out, slot_mapping=slots))
    assert bool(mask.all())
    assert_paged_equal(out, expected_paged(kv, spec, slots, mask))
    resident_ok(engine)
    engine.close()


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    layout=st.sampled_from(LAYOUT_NAMES),
    buffered=st.booleans(),
    num_layers=st.integers(1, 4),
    num_tokens=st.integers(0, 5 * CHUNK),
    skip_chunks=st.integers(0, 5),
    unfull=st.booleans(),
    block_size=st.sampled_from([4, 16]),
    seed=st.integers(0, 2**16),
)
def test_round_trip_property(layout, buffered, num_layers, num_tokens, skip_chunks, unfull, block_size, seed):
    """Any length, mask prefix, partial chunk and block size: the retrieved tokens are exactly
    the stored ones, bit for bit, and nothing else in the paged cache is written."""
    spec = KVSpec(num_layers=num_layers, layout=layout, block_size=block_size, num_blocks=96)
    engine = make_engine(spec, config(save_unfull_chunk=unfull), buffered=buffered)
    kv = random_kv_caches(spec, seed=seed)
    slots = random_slot_mapping(spec, num_tokens, seed=seed + 1)
    tokens = torch.arange(num_tokens) * 7 + seed
    storable = num_tokens if unfull else num_tokens - num_tokens % CHUNK
    stored = engine.stats.snapshot()["stored_tokens"]
    drive_store(engine.store_layer(tokens, kvcaches=kv, slot_mapping=slots))
    assert engine.stats.snapshot()["stored_tokens"] - stored == storable
    assert engine.lookup(tokens) == storable

    skip = min(skip_chunks, num_tokens // CHUNK) * CHUNK
    mask = torch.arange(num_tokens) >= skip
    out = [torch.zeros_like(t) for t in kv]
    _, got = drive_retrieve(engine.retrieve_layer(tokens, mask, kvcaches=out, slot_mapping=slots))
    want = (torch.arange(num_tokens) >= skip) & (torch.arange(num_tokens) < storable)
    assert torch.equal(got, want)
    assert_paged_equal(out, expected_paged(kv, spec, slots, want))
    resident_ok(engine)
    engine.close()


# ----------------------------------------------------------------------------- pipelining
def test_store_publishes_each_layer_one_call_after_its_copy(kernels):
    """Call i copies layer i and publishes layer i-1 (CPU copies are complete when their
    call returns): layers are published in order, whole, never before their copy, and
    the request stays a miss until the last call has published every layer."""
    spec = KVSpec(num_layers=4)
    engine, kv, slots, tokens = setup(spec, 3 * CHUNK)
    keys = layer_keys(engine.keys(tokens), spec.num_layers)
    sm = engine.storage_manager
    gen = engine.store_layer(tokens, kvcaches=kv, slot_mapping=slots)
    for call in range(spec.num_layers + 1):
        next(gen, None)
        for layer in range(spec.num_layers):
            present = [sm.contains(k) is not None for k in keys[layer]]
            published = layer < call or call == spec.num_layers
            assert present == [published] * 3, (call, layer, present)
        # lookup agrees with storage order: the request is a miss until every layer is in
        assert engine.lookup(tokens) == (3 * CHUNK if call == spec.num_layers else 0)
    resident_ok(engine)
    engine.close()


def test_retrieve_writes_layer_i_before_layer_i_plus_1(kernels):
    spec = KVSpec(num_layers=4, layout="flash_attn")
    engine, kv, slots, tokens = setup(spec, 2 * CHUNK)
    engine.store(tokens, kvcaches=kv, slot_mapping=slots)
    out = [torch.zeros_like(t) for t in kv]
    full = expected_paged(kv, spec, slots, torch.ones(2 * CHUNK, dtype=torch.bool))
    gen = engine.retrieve_layer(tokens, kvcaches=out, slot_mapping=slots)
    assert next(gen) is None  # setup writes nothing
    assert all(not t.any() for t in out)
    for layer in range(spec.num_layers):
        assert next(gen) is None
        for other in range(spec.num_layers):
            if other <= layer:
                assert torch.equal(out[other], full[other])
            else:
                assert not out[other].any()
    assert bool(next(gen).all())
    engine.close()


# ----------------------------------------------------------------------------- storage order / misses
@settings(max_examples=20, deadline=None)
@given(num_layers=st.integers(1, 4), missing_layer=st.integers(0, 3), missing_chunk=st.integers(0, 3))
def test_a_missing_layer_chunk_is_a_miss_from_there(num_layers, missing_layer, missing_chunk):
    missing_layer %= num_layers
    spec = KVSpec(num_layers=num_layers)
    engine, kv, slots, tokens = setup(spec, 4 * CHUNK)
    engine.store(tokens, kvcaches=kv, slot_mapping=slots)
    key = layer_keys(engine.keys(tokens), num_layers)[missing_layer][missing_chunk]
    assert engine.storage_manager.remove(key)
    assert engine.lookup(tokens) == missing_chunk * CHUNK

    out = [torch.zeros_like(t) for t in kv]
    _, mask = drive_retrieve(engine.retrieve_layer(tokens, kvcaches=out, slot_mapping=slots))
    want = torch.arange(4 * CHUNK) < missing_chunk * CHUNK
    assert torch.equal(mask, want)
    # layers >= 1 of the missed chunks were never written. Layer 0 is copied before the
    # other layers' presence is checked (that check runs after layer 0 is ready, off the
    # forward pass's critical path), so it holds KV past the mask when the gap is in a
    # later layer: the caller recomputes those tokens (the mask says so).
    layer0 = want if missing_layer == 0 else torch.ones(4 * CHUNK, dtype=torch.bool)
    expected = expected_paged(kv, spec, slots, want)
    expected[0] = expected_paged(kv[:1], spec, slots, layer0)[0]
    assert_paged_equal(out, expected)
    assert engine.stats.snapshot()["load_errors"] == 0
    resident_ok(engine)
    engine.close()


def test_entry_lost_before_the_rest_of_the_setup_shortens_the_mask(kernels):
    """Layers 2.. are checked (and their L1 objects taken) when layer 1 is copied, after layer 0
    is ready: an entry lost before that is a plain miss from its chunk on."""
    spec = KVSpec(num_layers=4)
    engine, kv, slots, tokens = setup(spec, 3 * CHUNK)
    engine.store(tokens, kvcaches=kv, slot_mapping=slots)
    keys = layer_keys(engine.keys(tokens), spec.num_layers)
    out = [torch.zeros_like(t) for t in kv]
    gen = engine.retrieve_layer(tokens, kvcaches=out, slot_mapping=slots)
    next(gen)  # setup: layer 0's reads
    next(gen)  # layer 0 copied (3 chunks), layer 1's reads started
    assert engine.storage_manager.remove(keys[2][1])  # a tier loses layer 2 / chunk 1
    next(gen)  # rest of the set-up: layers 2, 3 have chunk 0 only; layer 1 copied for chunk 0
    next(gen)  # layer 2
    next(gen)  # layer 3
    mask = next(gen)
    assert torch.equal(mask, torch.arange(3 * CHUNK) < CHUNK)
    assert engine.stats.snapshot()["load_errors"] == 0
    full = expected_paged(kv, spec, slots, mask)
    # every token the mask reports has all its layers; layers 1.. stopped at the cut
    assert_paged_equal(out[1:], full[1:])
    assert_paged_equal(out[:1], expected_paged(kv[:1], spec, slots, torch.ones(3 * CHUNK, dtype=torch.bool)))
    resident_ok(engine)
    engine.close()


def test_entry_removed_after_the_setup_is_still_read_from_the_held_object(kernels):
    spec = KVSpec(num_layers=4)
    engine, kv, slots, tokens = setup(spec, 3 * CHUNK)
    engine.store(tokens, kvcaches=kv, slot_mapping=slots)
    keys = layer_keys(engine.keys(tokens), spec.num_layers)
    out = [torch.zeros_like(t) for t in kv]
    gen = engine.retrieve_layer(tokens, kvcaches=out, slot_mapping=slots)
    for _ in range(3):  # set-up, layer 0, layer 1 (+ the rest of the set-up)
        next(gen)
    assert engine.storage_manager.remove(keys[3][1])  # out of the index; the retrieve holds the object
    _, mask = drive_retrieve(gen)
    assert bool(mask.all()) and engine.stats.snapshot()["load_errors"] == 0
    assert_paged_equal(out, expected_paged(kv, spec, slots, mask))
    resident_ok(engine)
    engine.close()


def test_retrieve_holds_its_later_layers_against_eviction_by_a_concurrent_store():
    """A store allocating upfront while a retrieve is mid-way must not evict the layers the
    retrieve has yet to copy (held since the rest of the set-up ran, at layer 1)."""
    spec = KVSpec(num_layers=4, num_blocks=64)
    one_chunk = CHUNK * 2 * spec.hidden * 4  # one layer-chunk of fp32 = 2 KiB, a 4 KiB page in the pool
    engine = make_engine(spec, config(max_local_cpu_size=(16 * 4096) / GiB))  # room for 4 chunks x 4 layers
    assert one_chunk <= 4096
    kv = random_kv_caches(spec, seed=5)
    slots = random_slot_mapping(spec, 4 * CHUNK, seed=6)
    a = torch.arange(4 * CHUNK)
    engine.store(a[: 2 * CHUNK], kvcaches=kv, slot_mapping=slots[: 2 * CHUNK])
    out = [torch.zeros_like(t) for t in kv]
    gen = engine.retrieve_layer(a[: 2 * CHUNK], kvcaches=out, slot_mapping=slots[: 2 * CHUNK])
    for _ in range(3):  # set-up, layer 0, layer 1: layers 2 and 3 of a (4 pages) are held
        next(gen)
    b = torch.arange(10_000, 10_000 + 4 * CHUNK)
    # wants 16 pages; 8 are free and a's copied layers 0, 1 (4 pages) are evictable: 3 chunks
    drive_store(engine.store_layer(b, kvcaches=kv, slot_mapping=slots))
    assert engine.stats.snapshot()["store_skipped_chunks"] == 1
    _, mask = drive_retrieve(gen)
    assert bool(mask.all()) and engine.stats.snapshot()["load_errors"] == 0
    assert_paged_equal(out, expected_paged(kv, spec, slots[: 2 * CHUNK], mask))
    assert engine.lookup(b) == 3 * CHUNK
    resident_ok(engine)
    engine.close()


# ----------------------------------------------------------------------------- store details
def test_store_skips_cached_chunks_and_stops_at_the_first_negative_slot():
    spec = KVSpec(num_layers=3)
    engine, kv, slots, tokens = setup(spec, 4 * CHUNK)
    holes = slots.clone()
    holes[2 * CHUNK + 3] = -1
    drive_store(engine.store_layer(tokens, kvcaches=kv, slot_mapping=holes))
    assert engine.stats.snapshot()["stored_tokens"] == 2 * CHUNK
    assert engine.lookup(tokens) == 2 * CHUNK
    puts = []
    sm = engine.storage_manager
    original = sm.batched_put
    sm.batched_put = lambda keys, objs, **kw: (puts.append(len(keys)), original(keys, objs, **kw))  # type: ignore[method-assign]
    drive_store(engine.store_layer(tokens, kvcaches=kv, slot_mapping=slots))
    assert puts == [2] * spec.num_layers  # only the two chunks not yet cached, per layer
    assert engine.lookup(tokens) == 4 * CHUNK
    resident_ok(engine)
    engine.close()


def test_store_skips_later_chunks_resident_for_every_layer_only():
    spec = KVSpec(num_layers=3)
    engine, kv, slots, tokens = setup(spec, 4 * CHUNK)
    drive_store(engine.store_layer(tokens, kvcaches=kv, slot_mapping=slots))
    sm = engine.storage_manager
    keys = layer_keys(engine.keys(tokens), spec.num_layers)
    assert sm.remove(keys[0][0])  # chunk 0 misses layer 0: nothing cached from the start
    assert sm.remove(keys[1][2])  # chunk 2 misses layer 1
    puts: list[list] = []
    original = sm.batched_put
    sm.batched_put = lambda k, objs, **kw: (puts.append(list(k)), original(k, objs, **kw))  # type: ignore[method-assign]
    drive_store(engine.store_layer(tokens, kvcaches=kv, slot_mapping=slots))
    assert puts == [[keys[layer][0], keys[layer][2]] for layer in range(spec.num_layers)]
    assert engine.lookup(tokens) == 4 * CHUNK
    resident_ok(engine)
    engine.close()


def test_full_pool_stores_whole_chunks_only():
    spec = KVSpec(num_layers=3)
    engine = make_engine(spec, config(max_local_cpu_size=(7 * 4096) / GiB))  # 7 pages: 2 chunks of 3 layers
    kv = random_kv_caches(spec)
    slots = random_slot_mapping(spec, 4 * CHUNK)
    tokens = torch.arange(4 * CHUNK)
    drive_store(engine.store_layer(tokens, kvcaches=kv, slot_mapping=slots))
    snap = engine.stats.snapshot()
    assert snap["stored_tokens"] == 2 * CHUNK and snap["store_skipped_chunks"] == 2
    assert len(engine.storage_manager.local_cpu) == 2 * spec.num_layers
    assert engine.lookup(tokens) == 2 * CHUNK
    resident_ok(engine)
    engine.close()


def test_eviction_order_is_tail_chunk_first_with_all_its_layers():
    spec = KVSpec(num_layers=3)
    engine, kv, slots, tokens = setup(spec, 3 * CHUNK)
    drive_store(engine.store_layer(tokens, kvcaches=kv, slot_mapping=slots))
    keys = layer_keys(engine.keys(tokens), spec.num_layers)
    victims = list(engine.storage_manager.local_cpu.policy.victims())
    want = [keys[layer][chunk] for chunk in (2, 1, 0) for layer in range(spec.num_layers)]
    assert victims == want
    # a retrieve reads layer by layer; afterwards the order is restored
    drive_retrieve(engine.retrieve_layer(tokens, kvcaches=[torch.zeros_like(t) for t in kv], slot_mapping=slots))
    assert list(engine.storage_manager.local_cpu.policy.victims()) == want
    engine.close()


def test_a_store_into_a_full_pool_evicts_whole_old_chunks_and_keeps_its_own():
    """Each chunk's layers are reserved as one block (evicting as needed); the older request
    loses whole chunks from its tail, never the new request's layers."""
    spec, engine, kv, slots, old, new = _full_pool_of_an_old_request()
    drive_store(engine.store_layer(new, kvcaches=kv, slot_mapping=slots[: 2 * CHUNK]))
    assert engine.lookup(new) == 2 * CHUNK and engine.lookup(old) == 2 * CHUNK
    assert engine.stats.snapshot()["evictions"] == 2 * spec.num_layers
    _assert_new_request_reads_back(spec, engine, kv, slots, new)


def _full_pool_of_an_old_request():
    """An engine whose pool (4 chunks x 3 layers) is full with the 4 chunks of ``old``;
    ``new`` is a 2-chunk request over the first slots."""
    spec = KVSpec(num_layers=3)
    engine = make_engine(spec, config(max_local_cpu_size=(12 * 4096) / GiB))
    kv = random_kv_caches(spec)
    slots = random_slot_mapping(spec, 4 * CHUNK)
    old, new = torch.arange(4 * CHUNK), torch.arange(9000, 9000 + 2 * CHUNK)
    drive_store(engine.store_layer(old, kvcaches=kv, slot_mapping=slots))
    assert engine.lookup(old) == 4 * CHUNK
    return spec, engine, kv, slots, old, new


def _assert_new_request_reads_back(spec, engine, kv, slots, new) -> None:
    out = [torch.zeros_like(t) for t in kv]
    _, mask = drive_retrieve(engine.retrieve_layer(new, kvcaches=out, slot_mapping=slots[: 2 * CHUNK]))
    assert bool(mask.all())
    assert_paged_equal(out, expected_paged(kv, spec, slots[: 2 * CHUNK], mask))
    resident_ok(engine)
    engine.close()


def _count_reservations(engine: LMCacheEngine) -> list[int]:
    counts: list[int] = []
    sm = engine.storage_manager
    original = sm.reserve
    sm.reserve = lambda shape, dtype, fmt, count: (counts.append(count), original(shape, dtype, fmt, count))[1]  # type: ignore[method-assign]
    return counts


def test_store_reserves_a_requests_same_shape_chunks_in_one_pool_call():
    spec = KVSpec(num_layers=3)
    engine, kv, slots, tokens = setup(spec, 4 * CHUNK + 5, save_unfull_chunk=True)
    counts = _count_reservations(engine)
    drive_store(engine.store_layer(tokens, kvcaches=kv, slot_mapping=slots))
    assert counts == [4 * spec.num_layers, spec.num_layers]  # the four full chunks, then the partial one
    out = [torch.zeros_like(t) for t in kv]
    _, mask = drive_retrieve(engine.retrieve_layer(tokens, kvcaches=out, slot_mapping=slots))
    assert int(mask.sum()) == 4 * CHUNK + 5
    assert_paged_equal(out, expected_paged(kv, spec, slots, mask))
    resident_ok(engine)
    engine.close()


def test_store_reservations_fall_back_to_one_per_chunk_in_a_fragmented_pool():
    """Free pool bytes in holes of one chunk each: the request's shared reservation does not
    fit, each chunk's does, and nothing is evicted."""
    spec, engine, kv, slots, old, new = _full_pool_of_an_old_request()
    sm = engine.storage_manager
    old_keys = layer_keys(engine.keys(old), spec.num_layers)
    for chunk in (1, 3):
        for layer in range(spec.num_layers):
            assert sm.remove(old_keys[layer][chunk])
    counts = _count_reservations(engine)
    drive_store(engine.store_layer(new, kvcaches=kv, slot_mapping=slots[: 2 * CHUNK]))
    assert counts == [2 * spec.num_layers, spec.num_layers, spec.num_layers]
    assert engine.stats.snapshot()["evictions"] == 0
    assert engine.lookup(new) == 2 * CHUNK
    assert all(sm.is_resident(old_keys[layer][chunk]) for chunk in (0, 2) for layer in range(spec.num_layers))
    _assert_new_request_reads_back(spec, engine, kv, slots, new)


def test_store_reservations_never_exceed_one_slab():
    spec = KVSpec(num_layers=3)
    engine, kv, slots, tokens = setup(spec, 5 * CHUNK)
    sm = engine.storage_manager
    sm.local_cpu.allocator.slab_bytes = 2 * spec.num_layers * 4096  # two chunks per slab
    counts = _count_reservations(engine)
    drive_store(engine.store_layer(tokens, kvcaches=kv, slot_mapping=slots))
    assert counts == [2 * spec.num_layers, 2 * spec.num_layers, spec.num_layers]
    assert engine.lookup(tokens) == 5 * CHUNK
    resident_ok(engine)
    engine.close()


def test_native_layer_plan_checks_layers_and_slots():
    mod = native.load()
    if mod is None:
        pytest.skip("native kernels (lmcache._c_ops) are not built")
    spec = KVSpec(num_layers=2, layout="flash_attn")
    connector = make_connector(spec, CHUNK, layerwise=True)
    kv = random_kv_caches(spec)
    slots = random_slot_mapping(spec, 2 * CHUNK)
    geom = connector.bind(2 * CHUNK, kvcaches=kv, slot_mapping=slots).geometry
    with pytest.raises(ValueError, match="chunk 1"):
        mod.layer_plan(native.SCATTER, kv, geom, slots, [0, CHUNK], [CHUNK, 2 * CHUNK])
    bad = slots.clone()
    bad[3] = spec.num_blocks * spec.block_size  # one past the cache
    plan = mod.layer_plan(native.SCATTER, kv, geom, bad, [0], [CHUNK])
    src = torch.zeros(2, 1, CHUNK, spec.hidden)
    with pytest.raises(IndexError, match="slot_mapping"):
        plan.run(0, [src.data_ptr()])
    odd = [kv[0], kv[1].transpose(1, 2)]  # same element count, other strides
    plan = mod.layer_plan(native.GATHER, odd, geom, slots, [0], [CHUNK])
    plan.run(0, [src.data_ptr()])
    with pytest.raises(ValueError, match=r"kv_layers\[1\]"):
        plan.run(1, [src.data_ptr()])
    with pytest.raises(ValueError, match="pointers"):
        plan.run(0, [src.data_ptr()] * 2)


# ----------------------------------------------------------------------------- ownership
def test_closing_a_store_midway_releases_memory_and_leaves_a_miss():
    spec = KVSpec(num_layers=4)
    engine, kv, slots, tokens = setup(spec, 2 * CHUNK)
    gen = engine.store_layer(tokens, kvcaches=kv, slot_mapping=slots)
    next(gen)
    next(gen)  # layers 0 and 1 copied, layer 0 published
    gen.close()
    assert len(engine.storage_manager.local_cpu) == 2 * 1
    assert engine.lookup(tokens) == 0  # layers 1-3 missing: the whole request is a miss
    resident_ok(engine)  # the 3 unpublished layers' objects went back to the pool
    drive_store(engine.store_layer(tokens, kvcaches=kv, slot_mapping=slots))  # a later store completes it
    assert engine.lookup(tokens) == 2 * CHUNK
    engine.close()


@pytest.mark.parametrize("steps", [1, 2, 3, 4])
def test_closing_a_retrieve_midway_releases_what_it_holds(steps):
    spec = KVSpec(num_layers=4)
    engine, kv, slots, tokens = setup(spec, 2 * CHUNK)
    engine.store(tokens, kvcaches=kv, slot_mapping=slots)
    gen = engine.retrieve_layer(tokens, kvcaches=[torch.zeros_like(t) for t in kv], slot_mapping=slots)
    for _ in range(steps):
        next(gen)
    held = sum(o.ref_count > 1 for o in engine.storage_manager.local_cpu.resident_objects().values())
    # set-up: layer 0's reads; layer 0 copied (its objects are released by the next call, and
    # all of it came from L1: layer 1's reads wait for that call too); layer 1: layers 2, 3 (the
    # rest of the set-up); layer 2: layer 3
    assert held == 2 * {1: 1, 2: 1, 3: 2, 4: 1}[steps]
    gen.close()
    resident_ok(engine)
    engine.close()


@pytest.mark.parametrize("steps", [0, 1, 3])
def test_abandoned_generators_release_everything_when_collected(steps):
    """A generator dropped without close() (e.g. a request aborted mid-step) releases its
    objects, reservations and held entries when it is garbage-collected."""
    spec = KVSpec(num_layers=4)
    engine, kv, slots, tokens = setup(spec, 3 * CHUNK)
    engine.store(tokens[: 2 * CHUNK], kvcaches=kv, slot_mapping=slots[: 2 * CHUNK])
    retrieve = engine.retrieve_layer(tokens[: 2 * CHUNK], kvcaches=[torch.zeros_like(t) for t in kv], slot_mapping=slots[: 2 * CHUNK])
    store = engine.store_layer(tokens, kvcaches=kv, slot_mapping=slots)
    for _ in range(steps):
        next(retrieve), next(store)
    del retrieve, store
    gc.collect()
    resident_ok(engine)  # only whole published layers stay, each with the tier's single reference
    assert engine.lookup(tokens) == 2 * CHUNK  # the unfinished store published no whole chunk
    engine.close()


def test_bad_arguments_raise_and_leak_nothing():
    spec = KVSpec(num_layers=3)
    engine, kv, slots, tokens = setup(spec, 2 * CHUNK)
    # issue 13: arguments are validated when the call is made, before any generator step
    with pytest.raises(ValueError, match="kvcaches"):
        engine.store_layer(tokens, slot_mapping=slots)  # no kvcaches
    assert engine.storage_manager.allocator.used_bytes == 0
    engine.store(tokens, kvcaches=kv, slot_mapping=slots)
    with pytest.raises(ValueError, match="kvcaches"):
        engine.retrieve_layer(tokens, kvcaches=kv[:2], slot_mapping=slots)  # a layer short
    resident_ok(engine)  # pins taken by the setup were undone
    engine.close()


def test_lookup_pin_and_unpin_cover_every_layer():
    spec = KVSpec(num_layers=3)
    engine, kv, slots, tokens = setup(spec, 2 * CHUNK)
    engine.store(tokens, kvcaches=kv, slot_mapping=slots)
    assert engine.lookup(tokens, pin=True) == 2 * CHUNK
    objs = engine.storage_manager.local_cpu.resident_objects()
    assert len(objs) == 6 and all(o.pin_count == 1 for o in objs.values())
    engine.lookup_unpin(tokens)
    assert all(o.pin_count == 0 for o in objs.values())
    engine.close()


# ----------------------------------------------------------------------------- engine API
def test_bulk_store_and_retrieve_run_the_layerwise_path_when_configured():
    spec = KVSpec(num_layers=3, layout="flashinfer")
    engine, kv, slots, tokens = setup(spec, 3 * CHUNK)
    assert engine.store(tokens, kvcaches=kv, slot_mapping=slots) == 3 * CHUNK
    assert all(isinstance(k, LayerCacheEngineKey) for k in engine.storage_manager.local_cpu.keys())
    out = [torch.zeros_like(t) for t in kv]
    mask = engine.retrieve(tokens, kvcaches=out, slot_mapping=slots)
    assert bool(mask.all())
    assert_paged_equal(out, expected_paged(kv, spec, slots, mask))
    engine.close()


def test_layerwise_calls_need_a_layerwise_connector():
    spec = KVSpec(num_layers=2)
    engine = make_engine(spec, config(use_layerwise=False))
    with pytest.raises(ValueError, match="layerwise connector"):
        engine.store_layer([1, 2, 3])
    with pytest.raises(ValueError, match="layerwise connector"):
        engine.retrieve_layer([1, 2, 3])
    engine.close()


@pytest.mark.parametrize(
    "over, cls",
    [
        ({"use_layerwise": False}, VLLMPagedMemGPUConnectorV2),
        ({}, VLLMPagedMemLayerwiseGPUConnector),
        ({"extra_config": {"use_gpu": True}}, VLLMBufferLayerwiseGPUConnector),
        ({"extra_config": {"enable_blending": True}}, VLLMBufferLayerwiseGPUConnector),
    ],
)
def test_connector_follows_the_config(over, cls):
    conn = create_gpu_connector(config(**over), 16, 2, dtype=torch.float16, device="cpu")
    assert type(conn) is cls and conn.chunk_size == CHUNK


# ----------------------------------------------------------------------------- connector protocol
def test_connector_protocol_and_argument_checks():
    spec = KVSpec(num_layers=2)
    conn = VLLMPagedMemLayerwiseGPUConnector(spec.hidden, 2, chunk_size=CHUNK, dtype=spec.dtype, device="cpu")
    kv = random_kv_caches(spec)
    slots = random_slot_mapping(spec, CHUNK)
    assert conn.fmt is MemoryFormat.KV_2LTD and conn.get_shape(5) == (2, 1, 5, spec.hidden)
    objs = [[MemoryObj.from_tensor(torch.zeros(2, 1, CHUNK, spec.hidden), MemoryFormat.KV_2LTD)] for _ in range(2)]
    with pytest.raises(ValueError, match="objs_per_layer"):
        conn.batched_from_gpu(objs[:1], [0], [CHUNK], kvcaches=kv, slot_mapping=slots)
    store = conn.batched_from_gpu(objs, [0], [CHUNK], kvcaches=kv, slot_mapping=slots, sync=False)
    handles = list(store)
    assert [h.layer for h in handles] == [0, 1] and all(isinstance(h, LayerCopy) and h.done() for h in handles)
    for layer in range(2):
        for t in range(CHUNK):
            assert torch.equal(objs[layer][0].tensor[:, 0, t], token_kv(kv[layer], spec, slots[t]))

    out = [torch.zeros_like(t) for t in kv]
    load = conn.batched_to_gpu([0], [CHUNK], kvcaches=out, slot_mapping=slots)
    assert next(load) is None
    with pytest.raises(ValueError, match="send"):
        next(load)
    load = conn.batched_to_gpu([0], [CHUNK], kvcaches=out, slot_mapping=slots)
    next(load)
    assert load.send([objs[0][0]]).done()
    assert load.send([]).layer == 1  # an empty layer (storage returned nothing) copies nothing
    assert next(load) is None
    with pytest.raises(StopIteration):
        next(load)
    assert torch.equal(out[0], expected_paged(kv, spec, slots, torch.ones(CHUNK, dtype=torch.bool))[0])
    assert not out[1].any()
    bad = MemoryObj.from_tensor(torch.zeros(2, 1, CHUNK - 1, spec.hidden), MemoryFormat.KV_2LTD)
    load = conn.batched_to_gpu([0], [CHUNK], kvcaches=out, slot_mapping=slots)
    next(load)
    with pytest.raises(ValueError, match="does not hold"):
        load.send([bad])


def test_batched_requests_share_the_connector_with_sync_flags():
    """Two requests driven in lockstep as the adapter does (first/last sync flags) on one connector."""
    spec = KVSpec(num_layers=3, num_blocks=64)
    engine, kv, slots, _ = setup(spec, 4 * CHUNK)
    t1, t2 = torch.arange(2 * CHUNK), torch.arange(500, 500 + 2 * CHUNK)
    s1, s2 = slots[: 2 * CHUNK], slots[2 * CHUNK :]
    g1 = engine.store_layer(t1, kvcaches=kv, slot_mapping=s1, sync=True)
    g2 = engine.store_layer(t2, kvcaches=kv, slot_mapping=s2, sync=False)
    for _ in range(spec.num_layers + 1):
        next(g1), next(g2)
    out = [torch.zeros_like(t) for t in kv]
    r1 = engine.retrieve_layer(t1, kvcaches=out, slot_mapping=s1, sync=False)
    r2 = engine.retrieve_layer(t2, kvcaches=out, slot_mapping=s2, sync=True)
    for _ in range(spec.num_layers + 1):
        assert next(r1) is None and next(r2) is None
    m1, m2 = next(r1), next(r2)
    assert bool(m1.all()) and bool(m2.all())
    assert_paged_equal(out, expected_paged(kv, spec, slots, torch.ones(4 * CHUNK, dtype=torch.bool)))
    engine.close()


# ----------------------------------------------------------------------------- lower tier, futures
class DictTier(StorageBackend):
    """A lower tier holding copies in a dict; non-blocking gets run on a thread pool."""

    name = "DictTier"

    def __init__(self, allocator) -> None:
        self.allocator = allocator
        self.data: dict[CacheEngineKey, tuple[torch.Tensor, MemoryFormat]] = {}
        self.requested: list[int] = []  # layer ids of gets, in order
        self.pool = ThreadPoolExecutor(2)
        self.lock = threading.Lock()

    def contains(self, key, pin=False) -> bool:
        return key in self.data

    def submit_put(self, key, obj) -> None:
        self.data[key] = (obj.tensor.clone(), obj.fmt)

    def get_blocking(self, key):
        item = self.data.get(key)
        if item is None:
            return None
        obj = self.allocator.allocate(item[0].shape, item[0].dtype, item[1])
        obj.tensor.copy_(item[0])
        return obj

    def get_non_blocking(self, key) -> Future:
        with self.lock:
            self.requested.append(key.layer_id)

        return self.pool.submit(self.get_blocking, key)

    def remove(self, key) -> bool:
        return self.data.pop(key, None) is not None

    def close(self) -> None:
        self.pool.shutdown(wait=True)


def tiered_engine(spec: KVSpec) -> tuple[LMCacheEngine, DictTier]:
    cfg = config(local_cpu=False, max_local_cpu_size=0)
    sm = StorageManager(cfg, lower_backends=[], pool_bytes=16 << 20)
    tier = DictTier(sm.allocator)
    sm.lower.append(tier)
    connector = make_connector(spec, CHUNK, layerwise=True)
    engine = LMCacheEngine(cfg, make_metadata(spec, CHUNK), connector, storage_manager=sm)
    return engine, tier


def test_lower_tier_reads_of_the_next_layer_start_before_this_layer_is_copied():
    spec = KVSpec(num_layers=4, layout="mla")
    engine, tier = tiered_engine(spec)
    kv = random_kv_caches(spec, seed=9)
    slots = random_slot_mapping(spec, 3 * CHUNK, seed=10)
    tokens = torch.arange(3 * CHUNK)
    drive_store(engine.store_layer(tokens, kvcaches=kv, slot_mapping=slots))
    assert len(tier.data) == 3 * spec.num_layers and len(engine.storage_manager.local_cpu) == 0
    assert engine.storage_manager.allocator.used_bytes == 0  # staging objects released
    out = [torch.zeros_like(t) for t in kv]
    gen = engine.retrieve_layer(tokens, kvcaches=out, slot_mapping=slots)
    next(gen)
    assert tier.requested == [0] * 3  # setup started layer 0 only
    next(gen)
    assert tier.requested == [0] * 3 + [1] * 3  # layer 0's call started layer 1's reads (they overlap the forward pass)
    _, mask = drive_retrieve(gen)
    assert bool(mask.all())
    assert_paged_equal(out, expected_paged(kv, spec, slots, mask))
    assert engine.storage_manager.allocator.used_bytes == 0  # every layer's objects released
    engine.close()


def test_lower_tier_entry_lost_after_setup_is_reported():
    spec = KVSpec(num_layers=4)
    engine, tier = tiered_engine(spec)
    kv = random_kv_caches(spec, seed=11)
    slots = random_slot_mapping(spec, 2 * CHUNK, seed=12)
    tokens = torch.arange(2 * CHUNK)
    drive_store(engine.store_layer(tokens, kvcaches=kv, slot_mapping=slots))
    gen = engine.retrieve_layer(tokens, kvcaches=[torch.zeros_like(t) for t in kv], slot_mapping=slots)
    for _ in range(3):  # set-up, layer 0, layer 1 (the rest of the set-up checked layers 2, 3)
        next(gen)
    keys = layer_keys(engine.keys(tokens), spec.num_layers)
    tier.remove(keys[3][0])  # lost before layer 3's reads start (they start when layer 2 is copied)
    _, mask = drive_retrieve(gen)
    assert not mask.any()
    assert engine.stats.snapshot()["load_errors"] == 1
    assert engine.storage_manager.allocator.used_bytes == 0
    engine.close()


# ----------------------------------------------------------------------------- stream protocol (no GPU here)
class _FakeEvent:
    count = 0

    def __init__(self, log: list) -> None:
        _FakeEvent.count += 1
        self.name = f"ev{_FakeEvent.count}"
        self.log = log

    def record(self, stream) -> None:
        self.log.append(("record", stream.name, self.name))

    def query(self) -> bool:
        return True

    def synchronize(self) -> None:
        self.log.append(("cpu_wait", self.name))


class _FakeStream:
    def __init__(self, name: str, log: list) -> None:
        self.name, self.log = name, log

    def wait_stream(self, other) -> None:
        self.log.append(("wait_stream", self.name, other.name))

    def wait_event(self, event) -> None:
        self.log.append(("wait_event", self.name, event.name))


@pytest.fixture
def fake_cuda(monkeypatch):
    """Route the connector's stream calls to recording fakes; copies still run on CPU tensors."""
    import contextlib

    log: list = []
    current = _FakeStream("current", log)
    monkeypatch.setattr(torch.cuda, "current_stream", lambda device=None: current)
    monkeypatch.setattr(torch.cuda, "Event", lambda: _FakeEvent(log))

    @contextlib.contextmanager
    def on(stream):
        log.append(("enter", stream.name))
        yield

    monkeypatch.setattr(torch.cuda, "stream", on)
    _FakeEvent.count = 0

    def attach(conn):
        conn.load_stream, conn.store_stream = _FakeStream("load", log), _FakeStream("store", log)
        monkeypatch.setattr(conn, "_stream_of", lambda stream, kv: stream)

    return log, attach


def test_stream_ordering_follows_the_first_and_last_request_rules(fake_cuda):
    log, attach = fake_cuda
    spec = KVSpec(num_layers=2)
    engine, kv, slots, _ = setup(spec, 2 * CHUNK)
    attach(engine.gpu_connector)
    t1, t2 = torch.arange(CHUNK), torch.arange(700, 700 + CHUNK)
    s1, s2 = slots[:CHUNK], slots[CHUNK:]

    # store: only the first request (sync=True) orders the store stream after the forward pass
    g1 = engine.store_layer(t1, kvcaches=kv, slot_mapping=s1, sync=True)
    g2 = engine.store_layer(t2, kvcaches=kv, slot_mapping=s2, sync=False)
    for _ in range(spec.num_layers):
        next(g1), next(g2)
    next(g1), next(g2)
    assert log == [
        ("wait_stream", "store", "current"), ("enter", "store"), ("record", "store", "ev1"),  # req 1, layer 0
        ("enter", "store"), ("record", "store", "ev2"),  # req 2, layer 0
        ("wait_stream", "store", "current"), ("enter", "store"), ("record", "store", "ev3"),  # req 1, layer 1
        ("enter", "store"), ("record", "store", "ev4"),  # req 2, layer 1
    ]

    # retrieve: only the last request (sync=True) makes the current stream wait, for layer i
    # when layer i+1 is sent (so layer i+1's copy overlaps layer i's compute) and at the end
    log.clear()
    out = [torch.zeros_like(t) for t in kv]
    r1 = engine.retrieve_layer(t1, kvcaches=out, slot_mapping=s1, sync=False)
    r2 = engine.retrieve_layer(t2, kvcaches=out, slot_mapping=s2, sync=True)
    for gen in (r1, r2):  # start_load_kv: setup and layer 0, request by request
        next(gen), next(gen)
    for _ in range(spec.num_layers - 1):  # wait_for_layer_load(i): layer i+1 of every request
        next(r1), next(r2)
    m1, m2 = next(r1), next(r2)  # wait_for_layer_load(last): the masks
    assert bool(m1.all()) and bool(m2.all())
    assert log == [
        ("wait_stream", "load", "current"), ("enter", "load"), ("record", "load", "ev5"),  # req 1 setup + layer 0
        ("wait_stream", "load", "current"), ("enter", "load"), ("record", "load", "ev6"),  # req 2 setup + layer 0
        ("enter", "load"), ("record", "load", "ev7"),  # req 1 layer 1
        ("wait_event", "current", "ev6"), ("enter", "load"), ("record", "load", "ev8"),  # req 2 layer 1
        ("wait_event", "current", "ev8"),  # req 2 final: forward's last layer waits for every load
    ]
    engine.close()


class _LateEvent(_FakeEvent):
    """A copy event that completes only when the test says so (``done`` holds its name)."""

    done: set[str] = set()

    def query(self) -> bool:
        return self.name in self.done

    def synchronize(self) -> None:
        self.log.append(("cpu_wait", self.name))
        self.done.add(self.name)


@pytest.mark.parametrize("close_after", [None, 2])
def test_async_store_publishes_only_completed_copies_and_owns_the_rest(fake_cuda, monkeypatch, close_after):
    """CUDA-like copies (events complete later): a layer is published by the first call that
    finds its copy complete, in layer order; the last call waits for the rest. Published
    layers belong to L1 (one reference each); a generator closed early waits only for the
    copies it still owns and releases those layers, leaving a miss."""
    log, attach = fake_cuda
    monkeypatch.setattr(torch.cuda, "Event", lambda: _LateEvent(log))
    _LateEvent.done = set()
    spec = KVSpec(num_layers=4)
    engine, kv, slots, tokens = setup(spec, 2 * CHUNK)
    attach(engine.gpu_connector)
    keys = layer_keys(engine.keys(tokens), spec.num_layers)
    sm = engine.storage_manager

    def published() -> list[bool]:
        return [all(sm.contains(k) for k in keys[layer]) for layer in range(spec.num_layers)]

    gen = engine.store_layer(tokens, kvcaches=kv, slot_mapping=slots)
    next(gen)  # layer 0 copy queued (ev1)
    next(gen)  # ev1 not complete: nothing published; layer 1 queued (ev2)
    assert published() == [False] * 4
    _LateEvent.done |= {"ev2"}  # layer 1 completes before layer 0: order is kept
    next(gen)  # layer 2 queued (ev3)
    assert published() == [False] * 4
    if close_after == 2:
        gen.close()  # waits for the copies it owns (ev1, ev2, ev3), then releases them
        assert [e for e in log if e[0] == "cpu_wait"] == [("cpu_wait", "ev1"), ("cpu_wait", "ev3")]
        assert published() == [False] * 4 and engine.lookup(tokens) == 0
        resident_ok(engine)
        engine.close()
        return
    _LateEvent.done |= {"ev1"}
    next(gen)  # layers 0 and 1 published, layer 3 queued (ev4)
    assert published() == [True, True, False, False]
    assert engine.lookup(tokens) == 0
    next(gen)  # last call: waits for ev3 and ev4, publishes layers 2 and 3
    assert [e for e in log if e[0] == "cpu_wait"] == [("cpu_wait", "ev3"), ("cpu_wait", "ev4")]
    assert published() == [True] * 4 and engine.lookup(tokens) == 2 * CHUNK
    resident_ok(engine)  # every published object carries only L1's (the generator's former) reference
    engine.close()


def test_store_asks_lower_tiers_once_per_layer_not_per_chunk():
    """Issue 12: the layerwise store looks up its cached prefix through the StorageManager's
    batched lookup (one batched call per tier and layer), not ``contains`` per chunk and
    layer (one remote round trip each)."""
    spec = KVSpec(num_layers=4)
    engine, tier = tiered_engine(spec)
    calls: list[int] = []
    tier.batched_contains = lambda keys, pin=False: (calls.append(len(keys)), StorageBackend.batched_contains(tier, keys))[1]
    tier.contains = lambda key, pin=False: key in tier.data
    kv = random_kv_caches(spec, seed=11)
    slots = random_slot_mapping(spec, 5 * CHUNK, seed=12)
    tokens = torch.arange(5 * CHUNK)
    drive_store(engine.store_layer(tokens, kvcaches=kv, slot_mapping=slots))
    assert len(tier.data) == 5 * spec.num_layers
    calls.clear()
    drive_store(engine.store_layer(tokens, kvcaches=kv, slot_mapping=slots))  # all cached in the lower tier
    assert calls == [5] * spec.num_layers, calls
    assert len(tier.data) == 5 * spec.num_layers
    engine.close()
