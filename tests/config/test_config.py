from __future__ import annotations

import logging

import pytest

from lmcache.v1.config import ConfigError, LMCacheEngineConfig, config_keys


def test_defaults():
    cfg = LMCacheEngineConfig.from_dict({})
    assert cfg.chunk_size == 256
    assert cfg.local_cpu is True
    assert cfg.max_local_cpu_size == 5.0
    assert cfg.local_disk is None and cfg.remote_url is None
    assert cfg.save_unfull_chunk is False
    assert cfg.use_layerwise is False
    assert cfg.cache_policy == "LRU"
    assert cfg.enable_hidden_state_cache is False
    assert cfg.hidden_state_layers is None
    assert cfg.extra_config is None


def test_from_file_and_env_precedence(tmp_path, monkeypatch):
    path = tmp_path / "c.yaml"
    path.write_text("chunk_size: 512\nmax_local_cpu_size: 2\ncache_policy: fifo\nhidden_state_layers: [0, 3]\n")
    monkeypatch.setenv("LMCACHE_CONFIG_FILE", str(path))
    monkeypatch.setenv("LMCACHE_CHUNK_SIZE", "128")
    monkeypatch.setenv("LMCACHE_SAVE_UNFULL_CHUNK", "true")
    monkeypatch.setenv("LMCACHE_EXTRA_CONFIG", "{a: 1}")
    cfg = LMCacheEngineConfig.load()
    assert cfg.chunk_size == 128  # env wins over file
    assert cfg.max_local_cpu_size == 2.0  # file wins over default
    assert cfg.cache_policy == "FIFO"
    assert cfg.hidden_state_layers == [0, 3]
    assert cfg.save_unfull_chunk is True
    assert cfg.extra_config == {"a": 1}
    assert LMCacheEngineConfig.from_file(path).chunk_size == 512
    assert LMCacheEngineConfig.from_env().chunk_size == 128


def test_env_list_forms(monkeypatch):
    monkeypatch.setenv("LMCACHE_HIDDEN_STATE_LAYERS", "1,2")
    assert LMCacheEngineConfig.from_env().hidden_state_layers == [1, 2]
    monkeypatch.setenv("LMCACHE_HIDDEN_STATE_LAYERS", "[4]")
    assert LMCacheEngineConfig.from_env().hidden_state_layers == [4]


@pytest.mark.parametrize(
    "data, needle",
    [
        ({"chunk_size": 0}, "chunk_size=0"),
        ({"chunk_size": "abc"}, "chunk_size='abc': expected an integer"),
        ({"chunk_size": True}, "chunk_size=True"),
        ({"local_cpu": "maybe"}, "local_cpu='maybe': expected a boolean"),
        ({"max_local_cpu_size": -1}, "max_local_cpu_size=-1.0"),
        ({"cache_policy": "ARC"}, "cache_policy='ARC': expected one of LRU, FIFO, LFU, MRU"),
        ({"local_disk": "/tmp/x"}, "max_local_disk_size=0.0: expected a size in GiB > 0 when local_disk is set"),
        ({"remote_url": "localhost:6379"}, "remote_url='localhost:6379': expected a URL"),
        ({"enable_hidden_state_cache": True, "max_hidden_state_cpu_size": 0}, "max_hidden_state_cpu_size=0.0"),
        ({"hidden_state_layers": [0, -1]}, "hidden_state_layers"),
        ({"extra_config": [1]}, "extra_config=[1]: expected a mapping"),
    ],
)
def test_bad_values_name_key_value_and_expectation(data, needle):
    with pytest.raises(ConfigError) as err:
        LMCacheEngineConfig.from_dict(data)
    assert needle in str(err.value)
    assert isinstance(err.value, ValueError)


def test_unknown_key_warns_with_suggestion(caplog):
    with caplog.at_level(logging.WARNING, logger="lmcache.v1.config"):
        cfg = LMCacheEngineConfig.from_dict({"chunk_sise": 64})
    assert cfg.chunk_size == 256
    assert "chunk_sise" in caplog.text and "did you mean 'chunk_size'" in caplog.text


def test_bad_file(tmp_path):
    with pytest.raises(ConfigError, match="cannot read"):
        LMCacheEngineConfig.from_file(tmp_path / "missing.yaml")
    bad = tmp_path / "bad.yaml"
    bad.write_text("- a\n- b\n")
    with pytest.raises(ConfigError, match="mapping"):
        LMCacheEngineConfig.from_file(bad)


def test_file_prefix_and_copy():
    cfg = LMCacheEngineConfig.from_dict({"local_disk": "file:///tmp/kv", "max_local_disk_size": 1})
    assert cfg.local_disk_path == "/tmp/kv"
    clone = cfg.copy()
    clone.chunk_size = 8
    assert cfg.chunk_size == 256
    assert set(config_keys()) >= {"chunk_size", "local_cpu", "max_local_cpu_size", "local_disk", "max_local_disk_size",
                                  "remote_url", "save_unfull_chunk", "use_layerwise", "cache_policy",
                                  "enable_hidden_state_cache", "max_hidden_state_cpu_size", "hidden_state_layers",
                                  "extra_config"}


# ---------------------------------------------------------------------- secrets and non-finite numbers
@pytest.mark.parametrize("value", [123456789, 3.25, ["hunter2"], {"p": "hunter2"}, True])
def test_non_string_password_is_refused_without_echoing_it(value):
    with pytest.raises(ConfigError, match="remote_password") as info:
        LMCacheEngineConfig.from_dict({"remote_password": value})
    for text in ("123456789", "3.25", "hunter2", "True"):
        assert text not in str(info.value)


@pytest.mark.parametrize("key", ["max_local_cpu_size", "max_local_disk_size", "remote_timeout", "max_hidden_state_cpu_size"])
@pytest.mark.parametrize("value", [float("nan"), float("inf"), float("-inf"), "nan", "inf", "-Infinity", 10**400])
def test_float_keys_refuse_nan_and_inf(key, value):
    with pytest.raises(ConfigError, match=key):
        LMCacheEngineConfig.from_dict({key: value})


# ---------------------------------------------------------------------- extra_config, local_disk
def test_extra_config_typo_is_warned_with_did_you_mean(caplog):
    caplog.set_level(logging.WARNING, logger="lmcache")
    LMCacheEngineConfig.from_dict({"extra_config": {"remote_backof_max": 3, "local_disk_o_direct": True}})
    msgs = [r.getMessage() for r in caplog.records]
    assert any("extra_config.remote_backof_max" in m and "extra_config.remote_backoff_max" in m for m in msgs), msgs
    assert not any("local_disk_o_direct" in m for m in msgs)


@pytest.mark.parametrize("value", ["", "   ", "file://"])
def test_local_disk_empty_string_raises(value):
    with pytest.raises(ConfigError, match="local_disk"):
        LMCacheEngineConfig.from_dict({"local_disk": value, "max_local_disk_size": 1})


def test_local_disk_null_means_unset():
    assert LMCacheEngineConfig.from_dict({"local_disk": None}).local_disk is None
