"""HiddenStateStore: API notes and eviction model of spec/hidden_state_store.rst.

The engines are real (real StorageManager, real paged KV copied through the connector);
nothing is mocked. Chunk size 16 keeps sequences short.
"""

from __future__ import annotations

import threading
from concurrent.futures import ThreadPoolExecutor

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from lmcache.v1.cache_engine import LMCacheEngine
from lmcache.v1.config import ConfigError, LMCacheEngineConfig
from lmcache.v1.hidden_state_store import HiddenStateStore
from lmcache.v1.memory_management import GiB
from lmcache.v1.testing import KVSpec, make_engine, random_kv_caches, random_slot_mapping

CHUNK = 16
DIM = 32
SPEC = KVSpec(num_layers=2, num_heads=2, head_size=8, num_blocks=64, block_size=16)
# KV bytes of one chunk for SPEC: 2 (K,V) * layers * tokens * hidden * 4 B = 4 KiB (one pool page)
KV_CHUNK_BYTES = 2 * SPEC.num_layers * CHUNK * SPEC.hidden * 4
PAGE = 4096


def make_hs_engine(
    *,
    save_unfull_chunk: bool = False,
    layers: list[int] | None = None,
    hs_bytes: int = 1 << 20,
    kv_bytes: int = 1 << 22,
) -> LMCacheEngine:
    cfg = LMCacheEngineConfig.from_dict(
        {
            "chunk_size": CHUNK,
            "max_local_cpu_size": kv_bytes / GiB,
            "enable_hidden_state_cache": True,
            "max_hidden_state_cpu_size": hs_bytes / GiB,
            "hidden_state_layers": layers,
            "save_unfull_chunk": save_unfull_chunk,
        }
    )
    return make_engine(SPEC, cfg)


class KVSource:
    """A real paged KV cache the tests store from (one per engine)."""

    def __init__(self, seed: int = 0) -> None:
        self.kv = random_kv_caches(SPEC, seed=seed)
        self.slots = random_slot_mapping(SPEC, SPEC.num_blocks * SPEC.block_size, seed=seed)

    def store(self, engine: LMCacheEngine, tokens: list[int], **extras) -> int:
        return engine.store(tokens, kvcaches=self.kv, slot_mapping=self.slots[: len(tokens)], **extras)


def tokens_of(seq: int, n: int) -> list[int]:
    return [(seq * 7919 + i * 31) % 5000 + 1 for i in range(n)]


def hs_of(seq: int, n: int, dim: int = DIM, layer: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seq * 1000 + layer)
    return torch.randn((n, dim), generator=g)


def store(engine: LMCacheEngine) -> HiddenStateStore:
    hs = engine.hidden_state_store
    assert isinstance(hs, HiddenStateStore)
    return hs


# ---------------------------------------------------------------------------- config
def test_disabled_store_is_none() -> None:
    engine = make_engine(SPEC)
    try:
        assert engine.hidden_state_store is None
    finally:
        engine.close()


def test_config_defaults() -> None:
    cfg = LMCacheEngineConfig()
    assert cfg.enable_hidden_state_cache is False
    assert cfg.max_hidden_state_cpu_size == 2.0  # GiB, LMCache 0.5.6's default
    assert cfg.hidden_state_layers is None


@pytest.mark.parametrize("size", [0, -1, "0", "-0.5"])
def test_config_enabled_needs_positive_pool(size) -> None:
    with pytest.raises(ConfigError, match="max_hidden_state_cpu_size"):
        LMCacheEngineConfig.from_dict({"enable_hidden_state_cache": True, "max_hidden_state_cpu_size": size})


def test_config_disabled_accepts_zero_pool() -> None:
    cfg = LMCacheEngineConfig.from_dict({"enable_hidden_state_cache": False, "max_hidden_state_cpu_size": 0})
    assert cfg.max_hidden_state_cpu_size == 0.0


@pytest.mark.parametrize("value", ["yes please", 2, 1.5])
def test_config_enable_must_be_boolean(value) -> None:
    with pytest.raises(ConfigError, match="enable_hidden_state_cache"):
        LMCacheEngineConfig.from_dict({"enable_hidden_state_cache": value})


