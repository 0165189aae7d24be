"""Remote tier configuration, no server needed: URLs, credentials, options."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from lmcache.v1.config import ConfigError, LMCacheEngineConfig
from lmcache.v1.storage_backend.connector import mask_url, parse_remote_url
from lmcache.v1.storage_backend.remote_backend import RemoteOptions
from lmcache.v1.storage_backend.storage_manager import StorageManager
from tests.remote_fixtures import remote_config


# ---------------------------------------------------------------------- URLs
@pytest.mark.parametrize(
    "url, scheme, nodes, path, db",
    [
        ("redis://h:1234/3", "redis", (("h", 1234),), None, 3),
        ("redis://h", "redis", (("h", 6379),), None, 0),
        ("rediss://u:pw@h:7000", "rediss", (("h", 7000),), None, 0),
        ("unix:///run/redis.sock?db=2", "unix", (), "/run/redis.sock", 2),
        ("redis-cluster://a:1,b:2,[::1]:3", "redis-cluster", (("a", 1), ("b", 2), ("::1", 3)), None, 0),
    ],
)
def test_parse_remote_url(url, scheme, nodes, path, db):
    addr = parse_remote_url(url)
    assert (addr.scheme, addr.nodes, addr.path, addr.db) == (scheme, nodes, path, db)
    assert addr.cluster == scheme.endswith("-cluster")
    assert addr.tls == scheme.startswith("rediss")


@pytest.mark.parametrize(
    "url, words",
    [
        ("memcached://h:1", "unsupported scheme"),
        ("redis://a:1,b:2", "cluster scheme"),
        ("redis://h:notaport", "not an integer"),
        ("redis://h:70000", "out of range"),
        ("redis-cluster://a:1/2", "database 0"),
        ("unix://relative.sock", "absolute socket path"),
        ("redis://:s3cret@h:x", "not an integer"),
    ],
)
def test_parse_remote_url_rejects(url, words):
    with pytest.raises(ValueError, match=words) as info:
        parse_remote_url(url)
    assert "s3cret" not in str(info.value)


_secret = st.text(st.characters(blacklist_characters="@/?#%", blacklist_categories=("Cs",)), min_size=1, max_size=20)


@given(user=st.sampled_from(["", "alice"]), pw=_secret,
       scheme=st.sampled_from(["redis", "rediss", "redis-cluster"]))
def test_mask_url_hides_any_password(user, pw, scheme):
    url = f"{scheme}://{user}:{pw}@host:6379"
    assert mask_url(url) == f"{scheme}://{user}:***@host:6379"
    addr = parse_remote_url(url)
    assert addr.password == pw and addr.nodes == (("host", 6379),)
    assert repr(addr) == f"RemoteAddress({scheme}://host:6379, db=0, username={user or None!r}, password=***)"
    assert mask_url("redis://host:1/0") == "redis://host:1/0"


@pytest.mark.parametrize("pw", ["p@ss", "a@b@c", "x/y?z#w", "se:cr:et", "  spaced  ", "%40enc", "ünï"])
def test_url_credentials_never_in_repr_str_or_errors(pw):
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


# ---------------------------------------------------------------------- credentials
def test_config_credentials_from_env_and_never_in_repr(monkeypatch):
    monkeypatch.setenv("LMCACHE_REMOTE_URL", "redis://127.0.0.1:1")
    monkeypatch.setenv("LMCACHE_REMOTE_USERNAME", "alice")
    monkeypatch.setenv("LMCACHE_REMOTE_PASSWORD", "hunter2-secret")
    monkeypatch.delenv("LMCACHE_CONFIG_FILE", raising=False)
    cfg = LMCacheEngineConfig.load()
    assert (cfg.remote_username, cfg.remote_password) == ("alice", "hunter2-secret")
    assert "hunter2-secret" not in repr(cfg)
    assert LMCacheEngineConfig.from_dict({}).remote_password is None


# ---------------------------------------------------------------------- options
@pytest.mark.parametrize(
    "extra, words",
    [
        ({"remote_workers": 0}, "remote_workers"),
        ({"remote_max_inflight_mb": "lots"}, "remote_max_inflight_mb"),
        ({"remote_backoff_initial": -1}, "remote_backoff_initial"),
        ({"remote_backoff_initial": 5, "remote_backoff_max": 1}, "remote_backoff_max"),
        ({"remote_tls_cert_reqs": "maybe"}, "remote_tls_cert_reqs"),
        ({"remote_key_prefix": "a b"}, "remote_key_prefix"),
    ],
)
def test_remote_options_reject_bad_values(extra, words):
    cfg = remote_config("redis://127.0.0.1:1", extra_config=extra)
    with pytest.raises(ValueError, match=words):
        RemoteOptions.from_config(cfg, 1 << 30)


@pytest.mark.parametrize("name", ["remote_backoff_max", "remote_backoff_initial"])
@pytest.mark.parametrize("value", ["nan", "inf", float("nan")])
def test_remote_backoff_refuses_nan_and_inf(name, value):
    if isinstance(value, float):
        with pytest.raises(ConfigError):  # already at the config boundary
            LMCacheEngineConfig.from_dict({"extra_config": {name: value}})
        return
    cfg = LMCacheEngineConfig.from_dict({"extra_config": {name: value}})
    with pytest.raises(ValueError, match=name):
        RemoteOptions.from_config(cfg, 1 << 30)


def test_remote_int_options_refuse_inf():
    cfg = LMCacheEngineConfig.from_dict({"extra_config": {"remote_workers": "inf"}})
    with pytest.raises(ValueError, match="remote_workers"):
        RemoteOptions.from_config(cfg, 1 << 30)


def test_malformed_url_is_a_clear_error_at_start():
    cfg = remote_config("redis://:pw-not-logged@a:1,b:2")
    with pytest.raises(ConfigError, match="remote_url=.*cluster scheme") as info:
        StorageManager(cfg, pool_bytes=1 << 20)
    assert "pw-not-logged" not in str(info.value)
