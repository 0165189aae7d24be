"""LMCacheECConnector / LMCacheECConnectorImpl against real storage (CPU pool, disk in a temp dir)."""

from __future__ import annotations

import logging
import os
import pickle
from types import SimpleNamespace

import pytest

pytest.importorskip("vllm")

import torch  # noqa: E402
from vllm.config import ECTransferConfig  # noqa: E402
from vllm.distributed.ec_transfer.ec_connector.base import ECConnectorRole  # noqa: E402
from vllm.distributed.ec_transfer.ec_connector.factory import ECConnectorFactory  # noqa: E402
from vllm.multimodal.inputs import MultiModalFeatureSpec, PlaceholderRange  # noqa: E402
from vllm.sampling_params import SamplingParams  # noqa: E402
from vllm.v1.request import Request  # noqa: E402

from lmcache.integration.vllm import vllm_ec_adapter  # noqa: E402
from lmcache.integration.vllm.vllm_ec_adapter import (  # noqa: E402
    ECLoadItem,
    LMCacheECConnector,
    LMCacheECConnectorImpl,
    LMCacheECConnectorMetadata,
    ec_connector_stats,
)


from lmcache.v1.config import load_ec_engine_config  # noqa: E402
from lmcache.v1.ec_engine import ECCacheEngine  # noqa: E402

MODULE = "lmcache.integration.vllm.vllm_ec_adapter"
SCHED, WORKER = ECConnectorRole.SCHEDULER, ECConnectorRole.WORKER


@pytest.fixture(autouse=True)
def ec_env(monkeypatch):
    for name in list(os.environ):
        if name.startswith("LMCACHE_"):
            monkeypatch.delenv(name)
    monkeypatch.setenv("LMCACHE_EC_MAX_LOCAL_CPU_SIZE", str(16 / 1024))  # 16 MiB pool
    yield
    vllm_ec_adapter.close_all_ec_engines()  # no engine outlives a test


def vllm_config(model="test/tiny-vlm", dtype=torch.float32, ec_role="ec_both", processor_cache_gb=4.0, prefix=True):
    """The parts of a VllmConfig the connector reads, with a real ECTransferConfig."""
    return SimpleNamespace(
        model_config=SimpleNamespace(
            model=model, dtype=dtype, multimodal_config=SimpleNamespace(mm_processor_cache_gb=processor_cache_gb)
        ),
        cache_config=SimpleNamespace(enable_prefix_caching=prefix),
        device_config=SimpleNamespace(device=torch.device("cpu"), device_type="cpu"),
        ec_transfer_config=ECTransferConfig(
            ec_connector="LMCacheECConnector", ec_role=ec_role, ec_connector_module_path=MODULE
        ),
    )


def request_with_items(*mm_hashes: str, tokens: int = 4) -> Request:
    features = [
        MultiModalFeatureSpec(
            data=None,
            modality="image",
            identifier=h,
            mm_position=PlaceholderRange(offset=1 + i * tokens, length=tokens),
        )
        for i, h in enumerate(mm_hashes)
    ]
    prompt = list(range(1 + tokens * len(mm_hashes) + 2))
    return Request("req-0", prompt, SamplingParams(max_tokens=1), None, mm_features=features)


def load(worker: LMCacheECConnector, meta, encoder_cache: dict) -> dict:
    worker.bind_connector_metadata(meta)
    try:
        worker.start_load_caches(encoder_cache)
    finally:
        worker.clear_connector_metadata()
    return encoder_cache


def plan(scheduler: LMCacheECConnector, request: Request) -> LMCacheECConnectorMetadata:
    """What vLLM's scheduler does for a request whose items are all newly allocated."""
    for i, feature in enumerate(request.mm_features):
        scheduler.has_cache_item(feature.identifier)
        scheduler.update_state_after_alloc(request, i)
    return scheduler.build_connector_meta(None)


# ----------------------------------------------------------------------------- loading
def test_factory_loads_the_connector_by_module_path():
    conn = ECConnectorFactory.create_connector(vllm_config(), WORKER)
    try:
        assert isinstance(conn, LMCacheECConnector)
        assert isinstance(conn.impl, LMCacheECConnectorImpl)
        assert conn.is_producer and conn.is_consumer
    finally:
        conn.shutdown()