@pytest.mark.parametrize("value", ["lots", True, [1]])
def test_config_pool_size_must_be_number(value) -> None:
    with pytest.raises(ConfigError, match="max_hidden_state_cpu_size"):
        LMCacheEngineConfig.from_dict({"max_hidden_state_cpu_size": value})


@pytest.mark.parametrize(
    ("value", "expected"),
    [(None, None), ([0, 3], [0, 3]), ("0,2", [0, 2]), ("[1, 4]", [1, 4]), (5, [5]), ("none", None), ("", None)],
)
def test_config_layer_allowlist_parsing(value, expected) -> None:
    cfg = LMCacheEngineConfig.from_dict({"hidden_state_layers": value})
    assert cfg.hidden_state_layers == expected


@pytest.mark.parametrize("value", [[-1], ["a"], [True], "x,y", {"a": 1}, 1.5])
def test_config_layer_allowlist_rejects_bad_items(value) -> None:
    with pytest.raises(ConfigError, match="hidden_state_layers"):
        LMCacheEngineConfig.from_dict({"hidden_state_layers": value})


def test_config_from_yaml_and_env(tmp_path, monkeypatch) -> None:
    path = tmp_path / "lmcache.yaml"
    path.write_text(
        "chunk_size: 16\nenable_hidden_state_cache: true\nmax_hidden_state_cpu_size: 0.5\nhidden_state_layers: [0, 1]\n"
    )
    monkeypatch.setenv("LMCACHE_CONFIG_FILE", str(path))
    monkeypatch.setenv("LMCACHE_HIDDEN_STATE_LAYERS", "2,3")
    cfg = LMCacheEngineConfig.load()
    got = (cfg.enable_hidden_state_cache, cfg.max_hidden_state_cpu_size, cfg.hidden_state_layers)
    assert got == (True, 0.5, [2, 3])  # env wins over the file
    monkeypatch.setenv("LMCACHE_MAX_HIDDEN_STATE_CPU_SIZE", "0")
    with pytest.raises(ConfigError, match="max_hidden_state_cpu_size"):
        LMCacheEngineConfig.load()


def test_pool_is_sized_by_config_and_separate_from_kv() -> None:
    engine = make_hs_engine(hs_bytes=64 * PAGE)
    try:
        hs = store(engine)
        assert hs.allocator.capacity == 64 * PAGE
        assert hs.allocator is not engine.storage_manager.allocator
        kv_used = engine.storage_manager.allocator.used_bytes
        hs.store_hidden_states(tokens_of(0, 48), hs_of(0, 48))
        assert engine.storage_manager.allocator.used_bytes == kv_used
        assert hs.used_bytes == 3 * PAGE
    finally:
        engine.close()


# ---------------------------------------------------------------------------- round trip
@pytest.fixture
def engine():
    eng = make_hs_engine()
    yield eng
    eng.close()


def test_round_trip_returns_cpu_float32_contiguous_copy(engine) -> None:
    hs, kv = store(engine), KVSource()
    tokens, rows = tokens_of(1, 48), hs_of(1, 48)
    kv.store(engine, tokens)
    assert hs.store_hidden_states(tokens, rows) == 3  # chunks stored
    out = hs.retrieve_hidden_states(tokens)
    assert out is not None
    assert out.device.type == "cpu" and out.dtype == torch.float32 and out.is_contiguous()
    assert torch.equal(out, rows)
    out.zero_()  # the caller owns it: writing must not reach the cache
    assert torch.equal(hs.retrieve_hidden_states(tokens), rows)
    rows.zero_()  # the store copied the input: the caller may reuse its tensor
    assert not torch.equal(hs.retrieve_hidden_states(tokens), rows)


def test_full_miss_is_none(engine) -> None:
    hs, kv = store(engine), KVSource()
    tokens = tokens_of(2, 32)
    assert hs.retrieve_hidden_states(tokens) is None  # neither KV nor HS
    kv.store(engine, tokens)
    assert hs.retrieve_hidden_states(tokens) is None  # KV only
    assert hs.retrieve_hidden_states([]) is None


