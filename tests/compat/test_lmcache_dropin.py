"""LMCache 0.5.6 drop-in, round 2: calls that strict validation used to reject.

Written as an LMCache user writes them: a polling ``lookup(tokens, search_range=...)``
that waits for the asynchronous disk write, masks built with ``torch.ones(n)``, a
``HiddenStateStore`` bound to a storage manager that offers only LMCache's
``contains``, and ``StorageManager.contains`` returning a backend name. The last
section walks LMCache 0.5.6's public signatures, recorded below as data (method names
and the keyword arguments each takes), and checks that ours accept every keyword.
"""

from __future__ import annotations

import inspect
import math
import re
import time
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from lmcache.v1.cache_engine import LMCacheEngine
from lmcache.v1.config import LMCacheEngineConfig
from lmcache.v1.hidden_state_store import HiddenStateStore
from lmcache.v1.keys import CacheEngineKey
from lmcache.v1.memory_management import MemoryFormat
from lmcache.v1.request import TIER_NAMES, mask_start
from lmcache.v1.storage_backend.storage_manager import StorageManager
from lmcache.v1.testing import KVSpec, make_engine, make_metadata, random_kv_caches, random_slot_mapping
from lmcache.v1.token_database import ChunkedTokenDatabase

CHUNK = 16
N = 3 * CHUNK
SPEC = KVSpec(num_layers=2, num_heads=2, head_size=8, num_blocks=16, block_size=8)
WAIT_S = 10.0


def config(**extra: Any) -> LMCacheEngineConfig:
    return LMCacheEngineConfig.from_dict({"chunk_size": CHUNK, "max_local_cpu_size": 0.05, **extra})


def disk_config(tmp_path, **extra: Any) -> LMCacheEngineConfig:
    return config(local_disk=str(tmp_path / "disk"), max_local_disk_size=0.05, **extra)


def wait_for_lookup(engine: LMCacheEngine, tokens: list[int], want: int, **kw: Any) -> int:
    """LMCache users poll ``lookup`` until an asynchronous tier has the prefix."""
    deadline = time.monotonic() + WAIT_S
    while (hit := engine.lookup(tokens, **kw)) < want and time.monotonic() < deadline:
        time.sleep(0.01)
    return hit


def stored_engine(cfg: LMCacheEngineConfig, *, layerwise: bool = False) -> tuple[LMCacheEngine, list[int]]:
    engine = make_engine(SPEC, cfg, layerwise=layerwise)
    tokens = list(range(100, 100 + N))
    kv, slots = random_kv_caches(SPEC), random_slot_mapping(SPEC, N)
    assert engine.store(tokens, kvcaches=kv, slot_mapping=slots) == N
    return engine, tokens


def drop_from_cpu(engine: LMCacheEngine, tokens: list[int]) -> None:
    """What L1 eviction does to a stored prefix (every layer key on a layerwise engine)."""
    keys = engine.keys(tokens)
    if engine.config.use_layerwise:
        keys = [k for key in keys for k in key.split_layers(SPEC.num_layers)]
    for key in keys:
        assert engine.storage_manager.local_cpu.remove(key)


# ----------------------------------------------------------------------------- 1. lookup(search_range=...)
@pytest.mark.parametrize("layerwise", [False, True])
def test_lookup_search_range_polls_the_disk_tier(tmp_path, layerwise):
    engine, tokens = stored_engine(disk_config(tmp_path), layerwise=layerwise)
    try:
        assert wait_for_lookup(engine, tokens, N, search_range=["LocalDiskBackend"]) == N
        assert engine.lookup(tokens, search_range=["LocalCPUBackend"]) == N
        drop_from_cpu(engine, tokens)
        assert engine.lookup(tokens, search_range=["LocalCPUBackend"]) == 0
        assert engine.lookup(tokens, search_range=["LocalDiskBackend"]) == N
        assert engine.lookup(tokens, search_range=["LocalCPUBackend", "LocalDiskBackend"]) == N
        assert engine.lookup(tokens) == N
    finally:
        engine.close()