# ----------------------------------------------------------------------------- round trips
def test_save_contains_load_round_trip_in_one_process():
    cfg = vllm_config()
    scheduler, worker = LMCacheECConnector(cfg, SCHED), LMCacheECConnector(cfg, WORKER)
    try:
        out = torch.randn(4, 32)
        worker.save_caches({"img-a": out}, "img-a")
        assert scheduler.has_cache_item("img-a")
        assert not scheduler.has_cache_item("img-b")

        meta = plan(scheduler, request_with_items("img-a", "img-b"))
        assert [(i.mm_hash, i.num_embeds) for i in meta.mm_datas] == [("img-a", 4)]
        assert scheduler.build_connector_meta(None).mm_datas == []  # drained

        cache = load(worker, meta, {})
        assert set(cache) == {"img-a"}
        assert torch.equal(cache["img-a"], out)
        cache["img-a"].zero_()  # vLLM owns what it gets: the cache is unaffected
        assert torch.equal(load(worker, meta, {})["img-a"], out)
    finally:
        scheduler.shutdown()
        worker.shutdown()


def test_round_trip_through_disk_into_a_fresh_engine(tmp_path, monkeypatch):
    monkeypatch.setenv("LMCACHE_EC_LOCAL_DISK", str(tmp_path))
    monkeypatch.setenv("LMCACHE_EC_MAX_LOCAL_DISK_SIZE", "0.0625")
    cfg = vllm_config(dtype=torch.bfloat16)
    out = torch.randn(6, 16)

    first = LMCacheECConnector(cfg, WORKER)
    first.save_caches({"photo": out}, "photo")
    first.shutdown()  # last user: pending disk writes finish, the CPU pool is gone
    assert any(tmp_path.rglob("*")), "the disk tier wrote nothing"

    before = ec_connector_stats()
    scheduler, worker = LMCacheECConnector(cfg, SCHED), LMCacheECConnector(cfg, WORKER)
    try:
        assert scheduler.engine is not first.engine
        assert scheduler.has_cache_item("photo")
        cache = load(worker, plan(scheduler, request_with_items("photo", tokens=6)), {})
        assert cache["photo"].dtype == torch.bfloat16  # the encoder dtype from model_config
        assert torch.equal(cache["photo"], out.to(torch.bfloat16))
        after = ec_connector_stats()
        assert after["hits"] - before["hits"] == 1 and after["puts"] == before["puts"]
    finally:
        scheduler.shutdown()
        worker.shutdown()


def test_remote_tier_is_seen_live_by_another_engine(redis_server, monkeypatch):
    monkeypatch.setenv("LMCACHE_EC_REMOTE_URL", redis_server.url)
    cfg = vllm_config()
    scheduler, worker = LMCacheECConnector(cfg, SCHED), LMCacheECConnector(cfg, WORKER)
    # another process's engine, writing to the same server while this one runs
    other = ECCacheEngine(load_ec_engine_config(), "test/tiny-vlm", torch.float32)
    try:
        out = torch.randn(3, 8)
        assert not scheduler.has_cache_item("remote-img")
        assert other.put("remote-img", out) and other.flush(timeout=30)
        assert scheduler.has_cache_item("remote-img")
        cache = load(worker, plan(scheduler, request_with_items("remote-img", tokens=3)), {})
        assert torch.equal(cache["remote-img"], out)
    finally:
        other.close()
        scheduler.shutdown()
        worker.shutdown()


def test_roles_of_one_process_share_one_engine_until_both_shut_down():
    cfg = vllm_config()
    scheduler, worker = LMCacheECConnector(cfg, SCHED), LMCacheECConnector(cfg, WORKER)
    engine = worker.engine
    assert scheduler.engine is engine
    other_model = LMCacheECConnector(vllm_config(model="other"), WORKER)
    assert other_model.engine is not engine
    other_model.shutdown()
    worker.save_caches({"x": torch.ones(2, 2)}, "x")
    worker.shutdown()
    assert scheduler.has_cache_item("x")  # still open: the scheduler uses it
    scheduler.shutdown()
    scheduler.shutdown()  # idempotent
    assert engine.storage_manager.closed


# ----------------------------------------------------------------------------- roles and edge cases
def test_consumer_only_does_not_save_and_producer_only_does_not_load():
    consumer = LMCacheECConnector(vllm_config(ec_role="ec_consumer"), WORKER)
    producer_sched = LMCacheECConnector(vllm_config(ec_role="ec_producer"), SCHED)
    try:
        consumer.save_caches({"c": torch.ones(1, 1)}, "c")
        assert not consumer.engine.contains("c")
        consumer.engine.put("c", torch.ones(1, 1))  # cached by someone else
        assert producer_sched.has_cache_item("c")
        assert plan(producer_sched, request_with_items("c")).mm_datas == []
    finally:
        consumer.shutdown()
        producer_sched.shutdown()