def test_longer_query_returns_cached_prefix(engine) -> None:
    hs, kv = store(engine), KVSource()
    tokens, rows = tokens_of(3, 64), hs_of(3, 64)
    kv.store(engine, tokens)
    hs.store_hidden_states(tokens[:32], rows[:32])
    out = hs.retrieve_hidden_states(tokens)
    assert torch.equal(out, rows[:32])


def test_trailing_partial_chunk_hidden_without_save_unfull_chunk(engine) -> None:
    hs, kv = store(engine), KVSource()
    tokens, rows = tokens_of(4, 40), hs_of(4, 40)
    kv.store(engine, tokens)
    assert hs.store_hidden_states(tokens, rows) == 2  # the 8 trailing rows are kept privately
    assert torch.equal(hs.retrieve_hidden_states(tokens), rows[:32])
    assert engine.lookup(tokens) == 32


def test_trailing_partial_chunk_visible_with_save_unfull_chunk() -> None:
    engine = make_hs_engine(save_unfull_chunk=True)
    try:
        hs, kv = store(engine), KVSource()
        tokens, rows = tokens_of(5, 40), hs_of(5, 40)
        assert kv.store(engine, tokens) == 40
        assert hs.store_hidden_states(tokens, rows) == 3  # two full chunks and the 8-token one
        out = hs.retrieve_hidden_states(tokens)
        assert torch.equal(out, rows)
        assert out.shape[0] == engine.lookup(tokens) == 40
    finally:
        engine.close()


def test_restore_is_first_store_wins(engine) -> None:
    hs, kv = store(engine), KVSource()
    tokens = tokens_of(6, 32)
    kv.store(engine, tokens)
    first = hs_of(6, 32)
    hs.store_hidden_states(tokens, first)
    assert hs.store_hidden_states(tokens, hs_of(7, 32)) == 0
    assert torch.equal(hs.retrieve_hidden_states(tokens), first)


def test_key_extras_must_match_the_kv_store(engine) -> None:
    hs, kv = store(engine), KVSource()
    tokens, rows = tokens_of(8, 32), hs_of(8, 32)
    kv.store(engine, tokens, cache_salt="tenant-a", extra_keys=["img-1"])
    hs.store_hidden_states(tokens, rows, cache_salt="tenant-a", extra_keys=["img-1"])
    assert torch.equal(hs.retrieve_hidden_states(tokens, cache_salt="tenant-a", extra_keys=["img-1"]), rows)
    # different keys: the KV of those chunks does not exist, so nothing is returned
    assert hs.retrieve_hidden_states(tokens, cache_salt="tenant-a") is None
    assert hs.retrieve_hidden_states(tokens) is None


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32, torch.float64])
def test_any_floating_dtype_comes_back_float32(engine, dtype) -> None:
    hs, kv = store(engine), KVSource()
    tokens = tokens_of(9, 32)
    rows = hs_of(9, 32).to(dtype)
    kv.store(engine, tokens)
    hs.store_hidden_states(tokens, rows)
    out = hs.retrieve_hidden_states(tokens)
    assert out.dtype == torch.float32
    assert torch.equal(out, rows.to(torch.float32))


def test_non_contiguous_input_accepted(engine) -> None:
    hs, kv = store(engine), KVSource()
    tokens = tokens_of(10, 32)
    rows = hs_of(10, 32).t().contiguous().t()  # column-major view
    assert not rows.is_contiguous()
    kv.store(engine, tokens)
    hs.store_hidden_states(tokens, rows)
    assert torch.equal(hs.retrieve_hidden_states(tokens), rows)


def test_tokens_as_tensor_or_list_give_same_keys(engine) -> None:
    hs, kv = store(engine), KVSource()
    tokens, rows = tokens_of(11, 32), hs_of(11, 32)
    kv.store(engine, tokens)
    hs.store_hidden_states(torch.tensor(tokens), rows)
    assert torch.equal(hs.retrieve_hidden_states(tokens), rows)


