"""load_ec_engine_config: sources, precedence, defaults, unknown keys, no invented paths."""

from __future__ import annotations

import itertools
import logging

import pytest
import yaml

from lmcache.v1.config import (
    EC_DEFAULT_CPU_SIZE_GIB,
    EC_DEFAULT_DISK_SIZE_GIB,
    ConfigError,
    LMCacheEngineConfig,
    load_ec_engine_config,
)


@pytest.fixture(autouse=True)
def clean_env(monkeypatch):
    import os

    for name in list(os.environ):
        if name.startswith("LMCACHE_"):
            monkeypatch.delenv(name)


@pytest.fixture
def write_yaml(tmp_path, monkeypatch):
    def write(data: dict) -> str:
        path = tmp_path / "lmcache.yaml"
        path.write_text(yaml.safe_dump(data))
        monkeypatch.setenv("LMCACHE_CONFIG_FILE", str(path))
        return str(path)

    return write


# ----------------------------------------------------------------------------- defaults
def test_defaults_without_any_ec_setting():
    base = LMCacheEngineConfig.from_dict({"max_local_cpu_size": 20, "chunk_size": 128})
    cfg = load_ec_engine_config(base)
    assert cfg.local_cpu is True
    assert cfg.max_local_cpu_size == EC_DEFAULT_CPU_SIZE_GIB == 1.0  # KV budget not inherited
    assert cfg.local_disk is None  # no disk path is invented
    assert cfg.max_local_disk_size == 0.0
    assert cfg.remote_url is None
    assert cfg.chunk_size == 128  # other base keys are inherited
    assert cfg is not base


def test_local_cpu_forced_on_even_if_base_or_override_disables_it(write_yaml, caplog):
    base = LMCacheEngineConfig.from_dict({"local_cpu": False, "max_local_cpu_size": 0})
    assert load_ec_engine_config(base).local_cpu is True
    write_yaml({"ec_local_cpu": False})
    with caplog.at_level(logging.WARNING, logger="lmcache.v1.config"):
        cfg = load_ec_engine_config(base)
    assert cfg.local_cpu is True and cfg.max_local_cpu_size == 1.0
    assert any("local_cpu" in r.getMessage() for r in caplog.records)


def test_cpu_size_override_is_used(monkeypatch):
    monkeypatch.setenv("LMCACHE_EC_MAX_LOCAL_CPU_SIZE", "0.25")
    assert load_ec_engine_config(LMCacheEngineConfig()).max_local_cpu_size == 0.25


def test_disk_size_default_only_when_a_disk_path_is_set(tmp_path, write_yaml):
    write_yaml({"ec_local_disk": str(tmp_path / "ec")})
    cfg = load_ec_engine_config(LMCacheEngineConfig())
    assert cfg.local_disk == str(tmp_path / "ec")
    assert cfg.max_local_disk_size == EC_DEFAULT_DISK_SIZE_GIB == 64.0


def test_disk_path_inherited_from_base_gets_the_ec_disk_default(tmp_path):
    base = LMCacheEngineConfig.from_dict({"local_disk": str(tmp_path), "max_local_disk_size": 3})
    cfg = load_ec_engine_config(base)
    assert cfg.local_disk == str(tmp_path)
    assert cfg.max_local_disk_size == 64.0


def test_disk_size_override_is_used(tmp_path, write_yaml):
    write_yaml({"ec": {"local_disk": str(tmp_path), "max_local_disk_size": 2}})
    cfg = load_ec_engine_config(LMCacheEngineConfig())
    assert cfg.max_local_disk_size == 2.0


def test_disk_size_alone_does_not_create_a_disk_tier(monkeypatch):
    monkeypatch.setenv("LMCACHE_EC_MAX_LOCAL_DISK_SIZE", "8")
    cfg = load_ec_engine_config(LMCacheEngineConfig())
    assert cfg.local_disk is None


def test_layerwise_and_hidden_states_are_off():
    base = LMCacheEngineConfig.from_dict({"use_layerwise": True, "enable_hidden_state_cache": True})
    cfg = load_ec_engine_config(base)
    assert cfg.use_layerwise is False and cfg.enable_hidden_state_cache is False


def test_base_is_not_mutated(tmp_path, write_yaml, monkeypatch):
    base = LMCacheEngineConfig.from_dict({"local_cpu": False, "max_local_cpu_size": 0, "chunk_size": 64})
    before = base.to_dict()
    write_yaml({"ec_chunk_size": 32, "ec": {"local_disk": str(tmp_path)}})
    monkeypatch.setenv("LMCACHE_EC_REMOTE_URL", "redis://localhost:1")
    load_ec_engine_config(base)
    assert base.to_dict() == before


# ----------------------------------------------------------------------------- precedence
SOURCES = ("ec_key", "ec_map", "env")
VALUES = {"ec_key": 16, "ec_map": 32, "env": 64}