def test_search_range_forms_follow_lmcache():
    engine, tokens = stored_engine(config())
    try:
        assert engine.lookup(tokens, search_range="LocalCPUBackend") == N  # one name
        assert engine.lookup(tokens, search_range=[]) == N  # empty: every tier, as in LMCache
        assert engine.lookup(tokens, search_range=("RemoteBackend",)) == 0  # known, not configured
        assert engine.lookup(tokens, None, None, ["LocalCPUBackend"]) == N  # LMCache's positional order
        with pytest.raises(ValueError, match="LocalCPUBackend, LocalDiskBackend, RemoteBackend") as err:
            engine.lookup(tokens, search_range=["LocalCPUBackends"])
        assert "LocalCPUBackends" in str(err.value)
        with pytest.raises(TypeError, match="search_range"):
            engine.lookup(tokens, search_range=[0])
    finally:
        engine.close()


def test_pinned_lookup_is_released_by_its_lookup_id():
    engine, tokens = stored_engine(config())
    cpu = engine.storage_manager.local_cpu
    keys = engine.keys(tokens)
    try:
        assert engine.lookup(tokens, lookup_id="req-1", pin=True) == N
        assert engine.lookup(tokens, lookup_id="req-1", pin=True) == N  # the scheduler may ask twice
        assert [cpu.pin_count(k) for k in keys] == [2, 2, 2]
        engine.lookup_unpin("req-1")
        assert [cpu.pin_count(k) for k in keys] == [0, 0, 0]
        engine.lookup_unpin("req-1")  # unknown (already released) id: nothing happens
        engine.lookup_unpin(lookup_id="never-pinned")
        assert engine.lookup(tokens, pin=True) == N  # the older pairing: unpin by tokens
        engine.lookup_unpin(tokens)
        assert [cpu.pin_count(k) for k in keys] == [0, 0, 0]
    finally:
        engine.close()


def test_lookup_search_range_limits_pins_to_the_tiers_asked(tmp_path):
    engine, tokens = stored_engine(disk_config(tmp_path))
    cpu = engine.storage_manager.local_cpu
    try:
        assert wait_for_lookup(engine, tokens, N, search_range=["LocalDiskBackend"]) == N
        assert engine.lookup(tokens, search_range=["LocalDiskBackend"], lookup_id="r", pin=True) == N
        assert all(cpu.pin_count(k) == 0 for k in engine.keys(tokens))
        engine.lookup_unpin("r")
    finally:
        engine.close()


@pytest.mark.parametrize("layerwise", [False, True])
def test_store_and_lookup_by_chunk_hashes(layerwise):
    engine = make_engine(SPEC, config(), layerwise=layerwise)
    kv, slots = random_kv_caches(SPEC), random_slot_mapping(SPEC, N)
    hashes, offsets = [0x1111, 0x2222, b"\x03" * 32], [CHUNK, CHUNK, CHUNK]
    try:
        stored = engine.store(hashes=hashes, offsets=offsets, kvcaches=kv, slot_mapping=slots.tolist())
        assert stored == N
        assert engine.lookup(hashes=hashes, offsets=offsets) == N
        assert engine.lookup(hashes=hashes[:1] + [0x9999, hashes[2]], offsets=offsets) == CHUNK  # prefix only
        assert engine.lookup(hashes=hashes, offsets=[CHUNK, CHUNK, CHUNK - 1]) == 2 * CHUNK  # length is part of a key
        assert engine.lookup(list(range(N))) == 0  # hash-named chunks are not token-named ones
        with pytest.raises(ValueError, match="offsets"):
            engine.lookup(hashes=hashes)
        with pytest.raises(ValueError, match="tokens: missing"):
            engine.store(kvcaches=kv, slot_mapping=slots)
    finally:
        engine.close()