# ---------------------------------------------------------------------------- input checks
@pytest.mark.parametrize(
    ("kwargs", "exc", "match"),
    [
        ({"hidden_states": torch.zeros(32)}, ValueError, "2-D"),
        ({"hidden_states": torch.zeros(32, DIM, 1)}, ValueError, "2-D"),
        ({"hidden_states": torch.zeros(32, DIM, dtype=torch.int32)}, TypeError, "floating"),
        ({"hidden_states": torch.zeros(32, DIM, dtype=torch.complex64)}, TypeError, "floating"),
        ({"hidden_states": [[0.0] * DIM] * 32}, TypeError, "torch.Tensor"),
        ({"hidden_states": torch.zeros(31, DIM)}, ValueError, "31 rows.*32 - 0 = 32"),
        ({"hidden_states": torch.zeros(32, DIM), "token_offset": 4}, ValueError, "32 rows.*32 - 4 = 28"),
        ({"hidden_states": torch.zeros(0, DIM), "token_offset": 33}, ValueError, "token_offset=33"),
        ({"hidden_states": torch.zeros(32, DIM), "token_offset": -1}, ValueError, "token_offset=-1"),
        ({"hidden_states": torch.zeros(32, DIM), "token_offset": 1.0}, TypeError, "token_offset"),
        ({"hidden_states": torch.zeros(32, 0)}, ValueError, "hidden_dim"),
        ({"hidden_states": torch.zeros(32, DIM), "layer_idx": -1}, ValueError, "layer_idx=-1"),
        ({"hidden_states": torch.zeros(32, DIM), "layer_idx": "0"}, TypeError, "layer_idx"),
    ],
)
def test_store_input_checks(engine, kwargs, exc, match) -> None:
    hs = store(engine)
    with pytest.raises(exc, match=match):
        hs.store_hidden_states(tokens_of(12, 32), **kwargs)
    assert len(hs) == 0


def test_offset_at_end_is_a_no_op(engine) -> None:
    hs = store(engine)
    assert hs.store_hidden_states(tokens_of(13, 32), torch.zeros(0, DIM), token_offset=32) == 0
    assert len(hs) == 0


def test_bad_token_ids_rejected(engine) -> None:
    with pytest.raises(ValueError, match="tokens"):
        store(engine).store_hidden_states([[1, 2]], torch.zeros(1, DIM))


def test_key_extras_must_be_a_list_not_a_string():
    cfg = LMCacheEngineConfig.from_dict({"chunk_size": 16, "max_local_cpu_size": 0.25, "enable_hidden_state_cache": True})
    engine = make_engine(KVSpec(num_blocks=8, block_size=8), cfg)
    hs = engine.hidden_state_store
    with pytest.raises(TypeError, match="extra_keys"):
        hs.store_hidden_states(list(range(16)), torch.zeros(16, 4), extra_keys="img")
    with pytest.raises(TypeError, match="extra_keys"):
        hs.retrieve_hidden_states(list(range(16)), extra_keys="img")
    engine.close()


# ---------------------------------------------------------------------------- allowlist
def test_layer_allowlist() -> None:
    engine = make_hs_engine(layers=[0, 3])
    try:
        hs, kv = store(engine), KVSource()
        tokens = tokens_of(14, 32)
        kv.store(engine, tokens)
        assert hs.store_hidden_states(tokens, hs_of(14, 32), layer_idx=2) == 0  # filtered, not an error
        assert len(hs) == 0
        assert hs.store_hidden_states(tokens, hs_of(14, 32, layer=3), layer_idx=3) == 2
        assert torch.equal(hs.retrieve_hidden_states(tokens, layer_idx=3), hs_of(14, 32, layer=3))
        assert hs.retrieve_hidden_states(tokens, layer_idx=2) is None  # never stored: a miss, not an error
    finally:
        engine.close()


def test_no_allowlist_accepts_any_layer(engine) -> None:
    hs, kv = store(engine), KVSource()
    tokens = tokens_of(15, 16)
    kv.store(engine, tokens)
    for layer in (0, 7, 1000):
        hs.store_hidden_states(tokens, hs_of(15, 16, layer=layer), layer_idx=layer)
    for layer in (0, 7, 1000):
        assert torch.equal(hs.retrieve_hidden_states(tokens, layer_idx=layer), hs_of(15, 16, layer=layer))


