"""Logs, per-tier stats, metric payloads and sinks, the summary line, fail-fast config errors,
``model_namespace`` (docs/observability.md). Real engines and tiers; vLLM is faked only where
the adapter is driven without a model (tests/vllm_adapter/test_vllm_connector_unit.py's MiniVLLM)."""

from __future__ import annotations

import logging
import os
import subprocess
import sys
import threading
from pathlib import Path

import pytest
from prometheus_client import CollectorRegistry

from lmcache.integration.vllm import utils as vutils
from lmcache.integration.vllm.metadata_builder import build_engine_metadata, settings_from_vllm
from lmcache.integration.vllm.vllm_v1_adapter import LMCacheConnectorV1Impl
from lmcache.observability.logs import effective_config, startup_line
from lmcache.observability.metrics import PromSink, StatsDelta, merge_payloads, summarize_payload
from lmcache.observability.snapshot import PER_REQUEST_KEYS, engine_snapshot, merge_rank_snapshots
from lmcache.observability.summary import SummaryLogger
from lmcache.v1.config import ConfigError, LMCacheEngineConfig
from lmcache.v1.testing import KVSpec, make_engine, random_kv_caches, random_slot_mapping
from lmcache.v1.token_database import ChunkedTokenDatabase
from tests.vllm_adapter.test_vllm_connector_unit import FakeModelConfig, FakeRequest, MiniVLLM, fake_vllm_config, prompt

REPO = Path(__file__).resolve().parents[2]
SPEC = KVSpec(num_layers=2, num_heads=2, head_size=8, num_blocks=64, block_size=16)
CHUNK = 16
TOKENS = 4 * CHUNK


@pytest.fixture(autouse=True)
def _hermetic_env(monkeypatch):
    for name in list(os.environ):
        if name.startswith("LMCACHE_"):
            monkeypatch.delenv(name)


def engine_with(**config):
    cfg = LMCacheEngineConfig.from_dict({"chunk_size": CHUNK, "max_local_cpu_size": 0.05, **config})
    return make_engine(SPEC, cfg)


def store_and_slots(engine, tokens=None, seed=0):
    tokens = tokens or list(range(TOKENS))
    kv = random_kv_caches(SPEC, seed=seed)
    engine.store(tokens, kvcaches=kv, slot_mapping=random_slot_mapping(SPEC, len(tokens)))
    return tokens, kv


# ------------------------------------------------------------------------ logging
def _run_python(code: str, **env: str) -> subprocess.CompletedProcess:
    full = {k: v for k, v in os.environ.items() if not k.startswith("LMCACHE_")}
    full.update(env, PYTHONPATH=os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")])))
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=full, timeout=120)


def test_lmcache_lines_are_visible_and_prefixed_without_host_logging():
    res = _run_python(
        "import logging, lmcache\n"
        "logging.getLogger('lmcache.x').info('hello %d', 1)\n"
        "logging.getLogger('lmcache.x').debug('quiet')\n"
        "logging.getLogger('lmcache.x').warning('careful')\n"
    )
    lines = res.stderr.strip().splitlines()
    assert len(lines) == 2
    assert lines[0].startswith("[lmcache] INFO") and lines[0].endswith("hello 1")
    assert lines[1].startswith("[lmcache] WARNING") and lines[1].endswith("careful")


def test_log_level_from_env_and_bad_value():
    res = _run_python("import logging, lmcache\nlogging.getLogger('lmcache.x').debug('shown')\n", LMCACHE_LOG_LEVEL="debug")
    assert "[lmcache] DEBUG" in res.stderr and "shown" in res.stderr
    res = _run_python("import logging, lmcache\nlogging.getLogger('lmcache.x').info('x')\n", LMCACHE_LOG_LEVEL="loud")
    assert "LMCACHE_LOG_LEVEL='loud'" in res.stderr and "[lmcache] INFO" in res.stderr


def test_host_configured_logging_wins_and_nothing_is_printed_twice():
    res = _run_python(
        "import logging, lmcache\n"
        "logging.basicConfig(format='HOST %(name)s %(message)s')\n"
        "logging.getLogger('lmcache.x').warning('once')\n"
    )
    assert res.stderr.strip().splitlines() == ["HOST lmcache.x once"]
    res = _run_python(
        "import logging, sys\n"
        "h = logging.StreamHandler(sys.stderr); h.setFormatter(logging.Formatter('MINE %(message)s'))\n"
        "logging.getLogger('lmcache').addHandler(h)\n"
        "import lmcache\n"
        "logging.getLogger('lmcache.x').warning('once')\n"
    )
    assert res.stderr.strip().splitlines() == ["MINE once"]