# ----------------------------------------------------------------------------- 2. 0/1 masks
def test_store_with_a_float_mask_built_from_torch_ones():
    engine = make_engine(SPEC, config())
    kv, slots = random_kv_caches(SPEC), random_slot_mapping(SPEC, N)
    tokens = list(range(N))
    try:
        mask = torch.ones(N)  # how LMCache users build masks
        mask[:CHUNK] = 0
        assert engine.store(tokens, mask=mask, kvcaches=kv, slot_mapping=slots) == N - CHUNK
        int_mask = torch.ones(N, dtype=torch.int64)
        int_mask[:CHUNK] = 0
        out = [torch.zeros_like(t) for t in kv]
        ret = engine.retrieve(tokens, int_mask, kvcaches=out, slot_mapping=slots)
        assert ret.dtype == torch.bool and ret.sum().item() == N - CHUNK  # LMCache callers sum it
        assert not bool(ret[:CHUNK].any()) and bool(ret[CHUNK:].all())
        assert engine.lookup(tokens) == 0  # chunk 0 was masked out of the store
        assert engine.store(tokens, mask=torch.ones(N, dtype=torch.float16), kvcaches=kv, slot_mapping=slots) == CHUNK
        assert engine.lookup(tokens) == N
    finally:
        engine.close()


MASK_DTYPES = [torch.bool, torch.uint8, torch.int8, torch.int32, torch.int64,
               torch.float16, torch.bfloat16, torch.float32, torch.float64]


@settings(max_examples=60, deadline=None)
@given(dtype=st.sampled_from(MASK_DTYPES), chunks=st.integers(1, 4), skipped=st.data(),
       form=st.sampled_from(["tensor", "numpy", "list"]))
def test_any_zero_one_mask_means_its_bool_mask(dtype, chunks, skipped, form):
    n = chunks * CHUNK
    first = skipped.draw(st.integers(0, chunks)) * CHUNK
    mask = torch.ones(n, dtype=dtype)
    mask[:first] = 0
    given_mask: Any = mask
    if form == "numpy" and dtype != torch.bfloat16:
        given_mask = mask.numpy()
    elif form == "list":
        given_mask = mask.tolist()
    assert mask_start(given_mask, n, CHUNK) == mask_start(mask.bool(), n, CHUNK) == first


@settings(max_examples=60, deadline=None)
@given(bad=st.one_of(st.floats(allow_nan=True, allow_infinity=True).filter(lambda v: v not in (0.0, 1.0)),
                     st.integers(-(2**31), 2**31).filter(lambda v: v not in (0, 1))),
       at=st.integers(0, N - 1), form=st.sampled_from(["tensor", "list"]))
def test_a_mask_value_other_than_zero_or_one_is_named(bad, at, form):
    values: list[Any] = [1] * N
    values[at] = bad
    if form == "tensor":
        dtype = torch.float64 if isinstance(bad, float) else torch.int64
        mask: Any = torch.tensor(values, dtype=dtype)
    else:
        mask = values
    with pytest.raises(ValueError, match=rf"mask: value \S+ at index {at}; expected only 0 or 1") as err:
        mask_start(mask, N, CHUNK)
    shown = str(err.value).split("value ", 1)[1].split(" at", 1)[0]
    assert shown == ("nan" if isinstance(bad, float) and math.isnan(bad) else f"{bad:g}" if isinstance(bad, float) else str(bad))


def test_mask_rules_that_stay():
    assert mask_start(np.array([0.0] * CHUNK + [1.0] * CHUNK), 2 * CHUNK, CHUNK) == CHUNK
    with pytest.raises(ValueError, match="run of False followed only by True"):
        mask_start(torch.tensor([1.0] * CHUNK + [0.0] * CHUNK), 2 * CHUNK, CHUNK)
    with pytest.raises(ValueError, match="multiple of chunk_size"):
        mask_start(torch.tensor([0] + [1] * (2 * CHUNK - 1)), 2 * CHUNK, CHUNK)
    with pytest.raises(ValueError, match="expected shape"):
        mask_start(torch.ones(CHUNK), 2 * CHUNK, CHUNK)
    with pytest.raises(TypeError, match="mask"):
        mask_start(torch.ones(CHUNK, dtype=torch.complex64), CHUNK, CHUNK)
    with pytest.raises(TypeError, match=r"mask\[1\]"):
        mask_start([1, "1"] + [1] * (CHUNK - 2), CHUNK, CHUNK)


