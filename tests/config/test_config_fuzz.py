"""Config fuzz: any document or file text gives a config or a ConfigError, never a secret
in an error, a repr or a log line, and never a non-finite size or timeout."""

from __future__ import annotations

import logging
import math

import yaml
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from lmcache.v1.config import ConfigError, LMCacheEngineConfig, config_keys


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
@given(doc=_doc, secret=_secret, where=st.sampled_from(["password", "url", "both", "password-any", "pd", "pd-long"]),
       pw_value=_value, as_yaml=st.booleans())
def test_config_fuzz_result_or_config_error_never_a_secret(doc, secret, where, pw_value, as_yaml):
    doc = dict(doc)
    if where in ("password", "both"):
        doc["remote_password"] = secret
    if where in ("url", "both"):
        doc["remote_url"] = f"redis://u:{secret}@h:1/0"
    if where == "password-any":
        doc["remote_password"] = pw_value if not isinstance(pw_value, str) else secret
    if where in ("pd", "pd-long"):  # the PD secret: too short (an error) or long enough (a config)
        doc["pd_secret"] = secret if where == "pd" else secret * 4
        secret = doc["pd_secret"]
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
