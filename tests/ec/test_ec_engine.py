"""ECCacheEngine: keys, return meanings, ownership (no aliasing, references released), concurrency."""

from __future__ import annotations

import threading

import pytest
import torch
import xxhash
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from lmcache.utils import CacheEngineKey
from lmcache.v1.config import LMCacheEngineConfig
from lmcache.v1.ec_engine import ECCacheEngine, ec_cache_key, stable_u64_from_str
from lmcache.v1.memory_management import GiB, MemoryFormat, MemoryObj

MiB = 1 << 20


def make_engine(
    pool_mib: float = 8, dtype: torch.dtype | str = torch.float32, model: str = "tiny/vlm"
) -> ECCacheEngine:
    config = LMCacheEngineConfig.from_dict({"max_local_cpu_size": pool_mib * MiB / GiB})
    return ECCacheEngine(config, model, dtype)


@pytest.fixture
def engine():
    eng = make_engine()
    yield eng
    eng.close()


def resident_bytes(eng: ECCacheEngine) -> int:
    return eng.storage_manager.allocator.used_bytes


# ----------------------------------------------------------------------------- keys
def test_stable_hash_is_xxh3_64_and_fixed_across_versions():
    # Golden values: a change here would orphan every EC entry on disk.
    assert stable_u64_from_str("abc") == 8696274497037089104
    assert stable_u64_from_str("") == 3244421341483603138


@given(st.text())
def test_stable_hash_is_64_bit_xxh3_of_utf8(text):
    value = stable_u64_from_str(text)
    assert value == xxhash.xxh3_64_intdigest(text.encode("utf-8"))
    assert 0 <= value < 2**64


def test_key_fields_follow_the_spec_table():
    eng = make_engine(dtype=torch.bfloat16, model="org/llava-tiny")
    try:
        key = eng.key("f00d" * 16)
        assert key == CacheEngineKey(
            model_name="org/llava-tiny",
            world_size=1,
            worker_id=0,
            chunk_hash=xxhash.xxh3_64_intdigest(("f00d" * 16).encode()),
            dtype="bfloat16",
            request_configs=(),
        )
        assert CacheEngineKey.from_string(key.to_string()) == key
        assert key == ec_cache_key("org/llava-tiny", "f00d" * 16, torch.bfloat16)
    finally:
        eng.close()


def test_key_dtype_is_the_encoder_dtype_so_entries_do_not_mix():
    a = ec_cache_key("m", "h", torch.float16)
    b = ec_cache_key("m", "h", torch.bfloat16)
    assert a.dtype == torch.float16 and b.dtype == torch.bfloat16 and a != b
    assert ec_cache_key("m1", "h", torch.float16) != ec_cache_key("m2", "h", torch.float16)


def test_encoder_dtype_by_name_and_bad_inputs():
    eng = make_engine(dtype="torch.float16")
    try:
        assert eng.encoder_dtype is torch.float16
        with pytest.raises(TypeError, match="mm_hash"):
            eng.contains(123)  # type: ignore[arg-type]
        with pytest.raises(TypeError, match="expected a torch.Tensor"):
            eng.put("h", [1.0, 2.0])  # type: ignore[arg-type]
    finally:
        eng.close()
    with pytest.raises(TypeError, match="encoder_dtype"):
        make_engine(dtype="not_a_dtype")
    with pytest.raises(ValueError, match="model_name"):
        make_engine(model="")


# ----------------------------------------------------------------------------- return meanings
def test_miss_then_put_then_hit(engine):
    t = torch.randn(7, 16)
    assert engine.contains("img") is False
    assert engine.get("img") is None
    assert engine.put("img", t) is True
    assert engine.contains("img") is True
    out = engine.get("img", "cpu")
    assert out is not None and out.dtype == torch.float32 and out.device.type == "cpu"
    assert torch.equal(out, t)
    s = engine.stats.snapshot()
    assert (s["lookups"], s["lookup_hits"], s["hits"], s["misses"], s["puts"]) == (2, 1, 1, 1, 1)


def test_put_casts_to_encoder_dtype_in_one_copy():
    eng = make_engine(dtype=torch.bfloat16)
    try:
        src = torch.randn(5, 12, dtype=torch.float64)
        assert eng.put("x", src)
        out = eng.get("x")
        assert out is not None and out.dtype == torch.bfloat16
        assert torch.equal(out, src.to(torch.bfloat16))
    finally:
        eng.close()


def test_put_returns_false_only_when_the_pool_cannot_hold_it():
    eng = make_engine(pool_mib=1)
    try:
        too_big = torch.zeros(512, 1024)  # 2 MiB > 1 MiB pool
        assert eng.put("big", too_big) is False
        assert eng.contains("big") is False and eng.get("big") is None
        assert eng.stats.snapshot()["put_failures"] == 1
        # pressure from older entries is not a failure: they are evicted
        for i in range(8):
            assert eng.put(f"small{i}", torch.full((64, 1024), float(i))) is True  # 256 KiB each
        assert eng.stats.snapshot()["evictions"] > 0
        out = eng.get("small7")
        assert out is not None and torch.all(out == 7.0)
    finally:
        eng.close()


def test_put_of_resident_entry_copies_nothing(engine):
    t = torch.randn(3, 4)
    assert engine.put("same", t)
    used = resident_bytes(engine)
    assert engine.put("same", t * 0)  # ignored: same mm_hash means same content
    assert resident_bytes(engine) == used
    assert torch.equal(engine.get("same"), t)
    assert engine.stats.snapshot()["put_existing"] == 1


