"""The blending keys: LMCache's names and forms, defaults, and every bad value refused by name."""

from __future__ import annotations

import logging

import pytest

from lmcache.v1 import config as config_module
from lmcache.v1.config import DEFAULT_BLEND_RATIO, ConfigError, LMCacheEngineConfig


@pytest.fixture(autouse=True)
def _clean_env(monkeypatch):
    import os

    for name in list(os.environ):
        if name.startswith("LMCACHE_"):
            monkeypatch.delenv(name)


def test_defaults():
    cfg = LMCacheEngineConfig()
    assert cfg.enable_blending is False and cfg.blend_special_str == " # # " and cfg.blend_min_tokens == 256
    assert cfg.blend_ratios == (DEFAULT_BLEND_RATIO,) == (0.2,) and cfg.blend_layers == (1,)


@pytest.mark.parametrize(
    ("value", "want"),
    [(0.3, (0.3,)), ("0.3", (0.3,)), ([0.3, 0.1], (0.3, 0.1)), ("[0.3, 0.1]", (0.3, 0.1)), ("0.3,0.1", (0.3, 0.1))],
)
def test_ratios_scalar_or_list(value, want):
    layers = [1] if len(want) == 1 else [1, 5]
    cfg = LMCacheEngineConfig.from_dict({"blend_recompute_ratios": value, "blend_check_layers": layers})
    assert cfg.blend_ratios == want


def test_env_forms(monkeypatch):
    monkeypatch.setenv("LMCACHE_ENABLE_BLENDING", "true")
    monkeypatch.setenv("LMCACHE_BLEND_RECOMPUTE_RATIOS", "0.25")
    monkeypatch.setenv("LMCACHE_BLEND_CHECK_LAYERS", "2")
    monkeypatch.setenv("LMCACHE_BLEND_SPECIAL_STR", "<doc>")
    monkeypatch.setenv("LMCACHE_BLEND_MIN_TOKENS", "64")
    cfg = LMCacheEngineConfig.load()
    assert cfg.enable_blending and cfg.blend_ratios == (0.25,) and cfg.blend_layers == (2,)
    assert cfg.blend_special_str == "<doc>" and cfg.blend_min_tokens == 64


@pytest.mark.parametrize(
    ("data", "needle"),
    [
        ({"blend_recompute_ratios": 1.5}, "blend_recompute_ratios=[1.5]: expected numbers between 0 and 1"),
        ({"blend_recompute_ratios": -0.1}, "between 0 and 1"),
        ({"blend_recompute_ratios": "nan"}, "finite"),
        ({"blend_recompute_ratios": "abc"}, "blend_recompute_ratios"),
        ({"blend_recompute_ratios": []}, "non-empty"),
        ({"blend_recompute_ratios": [0.1, 0.3], "blend_check_layers": [1, 2]}, "non-increasing"),
        ({"blend_recompute_ratios": [0.3, 0.1]}, "one ratio per check layer"),
        ({"blend_check_layers": [3, 2], "blend_recompute_ratios": [0.3, 0.1]}, "strictly increasing"),
        ({"blend_check_layers": [-1]}, "non-negative"),
        ({"blend_min_tokens": 0}, "blend_min_tokens=0: expected an integer >= 1"),
        ({"blend_sink_tokens": -1}, "blend_sink_tokens=-1: expected an integer >= 0"),
        ({"blend_sink_tokens": "many"}, "blend_sink_tokens"),
        ({"lazy_store": "later"}, "lazy_store='later': expected a boolean"),
        ({"async_copy_in_background": "sometimes"}, "async_copy_in_background='sometimes': expected a boolean"),
        ({"async_min_tokens": -1}, "async_min_tokens=-1: expected tokens >= 0"),
        ({"async_min_tokens": "few"}, "async_min_tokens"),
        ({"lazy_store": True, "enable_blending": True}, "lazy_store=True with enable_blending=True"),
        ({"blend_special_str": ""}, "blend_special_str=''"),
        ({"blend_special_str": "   "}, "visible characters"),
        ({"enable_blending": "maybe"}, "enable_blending='maybe': expected a boolean"),
        ({"enable_blending": True, "enable_pd": True, "remote_url": "redis://h:1"}, "enable_pd=True"),
    ],
)
def test_bad_values_are_refused_by_name(data, needle):
    with pytest.raises(ConfigError, match=None) as err:
        LMCacheEngineConfig.from_dict(data)
    assert needle in str(err.value), str(err.value)


def test_thresholds_are_accepted_and_warned_about_once(caplog, monkeypatch):
    monkeypatch.setattr(config_module, "_warned_thresholds", False)
    with caplog.at_level(logging.WARNING):
        for _ in range(2):
            cfg = LMCacheEngineConfig.from_dict({"enable_blending": True, "blend_thresholds": [0.5]})
    assert cfg.blend_thresholds == [0.5]
    assert sum("blend_thresholds" in r.getMessage() for r in caplog.records) == 1


def test_lmcache_spellings_are_applied():
    cfg = LMCacheEngineConfig.from_defaults(enable_blending=True, blend_recompute_ratios=[0.15], blend_check_layers=[1])
    assert cfg.enable_blending and cfg.blend_ratios == (0.15,)
