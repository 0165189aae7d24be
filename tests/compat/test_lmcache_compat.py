"""LMCache 0.5.6 drop-in surface (issue 15), written from LMCache's documented API.

Each section names the issue item it covers. The disk tier's submit-time reservation
(item 5) is tested in test_disk_reservation.py, next to the other disk tests.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import re
from pathlib import Path

import pytest
import torch
import yaml
from hypothesis import given
from hypothesis import strategies as st

from lmcache.utils import KEY_DTYPE_NAMES, CacheEngineKey, LayerCacheEngineKey
from lmcache.v1.cache_engine import LMCacheEngine, LMCacheEngineBuilder
from lmcache.v1.config import ConfigError, LMCacheEngineConfig, load_ec_engine_config
from lmcache.v1.config_compat import LMCACHE_056_ALIASES, LMCACHE_056_KEYS, RENAMED, SUPPORTED
from lmcache.v1.hidden_state_store import HiddenStateStore
from lmcache.v1.memory_management import GiB, MemoryFormat, PoolAllocator
from lmcache.v1.metadata import LMCacheEngineMetadata, LMCacheMetadata
from lmcache.v1.storage_backend.cache_policy import MRUPolicy, make_policy
from lmcache.v1.storage_backend.local_cpu_backend import LocalCPUBackend
from lmcache.v1.testing import KVSpec, make_metadata, random_kv_caches, random_slot_mapping
from lmcache.v1.token_database import ChunkedTokenDatabase

CHUNK = 8
SPEC = KVSpec(num_layers=2, num_heads=2, head_size=8, num_blocks=32, block_size=16)
DOC = Path(__file__).resolve().parents[2] / "docs" / "migrating_from_lmcache.md"


@pytest.fixture(autouse=True)
def clean_env(monkeypatch):
    for name in list(os.environ):
        if name.startswith("LMCACHE_"):
            monkeypatch.delenv(name)


def lmcache_metadata(model: str = "org/model", worker: int = 0) -> LMCacheMetadata:
    kv_shape = (SPEC.num_layers, 2, CHUNK, SPEC.num_heads, SPEC.head_size)
    return LMCacheMetadata(model, 2, 2, worker, worker, torch.float32, kv_shape)


def hs_config(**kw) -> LMCacheEngineConfig:
    data = {"chunk_size": CHUNK, "max_local_cpu_size": 0.01, "enable_hidden_state_cache": True,
            "max_hidden_state_cpu_size": 0.001}
    data.update(kw)
    return LMCacheEngineConfig.from_defaults(**data)


# ------------------------------------------------------------------ items 1-3: HiddenStateStore
def standalone_store(**kw) -> tuple[HiddenStateStore, ChunkedTokenDatabase]:
    cfg = hs_config(**kw)
    db = ChunkedTokenDatabase(cfg, lmcache_metadata())
    return HiddenStateStore(cfg, db), db  # LMCache's constructor: no storage manager


def test_store_returns_chunks_stored() -> None:
    hs, _ = standalone_store()
    try:
        assert hs.store_hidden_states(list(range(24)), torch.randn(24, 16)) == 3
        assert hs.store_hidden_states(list(range(24)), torch.randn(24, 16)) == 0  # already cached
        assert hs.store_hidden_states(list(range(40)), torch.randn(8, 16), token_offset=32) == 1
        assert hs.stats.snapshot()["stored_tokens"] == 32
    finally:
        hs.close()


def test_layer_outside_allowlist_returns_zero_and_stores_nothing() -> None:
    hs, _ = standalone_store(hidden_state_layers=[0, 2])
    try:
        for layer in range(4):  # an integrator storing every hook index
            got = hs.store_hidden_states(list(range(16)), torch.randn(16, 4), layer_idx=layer)
            assert got == (2 if layer in (0, 2) else 0)
        assert len(hs) == 4
        assert hs.retrieve_hidden_states(list(range(16)), layer_idx=1) is None
    finally:
        hs.close()


def test_introspection_methods_and_retrieve_without_storage_manager() -> None:
    hs, db = standalone_store()
    try:
        tokens, rows = list(range(24)), torch.randn(24, 16)
        hs.store_hidden_states(tokens, rows, layer_idx=0)
        hs.store_hidden_states(tokens[:8], rows[:8] * 2, layer_idx=5)
        keys = [s.key for s in db.spans(tokens)]
        assert hs.num_cached_chunks() == 3
        assert hs.has_chunk(keys[0]) and hs.has_chunk(keys[0], layer_idx=5) and not hs.has_chunk(keys[1], 5)
        out = hs.retrieve_hidden_states(tokens)  # no storage manager: KV counts as present
        assert out is not None and torch.equal(out, rows)
        assert hs.drop_key(keys[1]) and not hs.drop_key(keys[1])
        assert hs.num_cached_chunks() == 2 and not hs.has_chunk(keys[1])
        assert torch.equal(hs.retrieve_hidden_states(tokens), rows[:8])  # prefix-strict
        assert torch.equal(hs.retrieve_hidden_states(tokens, layer_idx=5), rows[:8] * 2)
    finally:
        hs.close()


def test_bind_storage_manager_turns_on_coupled_eviction() -> None:
    engine = LMCacheEngine(hs_config(), lmcache_metadata(), None)
    hs, _ = standalone_store()
    try:
        tokens = list(range(16))
        hs.store_hidden_states(tokens, torch.randn(16, 4))
        hs.bind_storage_manager(engine.storage_manager)  # its KV was never stored
        assert hs.retrieve_hidden_states(tokens) is None
        assert hs.num_cached_chunks() == 1  # the first chunk was an orphan: dropped, and the walk stopped there
    finally:
        hs.close()
        engine.close()


# ------------------------------------------------------------------ item 4: builder
@pytest.fixture
def builder_ids():
    ids: list[str] = []
    yield ids
    for instance in ids:
        LMCacheEngineBuilder.destroy(instance)


def connector():
    from lmcache.v1.gpu_connector import VLLMPagedMemGPUConnectorV2

    return VLLMPagedMemGPUConnectorV2(SPEC.hidden, SPEC.num_layers, chunk_size=CHUNK)


def test_builder_takes_lmcache_arguments_and_round_trips(builder_ids) -> None:
    builder_ids.append("compat-a")
    cfg = LMCacheEngineConfig.from_defaults(chunk_size=CHUNK, max_local_cpu_size=0.01)
    md = lmcache_metadata()
    calls = []
    engine = LMCacheEngineBuilder.get_or_create("compat-a", cfg, md, connector(), calls.append, calls.append)
    assert engine.metadata is md and isinstance(engine.metadata, LMCacheEngineMetadata)
    same = LMCacheEngineBuilder.get_or_create(
        "compat-a", LMCacheEngineConfig.from_defaults(chunk_size=CHUNK, max_local_cpu_size=0.01), lmcache_metadata(),
        connector(), broadcast_fn=None, broadcast_object_fn=None,
    )
    assert same is engine
    kv = random_kv_caches(SPEC, seed=3)
    slots = random_slot_mapping(SPEC, 32, seed=3)
    assert engine.store(list(range(32)), kvcaches=kv, slot_mapping=slots) == 32
    out = [torch.zeros_like(t) for t in kv]
    assert bool(engine.retrieve(list(range(32)), kvcaches=out, slot_mapping=slots).all())
    assert calls == []  # never broadcasts


def test_builder_names_what_differs(builder_ids) -> None:
    builder_ids.append("compat-b")
    cfg = LMCacheEngineConfig.from_defaults(chunk_size=CHUNK, max_local_cpu_size=0.01)
    md = lmcache_metadata()
    LMCacheEngineBuilder.get_or_create("compat-b", cfg, md, None)
    other = LMCacheEngineConfig.from_defaults(chunk_size=2 * CHUNK, max_local_cpu_size=0.01, save_unfull_chunk=True)
    with pytest.raises(ValueError, match=r"configuration \(differs: config.chunk_size, config.save_unfull_chunk\)"):
        LMCacheEngineBuilder.get_or_create("compat-b", other, md, None)
    with pytest.raises(ValueError, match=r"metadata \(differs: metadata.model_name\)"):
        LMCacheEngineBuilder.get_or_create("compat-b", cfg, lmcache_metadata("other"), None)
    with pytest.raises(ValueError, match=r"configuration and metadata .*config.chunk_size, .*metadata.worker_id"):
        LMCacheEngineBuilder.get_or_create("compat-b", other, lmcache_metadata(worker=1), None)
    cfg.max_local_cpu_size = 0.02  # mutating the caller's object later is still a change
    with pytest.raises(ValueError, match="config.max_local_cpu_size"):
        LMCacheEngineBuilder.get_or_create("compat-b", cfg, md, None)


def test_builder_never_prints_a_password(builder_ids) -> None:
    builder_ids.append("compat-c")
    cfg = LMCacheEngineConfig.from_defaults(chunk_size=CHUNK, max_local_cpu_size=0.01)
    LMCacheEngineBuilder.get_or_create("compat-c", cfg, lmcache_metadata(), None)
    changed = cfg.copy()
    changed.remote_password = "hunter2-secret"
    with pytest.raises(ValueError) as err:
        LMCacheEngineBuilder.get_or_create("compat-c", changed, lmcache_metadata(), None)
    assert "config.remote_password" in str(err.value) and "hunter2" not in str(err.value)


# ------------------------------------------------------------------ LMCacheMetadata
def test_lmcache_metadata_constructor_and_helpers() -> None:
    md = LMCacheMetadata("m", 4, 2, 3, 1, torch.bfloat16, (32, 2, 256, 8, 128), role="worker", chunk_size=256)
    assert (md.model_name, md.world_size, md.local_world_size, md.worker_id, md.local_worker_id) == ("m", 4, 2, 3, 1)
    assert md.fmt == "vllm" and md.use_mla is False and md.role == "worker" and md.engine_id is None
    assert md.get_shapes() == [torch.Size([2, 32, 256, 1024])] and md.get_dtypes() == [torch.bfloat16]
    assert md.get_num_groups() == 1 and not md.is_first_rank()
    assert LMCacheMetadata("m", 1, 1, 0, 0, torch.bfloat16, (2, 2, 16, 1, 8)).is_first_rank()
    with pytest.raises(dataclasses.FrozenInstanceError):
        md.worker_id = 0  # type: ignore[misc]
    with pytest.raises(ValueError, match="local_worker_id"):
        LMCacheMetadata("m", 4, 2, 3, 2, torch.bfloat16, (32, 2, 256, 8, 128))
    with pytest.raises(ValueError, match="worker_id"):
        LMCacheMetadata("m", 4, 2, 4, 1, torch.bfloat16, (32, 2, 256, 8, 128))


# ------------------------------------------------------------------ item 6: keys
dtypes = st.sampled_from(sorted(KEY_DTYPE_NAMES, key=str))
names = st.text(min_size=1, max_size=12)


@given(names, st.integers(1, 8), st.integers(0, 7), st.integers(0, 2**128 - 1), dtypes,
       st.dictionaries(names, names, max_size=3), st.none() | st.integers(0, 80))
def test_key_dict_round_trip(model, world, worker, chash, dtype, cfgs, layer) -> None:
    key = CacheEngineKey(model, world, worker, chash, dtype, cfgs)
    if layer is not None:
        key = key.split_layers(layer + 1)[layer]
    assert isinstance(key.dtype, torch.dtype) and key.dtype == dtype
    again = CacheEngineKey.from_dict(key.to_dict())
    assert again == key and type(again) is type(key)
    assert CacheEngineKey.from_string(key.to_string()).dtype == dtype if layer is None else True


def test_key_fields_and_methods() -> None:
    key = CacheEngineKey("m", 2, 0, 0xABC, torch.float16, {"b": "2", "a": "1"})
    assert key.dtype is torch.float16 and key.request_configs == (("a", "1"), ("b", "2"))
    assert key.to_string() == "m@2@0@00000000000000000000000000000abc@float16@a=1&b=2"
    assert key.chunk_hash_hex == "abc" and int(key.chunk_hash_hex, 16) == key.chunk_hash
    assert CacheEngineKey("m", 2, 0, 0xABC, "float16", (("a", "1"), ("b", "2"))) == key
    moved = key.with_new_worker_id(1)
    assert moved.worker_id == 1 and moved.chunk_hash == key.chunk_hash and moved != key
    first = key.get_first_layer()
    assert isinstance(first, LayerCacheEngineKey) and first.layer_id == 0 and first == key.split_layers(3)[0]
    layer = key.split_layers(3)[2].with_new_worker_id(1)
    assert isinstance(layer, LayerCacheEngineKey) and layer.layer_id == 2 and layer.worker_id == 1
    d = key.to_dict()
    assert d["dtype"] == "float16" and d["request_configs"] == {"a": "1", "b": "2"} and d["chunk_hash"] == 0xABC


@pytest.mark.parametrize("dtype", [torch.complex64, torch.uint16, "float128", "", None, 5])
def test_unsupported_key_dtype_is_rejected(dtype) -> None:
    with pytest.raises(ValueError, match="Unsupported dtype in CacheEngineKey"):
        CacheEngineKey("m", 1, 0, 1, dtype)


@pytest.mark.parametrize(
    "bad, field",
    [
        ({"model_name": 1}, "model_name"),
        ({"world_size": "1"}, "world_size"),
        ({"chunk_hash": True}, "chunk_hash"),
        ({"dtype": "complex64"}, "dtype"),
        ({"request_configs": ["a%b"]}, "request_configs"),
        ({"__type__": "Other"}, "__type__"),
        ({"__type__": "LayerCacheEngineKey"}, "layer_id"),
    ],
)
def test_key_from_dict_rejects_malformed_input(bad, field) -> None:
    d = CacheEngineKey("m", 1, 0, 5, torch.bfloat16).to_dict()
    d.update(bad)
    with pytest.raises(ValueError, match=field):
        CacheEngineKey.from_dict(d)


def test_lmcache_fp8_names_are_accepted() -> None:
    if not hasattr(torch, "float8_e4m3fn"):
        pytest.skip("no float8 in this torch")
    assert CacheEngineKey("m", 1, 0, 1, "fp8_e4m3fn").dtype is torch.float8_e4m3fn


# ------------------------------------------------------------------ item 7: MRU
def test_mru_evicts_the_most_recent_first() -> None:
    p = MRUPolicy()
    for k in "abc":
        p.on_insert(k)
    p.on_hit("a")
    assert list(p.victims()) == ["a", "c", "b"]
    p.on_remove("a")
    assert list(p.victims()) == ["c", "b"] and len(p) == 2
    assert isinstance(make_policy("mru"), MRUPolicy)
    assert LMCacheEngineConfig.from_defaults(cache_policy="MRU").cache_policy == "MRU"


def test_mru_in_the_cpu_tier() -> None:
    cpu = LocalCPUBackend(PoolAllocator(3 * 4096), make_policy("MRU"))
    try:
        keys = [CacheEngineKey("m", 1, 0, i, torch.uint8) for i in range(4)]
        for k in keys:
            obj = cpu.allocate((4096,), torch.uint8, MemoryFormat.BINARY)
            assert obj is not None
            cpu.submit_put(k, obj)
            obj.ref_count_down()
        assert [cpu.contains(k) for k in keys] == [True, True, False, True]  # key 2 was the newest when 3 came
    finally:
        cpu.close()


# ------------------------------------------------------------------ item 8: MemoryObj
def test_memory_obj_is_pinned_is_a_property() -> None:
    alloc = PoolAllocator(1 << 20)
    obj = alloc.allocate((4, 8), torch.float32, MemoryFormat.HS_TD)
    assert not obj.is_pinned and obj.can_evict
    assert obj.pin() is True and obj.is_pinned and not obj.can_evict
    assert obj.unpin() is True and not obj.is_pinned and obj.unpin() is False
    assert obj.get_shape() == torch.Size([4, 8]) and obj.get_dtype() is torch.float32
    assert obj.get_memory_format() is MemoryFormat.HS_TD and obj.get_num_tokens() == 4
    assert obj.get_size() == 128 and obj.get_physical_size() == 4096 and obj.metadata is obj.meta
    assert obj.data_ptr == obj.tensor.data_ptr() and obj.raw_tensor.numel() == 4096
    assert obj.get_ref_count() == 1 and obj.is_valid()
    obj.ref_count_down()
    assert not obj.is_valid() and obj.raw_tensor is None


# ------------------------------------------------------------------ item 9: config
def test_from_defaults_applies_keywords_and_validates() -> None:
    cfg = LMCacheEngineConfig.from_defaults(chunk_size=64, local_disk="/tmp/x", max_local_disk_size=2)
    assert (cfg.chunk_size, cfg.local_disk, cfg.max_local_disk_size) == (64, "/tmp/x", 2.0)
    assert LMCacheEngineConfig.from_defaults() == LMCacheEngineConfig()
    with pytest.raises(ConfigError, match="chunk_size='x'"):
        LMCacheEngineConfig.from_defaults(chunk_size="x")  # each value is parsed at once
    # rules across keys are checked by validate(), which building an engine runs
    unsized = LMCacheEngineConfig.from_defaults(local_disk="/tmp/x")
    with pytest.raises(ConfigError, match="max_local_disk_size"):
        unsized.validate()
    with pytest.raises(ConfigError, match="chunk_size=0"):
        LMCacheEngine(LMCacheEngineConfig.from_defaults(chunk_size=0), lmcache_metadata(), None)
    with pytest.raises(TypeError, match="'chunk_sise'.*did you mean 'chunk_size'"):
        LMCacheEngineConfig.from_defaults(chunk_sise=64)


def test_lmcache_only_keys(caplog) -> None:
    with caplog.at_level(logging.WARNING, logger="lmcache.v1.config"):
        cfg = LMCacheEngineConfig.from_defaults(
            remote_serde="naive", enable_blending=False, py_enable_gc=True,  # LMCache's defaults: silent
            enable_p2p=True,  # not supported, set: one warning with what to use instead
            blocking_timeout_secs=7,  # renamed: applied as remote_timeout
            enable_xpyd=False,  # an LMCache alias of enable_pd, at its default
        )
    assert cfg.remote_timeout == 7.0 and cfg.enable_pd is False
    messages = [r.getMessage() for r in caplog.records]
    assert len(messages) == 2, messages
    assert "'enable_p2p'" in messages[0] and "not supported" in messages[0] and "remote_url" in messages[0]
    assert "'blocking_timeout_secs'" in messages[1] and "'remote_timeout'" in messages[1]


def test_lmcache_yaml_file_loads(tmp_path, monkeypatch) -> None:
    path = tmp_path / "lmcache.yaml"
    path.write_text(yaml.safe_dump({
        "chunk_size": 256, "local_cpu": True, "max_local_cpu_size": 5.0, "remote_serde": "naive",
        "pre_caching_hash_algorithm": "builtin", "enable_hidden_state_cache": True,
        "hidden_states_retrieve_mode": "prefix_strict", "save_decode_cache": False,
    }))
    monkeypatch.setenv("LMCACHE_CONFIG_FILE", str(path))
    cfg = LMCacheEngineConfig.load()
    assert cfg.enable_hidden_state_cache and cfg.max_hidden_state_cpu_size == 2.0


def test_quoted_env_values(monkeypatch) -> None:
    monkeypatch.setenv("LMCACHE_REMOTE_URL", "'redis://cache.local:6379'")
    monkeypatch.setenv("LMCACHE_CACHE_POLICY", '"fifo"')
    monkeypatch.setenv("LMCACHE_CHUNK_SIZE", "'512'")
    monkeypatch.setenv("LMCACHE_LOCAL_DISK", '"/mnt/a it\'s"')
    monkeypatch.setenv("LMCACHE_MAX_LOCAL_DISK_SIZE", "4")
    cfg = LMCacheEngineConfig.from_env()
    assert cfg.remote_url == "redis://cache.local:6379" and cfg.cache_policy == "FIFO" and cfg.chunk_size == 512
    assert cfg.local_disk == "/mnt/a it's"


def test_update_config_from_env(monkeypatch) -> None:
    cfg = LMCacheEngineConfig.from_defaults(chunk_size=64)
    monkeypatch.setenv("LMCACHE_SAVE_UNFULL_CHUNK", "'true'")
    monkeypatch.setenv("LMCACHE_HIDDEN_STATE_LAYERS", "0,3")
    assert cfg.update_config_from_env() is cfg
    assert cfg.save_unfull_chunk and cfg.hidden_state_layers == [0, 3] and cfg.chunk_size == 64
    monkeypatch.setenv("LMCACHE_CHUNK_SIZE", "many")
    with pytest.raises(ConfigError, match="chunk_size='many'"):
        cfg.update_config_from_env()


def test_comma_separated_local_disk_paths(tmp_path) -> None:
    a, b = tmp_path / "nvme0", tmp_path / "nvme1"
    cfg = LMCacheEngineConfig.from_defaults(local_disk=f"file://{a}, {b}", max_local_disk_size=1)
    assert cfg.local_disk_paths == [str(a), str(b)]
    assert cfg.local_disk_path == str(a)  # device 0 (no CUDA here) -> the first path
    one = LMCacheEngineConfig.from_defaults(local_disk=f"file://{a}", max_local_disk_size=1)
    assert one.local_disk_paths == [str(a)] and one.local_disk_path == str(a)


def test_max_hidden_state_cpu_size_default() -> None:
    assert LMCacheEngineConfig().max_hidden_state_cpu_size == 2.0


def test_load_ec_engine_config_gives_an_unsized_base_disk_the_ec_default() -> None:
    base = LMCacheEngineConfig.from_defaults(local_cpu=False, max_local_cpu_size=0, local_disk="/tmp/ec-disk",
                                             max_local_disk_size=0)
    cfg = load_ec_engine_config(base_config=base)
    assert cfg.local_cpu and cfg.max_local_cpu_size == 1.0 and cfg.max_local_disk_size == 64.0


def test_load_ec_engine_config_base_config_keyword(tmp_path) -> None:
    base = LMCacheEngineConfig.from_defaults(chunk_size=64, local_disk=str(tmp_path), max_local_disk_size=3)
    for cfg in (load_ec_engine_config(base_config=base), load_ec_engine_config(base), load_ec_engine_config(base=base)):
        assert cfg.chunk_size == 64 and cfg.max_local_disk_size == 64.0 and cfg is not base
    assert base.max_local_disk_size == 3.0  # never mutated
    with pytest.raises(TypeError, match="not both"):
        load_ec_engine_config(base, base=base)


# ------------------------------------------------------------------ item 11: EC disk default
def test_ec_applies_the_disk_default_when_the_base_file_has_no_size(tmp_path, monkeypatch) -> None:
    path = tmp_path / "lmcache.yaml"
    path.write_text(yaml.safe_dump({"chunk_size": 128, "local_disk": str(tmp_path / "cache")}))
    monkeypatch.setenv("LMCACHE_CONFIG_FILE", str(path))
    cfg = load_ec_engine_config()
    assert cfg.local_disk == str(tmp_path / "cache") and cfg.max_local_disk_size == 64.0 and cfg.chunk_size == 128
    with pytest.raises(ConfigError, match="max_local_disk_size"):
        LMCacheEngineConfig.load()  # the KV engine keeps its clear error for the same file


# ------------------------------------------------------------------ item 10: connectors
def test_connectors_positional_form_and_exports() -> None:
    import lmcache.v1.gpu_connector as gc
    from lmcache.v1.gpu_connector import (
        VLLMBufferLayerwiseGPUConnector,
        VLLMPagedMemGPUConnectorV2,
        VLLMPagedMemLayerwiseGPUConnector,
    )
    from lmcache.v1.gpu_connector.gpu_connectors import VLLMPagedMemGPUConnectorV2 as same

    assert same is VLLMPagedMemGPUConnectorV2 and {"VLLMPagedMemLayerwiseGPUConnector",
                                                     "VLLMBufferLayerwiseGPUConnector"} <= set(gc.__all__)
    for cls in (VLLMPagedMemGPUConnectorV2, VLLMPagedMemLayerwiseGPUConnector, VLLMBufferLayerwiseGPUConnector):
        conn = cls(SPEC.hidden, SPEC.num_layers)
        assert conn.dtype is None and conn.device.type == ("cuda" if torch.cuda.is_available() else "cpu")
        cls(SPEC.hidden, SPEC.num_layers, False)  # LMCache's use_gpu positional
    VLLMBufferLayerwiseGPUConnector(SPEC.hidden, SPEC.num_layers, use_gpu=True, use_double_buffer=False)
    with pytest.raises(TypeError, match="dtype"):
        VLLMPagedMemGPUConnectorV2(SPEC.hidden, SPEC.num_layers, dtype="float16")


def test_connector_without_dtype_adopts_the_kv_dtype() -> None:
    from lmcache.v1.gpu_connector import VLLMPagedMemGPUConnectorV2

    cfg = LMCacheEngineConfig.from_defaults(chunk_size=16, max_local_cpu_size=0.01)
    conn = VLLMPagedMemGPUConnectorV2(SPEC.hidden, SPEC.num_layers, chunk_size=16)
    engine = LMCacheEngine(cfg, make_metadata(SPEC, 16), conn)
    try:
        kv = random_kv_caches(SPEC, seed=9)
        slots = random_slot_mapping(SPEC, 32, seed=9)
        assert engine.store(list(range(32)), kvcaches=kv, slot_mapping=slots) == 32
        assert conn.dtype == SPEC.dtype
        out = [torch.zeros_like(t) for t in kv]
        assert bool(engine.retrieve(list(range(32)), kvcaches=out, slot_mapping=slots).all())
        with pytest.raises(ValueError, match="dtype"):
            engine.store(list(range(100, 132)), kvcaches=[t.half() for t in kv], slot_mapping=slots)
    finally:
        engine.close()


# ------------------------------------------------------------------ docs: every LMCache key listed
def test_migration_doc_lists_every_lmcache_key_with_its_status() -> None:
    rows = dict(re.findall(r"^\| `([a-z0-9_]+)` \| [^|]+ \| ([a-z ]+) \|", DOC.read_text(), re.M))
    expected = {k.name: {SUPPORTED: "supported", RENAMED: "renamed"}.get(k.status, "not supported")
                for k in LMCACHE_056_KEYS}
    assert rows == expected
    assert len(expected) == 108  # LMCache 0.5.6's _CONFIG_DEFINITIONS
    aliases = dict(re.findall(r"^\| `([a-z0-9_]+)` \| `([a-z0-9_]+)` \|$", DOC.read_text(), re.M))
    assert aliases == LMCACHE_056_ALIASES
    supported_here = {k.name for k in LMCACHE_056_KEYS if k.status == SUPPORTED}
    from lmcache.v1.config import config_keys

    assert supported_here <= set(config_keys())
    for k in LMCACHE_056_KEYS:
        if k.status == RENAMED:
            assert k.note in config_keys()


def test_gib_constant_matches() -> None:
    assert GiB == 1 << 30