def test_put_and_get_validate_their_arguments():
    ec = ECCacheEngine(LMCacheEngineConfig.from_dict({"chunk_size": 16, "max_local_cpu_size": 0.05}), "m", torch.float32)
    try:
        with pytest.raises(TypeError, match="mm_hash"):
            ec.put(123, torch.zeros(2, 2))
        with pytest.raises(TypeError, match="tensor"):
            ec.put("a", [[1.0]])
        with pytest.raises(ValueError, match="tensor"):
            ec.put("a", torch.tensor(1.0))
        assert ec.put("a", torch.ones(2, 3))
        with pytest.raises(ValueError, match="device"):
            ec.get("a", device="not-a-device")
        assert torch.equal(ec.get("a"), torch.ones(2, 3))
    finally:
        ec.close()


# ----------------------------------------------------------------------------- ownership
def test_returned_tensor_never_aliases_cache_memory(engine):
    src = torch.randn(6, 8)
    keep = src.clone()
    assert engine.put("a", src)
    src.add_(100)  # the cache holds its own copy
    first = engine.get("a")
    assert torch.equal(first, keep)
    first.mul_(0)  # changing the result does not change the cache
    second = engine.get("a")
    assert torch.equal(second, keep)
    assert first.data_ptr() != second.data_ptr()
    slabs = engine.storage_manager.allocator.slab_ranges()
    assert slabs and not any(p <= second.data_ptr() < p + size for p, size in slabs)
    engine.close()
    assert torch.equal(second, keep)  # still valid after the cache is gone


def test_references_are_released_on_every_path(engine):
    key = engine.key("r")
    assert engine.put("r", torch.randn(4, 4))
    for _ in range(3):
        assert engine.get("r") is not None
    assert engine.get("missing") is None
    # only the CPU tier's own reference is left: removing it returns all memory to the pool
    assert engine.storage_manager.remove(key)
    assert resident_bytes(engine) == 0


def test_reference_released_when_memory_object_has_no_tensor(engine, monkeypatch):
    freed = MemoryObj.from_tensor(torch.zeros(2, 2), MemoryFormat.EC_TD)
    freed.ref_count_up()  # 2 references: ours below, and the one get() must drop
    freed._tensor = None  # what a tier returns for an object whose data is gone
    monkeypatch.setattr(engine.storage_manager, "get", lambda key: freed)
    assert engine.get("gone") is None
    assert freed.ref_count == 1
    assert engine.stats.snapshot()["misses"] == 1


def test_tier_failure_is_a_miss_logged_once(engine, monkeypatch, caplog):
    def broken(key):
        raise OSError("disk unplugged")

    monkeypatch.setattr(engine.storage_manager, "get", broken)
    monkeypatch.setattr(engine.storage_manager, "contains", lambda key, pin=False: broken(key))
    with caplog.at_level("WARNING", logger="lmcache.v1.ec_engine"):
        assert engine.get("x") is None
        assert engine.get("y") is None
        assert engine.contains("x") is False
    assert sum("disk unplugged" in r.getMessage() for r in caplog.records) == 1
    assert engine.stats.snapshot()["load_errors"] == 3


# ----------------------------------------------------------------------------- concurrency
def test_concurrent_puts_of_the_same_item_are_idempotent():
    eng = make_engine()
    try:
        payload = torch.randn(32, 64)
        n = 8
        barrier = threading.Barrier(n)
        results: list[bool] = []
        lock = threading.Lock()

        def worker():
            barrier.wait()
            ok = eng.put("shared-image", payload.clone())
            with lock:
                results.append(ok)

        threads = [threading.Thread(target=worker) for _ in range(n)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        assert results == [True] * n
        assert eng.storage_manager.local_cpu.keys() == [eng.key("shared-image")]
        assert resident_bytes(eng) == payload.numel() * 4  # one copy (16 KiB, page aligned)
        assert torch.equal(eng.get("shared-image"), payload)
        s = eng.stats.snapshot()
        assert s["puts"] + s["put_existing"] == n and s["puts"] >= 1
    finally:
        eng.close()


def test_concurrent_gets_and_puts_of_different_items():
    eng = make_engine()
    try:
        tensors = {f"h{i}": torch.full((8, 8), float(i)) for i in range(16)}
        errors: list[BaseException] = []

        def worker(names):
            try:
                for name in names:
                    assert eng.put(name, tensors[name])
                    out = eng.get(name)
                    assert out is not None and torch.equal(out, tensors[name])
            except BaseException as exc:  # noqa: BLE001 - reported by the main thread
                errors.append(exc)

        names = sorted(tensors)
        threads = [threading.Thread(target=worker, args=(names[i::4],)) for i in range(4)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        assert not errors
        assert len(eng.storage_manager.local_cpu) == 16
    finally:
        eng.close()


# ----------------------------------------------------------------------------- properties
@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(
    tokens=st.integers(1, 40),
    dim=st.integers(1, 96),
    src_dtype=st.sampled_from([torch.float32, torch.float16, torch.bfloat16, torch.float64]),
    enc_dtype=st.sampled_from([torch.float32, torch.float16, torch.bfloat16]),
    mm_hash=st.text(min_size=1, max_size=70),
)
def test_round_trip_equals_one_cast(tokens, dim, src_dtype, enc_dtype, mm_hash):
    eng = make_engine(pool_mib=1, dtype=enc_dtype)
    try:
        src = torch.randn(tokens, dim).to(src_dtype)
        assert eng.put(mm_hash, src)
        out = eng.get(mm_hash)
        assert out is not None and out.shape == src.shape and out.dtype == enc_dtype
        assert torch.equal(out, src.to(enc_dtype))
    finally:
        eng.close()


def test_close_is_idempotent_and_flushes():
    eng = make_engine()
    assert eng.put("a", torch.ones(2, 2))
    assert eng.flush(timeout=1.0)
    eng.close()
    eng.close()