def test_startup_line_and_effective_config_mask_secrets():
    cfg = LMCacheEngineConfig.from_dict(
        {"remote_url": "redis://u:hunter2@h:6379", "remote_password": "s3cret", "extra_config": {"tls_password": "x"}}
    )
    line = startup_line(cfg, who="worker rank 0", model_namespace="m")
    assert "hunter2" not in line and "remote redis://u:***@h:6379" in line and "chunk_size=256" in line
    shown = effective_config(cfg)
    assert shown["remote_password"] == "***" and shown["extra_config"] == {"tls_password": "***"}
    assert "hunter2" not in repr(shown) and "s3cret" not in repr(shown)


# ------------------------------------------------------------------------ hits when loaded, by tier
def test_cpu_hits_count_written_tokens_only():
    engine = engine_with()
    try:
        tokens, kv = store_and_slots(engine)
        slots = random_slot_mapping(SPEC, TOKENS, seed=1)
        slots[-1] = -1  # the caller recomputes the last token: not loaded
        ret = engine.retrieve(tokens, kvcaches=kv, slot_mapping=slots)
        snap = engine_snapshot(engine)
        assert int(ret.sum()) == TOKENS - 1 and snap["hit_tokens"] == TOKENS  # chunks loaded, one token unwritten
        assert snap["hit_tokens_cpu"] == TOKENS - 1 and snap["hit_tokens_disk"] == snap["hit_tokens_remote"] == 0
        assert snap["hit_bytes_cpu"] == snap["stored_bytes"] > 0
        assert snap["retrieve_seconds_count"] == 1 and snap["store_seconds_count"] == 1
    finally:
        engine.close()


def test_disk_hits_are_attributed_to_the_disk_tier(tmp_path):
    engine = engine_with(local_disk=str(tmp_path), max_local_disk_size=0.01)
    try:
        tokens, kv = store_and_slots(engine)
        assert engine.storage_manager.flush(30)
        for key in engine.keys(tokens)[2:]:
            engine.storage_manager.local_cpu.remove(key)  # chunks 2, 3 only on disk now
        engine.retrieve(tokens, kvcaches=kv, slot_mapping=random_slot_mapping(SPEC, TOKENS, seed=1))
        snap = engine_snapshot(engine)
        assert (snap["hit_tokens_cpu"], snap["hit_tokens_disk"]) == (2 * CHUNK, 2 * CHUNK)
        assert snap["disk_hits"] == 2 and snap["pool_used_bytes_disk"] > 0
        assert snap["pool_capacity_bytes_disk"] == int(0.01 * (1 << 30))
    finally:
        engine.close()


def test_a_failed_load_is_a_miss(monkeypatch):
    engine = engine_with()
    try:
        tokens, kv = store_and_slots(engine)

        def broken(*a, **k):
            raise RuntimeError("copy failed")

        monkeypatch.setattr(engine.gpu_connector, "batched_to_gpu", broken)
        with pytest.raises(RuntimeError):
            engine.retrieve(tokens, kvcaches=kv, slot_mapping=random_slot_mapping(SPEC, TOKENS, seed=1))
        snap = engine_snapshot(engine)
        assert snap["hit_tokens_cpu"] == 0 and snap["hit_bytes_cpu"] == 0
        assert engine.lookup(tokens) == TOKENS and engine_snapshot(engine)["lookup_hit_tokens"] == TOKENS
    finally:
        engine.close()


def test_layerwise_hits_are_counted_by_tier():
    engine = engine_with(use_layerwise=True)
    try:
        tokens, kv = store_and_slots(engine)
        engine.retrieve(tokens, kvcaches=kv, slot_mapping=random_slot_mapping(SPEC, TOKENS, seed=1))
        assert engine_snapshot(engine)["hit_tokens_cpu"] == TOKENS
    finally:
        engine.close()


# ------------------------------------------------------------------------ payloads and sinks
def _sample(registry: CollectorRegistry, name: str, **labels: str) -> float:
    return registry.get_sample_value(name, {"model_name": "m", "engine": "0", **labels}) or 0.0