# ---------------------------------------------------------------------------- layers
def test_layers_are_independent(engine) -> None:
    hs, kv = store(engine), KVSource()
    tokens = tokens_of(16, 48)
    kv.store(engine, tokens)
    text = hs_of(16, 48, dim=DIM, layer=0)
    hook = hs_of(16, 48, dim=8, layer=1)  # a second tensor with its own hidden_dim
    hs.store_hidden_states(tokens, text, layer_idx=0)
    hs.store_hidden_states(tokens[:16], hook[:16], layer_idx=1)
    assert torch.equal(hs.retrieve_hidden_states(tokens, layer_idx=0), text)
    # restore stops at the first chunk missing for the requested layer
    assert torch.equal(hs.retrieve_hidden_states(tokens, layer_idx=1), hook[:16])
    assert hs.retrieve_hidden_states(tokens, layer_idx=2) is None


def test_hidden_dim_change_within_a_sequence_cuts_the_prefix(engine) -> None:
    hs, kv = store(engine), KVSource()
    tokens = tokens_of(17, 32)
    kv.store(engine, tokens)
    hs.store_hidden_states(tokens[:16], hs_of(17, 16))
    hs.store_hidden_states(tokens, hs_of(17, 16, dim=8), token_offset=16)
    assert torch.equal(hs.retrieve_hidden_states(tokens), hs_of(17, 16))


# ---------------------------------------------------------------------------- prefix-strict
def test_prefix_stops_at_first_missing_hs_chunk(engine) -> None:
    hs, kv = store(engine), KVSource()
    tokens, rows = tokens_of(18, 48), hs_of(18, 48)
    kv.store(engine, tokens)
    hs.store_hidden_states(tokens[:16], rows[:16])
    hs.store_hidden_states(tokens, rows[32:], token_offset=32)  # chunk 1 never stored
    assert len(hs) == 2
    assert torch.equal(hs.retrieve_hidden_states(tokens), rows[:16])


def test_prefix_stops_at_first_missing_kv_chunk(engine) -> None:
    hs, kv = store(engine), KVSource()
    tokens, rows = tokens_of(19, 48), hs_of(19, 48)
    kv.store(engine, tokens[:16])
    hs.store_hidden_states(tokens, rows)
    assert torch.equal(hs.retrieve_hidden_states(tokens), rows[:16])


def test_offset_inside_an_uncached_chunk_skips_it(engine) -> None:
    hs, kv = store(engine), KVSource()
    tokens, rows = tokens_of(20, 48), hs_of(20, 48)
    kv.store(engine, tokens)
    hs.store_hidden_states(tokens, rows[20:], token_offset=20)  # rows 16..20 were never given
    assert hs.stats.snapshot()["incomplete_chunks"] == 1
    assert hs.retrieve_hidden_states(tokens) is None
    hs.store_hidden_states(tokens[:32], rows[:32])  # fill the hole: the whole prefix appears
    assert torch.equal(hs.retrieve_hidden_states(tokens), rows)


# ---------------------------------------------------------------------------- incremental
def _incremental(engine: LMCacheEngine, tokens: list[int], rows: torch.Tensor, cuts: list[int]) -> None:
    hs = store(engine)
    bounds = [0, *cuts, len(tokens)]
    for a, b in zip(bounds, bounds[1:]):
        hs.store_hidden_states(tokens[:b], rows[a:b], token_offset=a)


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    n=st.integers(1, 90),
    cut_fracs=st.lists(st.floats(0, 1), max_size=6),
    save_unfull=st.booleans(),
    dtype=st.sampled_from([torch.float32, torch.bfloat16]),
)
def test_incremental_stores_equal_one_full_store(n, cut_fracs, save_unfull, dtype) -> None:
    cuts = sorted({int(f * n) for f in cut_fracs})
    tokens, rows = tokens_of(21, n), hs_of(21, n).to(dtype)
    whole, parts = make_hs_engine(save_unfull_chunk=save_unfull), make_hs_engine(save_unfull_chunk=save_unfull)
    try:
        kv = KVSource()
        for eng in (whole, parts):
            kv.store(eng, tokens)
        for cut in cuts:  # the KV engine stores each step's prefix too (partial chunks when saved)
            kv.store(parts, tokens[:cut])
        store(whole).store_hidden_states(tokens, rows)
        _incremental(parts, tokens, rows, cuts)
        a = store(whole).retrieve_hidden_states(tokens)
        b = store(parts).retrieve_hidden_states(tokens)
        visible = n if save_unfull else n - n % CHUNK
        if visible == 0:
            assert a is None and b is None
        else:
            assert torch.equal(a, rows[:visible].float())
            assert torch.equal(b, a)
        if not save_unfull:  # private continuation buffers are consumed: no leftover memory
            assert len(store(parts)) == len(store(whole))
            assert store(parts).used_bytes == store(whole).used_bytes
        # every intermediate prefix that was a store boundary is retrievable too
        for cut in cuts:
            vis = cut if save_unfull else cut - cut % CHUNK
            out = store(parts).retrieve_hidden_states(tokens[:cut])
            assert (out is None) if vis == 0 else torch.equal(out, rows[:vis].float())
    finally:
        whole.close()
        parts.close()