# ----------------------------------------------------------------------------- 3. HiddenStateStore on LMCache's interface
class ContainsOnly:
    """A storage manager as LMCache's interface promises it: ``contains`` only."""

    def __init__(self, present: set[CacheEngineKey]) -> None:
        self.present = present
        self.asked: list[CacheEngineKey] = []

    def contains(self, key: CacheEngineKey, search_range: list[str] | None = None, pin: bool = False) -> str | None:
        self.asked.append(key)
        return "LocalCPUBackend" if key in self.present else None


def hidden_store(*, layerwise: bool = False) -> tuple[HiddenStateStore, ChunkedTokenDatabase]:
    cfg = config(enable_hidden_state_cache=True, max_hidden_state_cpu_size=0.01, use_layerwise=layerwise)
    db = ChunkedTokenDatabase(cfg, make_metadata(SPEC, CHUNK))
    return HiddenStateStore(cfg, db), db


def test_hidden_state_store_with_a_contains_only_storage_manager():
    hs, db = hidden_store()
    tokens, rows = list(range(N)), torch.randn(N, 4)
    keys = [s.key for s in db.spans(tokens)]
    manager = ContainsOnly(set(keys))
    try:
        assert hs.store_hidden_states(tokens, rows) == 3
        hs.bind_storage_manager(manager)
        assert torch.equal(hs.retrieve_hidden_states(tokens), rows)
        assert manager.asked == keys
        manager.present.discard(keys[1])  # the KV of chunk 1 was evicted
        assert torch.equal(hs.retrieve_hidden_states(tokens), rows[:CHUNK])
        assert not hs.has_chunk(keys[1]) and hs.has_chunk(keys[2])  # the orphan went, the walk stopped there
    finally:
        hs.close()


def test_hidden_state_store_asks_every_layer_key_of_a_layerwise_engine():
    hs, db = hidden_store(layerwise=True)
    tokens, rows = list(range(N)), torch.randn(N, 4)
    chunk_keys = [s.key for s in db.spans(tokens)]
    layer_keys = {k for key in chunk_keys for k in key.split_layers(SPEC.num_layers)}
    manager = ContainsOnly(set(layer_keys))
    try:
        hs.store_hidden_states(tokens, rows)
        hs.bind_storage_manager(manager)
        assert torch.equal(hs.retrieve_hidden_states(tokens), rows)
        assert set(manager.asked) == layer_keys
        manager.present.discard(chunk_keys[2].split_layers(SPEC.num_layers)[1])  # one layer of chunk 2 gone
        assert torch.equal(hs.retrieve_hidden_states(tokens), rows[: 2 * CHUNK])
    finally:
        hs.close()


class ContainsView:
    """Only LMCache's ``contains`` of a real storage manager."""

    def __init__(self, sm: StorageManager) -> None:
        self._sm = sm

    def contains(self, key: CacheEngineKey, search_range: list[str] | None = None, pin: bool = False) -> str | None:
        return self._sm.contains(key, search_range, pin)


def test_hidden_state_store_over_a_real_engine_through_contains_only():
    cfg = config(enable_hidden_state_cache=True, max_hidden_state_cpu_size=0.01)
    engine, tokens = stored_engine(cfg)
    hs = engine.hidden_state_store
    assert hs is not None
    sm = engine.storage_manager
    try:
        rows = torch.randn(N, 4)
        hs.store_hidden_states(tokens, rows)
        hs.bind_storage_manager(ContainsView(sm))
        assert torch.equal(hs.retrieve_hidden_states(tokens), rows)
        drop_from_cpu(engine, tokens[:CHUNK])
        assert hs.retrieve_hidden_states(tokens) is None
    finally:
        engine.close()


# ----------------------------------------------------------------------------- 4. StorageManager.contains
def put_one(sm: StorageManager, key: CacheEngineKey) -> None:
    obj = sm.allocate((64,), torch.uint8, MemoryFormat.BINARY)
    assert obj is not None
    sm.put(key, obj)
    obj.ref_count_down()