def test_payloads_reproduce_the_snapshot_in_prometheus(tmp_path):
    engine = engine_with(local_disk=str(tmp_path), max_local_disk_size=0.01)
    try:
        delta = StatsDelta(lambda: engine_snapshot(engine), rank=0, latency=engine.latency)
        registry = CollectorRegistry()
        sink = PromSink({}, ["model_name", "engine"], {0: ["m", "0"]}, registry=registry)
        assert _sample(registry, "lmcache_hit_tokens_total", tier="cpu") == 0  # series exist before traffic
        tokens, kv = store_and_slots(engine)
        assert engine.storage_manager.flush(30)
        sink.observe(delta.collect())
        engine.retrieve(tokens, kvcaches=kv, slot_mapping=random_slot_mapping(SPEC, TOKENS, seed=1))
        engine.lookup(tokens)
        sink.observe(delta.collect())
        assert delta.collect() is None  # nothing changed since
        snap = engine_snapshot(engine)
        assert _sample(registry, "lmcache_hit_tokens_total", tier="cpu") == snap["hit_tokens_cpu"] == TOKENS
        assert _sample(registry, "lmcache_stored_tokens_total") == snap["stored_tokens"]
        assert _sample(registry, "lmcache_stored_bytes_total", tier="disk") == snap["disk_bytes_written"] > 0
        assert _sample(registry, "lmcache_pool_used_bytes", tier="cpu") == snap["pool_used_bytes_cpu"]
        assert _sample(registry, "lmcache_pool_capacity_bytes", tier="disk") == snap["pool_capacity_bytes_disk"]
        assert _sample(registry, "lmcache_lookup_requests_total") == 1
        assert _sample(registry, "lmcache_retrieve_seconds_count") == 1
        assert _sample(registry, "lmcache_store_seconds_count") == 1
    finally:
        engine.close()


def test_ranks_merge_without_double_counting_tokens():
    r0 = {"hit_tokens_cpu": 64, "hit_bytes_cpu": 1000, "pool_used_bytes_cpu": 10, "lookup_requests": 1}
    r1 = {"hit_tokens_cpu": 64, "hit_bytes_cpu": 1000, "pool_used_bytes_cpu": 12, "lookup_requests": 1}
    merged = merge_rank_snapshots([r0, r1])
    assert merged == {"hit_tokens_cpu": 64, "hit_bytes_cpu": 2000, "pool_used_bytes_cpu": 22, "lookup_requests": 1}
    payloads = [StatsDelta(lambda s=s: s, rank=rank).collect() for rank, s in enumerate((r0, r1))]
    assert not PER_REQUEST_KEYS & set(payloads[1]["c"])
    combined = merge_payloads(payloads[0], payloads[1])
    registry = CollectorRegistry()
    sink = PromSink({}, ["model_name", "engine"], {0: ["m", "0"]}, registry=registry)
    sink.observe(combined)
    sink.observe(merge_payloads({}, {"g": {"pool_used_bytes_cpu@r1": 20}}))  # a later update of rank 1 only
    assert _sample(registry, "lmcache_hit_tokens_total", tier="cpu") == 64
    assert _sample(registry, "lmcache_loaded_bytes_total", tier="cpu") == 2000
    assert _sample(registry, "lmcache_pool_used_bytes", tier="cpu") == 30
    assert summarize_payload(combined)["lmcache_hit_tokens"] == 64


def test_vllm_connector_stats_container_and_prom_metrics():
    pytest.importorskip("vllm")
    from prometheus_client import REGISTRY, Counter, Gauge, Histogram

    from lmcache.integration.vllm.lmcache_connector_v1 import LMCacheConnectorV1Dynamic

    a = LMCacheConnectorV1Dynamic.build_kv_connector_stats({"c": {"hit_tokens_cpu": 32}, "g": {}, "h": {}})
    b = LMCacheConnectorV1Dynamic.build_kv_connector_stats({"c": {"hit_tokens_cpu": 16}, "g": {}, "h": {"lookup": [0.1]}})
    assert LMCacheConnectorV1Dynamic.build_kv_connector_stats(None).is_empty()
    merged = a.aggregate(b)
    assert merged.data["c"]["hit_tokens_cpu"] == 48 and not merged.is_empty()
    assert merged.reduce()["lmcache_hit_tokens"] == 48
    prom = LMCacheConnectorV1Dynamic.build_prom_metrics(
        fake_vllm_config(), {Counter: Counter, Gauge: Gauge, Histogram: Histogram}, ["model_name", "engine"], {0: ["m", "0"]}
    )
    try:
        prom.observe(merged.to_dict(), 0)
        assert REGISTRY.get_sample_value("lmcache_hit_tokens_total", {"model_name": "m", "engine": "0", "tier": "cpu"}) == 48
    finally:
        from lmcache.observability.metrics import _unregister_lmcache_metrics

        _unregister_lmcache_metrics()