def test_decode_style_one_row_at_a_time(engine) -> None:
    hs, kv = store(engine), KVSource()
    tokens, rows = tokens_of(22, 40), hs_of(22, 40)
    kv.store(engine, tokens)
    hs.store_hidden_states(tokens[:5], rows[:5])
    for i in range(5, 40):
        hs.store_hidden_states(tokens[: i + 1], rows[i : i + 1], token_offset=i)
    assert torch.equal(hs.retrieve_hidden_states(tokens), rows[:32])
    assert len(hs) == 3  # two chunks and the private buffer of the 8 trailing rows


def test_continuation_must_keep_hidden_dim(engine) -> None:
    hs = store(engine)
    tokens = tokens_of(23, 32)
    hs.store_hidden_states(tokens[:8], hs_of(23, 8))
    with pytest.raises(ValueError, match="hidden_dim=8 differs from the 32"):
        hs.store_hidden_states(tokens, hs_of(23, 24, dim=8), token_offset=8)


def test_continuation_mixing_dtypes_keeps_precision(engine) -> None:
    hs, kv = store(engine), KVSource()
    tokens, rows = tokens_of(24, 16), hs_of(24, 16)
    kv.store(engine, tokens)
    hs.store_hidden_states(tokens[:8], rows[:8])  # float32 head
    hs.store_hidden_states(tokens, rows[8:].bfloat16(), token_offset=8)
    out = hs.retrieve_hidden_states(tokens)
    assert torch.equal(out[:8], rows[:8])
    assert torch.equal(out[8:], rows[8:].bfloat16().float())


# ---------------------------------------------------------------------------- eviction model
def test_kv_removed_drops_orphan_hs_of_every_layer(engine) -> None:
    hs, kv = store(engine), KVSource()
    tokens, rows = tokens_of(25, 48), hs_of(25, 48)
    kv.store(engine, tokens)
    hs.store_hidden_states(tokens, rows, layer_idx=0)
    hs.store_hidden_states(tokens, rows * 2, layer_idx=1)
    assert len(hs) == 6
    middle = engine.keys(tokens)[1]
    assert engine.storage_manager.remove(middle)
    assert torch.equal(hs.retrieve_hidden_states(tokens, layer_idx=0), rows[:16])
    assert len(hs) == 4  # both layers of the orphan chunk went
    assert hs.stats.snapshot()["orphans_dropped"] == 2
    # re-storing the KV does not bring the dropped HS back
    kv.store(engine, tokens)
    assert torch.equal(hs.retrieve_hidden_states(tokens, layer_idx=1), rows[:16] * 2)


def test_kv_evicted_by_pressure_ends_hs_prefix_at_the_same_place() -> None:
    # KV pool of 3 chunks: storing B (2 chunks) after A (2 chunks) evicts A's tail chunk.
    engine = make_hs_engine(kv_bytes=3 * KV_CHUNK_BYTES)
    try:
        hs, kv = store(engine), KVSource()
        a, b = tokens_of(26, 32), tokens_of(27, 32)
        rows_a = hs_of(26, 32)
        kv.store(engine, a)
        hs.store_hidden_states(a, rows_a)
        kv.store(engine, b)
        hs.store_hidden_states(b, hs_of(27, 32))
        assert engine.stats.evictions == 1
        kv_prefix = engine.lookup(a)
        assert kv_prefix == 16
        out = hs.retrieve_hidden_states(a)
        assert out.shape[0] == kv_prefix
        assert torch.equal(out, rows_a[:16])
        assert hs.stats.snapshot()["orphans_dropped"] == 1
        assert hs.stats.snapshot()["evictions"] == 0
    finally:
        engine.close()