def test_storage_manager_contains_names_the_tier(tmp_path):
    sm = StorageManager(disk_config(tmp_path))
    key, other = CacheEngineKey("m", 1, 0, 1, "uint8"), CacheEngineKey("m", 1, 0, 2, "uint8")
    try:
        put_one(sm, key)
        assert sm.contains(key) == "LocalCPUBackend"
        assert sm.contains(other) is None
        assert sm.flush(WAIT_S)
        assert sm.contains(key, search_range=["LocalDiskBackend"]) == "LocalDiskBackend"
        assert sm.contains(key, ["RemoteBackend"]) is None  # LMCache's positional order
        sm.local_cpu.remove(key)
        assert sm.contains(key) == "LocalDiskBackend"
        with pytest.raises(ValueError, match="expected one of LocalCPUBackend, LocalDiskBackend, RemoteBackend"):
            sm.contains(key, search_range=["GdsBackend"])
    finally:
        sm.close()


def test_storage_manager_contains_pins_in_the_cpu_tier():
    sm = StorageManager(config())
    key = CacheEngineKey("m", 1, 0, 3, "uint8")
    try:
        put_one(sm, key)
        assert sm.contains(key, None, True) == "LocalCPUBackend"
        assert sm.local_cpu.pin_count(key) == 1
        assert sm.contains(key, search_range=["LocalDiskBackend"], pin=True) is None  # L1 not asked: no pin
        assert sm.local_cpu.pin_count(key) == 1
        sm.batched_unpin([key], ["LocalDiskBackend"])  # no L1 in locations: nothing to undo
        assert sm.local_cpu.pin_count(key) == 1
        sm.batched_unpin([key], locations=["LocalCPUBackend"])
        assert sm.local_cpu.pin_count(key) == 0
    finally:
        sm.close()


def test_storage_manager_location_keywords(tmp_path):
    sm = StorageManager(disk_config(tmp_path))
    keys = [CacheEngineKey("m", 1, 0, i, "uint8") for i in range(3)]
    try:
        obj = sm.allocate((64,), torch.uint8, MemoryFormat.BINARY)
        obj.byte_array.fill_(7)
        sm.batched_put(keys[:1], [obj], transfer_spec=None, location="LocalDiskBackend")
        obj.ref_count_down()
        assert sm.flush(WAIT_S)
        assert sm.contains(keys[0]) == "LocalDiskBackend"  # L1 was not written
        got = sm.get(keys[0], location="LocalCPUBackend")
        assert got is None
        got = sm.get(keys[0], location="LocalDiskBackend")
        assert got is not None and int(got.byte_array[0]) == 7
        got.ref_count_down()
        assert sm.contains(keys[0]) == "LocalCPUBackend"  # a lower-tier hit is promoted, as in LMCache
        first, second = sm.batched_get(keys[:2], location="LocalCPUBackend")
        assert first is not None and second is None
        first.ref_count_down()
        layers = list(sm.layerwise_batched_get([keys[:1], keys[1:2]], location="LocalDiskBackend"))
        got_layers = [f.result() for f in layers]
        assert got_layers[0][0] is not None and got_layers[1] == [None]
        got_layers[0][0].ref_count_down()
        assert sm.remove(keys[0], locations=["LocalCPUBackend"])
        assert sm.contains(keys[0]) == "LocalDiskBackend"
        assert sm.remove(keys[0]) and sm.contains(keys[0]) is None
    finally:
        sm.close()