# ------------------------------------------------------------------------ adapter
@pytest.fixture
def mini(tmp_path):
    m = MiniVLLM(fake_vllm_config(tmp=str(tmp_path)))
    yield m
    m.close()


def test_worker_payloads_sum_to_collect_stats_and_hits_match_external_tokens(mini):
    payloads = []
    base = prompt(80, 21)
    mini.serve(FakeRequest("a", base))
    payloads.append(mini.worker.get_kv_connector_stats())
    rb = mini.serve(FakeRequest("b", list(base)))
    payloads.append(mini.worker.get_kv_connector_stats())
    assert mini.worker.get_kv_connector_stats() is None
    total = merge_payloads(payloads[0], payloads[1])
    stats = vutils.collect_stats(mini.config.kv_transfer_config.engine_id)
    assert rb["external"] == 79  # all but the last token came from lmcache
    assert stats["hit_tokens_cpu"] == total["c"]["hit_tokens_cpu"] == rb["external"]
    assert stats["stored_tokens"] == total["c"]["stored_tokens"]
    assert stats["lookup_requests"] == total["c"]["lookup_requests"] == 2


def test_hidden_state_hits_and_misses_in_the_snapshot():
    import torch

    engine = engine_with(enable_hidden_state_cache=True)
    try:
        tokens, _ = store_and_slots(engine)
        hs = engine.hidden_state_store
        assert hs.store_hidden_states(tokens, torch.ones(TOKENS, 8)) == TOKENS // CHUNK
        assert hs.retrieve_hidden_states(tokens) is not None
        assert hs.retrieve_hidden_states([t + 1000 for t in tokens]) is None  # nothing cached
        snap = engine_snapshot(engine)
        assert (snap["hidden_retrieve_requests"], snap["hidden_hit_tokens"], snap["hidden_misses"]) == (2, TOKENS, 1)
    finally:
        engine.close()


def test_encoder_cache_counters_reach_the_worker_payload_and_prometheus(mini):
    import torch

    from lmcache.integration.vllm.vllm_ec_adapter import acquire_ec_engine, release_ec_engine

    mini.worker.get_kv_connector_stats()  # drain what earlier traffic left
    engine = acquire_ec_engine(LMCacheEngineConfig.from_dict({"max_local_cpu_size": 0.01}), "ec-metrics", torch.float32)
    try:
        assert engine.put("img-1", torch.arange(12, dtype=torch.float32).reshape(3, 4))
        assert engine.contains("img-1") and not engine.contains("img-2")
        assert engine.get("img-1") is not None
        assert engine.get("img-2") is None
    finally:
        release_ec_engine(engine)
    payload = mini.worker.get_kv_connector_stats()
    c = payload["c"]
    assert (c["ec_puts"], c["ec_lookups"], c["ec_lookup_hits"], c["ec_hits"], c["ec_misses"]) == (1, 2, 1, 1, 1)
    registry = CollectorRegistry()
    sink = PromSink({}, ["model_name", "engine"], {0: ["m", "0"]}, registry=registry)
    sink.observe(payload)
    assert _sample(registry, "lmcache_encoder_cache_hits_total") == 1
    assert _sample(registry, "lmcache_encoder_cache_misses_total") == 1
    assert _sample(registry, "lmcache_encoder_cache_stores_total") == 1
    # process-wide counters: never summed over tensor-parallel ranks
    assert merge_rank_snapshots([{"ec_hits": 3}, {"ec_hits": 3}]) == {"ec_hits": 3}


