"""Hardening issue (#13), configuration: items 6 (secrets) and 11 (NaN/inf), extra_config
keys, ``local_disk: ""``, and a config fuzz test (result or ConfigError, never a secret)."""

from __future__ import annotations

import logging
import math

import pytest
import yaml
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from lmcache.v1.config import ConfigError, LMCacheEngineConfig, config_keys
from lmcache.v1.storage_backend.connector import mask_url, parse_remote_url
from lmcache.v1.storage_backend.remote_backend import RemoteOptions


# ----------------------------------------------------------------------------- item 6
@pytest.mark.parametrize("value", [123456789, 3.25, ["hunter2"], {"p": "hunter2"}, True])
def test_item6_non_string_password_is_never_echoed(value):
    with pytest.raises(ConfigError, match="remote_password") as info:
        LMCacheEngineConfig.from_dict({"remote_password": value})
    for text in ("123456789", "3.25", "hunter2", "True"):
        assert text not in str(info.value)


@pytest.mark.parametrize("pw", ["p@ss", "a@b@c", "x/y?z#w", "se:cr:et", "  spaced  ", "%40enc", "ünï"])
def test_item6_url_credentials_never_in_repr_str_or_errors(pw):
    url = f"redis://user:{pw}@host:6379/0"
    cfg = LMCacheEngineConfig.from_dict({"remote_url": url, "remote_password": "other-" + pw})
    for text in (repr(cfg), str(cfg), mask_url(url), repr(parse_remote_url(url))):
        assert pw not in text, text
    assert mask_url(url) == "redis://user:***@host:6379/0"
    with pytest.raises(ValueError) as info:
        parse_remote_url(f"redis://user:{pw}@host:notaport")
    assert pw not in str(info.value)
    with pytest.raises(ConfigError) as info:
        LMCacheEngineConfig.from_dict({"remote_url": f"user:{pw}@host"})  # no scheme
    assert pw not in str(info.value)


# ----------------------------------------------------------------------------- item 11
@pytest.mark.parametrize("key", ["max_local_cpu_size", "max_local_disk_size", "remote_timeout", "max_hidden_state_cpu_size"])
@pytest.mark.parametrize("value", [float("nan"), float("inf"), float("-inf"), "nan", "inf", "-Infinity", 10**400])
def test_item11_nan_and_inf_rejected_for_every_float_key(key, value):
    with pytest.raises(ConfigError, match=key):
        LMCacheEngineConfig.from_dict({key: value})


@pytest.mark.parametrize("name", ["remote_backoff_max", "remote_backoff_initial"])
@pytest.mark.parametrize("value", ["nan", "inf", float("nan")])
def test_item11_remote_backoff_nan_rejected(name, value):
    if isinstance(value, float):
        with pytest.raises(ConfigError):  # already at the config boundary
            LMCacheEngineConfig.from_dict({"extra_config": {name: value}})
        return
    cfg = LMCacheEngineConfig.from_dict({"extra_config": {name: value}})
    with pytest.raises(ValueError, match=name):
        RemoteOptions.from_config(cfg, 1 << 30)


def test_item11_remote_int_options_reject_inf():
    cfg = LMCacheEngineConfig.from_dict({"extra_config": {"remote_workers": "inf"}})
    with pytest.raises(ValueError, match="remote_workers"):
        RemoteOptions.from_config(cfg, 1 << 30)


# ----------------------------------------------------------------------------- extra_config, local_disk
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


# ----------------------------------------------------------------------------- fuzz
_secret = st.text(min_size=4, max_size=24).map(lambda s: "Zq9" + s.replace("\x00", "") + "Kw7")
_scalar = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(-(2**70), 2**70),
    st.floats(allow_nan=True, allow_infinity=True),
    st.text(max_size=20),
    st.sampled_from(["nan", "inf", "-1", "0", "1e400", "true", "LRU", "[1, 2]", "{a: 1}", "file://", ": bad: yaml: ["]),
)
_value = st.recursive(_scalar, lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=8), inner, max_size=3), max_leaves=6)
_keys = st.sampled_from([*config_keys(), "chunk_sise", "ec_chunk_size", "EXTRA_CONFIG", "x"])
_doc = st.dictionaries(_keys, _value, max_size=6)


class _Capture(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.DEBUG)
        self.lines: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.lines.append(record.getMessage())


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(doc=_doc, secret=_secret, where=st.sampled_from(["password", "url", "both", "password-any"]),
       pw_value=_value, as_yaml=st.booleans())
def test_config_fuzz_result_or_config_error_never_a_secret(doc, secret, where, pw_value, as_yaml):
    doc = dict(doc)
    if where in ("password", "both"):
        doc["remote_password"] = secret
    if where in ("url", "both"):
        doc["remote_url"] = f"redis://u:{secret}@h:1/0"
    if where == "password-any":
        doc["remote_password"] = pw_value if not isinstance(pw_value, str) else secret
    handler = _Capture()
    log = logging.getLogger("lmcache")
    log.addHandler(handler)
    old_level = log.level
    log.setLevel(logging.DEBUG)
    try:
        if as_yaml:
            try:
                text = yaml.safe_dump(doc, allow_unicode=True)
            except yaml.YAMLError:
                return
            doc = yaml.safe_load(text)
        try:
            cfg = LMCacheEngineConfig.from_dict(doc)
        except ConfigError as exc:
            assert secret not in str(exc)
            if where == "password-any" and pw_value is not None and str(exc).startswith("remote_password"):
                assert repr(pw_value) not in str(exc)  # a non-string password is not echoed either
        else:
            assert secret not in repr(cfg) and secret not in str(cfg)
            for key in ("max_local_cpu_size", "max_local_disk_size", "remote_timeout", "max_hidden_state_cpu_size"):
                assert math.isfinite(getattr(cfg, key))
    finally:
        log.removeHandler(handler)
        log.setLevel(old_level)
    assert not any(secret in line for line in handler.lines)


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(text=st.text(st.characters(blacklist_categories=("Cs",)), max_size=200), secret=_secret)
def test_config_fuzz_raw_yaml_text(tmp_path, text, secret):
    """Arbitrary text as the config file (often not YAML at all): a config or a ConfigError."""
    path = tmp_path / "c.yaml"
    path.write_text(f"remote_password: {secret!r}\n" + text, encoding="utf-8")
    try:
        cfg = LMCacheEngineConfig.from_file(path)
    except ConfigError as exc:
        assert secret not in str(exc)
    else:
        assert secret not in repr(cfg)