def test_items_already_in_vllm_cache_are_not_reloaded():
    cfg = vllm_config()
    worker = LMCacheECConnector(cfg, WORKER)
    try:
        worker.save_caches({"k": torch.ones(2, 3)}, "k")
        existing = torch.zeros(2, 3)
        cache = load(worker, LMCacheECConnectorMetadata([ECLoadItem("k", 2)]), {"k": existing})
        assert cache["k"] is existing
    finally:
        worker.shutdown()


def test_planned_item_that_vanished_is_a_logged_miss(caplog):
    worker = LMCacheECConnector(vllm_config(), WORKER)
    try:
        before = ec_connector_stats()["misses"]
        with caplog.at_level(logging.WARNING, logger=MODULE):
            cache = load(worker, LMCacheECConnectorMetadata([ECLoadItem("gone", 3)]), {})
        assert cache == {}
        assert ec_connector_stats()["misses"] == before + 1
        assert any("gone" in r.getMessage() for r in caplog.records)
    finally:
        worker.shutdown()


def test_hit_reported_to_the_scheduler_is_planned_even_if_evicted_before_alloc():
    cfg = vllm_config()
    scheduler = LMCacheECConnector(cfg, SCHED)
    try:
        engine = scheduler.engine
        engine.put("e", torch.ones(4, 4))
        assert scheduler.has_cache_item("e")  # vLLM now skips the encoder for "e"
        engine.storage_manager.remove(engine.key("e"))
        scheduler.update_state_after_alloc(request_with_items("e"), 0)
        assert [i.mm_hash for i in scheduler.build_connector_meta(None).mm_datas] == ["e"]
    finally:
        scheduler.shutdown()


def test_non_tensor_encoder_output_is_skipped_with_one_warning(caplog):
    worker = LMCacheECConnector(vllm_config(), WORKER)
    try:
        with caplog.at_level(logging.WARNING, logger=MODULE):
            worker.save_caches({"t": (torch.ones(1),)}, "t")
            worker.save_caches({"u": None}, "u")
        assert not worker.engine.contains("t")
        assert sum("not a tensor" in r.getMessage() for r in caplog.records) == 1
    finally:
        worker.shutdown()


def test_wrong_metadata_type_is_rejected():
    worker = LMCacheECConnector(vllm_config(), WORKER)
    try:
        worker.bind_connector_metadata(SimpleNamespace(mm_datas=[]))
        with pytest.raises(TypeError, match="LMCacheECConnectorMetadata"):
            worker.start_load_caches({})
    finally:
        worker.clear_connector_metadata()
        worker.shutdown()


def test_request_scoped_identifiers_are_never_cached_when_vllm_does_not_hash_content():
    # With both vLLM caches off, items are named by a per-process request counter: the
    # same name means different images in different processes, so they must not be cached.
    cfg = vllm_config(processor_cache_gb=0, prefix=False)
    scheduler, worker = LMCacheECConnector(cfg, SCHED), LMCacheECConnector(cfg, WORKER)
    try:
        counter_id, user_uuid = "renderer0-mm-1-image-0", "customer-uuid-42"
        worker.save_caches({counter_id: torch.ones(2, 2), user_uuid: torch.ones(2, 2)}, counter_id)
        worker.save_caches({counter_id: torch.ones(2, 2), user_uuid: torch.ones(2, 2)}, user_uuid)
        engine = worker.engine
        assert not engine.contains(counter_id) and engine.contains(user_uuid)
        engine.put(counter_id, torch.ones(2, 2))  # e.g. left on disk by an older process
        assert not scheduler.has_cache_item(counter_id)
        assert scheduler.has_cache_item(user_uuid)
        assert [i.mm_hash for i in plan(scheduler, request_with_items(counter_id, user_uuid)).mm_datas] == [user_uuid]
    finally:
        scheduler.shutdown()
        worker.shutdown()
    hashed = LMCacheECConnector(vllm_config(processor_cache_gb=0, prefix=True), SCHED)
    try:
        hashed.engine.put("renderer0-mm-1-image-0", torch.ones(1, 1))
        assert hashed.has_cache_item("renderer0-mm-1-image-0")  # content hashes: any name is fine
    finally:
        hashed.shutdown()


def test_metadata_pickles_for_multiprocess_executors():
    meta = LMCacheECConnectorMetadata([ECLoadItem("a", 3), ECLoadItem("b", 5)])
    again = pickle.loads(pickle.dumps(meta))
    assert [(i.mm_hash, i.num_embeds) for i in again.mm_datas] == [("a", 3), ("b", 5)]