def test_summary_logs_while_there_is_traffic(caplog):
    engine = engine_with()
    got = threading.Event()

    class _Seen(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            if "lmcache summary" in record.getMessage():
                got.set()

    seen = _Seen()
    logging.getLogger("lmcache.summary").addHandler(seen)
    summary = None
    try:
        quiet = SummaryLogger(lambda: engine_snapshot(engine), 0, "test")
        assert quiet.log_if_traffic(1.0) is False  # no traffic, no line
        store_and_slots(engine)
        with caplog.at_level(logging.INFO, logger="lmcache.summary"):
            assert quiet.log_if_traffic(1.0) is True
        assert "stored 64 tokens" in caplog.text and "pool cpu" in caplog.text
        summary = SummaryLogger(lambda: engine_snapshot(engine), 0.05, "thread")
        engine.lookup(list(range(TOKENS)))
        assert got.wait(10)  # the timer thread logged on its own
    finally:
        if summary is not None:
            summary.close()
        logging.getLogger("lmcache.summary").removeHandler(seen)
        engine.close()


def test_bad_config_fails_at_construction_with_one_clear_line(caplog, tmp_path, monkeypatch):
    with caplog.at_level(logging.ERROR, logger="lmcache"):
        with pytest.raises(ConfigError):
            LMCacheConnectorV1Impl(fake_vllm_config(extra={"lmcache.chunk_size": "big"}), _role("WORKER"))
    (rec,) = [r for r in caplog.records if r.levelno >= logging.ERROR]
    assert "kv_connector_extra_config: chunk_size='big': expected an integer" in rec.getMessage()
    path = tmp_path / "bad.yaml"
    path.write_text("cache_policy: ARC\n")
    monkeypatch.setenv("LMCACHE_CONFIG_FILE", str(path))
    caplog.clear()
    with caplog.at_level(logging.ERROR, logger="lmcache"):
        with pytest.raises(ConfigError):
            LMCacheConnectorV1Impl(fake_vllm_config(), _role("SCHEDULER"))
    (rec,) = [r for r in caplog.records if r.levelno >= logging.ERROR]
    assert f"{path}: cache_policy='ARC': expected one of" in rec.getMessage()


def _role(name: str):
    from types import SimpleNamespace

    return SimpleNamespace(name=name)


def test_model_namespace_lets_two_paths_share_keys():
    def keys(model_path: str, namespace: str | None) -> list:
        extra = {"lmcache.model_namespace": namespace} if namespace else {}
        cfg = fake_vllm_config(extra=extra)
        cfg.model_config = FakeModelConfig(SPEC_UNIT, model_path)
        settings = settings_from_vllm(cfg)
        db = ChunkedTokenDatabase(settings.config, build_engine_metadata(settings, 0))
        return [k for _, _, k in db.process_tokens(list(range(64)))]

    assert keys("/a/model", None) != keys("/b/model", None)  # default: the path
    assert keys("/a/model", "llama-3-8b@rev1") == keys("/b/model", "llama-3-8b@rev1")
    assert keys("/a/model", "one") != keys("/a/model", "two")


from tests.vllm_adapter.test_vllm_connector_unit import SPEC as SPEC_UNIT  # noqa: E402


# ------------------------------------------------------------------------ KV events
class EventsMini(MiniVLLM):
    """MiniVLLM whose steps collect the worker's KV events (``take_kv_events``, the Dynamic route)."""

    def __init__(self, config) -> None:
        super().__init__(config)
        self.collected: list = []
        self.drain = True

    def _step(self, so, req, blocks, start, num):
        meta = self.scheduler.build_connector_meta(so)
        self.worker.bind_connector_metadata(meta)
        self.worker.start_load_kv(None)
        self._forward(req, blocks, start, num)
        self.worker.wait_for_save()
        if self.drain:
            self.collected.extend(self.worker.take_kv_events())
        return self.worker.get_block_ids_with_load_errors()

    def take(self) -> list:
        out = self.collected + self.worker.take_kv_events()
        self.collected = []
        return out


def _events_mini(tmp_path, **extra):
    from types import SimpleNamespace

    cfg = fake_vllm_config(tmp=str(tmp_path), extra=extra)
    cfg.kv_events_config = SimpleNamespace(enable_kv_cache_events=True)
    return EventsMini(cfg)


def test_kv_events_report_stored_and_evicted_chunks_by_tier(tmp_path):
    from lmcache.integration.vllm.kv_events import RemovedEvent, StoredEvent, chunk_hashes

    disk = tmp_path / "disk"
    m = _events_mini(tmp_path, **{"lmcache.local_disk": str(disk), "lmcache.max_local_disk_size": 0.01})
    try:
        base = prompt(80, 31)
        m.serve(FakeRequest("a", base))
        assert m.engine.storage_manager.flush(30)
        events = m.take()
        infos = chunk_hashes(m.engine.metadata.model_name, 16, np_array(base), {})
        stored = [e for e in events if isinstance(e, StoredEvent)]
        assert {e.medium for e in stored} == {"CPU", "DISK"} and all(e.block_size == 16 for e in stored)
        cpu = [e for e in stored if e.medium == "CPU"]
        assert cpu[0].parent_block_hash is None
        assert [h for e in cpu for h in e.block_hashes] == [i.block_hash for i in infos]  # chained, in order
        assert [t for e in cpu for t in e.token_ids] == base
        disk = [h for e in stored if e.medium == "DISK" for h in e.block_hashes]
        assert sorted(disk) == sorted(i.block_hash for i in infos)
        assert m.take() == []  # drained
        # evict: a removal reports the same hashes
        for key in m.engine.keys(base)[:2]:
            m.engine.storage_manager.local_cpu.remove(key)
        removed = [e for e in m.take() if isinstance(e, RemovedEvent)]
        assert removed == [RemovedEvent([infos[0].block_hash, infos[1].block_hash], "CPU")]
        # the built-in wrapper's route (get_kv_events) gets stored events only
        m.drain = False
        m.engine.storage_manager.local_cpu.remove(m.engine.keys(base)[2])
        m.serve(FakeRequest("c", prompt(48, 33)))
        got = m.worker.get_kv_events()
        assert got and all(isinstance(e, StoredEvent) for e in got)
        assert {e.medium for e in got} <= {"CPU", "DISK"}
    finally:
        m.close()


def test_kv_event_hashes_depend_on_namespace_and_extras_not_on_rank():
    from lmcache.integration.vllm.kv_events import chunk_hashes

    toks = np_array(list(range(40)))
    a = chunk_hashes("model", 16, toks, {})
    assert [len(i.token_ids) for i in a] == [16, 16, 8]
    assert [i.parent_block_hash for i in a] == [None, a[0].block_hash, a[1].block_hash]
    assert a == chunk_hashes("model", 16, toks, {})
    assert a[0] != chunk_hashes("other", 16, toks, {})[0]
    assert a[0] != chunk_hashes("model", 16, toks, {"cache_salt": "t"})[0]
    assert all(0 <= i.block_hash < 2**63 for i in a)


def np_array(tokens):
    import numpy as np

    return np.asarray(tokens, dtype=np.int32)


def test_tiers_share_one_counter_vocabulary():
    """Tier labels are :class:`Tier` values, and the disk and remote tiers feed each per-tier
    metric from the same counter name (``disk_<name>`` / ``remote_<name>``)."""
    import dataclasses

    from lmcache.observability.metrics import METRICS
    from lmcache.v1.stats import TierStats
    from lmcache.v1.storage_backend.local_cpu_backend import LocalCPUBackend
    from lmcache.v1.storage_backend.local_disk_backend import DiskTierStats, LocalDiskBackend
    from lmcache.v1.storage_backend.remote_backend import RemoteBackend, RemoteStats
    from lmcache.v1.tiers import TIERS, Tier

    assert [LocalCPUBackend.tier, LocalDiskBackend.tier, RemoteBackend.tier] == list(TIERS)
    shared = {f.name for f in dataclasses.fields(TierStats) if not f.name.startswith("_")}
    for cls in (DiskTierStats, RemoteStats):
        assert issubclass(cls, TierStats) and shared <= set(cls().snapshot())
    for m in METRICS:
        if m.label is None:
            continue
        assert all(isinstance(label, Tier) and label in TIERS for label, _ in m.sources), m.name
        by_tier = dict(m.sources)
        if Tier.DISK in by_tier and Tier.REMOTE in by_tier and len(by_tier[Tier.REMOTE]) == 1:
            (disk_key,), (remote_key,) = by_tier[Tier.DISK], by_tier[Tier.REMOTE]
            if disk_key.startswith("disk_"):
                assert disk_key.removeprefix("disk_") == remote_key.removeprefix("remote_"), m.name
                assert disk_key.removeprefix("disk_") in shared, m.name