# ----------------------------------------------------------------------------- 5. LMCache 0.5.6's signatures
LMCACHE_056_SIGNATURES: dict[str, tuple[str, ...]] = {
    # LMCacheEngine: named parameters, then the **kwargs names LMCache's own vLLM adapter passes
    "LMCacheEngine.store": ("tokens", "hashes", "offsets", "mask",
                            "kvcaches", "slot_mapping", "offset", "transfer_spec", "request_configs", "req_id"),
    "LMCacheEngine.retrieve": ("tokens", "mask",
                               "kvcaches", "slot_mapping", "vllm_cached_tokens", "request_configs", "req_id"),
    "LMCacheEngine.lookup": ("tokens", "hashes", "offsets", "search_range", "lookup_id", "pin", "request_configs"),
    "LMCacheEngine.lookup_unpin": ("lookup_id", "tokens"),  # tokens: the older form
    "LMCacheEngine.store_layer": ("tokens", "mask", "kvcaches", "slot_mapping", "offset", "sync", "req_id"),
    "LMCacheEngine.retrieve_layer": ("tokens", "mask", "kvcaches", "slot_mapping", "vllm_cached_tokens", "sync"),
    "StorageManager.allocate": ("shapes", "dtypes", "fmt", "eviction", "busy_loop"),
    "StorageManager.put": ("key", "memory_obj", "location"),
    "StorageManager.batched_put": ("keys", "memory_objs", "transfer_spec", "location"),
    "StorageManager.get": ("key", "location"),
    "StorageManager.get_non_blocking": ("key", "location"),
    "StorageManager.batched_get": ("keys", "location"),
    "StorageManager.layerwise_batched_get": ("keys", "location"),
    "StorageManager.contains": ("key", "search_range", "pin"),
    "StorageManager.batched_contains": ("keys", "search_range", "pin"),
    "StorageManager.remove": ("key", "locations"),
    "StorageManager.batched_unpin": ("keys", "locations"),
    "HiddenStateStore.__init__": ("config", "token_database"),
    "HiddenStateStore.bind_storage_manager": ("storage_manager",),
    "HiddenStateStore.store_hidden_states": ("token_ids", "hidden_states", "layer_idx", "token_offset"),
    "HiddenStateStore.retrieve_hidden_states": ("token_ids", "layer_idx"),
    "HiddenStateStore.has_chunk": ("key", "layer_idx"),
    "HiddenStateStore.drop_key": ("key",),
    "HiddenStateStore.num_cached_chunks": (),
    "HiddenStateStore.close": (),
}
CLASSES = {"LMCacheEngine": LMCacheEngine, "StorageManager": StorageManager, "HiddenStateStore": HiddenStateStore}


def ours(qualname: str) -> Any:
    cls, name = qualname.split(".")
    return getattr(CLASSES[cls], name)


@pytest.mark.parametrize("qualname", sorted(LMCACHE_056_SIGNATURES))
def test_every_lmcache_keyword_binds(qualname):
    sig = inspect.signature(ours(qualname))
    for name in LMCACHE_056_SIGNATURES[qualname]:
        sig.bind_partial(None, **{name: None})  # TypeError if the name has no parameter and no **kwargs takes it


def sample_values(kv: list[torch.Tensor], slots: torch.Tensor) -> dict[str, Any]:
    """One valid value per LMCache keyword of the engine's methods."""
    return {
        "hashes": [1, 2, 3], "offsets": [CHUNK] * 3, "mask": torch.ones(N),
        "kvcaches": kv, "slot_mapping": slots, "offset": 0, "transfer_spec": None,
        "request_configs": {"lmcache.tag.user": "a"}, "req_id": "req-1", "vllm_cached_tokens": 0,
        "sync": True, "search_range": ["LocalCPUBackend"], "lookup_id": "req-1", "pin": False,
    }


ENGINE_CALLS = {"store": "bulk", "retrieve": "bulk", "lookup": "bulk", "lookup_unpin": "bulk",
                "store_layer": "layerwise", "retrieve_layer": "layerwise"}


