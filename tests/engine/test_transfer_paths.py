"""The engine's transfer path, the connector protocol and factory, the shared registry, the error root."""

from __future__ import annotations

import dataclasses
import threading

import pytest
import torch

import lmcache.utils
from lmcache.errors import LMCacheError
from lmcache.integration.vllm.lookup_service import ProtocolError
from lmcache.v1 import keys
from lmcache.v1.cache_engine import LMCacheEngine, LMCacheEngineBuilder
from lmcache.v1.config import ConfigError, LMCacheEngineConfig
from lmcache.v1.gpu_connector.factory import create_gpu_connector
from lmcache.v1.gpu_connector.layerwise import VLLMBufferLayerwiseGPUConnector, VLLMPagedMemLayerwiseGPUConnector
from lmcache.v1.gpu_connector.protocol import KVConnector
from lmcache.v1.layerwise import LayerwiseTransfer
from lmcache.v1.private_files import UnsafePathError
from lmcache.v1.registry import Registry
from lmcache.v1.testing import (
    KVSpec,
    make_connector,
    make_engine,
    make_metadata,
    random_kv_caches,
    random_slot_mapping,
)
from lmcache.v1.transfer import BulkTransfer

CHUNK = 16


def config(**over) -> LMCacheEngineConfig:
    return LMCacheEngineConfig.from_dict({"chunk_size": CHUNK, "max_local_cpu_size": 0.0625, **over})


@pytest.mark.parametrize("layerwise, path", [(False, BulkTransfer), (True, LayerwiseTransfer)])
def test_the_engine_picks_its_transfer_path_once_from_the_config(layerwise, path):
    spec = KVSpec(num_layers=2)
    engine = make_engine(spec, config(use_layerwise=layerwise))
    try:
        assert type(engine.transfer) is path
        kv = random_kv_caches(spec)
        slots = random_slot_mapping(spec, 2 * CHUNK)
        tokens = list(range(2 * CHUNK))
        assert engine.store(tokens, kvcaches=kv, slot_mapping=slots) == 2 * CHUNK
        assert engine.lookup(tokens) == 2 * CHUNK
        out = [torch.zeros_like(t) for t in kv]
        assert bool(engine.retrieve(tokens, kvcaches=out, slot_mapping=slots).all())
        assert type(engine.transfer) is path  # unchanged by the calls
    finally:
        engine.close()


def test_the_transfer_context_is_complete_when_built_and_a_connector_attaches_through_a_new_one():
    """The context (block reuse included) never changes once built; attaching a connector
    to an engine built without one gives a new context and path sharing the same parts."""
    spec = KVSpec(num_layers=2, block_size=4)
    cfg = config()
    engine = LMCacheEngine(cfg, make_metadata(spec, CHUNK, "test-model", block_size=4), None)
    try:
        ctx = engine._ctx
        assert ctx.blocks is not None and ctx.connector is None
        with pytest.raises(dataclasses.FrozenInstanceError):
            ctx.connector = make_connector(spec, CHUNK, "cpu", layerwise=False)  # type: ignore[misc]
        engine.gpu_connector = make_connector(spec, CHUNK, "cpu", layerwise=False)
        new = engine._ctx
        assert new is not ctx and new.connector is engine.gpu_connector and ctx.connector is None
        assert new.blocks is ctx.blocks and new.latency is engine.latency and new.stats is engine.stats
        assert type(engine.transfer) is BulkTransfer and engine.transfer.ctx is new
        kv = random_kv_caches(spec)
        tokens = list(range(2 * CHUNK + 6))
        assert engine.store(tokens, kvcaches=kv, slot_mapping=random_slot_mapping(spec, len(tokens))) == 2 * CHUNK + 4
        assert engine.lookup(tokens[: CHUNK + 8] + [1, 2]) == CHUNK + 8  # block reuse through the new context
    finally:
        engine.close()


@pytest.mark.parametrize("use_layerwise", [False, True])
def test_every_connector_satisfies_the_one_protocol(use_layerwise):
    conn = create_gpu_connector(config(use_layerwise=use_layerwise), 16, 2, dtype=torch.float16, device="cpu")
    assert isinstance(conn, KVConnector)
    assert conn.get_shape(CHUNK)[2] == CHUNK and conn.num_layers == 2