@pytest.mark.parametrize(
    "present", [c for n in range(len(SOURCES) + 1) for c in itertools.combinations(SOURCES, n)], ids=str
)
def test_precedence_base_then_ec_key_then_ec_map_then_env(present, write_yaml, monkeypatch):
    data: dict = {"chunk_size": 512}  # base value, from the same file
    if "ec_key" in present:
        data["ec_chunk_size"] = VALUES["ec_key"]
    if "ec_map" in present:
        data["ec"] = {"chunk_size": VALUES["ec_map"]}
    write_yaml(data)
    if "env" in present:
        monkeypatch.setenv("LMCACHE_EC_CHUNK_SIZE", str(VALUES["env"]))
    expected = VALUES[present[-1]] if present else 512
    assert load_ec_engine_config().chunk_size == expected


def test_base_none_means_file_then_env(write_yaml, monkeypatch):
    write_yaml({"chunk_size": 128, "remote_timeout": 2})
    monkeypatch.setenv("LMCACHE_CHUNK_SIZE", "96")
    cfg = load_ec_engine_config()
    assert cfg.chunk_size == 96 and cfg.remote_timeout == 2.0


def test_explicit_base_still_gets_file_and_env_overrides(write_yaml, monkeypatch):
    write_yaml({"chunk_size": 128, "ec_remote_timeout": 9})
    monkeypatch.setenv("LMCACHE_EC_CACHE_POLICY", "lfu")
    cfg = load_ec_engine_config(LMCacheEngineConfig.from_dict({"chunk_size": 8}))
    assert cfg.chunk_size == 8  # base keys come from the given base only
    assert cfg.remote_timeout == 9.0 and cfg.cache_policy == "LFU"


def test_ec_settings_do_not_leak_into_the_kv_config(write_yaml, monkeypatch, caplog):
    write_yaml({"chunk_size": 128, "ec_chunk_size": 16, "ec": {"max_local_cpu_size": 0.5}})
    monkeypatch.setenv("LMCACHE_EC_LOCAL_CPU", "false")
    with caplog.at_level(logging.WARNING, logger="lmcache.v1.config"):
        kv = LMCacheEngineConfig.load()
    assert kv.chunk_size == 128 and kv.max_local_cpu_size == 5.0 and kv.local_cpu is True
    assert not caplog.records  # ec keys are not "unknown" to the KV loader


def test_key_names_are_case_insensitive(write_yaml, monkeypatch):
    write_yaml({"EC_CHUNK_SIZE": 48, "EC": {"Remote_Timeout": 3}})
    cfg = load_ec_engine_config(LMCacheEngineConfig())
    assert cfg.chunk_size == 48 and cfg.remote_timeout == 3.0


# ----------------------------------------------------------------------------- bad input
def test_unknown_ec_keys_are_logged_and_dropped(write_yaml, monkeypatch, caplog):
    write_yaml({"ec_chunk_sise": 7, "ec": {"bogus": 1}})
    monkeypatch.setenv("LMCACHE_EC_LOCAL_DSK", "/nowhere")
    with caplog.at_level(logging.WARNING, logger="lmcache.v1.config"):
        cfg = load_ec_engine_config(LMCacheEngineConfig())
    text = " ".join(r.getMessage() for r in caplog.records)
    assert "'chunk_sise'" in text and "'chunk_size'" in text  # with a suggestion
    assert "'bogus'" in text and "'local_dsk'" in text
    assert cfg.chunk_size == 256 and cfg.local_disk is None


def test_bad_value_names_the_ec_key(monkeypatch):
    monkeypatch.setenv("LMCACHE_EC_CHUNK_SIZE", "lots")
    with pytest.raises(ConfigError, match="ec_chunk_size='lots'.*integer"):
        load_ec_engine_config(LMCacheEngineConfig())


def test_bad_combination_is_rejected(tmp_path, monkeypatch):
    monkeypatch.setenv("LMCACHE_EC_LOCAL_DISK", str(tmp_path))
    monkeypatch.setenv("LMCACHE_EC_MAX_LOCAL_DISK_SIZE", "0")
    with pytest.raises(ConfigError, match="max_local_disk_size"):
        load_ec_engine_config(LMCacheEngineConfig())


def test_ec_map_that_is_not_a_mapping_is_ignored(write_yaml, caplog):
    write_yaml({"ec": [1, 2], "ec_chunk_size": 8})
    with caplog.at_level(logging.WARNING, logger="lmcache.v1.config"):
        cfg = load_ec_engine_config(LMCacheEngineConfig())
    assert cfg.chunk_size == 8
    assert any("not a mapping" in r.getMessage() for r in caplog.records)


def test_unreadable_config_file_with_explicit_base_keeps_env_overrides(tmp_path, monkeypatch, caplog):
    monkeypatch.setenv("LMCACHE_CONFIG_FILE", str(tmp_path / "missing.yaml"))
    monkeypatch.setenv("LMCACHE_EC_CHUNK_SIZE", "12")
    with caplog.at_level(logging.WARNING, logger="lmcache.v1.config"):
        cfg = load_ec_engine_config(LMCacheEngineConfig())
    assert cfg.chunk_size == 12
    assert any("missing.yaml" in r.getMessage() for r in caplog.records)