@pytest.mark.parametrize("method", sorted(ENGINE_CALLS))
def test_engine_methods_take_every_lmcache_keyword(method):
    """The **kwargs methods: a real call per keyword (binding alone proves nothing there)."""
    engine = make_engine(SPEC, config(), layerwise=ENGINE_CALLS[method] == "layerwise")
    kv, slots = random_kv_caches(SPEC), random_slot_mapping(SPEC, N)
    tokens = list(range(N))
    values = sample_values(kv, slots)
    copy_args = {"kvcaches": kv, "slot_mapping": slots}
    try:
        for name in LMCACHE_056_SIGNATURES[f"LMCacheEngine.{method}"]:
            if method == "lookup_unpin":
                args: dict[str, Any] = {name: tokens if name == "tokens" else "req-1"}
            elif method == "lookup":
                args = {"tokens": tokens, name: values.get(name, tokens)}
                if name == "hashes":
                    args = {"hashes": values["hashes"], "offsets": values["offsets"]}
                elif name == "offsets":
                    args["hashes"] = values["hashes"]
            else:
                args = {"tokens": tokens, **copy_args, name: values.get(name, tokens)}
                if name in ("hashes", "offsets"):
                    args = {**copy_args, "hashes": values["hashes"], "offsets": values["offsets"]}
            result = getattr(engine, method)(**args)
            if method.endswith("_layer"):
                list(result)  # run the generator to the end
        with pytest.raises(TypeError, match="unexpected keyword argument 'bogus'"):
            getattr(engine, method)(tokens, bogus=1)  # unknown names still raise
    finally:
        engine.close()


def test_tier_names_are_lmcache_s():
    assert TIER_NAMES == ("LocalCPUBackend", "LocalDiskBackend", "RemoteBackend")


def test_migration_doc_names_every_recorded_keyword():
    doc = (Path(__file__).resolve().parents[2] / "docs" / "migrating_from_lmcache.md").read_text()
    section = doc.split("## Call arguments", 1)[1].split("\n## ", 1)[0]
    for qualname, names in LMCACHE_056_SIGNATURES.items():
        method = qualname.split(".")[1]
        if method != "__init__":
            assert f"`{method}(" in section or f"`{method}`" in section or f", `{method}`" in section, qualname
        for name in names:
            assert re.search(rf"`[^`\n]*\b{name}\b[^`\n]*`", section), (qualname, name)


def test_a_slot_list_with_hashes_is_checked_like_a_slot_tensor():
    engine = make_engine(SPEC, config())
    kv = random_kv_caches(SPEC)
    slots = random_slot_mapping(SPEC, CHUNK).tolist()
    try:
        with pytest.raises(TypeError, match=r"slot_mapping\[3\]=1.5"):
            engine.store(hashes=[1], offsets=[CHUNK], kvcaches=kv, slot_mapping=slots[:3] + [1.5] + slots[4:])
        with pytest.raises(ValueError, match="slot_mapping: slot"):
            engine.store(hashes=[1], offsets=[CHUNK], kvcaches=kv, slot_mapping=[10**9] * CHUNK)
        assert engine.store(hashes=[1], offsets=[CHUNK], kvcaches=kv, slot_mapping=slots) == CHUNK
    finally:
        engine.close()


def test_storage_manager_allocate_takes_lmcache_s_keywords():
    from lmcache.v1.memory_management import ALIGN

    sm = StorageManager(config(), lower_backends=[], pool_bytes=4 * ALIGN)
    keys = [CacheEngineKey("m", 1, 0, i, "uint8") for i in range(5)]
    try:
        for key in keys[:4]:
            obj = sm.allocate(shapes=(ALIGN,), dtypes=torch.uint8, fmt=MemoryFormat.BINARY, busy_loop=False)
            sm.put(key, obj)
            obj.ref_count_down()
        assert sm.allocate((ALIGN,), torch.uint8, MemoryFormat.BINARY, eviction=False) is None  # full, nothing evicted
        assert sm.contains(keys[0]) == "LocalCPUBackend"
        obj = sm.allocate((ALIGN,), torch.uint8, MemoryFormat.BINARY, eviction=True)
        assert obj is not None and sm.contains(keys[0]) is None  # the oldest entry made room
        obj.ref_count_down()
        with pytest.raises(TypeError, match="shapes/dtypes"):
            sm.allocate([(ALIGN,), (ALIGN,)], [torch.uint8, torch.uint8])
    finally:
        sm.close()