@pytest.mark.parametrize(
    "value, cls",
    [
        ("false", VLLMPagedMemLayerwiseGPUConnector),
        ("off", VLLMPagedMemLayerwiseGPUConnector),
        (0, VLLMPagedMemLayerwiseGPUConnector),
        ("true", VLLMBufferLayerwiseGPUConnector),
        ("1", VLLMBufferLayerwiseGPUConnector),
    ],
)
def test_connector_flags_in_extra_config_are_read_as_booleans(value, cls):
    cfg = config(use_layerwise=True, extra_config={"use_gpu": value})
    assert type(create_gpu_connector(cfg, 16, 2, dtype=torch.float16, device="cpu")) is cls


def test_builder_attaches_a_connector_to_an_engine_built_without_one():
    spec = KVSpec(num_layers=2)
    cfg = config()
    md = make_metadata(spec, CHUNK)
    try:
        engine = LMCacheEngineBuilder.get_or_create("h12a-attach", cfg, md, None)
        assert engine.gpu_connector is None
        conn = create_gpu_connector(cfg, spec.hidden, 2, dtype=spec.dtype, device="cpu")
        assert LMCacheEngineBuilder.get_or_create("h12a-attach", cfg, md, conn) is engine
        assert engine.gpu_connector is conn
        with pytest.raises(ValueError, match="chunk_size"):
            LMCacheEngineBuilder.get_or_create("h12a-attach", config(chunk_size=32), md, conn)
    finally:
        LMCacheEngineBuilder.destroy("h12a-attach")
    assert LMCacheEngineBuilder.get("h12a-attach") is None and engine.closed


def test_registry_counts_users_and_creates_once_under_threads():
    reg: Registry[str, object] = Registry()
    made: list[object] = []

    def create() -> object:
        made.append(object())
        return made[-1]

    barrier = threading.Barrier(8)
    got: list[object] = []

    def user() -> None:
        barrier.wait()
        got.append(reg.get_or_create("k", create, acquire=True))

    threads = [threading.Thread(target=user) for _ in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(made) == 1 and all(v is made[0] for v in got)
    assert [reg.release(made[0]) for _ in range(8)] == [False] * 7 + [True]
    assert reg.get("k") is None and reg.release(made[0]) is False


def test_registry_reuse_may_refuse_and_changes_nothing():
    reg: Registry[str, int] = Registry()
    assert reg.get_or_create("a", lambda: 1) == 1

    def refuse(value: int) -> None:
        raise ValueError("different")

    with pytest.raises(ValueError, match="different"):
        reg.get_or_create("a", lambda: 2, reuse=refuse)
    assert reg.values() == [1] and reg.pop("a") == 1 and reg.clear() == []


def test_errors_share_one_root_and_keep_their_standard_types():
    assert issubclass(ConfigError, LMCacheError) and issubclass(ConfigError, ValueError)
    assert issubclass(ProtocolError, LMCacheError) and issubclass(ProtocolError, ConnectionError)
    assert issubclass(UnsafePathError, LMCacheError) and issubclass(UnsafePathError, PermissionError)


def test_keys_live_in_v1_keys_and_stay_importable_from_lmcache_utils():
    assert lmcache.utils.CacheEngineKey is keys.CacheEngineKey
    assert lmcache.utils.LayerCacheEngineKey is keys.LayerCacheEngineKey
    assert lmcache.utils.parse_cache_key is keys.parse_cache_key


def test_a_bulk_engine_with_a_layerwise_connector_refuses_copies_before_touching_storage():
    spec = KVSpec(num_layers=2)
    engine = make_engine(spec, config(use_layerwise=False))
    try:
        engine.gpu_connector = create_gpu_connector(
            config(use_layerwise=True), spec.hidden, 2, dtype=spec.dtype, device="cpu"
        )
        kv = random_kv_caches(spec)
        slots = random_slot_mapping(spec, CHUNK)
        with pytest.raises(ValueError, match="bulk connector"):
            engine.store(list(range(CHUNK)), kvcaches=kv, slot_mapping=slots)
        with pytest.raises(ValueError, match="bulk connector"):
            engine.retrieve(list(range(CHUNK)), kvcaches=kv, slot_mapping=slots)
        assert engine.storage_manager.allocator.used_bytes == 0
    finally:
        engine.close()
