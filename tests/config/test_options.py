"""Typed tier options (issue 12, item 4): parsed from their field definitions, documented from them."""

from __future__ import annotations

import importlib.util
import pathlib
import re

import pytest
import torch
import yaml
from hypothesis import given
from hypothesis import strategies as st

from lmcache.v1.config import EXTRA_CONFIG_KEYS, ConfigError, LMCacheEngineConfig
from lmcache.v1.gpu_connector.layerwise import (
    VLLMBufferLayerwiseGPUConnector,
    VLLMPagedMemLayerwiseGPUConnector,
)
from lmcache.v1.gpu_connector.factory import create_gpu_connector
from lmcache.v1.gpu_connector.options import ConnectorOptions
from lmcache.v1.options import default_text, option_fields, option_keys, parse_options, parse_value
from lmcache.v1.storage_backend.local_disk_backend import DiskTierOptions
from lmcache.v1.storage_backend.remote_backend import RemoteOptions

ROOT = pathlib.Path(__file__).resolve().parents[2]
_spec = importlib.util.spec_from_file_location("option_tables", ROOT / "scripts" / "option_tables.py")
option_tables = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(option_tables)
GROUPS = [cls for _, cls in option_tables.GROUPS]


def layerwise_config(extra: dict) -> LMCacheEngineConfig:
    return LMCacheEngineConfig.from_dict({"chunk_size": 16, "use_layerwise": True, "extra_config": extra})


# ----------------------------------------------------------------------------- the bool("false") bug
@pytest.mark.parametrize("value", ["false", "False", "no", "0", "off", False, 0])
@pytest.mark.parametrize("key", ["use_gpu", "enable_blending"])
def test_layerwise_connector_false_strings_are_false(key, value):
    """Regression: ``bool("false")`` is True, so ``use_gpu: "false"`` used to pick the buffer connector."""
    conn = create_gpu_connector(layerwise_config({key: value}), 16, 2, dtype=torch.float16, device="cpu")
    assert type(conn) is VLLMPagedMemLayerwiseGPUConnector


@pytest.mark.parametrize("value", ["true", "yes", "1", True])
def test_layerwise_connector_true_strings_are_true(value):
    conn = create_gpu_connector(layerwise_config({"use_gpu": value}), 16, 2, dtype=torch.float16, device="cpu")
    assert type(conn) is VLLMBufferLayerwiseGPUConnector


def test_layerwise_connector_rejects_a_non_boolean():
    with pytest.raises(ConfigError, match=r"extra_config\.use_gpu='maybe': expected a boolean"):
        ConnectorOptions.from_config(layerwise_config({"use_gpu": "maybe"}))


# ----------------------------------------------------------------------------- parsing from the fields
def test_every_option_key_is_known_to_the_config():
    keys = [k for cls in GROUPS for k in option_keys(cls)]
    assert len(keys) == len(set(keys)), "two option groups share a key"
    assert set(keys) == set(EXTRA_CONFIG_KEYS)


def test_defaults_and_string_values():
    assert parse_options(DiskTierOptions, None, root="/x", capacity_bytes=1) == DiskTierOptions("/x", 1)
    opts = parse_options(
        DiskTierOptions,
        {"local_disk_o_direct": "true", "local_disk_write_threads": "3", "local_disk_close_timeout": "1.5"},
        root="/x",
        capacity_bytes=1,
    )
    assert (opts.o_direct, opts.write_threads, opts.close_timeout) == (True, 3, 1.5)


@pytest.mark.parametrize(
    "extra, message",
    [
        ({"local_disk_write_threads": 0}, r"extra_config\.local_disk_write_threads=0: expected an integer >= 1"),
        ({"local_disk_queue_depth": 2.5}, r"extra_config\.local_disk_queue_depth=2\.5: expected an integer"),
        ({"local_disk_close_timeout": -1}, r"extra_config\.local_disk_close_timeout=-1: expected a number >= 0"),
        ({"local_disk_o_direct": "maybe"}, r"extra_config\.local_disk_o_direct='maybe': expected a boolean"),
    ],
)
def test_bad_values_name_key_value_and_expectation(extra, message):
    with pytest.raises(ConfigError, match=message):
        parse_options(DiskTierOptions, extra, root="/x", capacity_bytes=1)


def test_remote_choices_and_cross_field_rules():
    cfg = LMCacheEngineConfig.from_dict({"extra_config": {"remote_tls_cert_reqs": "maybe"}})
    with pytest.raises(ConfigError, match="expected one of required, optional, none"):
        RemoteOptions.from_config(cfg, 1 << 30)
    cfg = LMCacheEngineConfig.from_dict({"extra_config": {"remote_backoff_initial": 2, "remote_backoff_max": 1}})
    with pytest.raises(ConfigError, match="remote_backoff_max=1.0: expected >= remote_backoff_initial=2.0"):
        RemoteOptions.from_config(cfg, 1 << 30)
    opts = RemoteOptions.from_config(LMCacheEngineConfig.from_dict({}), 64 << 20)
    assert opts.max_inflight_bytes == 16 << 20 and opts.key_prefix == "lmcache" and opts.tls.cert_reqs == "required"


@given(st.integers(-5, 100))
def test_int_bounds_from_the_field(n):
    extra = {"remote_workers": n}
    cfg = LMCacheEngineConfig.from_dict({"extra_config": extra})
    if n >= 1:
        assert RemoteOptions.from_config(cfg, 1 << 30).workers == n
        assert RemoteOptions.from_config(LMCacheEngineConfig.from_dict({"extra_config": {"remote_workers": str(n)}}), 1 << 30).workers == n
    else:
        with pytest.raises(ConfigError, match=f"remote_workers={n!r}"):
            RemoteOptions.from_config(cfg, 1 << 30)


def test_option_classes_are_frozen():
    opts = ConnectorOptions()
    with pytest.raises(AttributeError):
        opts.use_gpu = True  # type: ignore[misc]


# ----------------------------------------------------------------------------- the docs come from the fields
def test_configuration_doc_tables_are_generated_from_the_fields():
    text = (ROOT / "docs" / "configuration.md").read_text()
    assert option_tables.current(text) == option_tables.render(), "run scripts/option_tables.py --write"


@pytest.mark.parametrize("doc, cls", [("disk.md", DiskTierOptions), ("remote.md", RemoteOptions)])
def test_tier_pages_show_every_option_with_its_default(doc, cls):
    text = (ROOT / "docs" / doc).read_text()
    for f in option_fields(cls):
        key = f.metadata["key"]
        assert key in text, f"{doc} does not mention {key}"
        line = re.search(rf"^\s*{key}:\s*(\S+)", text, re.M)
        if line is not None and f.default is not None:  # a YAML example line: it shows the default
            shown = parse_value(f, yaml.safe_load(line.group(1)))
            assert shown == f.default, f"{doc}: {key}: {line.group(1)} but the default is {default_text(f)}"