def test_layerwise_engine_couples_on_every_layer_key() -> None:
    """With use_layerwise the KV of a chunk lives under one key per layer: all must exist."""
    cfg = LMCacheEngineConfig.from_dict(
        {
            "chunk_size": CHUNK,
            "max_local_cpu_size": 4 / 1024,
            "use_layerwise": True,
            "enable_hidden_state_cache": True,
            "max_hidden_state_cpu_size": 1 / 1024,
        }
    )
    engine = make_engine(SPEC, cfg)
    try:
        hs, kv = store(engine), KVSource()
        tokens, rows = tokens_of(49, 48), hs_of(49, 48)
        assert kv.store(engine, tokens) == 48
        hs.store_hidden_states(tokens, rows)
        assert torch.equal(hs.retrieve_hidden_states(tokens), rows)
        # lose one layer of chunk 1's KV: the KV prefix and the HS prefix both end at 16
        assert engine.storage_manager.remove(engine.keys(tokens)[1].split_layers(SPEC.num_layers)[1])
        assert engine.lookup(tokens) == 16
        assert torch.equal(hs.retrieve_hidden_states(tokens), rows[:16])
        assert hs.stats.snapshot()["orphans_dropped"] == 1
    finally:
        engine.close()


def test_hs_pressure_never_evicts_kv() -> None:
    # HS pool of 3 chunks; KV pool is large
    engine = make_hs_engine(hs_bytes=3 * PAGE)
    try:
        hs, kv = store(engine), KVSource()
        a, b = tokens_of(28, 32), tokens_of(29, 32)
        rows_a, rows_b = hs_of(28, 32), hs_of(29, 32)
        for tokens, rows in ((a, rows_a), (b, rows_b)):
            kv.store(engine, tokens)
            hs.store_hidden_states(tokens, rows)
        assert hs.stats.snapshot()["evictions"] == 1
        assert engine.stats.evictions == 0
        # HS evicted (tail first) => KV still fully retrievable
        assert engine.lookup(a) == 32 and engine.lookup(b) == 32
        fresh = random_kv_caches(SPEC, seed=99)
        got = engine.retrieve(a, kvcaches=fresh, slot_mapping=random_slot_mapping(SPEC, 32, seed=5))
        assert bool(got.all())
        assert torch.equal(hs.retrieve_hidden_states(a), rows_a[:16])
        assert torch.equal(hs.retrieve_hidden_states(b), rows_b)
    finally:
        engine.close()


def test_hs_lru_keeps_recently_retrieved_sequences() -> None:
    engine = make_hs_engine(hs_bytes=4 * PAGE)
    try:
        hs, kv = store(engine), KVSource()
        seqs = [(tokens_of(s, 32), hs_of(s, 32)) for s in (30, 31, 32)]
        for tokens, _ in seqs:
            kv.store(engine, tokens)
        hs.store_hidden_states(*seqs[0])
        hs.store_hidden_states(*seqs[1])
        assert hs.retrieve_hidden_states(seqs[0][0]) is not None  # A is now most recent
        hs.store_hidden_states(*seqs[2])  # evicts B (least recent), not A
        assert torch.equal(hs.retrieve_hidden_states(seqs[0][0]), seqs[0][1])
        assert hs.retrieve_hidden_states(seqs[1][0]) is None
        assert torch.equal(hs.retrieve_hidden_states(seqs[2][0]), seqs[2][1])
    finally:
        engine.close()


def test_retrieve_keeps_the_head_most_recent() -> None:
    """A retrieve touches a sequence tail first, so under pressure its tail goes before its head."""
    engine = make_hs_engine(hs_bytes=3 * PAGE)
    try:
        hs, kv = store(engine), KVSource()
        a, b, c = tokens_of(37, 32), tokens_of(38, 16), tokens_of(39, 32)
        for tokens in (a, b, c):
            kv.store(engine, tokens)
        hs.store_hidden_states(a, hs_of(37, 32))
        hs.store_hidden_states(b, hs_of(38, 16))
        assert hs.retrieve_hidden_states(a) is not None  # LRU order now: B0, A1, A0
        hs.store_hidden_states(c, hs_of(39, 32))  # evicts B0, then A1
        assert hs.stats.snapshot()["evictions"] == 2
        assert torch.equal(hs.retrieve_hidden_states(a), hs_of(37, 32)[:16])
        assert hs.retrieve_hidden_states(b) is None
    finally:
        engine.close()


def test_chunk_larger_than_pool_is_skipped_not_raised() -> None:
    engine = make_hs_engine(hs_bytes=PAGE)
    try:
        hs, kv = store(engine), KVSource()
        tokens = tokens_of(33, 32)
        kv.store(engine, tokens)
        assert hs.store_hidden_states(tokens, hs_of(33, 32, dim=4096)) == 0
        assert hs.stats.snapshot()["skipped_chunks"] == 1
        assert hs.retrieve_hidden_states(tokens) is None
        assert hs.store_hidden_states(tokens, hs_of(33, 32, dim=16)) == 1  # one 1 KiB-chunk page fits
    finally:
        engine.close()


def test_entry_being_read_is_not_evicted() -> None:
    engine = make_hs_engine(hs_bytes=PAGE)
    try:
        hs, kv = store(engine), KVSource()
        a, b = tokens_of(34, 16), tokens_of(35, 16)
        kv.store(engine, a)
        kv.store(engine, b)
        hs.store_hidden_states(a, hs_of(34, 16))
        # simulate a reader holding A's entry (as retrieve does while copying)
        held = hs.acquire(hs.keys()[0])
        try:
            assert hs.store_hidden_states(b, hs_of(35, 16)) == 0  # nothing evictable
        finally:
            held.ref_count_down()
        assert torch.equal(hs.retrieve_hidden_states(a), hs_of(34, 16))  # A was not dropped
        assert hs.stats.snapshot()["evictions"] == 0
        assert hs.store_hidden_states(b, hs_of(35, 16)) == 1
        assert hs.retrieve_hidden_states(a) is None
    finally:
        engine.close()


# ---------------------------------------------------------------------------- lifecycle
def test_engine_close_closes_the_store() -> None:
    engine = make_hs_engine()
    hs, kv = store(engine), KVSource()
    tokens = tokens_of(36, 32)
    kv.store(engine, tokens)
    hs.store_hidden_states(tokens, hs_of(36, 32))
    engine.close()
    assert len(hs) == 0 and hs.used_bytes == 0
    assert hs.store_hidden_states(tokens, hs_of(36, 32)) == 0
    assert hs.retrieve_hidden_states(tokens) is None
    hs.close()  # idempotent


# ---------------------------------------------------------------------------- threads
def test_concurrent_stores_and_retrieves_under_pressure() -> None:
    engine = make_hs_engine(hs_bytes=12 * PAGE)
    try:
        hs, kv = store(engine), KVSource()
        seqs = {s: (tokens_of(s, 48), hs_of(s, 48)) for s in range(40, 48)}
        for tokens, _ in seqs.values():
            kv.store(engine, tokens)
        start = threading.Barrier(4)

        def worker(offset: int) -> int:
            start.wait()
            checked = 0
            for rnd in range(30):
                s = 40 + (offset + rnd) % 8
                tokens, rows = seqs[s]
                cut = 16 * (1 + (rnd + offset) % 3)
                hs.store_hidden_states(tokens[:cut], rows[:cut], layer_idx=rnd % 2)
                out = hs.retrieve_hidden_states(tokens, layer_idx=rnd % 2)
                if out is not None:
                    assert out.shape[0] % CHUNK == 0
                    assert torch.equal(out, rows[: out.shape[0]])
                    checked += 1
            return checked

        with ThreadPoolExecutor(4) as pool:
            results = [f.result() for f in [pool.submit(worker, i) for i in range(4)]]
        assert sum(results) > 0
        assert hs.used_bytes <= 12 * PAGE
        assert hs.used_bytes == len(hs) * PAGE
    finally:
        engine.close()
