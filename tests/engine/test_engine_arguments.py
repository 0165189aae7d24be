"""Regression tests for the hardening issue (#13): one test (or more) per numbered defect.

Items 7 (disk ENOSPC) and 14 (builder config mismatch) are tested with their own features.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from lmcache.v1.gpu_connector import copy_ops, native
from lmcache.v1.gpu_connector.layouts import get_layout
from lmcache.v1.request import KeyExtras
from lmcache.v1.testing import KVSpec, make_engine, random_kv_caches, random_slot_mapping
from tests.keys.test_keys import make_db

REPO = Path(__file__).resolve().parents[2]
CHUNK = 16


def _impls() -> list[str]:
    out = ["torch"]
    if native.load() is not None:
        out.append("native")
    return out


# ----------------------------------------------------------------------------- item 1
@pytest.mark.parametrize("layout", ["vllm_cpu", "flashinfer", "mla"])
def test_item1_a_shorter_later_layer_is_rejected_by_the_engine(layout):
    """Strides that do not depend on num_blocks: a 1-block layer 1 must not pass as layer 0's size."""
    spec = KVSpec(layout=layout, num_blocks=8, block_size=8)
    short = KVSpec(layout=layout, num_blocks=1, block_size=8)
    engine = make_engine(spec)
    kv = random_kv_caches(spec)
    kv[1] = random_kv_caches(short)[0]
    slots = random_slot_mapping(spec, 32)
    with pytest.raises(ValueError, match=r"kvcaches\[1\]"):
        engine.store(list(range(32)), kvcaches=kv, slot_mapping=slots)
    with pytest.raises(ValueError, match=r"kvcaches\[1\]"):
        engine.retrieve(list(range(32)), kvcaches=kv, slot_mapping=slots)
    engine.close()


@pytest.mark.parametrize("impl", _impls())
@pytest.mark.parametrize("direction", ["gather", "scatter"])
def test_item1_kernels_check_every_layer_capacity(impl, direction):
    """Below the request layer: the copy paths themselves refuse a slot past a shorter layer."""
    spec = KVSpec(layout="vllm_cpu", num_layers=2, num_blocks=8, block_size=8)
    buf = torch.stack(random_kv_caches(spec)).reshape(-1)
    guard = 4096
    raw = torch.full((buf.numel() + guard,), 7.0)
    raw[: buf.numel()] = buf
    per_layer = buf.numel() // 2
    layer0 = raw[:per_layer].view(8, 2, 8, 16)
    layer1 = raw[per_layer : per_layer + per_layer // 2].view(4, 2, 8, 16)  # 4 blocks, same strides
    geom = get_layout("vllm_cpu").geometry(layer0)
    slots = torch.arange(40, 48)  # block 5: inside layer 0, past layer 1
    mem = torch.zeros(2, 2, 8, geom.hidden)
    before = raw.clone()
    fn = copy_ops.paged_gather if direction == "gather" else copy_ops.paged_scatter
    with pytest.raises(IndexError, match="slot"):
        fn([layer0, layer1], geom, slots, [0], [mem], use_native=impl == "native")
    assert torch.equal(raw, before), "nothing may be written when a slot is outside a layer"
    if direction == "gather":
        assert not bool(mem.any())


def test_item1_native_reports_layer_capacity_errors_directly():
    k = native.load()
    if k is None:
        pytest.skip("native kernels are not built")
    spec = KVSpec(layout="flashinfer", num_layers=2, num_blocks=4, block_size=4)
    kv = random_kv_caches(spec)
    small = random_kv_caches(KVSpec(layout="flashinfer", num_layers=1, num_blocks=1, block_size=4))[0]
    geom = get_layout("flashinfer").geometry(kv[0])
    with pytest.raises(IndexError, match=r"slot_mapping\[0\] = 12"):
        k.paged_scatter([kv[0], small], geom, torch.tensor([12, 13]), [0], [torch.zeros(2, 2, 2, geom.hidden)])


# ----------------------------------------------------------------------------- item 2
@pytest.mark.parametrize(
    "slots",
    [
        torch.tensor([float("nan")] * 32),
        torch.arange(32, dtype=torch.float32),
        torch.ones(32, dtype=torch.bool),
        torch.arange(32, dtype=torch.int8),
        torch.arange(32, dtype=torch.int16),
        torch.arange(32).tolist(),
        torch.arange(32).numpy(),
    ],
    ids=["nan", "float", "bool", "int8", "int16", "list", "numpy"],
)
def test_item2_non_integer_slot_mappings_raise(slots):
    spec = KVSpec(num_blocks=8, block_size=8)
    engine = make_engine(spec)
    kv = random_kv_caches(spec)
    with pytest.raises(TypeError, match="slot_mapping"):
        engine.store(list(range(32)), kvcaches=kv, slot_mapping=slots)
    with pytest.raises(TypeError, match="slot_mapping"):
        engine.retrieve(list(range(32)), kvcaches=kv, slot_mapping=slots)
    assert engine.storage_manager.allocator.used_bytes == 0
    engine.close()


@pytest.mark.parametrize("dtype", [torch.int32, torch.int64])
def test_item2_int32_and_int64_slots_round_trip(dtype):
    spec = KVSpec(num_blocks=8, block_size=8)
    engine = make_engine(spec)
    kv = random_kv_caches(spec, seed=3)
    slots = random_slot_mapping(spec, 32).to(dtype)
    assert engine.store(list(range(32)), kvcaches=kv, slot_mapping=slots) == 32
    out = [torch.zeros_like(t) for t in kv]
    assert bool(engine.retrieve(list(range(32)), kvcaches=out, slot_mapping=slots).all())
    for a, b in zip(kv, out):
        flat_a, flat_b = a.reshape(a.shape[0], -1), b.reshape(b.shape[0], -1)
        used = sorted({int(s) // 8 for s in slots})
        assert torch.equal(flat_a[used], flat_b[used])
    engine.close()


def test_item2_out_of_range_slot_raises_value_error():
    spec = KVSpec(num_blocks=8, block_size=8)
    engine = make_engine(spec)
    slots = random_slot_mapping(spec, 32)
    slots[3] = 64
    with pytest.raises(ValueError, match="outside the paged cache"):
        engine.store(list(range(32)), kvcaches=random_kv_caches(spec), slot_mapping=slots)
    engine.close()


# ----------------------------------------------------------------------------- item 10
def test_item10_salt_and_extra_keys_do_not_collide():
    db = make_db()
    tokens = list(range(40))
    a = [k for *_, k in db.process_tokens(tokens, cache_salt="s", extra_keys=["lora=X"])]
    b = [k for *_, k in db.process_tokens(tokens, cache_salt="s|extra=lora=X")]
    assert set(a).isdisjoint(b)


@pytest.mark.parametrize(
    "x, y",
    [
        (dict(extra_keys=["a", "b"]), dict(extra_keys=["ab"])),
        (dict(extra_keys=["a|b"]), dict(extra_keys=["a", "b"])),
        (dict(request_configs={"a": "b=c"}), dict(request_configs={"a=b": "c"})),
        (dict(request_configs={"t": 1}), dict(request_configs={"t": "1"})),
        (dict(cache_salt="x"), dict(extra_keys=["x"])),
        (dict(extra_keys=[1]), dict(extra_keys=["1"])),
    ],
)
def test_item10_key_extras_encoding_is_injective(x, y):
    assert KeyExtras.build(**x).encode() != KeyExtras.build(**y).encode()
    db = make_db()
    ka = [k.chunk_hash for *_, k in db.process_tokens(list(range(16)), **x)]
    kb = [k.chunk_hash for *_, k in db.process_tokens(list(range(16)), **y)]
    assert ka != kb


_CHILD = """
import json
from tests.keys.test_keys import make_db
db = make_db()
out = [k.to_string() for *_, k in db.process_tokens(list(range(40)), cache_salt="s",
       extra_keys=["lora=X", 7], request_configs={"b": 1.5, "a": "x"})]
print(json.dumps(out))
"""


def test_item10_keys_with_extras_are_stable_across_processes_and_hash_seeds():
    outs = []
    for seed in ("1", "98765"):
        env = dict(os.environ, PYTHONHASHSEED=seed, PYTHONPATH=str(REPO))
        res = subprocess.run([sys.executable, "-c", _CHILD], env=env, capture_output=True, text=True, check=True, cwd=REPO)
        outs.append(json.loads(res.stdout))
    local = [
        k.to_string()
        for *_, k in make_db().process_tokens(
            list(range(40)), cache_salt="s", extra_keys=["lora=X", 7], request_configs={"a": "x", "b": 1.5}
        )
    ]
    assert outs[0] == outs[1] == local


def test_item10_key_format_version_bumped():
    from lmcache.v1.token_database import KEY_FORMAT_VERSION

    assert KEY_FORMAT_VERSION == "lmcache-key-v2"


# ----------------------------------------------------------------------------- item 12
@pytest.mark.parametrize("layerwise", [False, True])
def test_item12_retrieve_mask_true_only_where_written(layerwise):
    spec = KVSpec(num_blocks=8, block_size=8)
    engine = make_engine(spec, layerwise=layerwise)
    kv = random_kv_caches(spec)
    slots = random_slot_mapping(spec, 32)
    engine.store(list(range(32)), kvcaches=kv, slot_mapping=slots)
    holes = slots.clone()
    holes[[0, 17, 31]] = -1
    ret = engine.retrieve(list(range(32)), kvcaches=[torch.zeros_like(t) for t in kv], slot_mapping=holes)
    assert ret.tolist() == (holes >= 0).tolist()
    engine.close()


# ----------------------------------------------------------------------------- also accepted silently before
def test_unknown_keyword_arguments_raise_type_error():
    spec = KVSpec(num_blocks=8, block_size=8)
    engine = make_engine(spec)
    kv, slots = random_kv_caches(spec), random_slot_mapping(spec, 32)
    with pytest.raises(TypeError, match="slot_maping"):
        engine.store(list(range(32)), kvcaches=kv, slot_maping=slots)
    with pytest.raises(TypeError, match="kv_caches"):
        engine.retrieve(list(range(32)), kv_caches=kv, slot_mapping=slots)
    with pytest.raises(TypeError, match="salt"):
        engine.lookup(list(range(32)), salt="x")
    with pytest.raises(TypeError, match="kvcaches"):
        engine.lookup(list(range(32)), kvcaches=kv)
    with pytest.raises(TypeError, match="sync"):
        engine.store(list(range(32)), kvcaches=kv, slot_mapping=slots, sync=True)
    engine.close()


def test_extra_keys_as_a_bare_string_raises():
    spec = KVSpec(num_blocks=8, block_size=8)
    engine = make_engine(spec)
    with pytest.raises(TypeError, match="extra_keys"):
        engine.lookup(list(range(32)), extra_keys="lora=X")
    with pytest.raises(TypeError, match="extra_keys"):
        KeyExtras.build(extra_keys=b"abc")
    with pytest.raises(TypeError, match="cache_salt"):
        engine.lookup(list(range(32)), cache_salt=5)
    with pytest.raises(TypeError, match="request_configs"):
        engine.lookup(list(range(32)), request_configs=[("a", "b")])
    with pytest.raises(ValueError, match="finite"):
        engine.lookup(list(range(32)), request_configs={"a": float("nan")})
    engine.close()


def test_hidden_state_store_validates_extras():
    from lmcache.v1.config import LMCacheEngineConfig

    cfg = LMCacheEngineConfig.from_dict({"chunk_size": 16, "max_local_cpu_size": 0.25, "enable_hidden_state_cache": True})
    engine = make_engine(KVSpec(num_blocks=8, block_size=8), cfg)
    hs = engine.hidden_state_store
    with pytest.raises(TypeError, match="extra_keys"):
        hs.store_hidden_states(list(range(16)), torch.zeros(16, 4), extra_keys="img")
    with pytest.raises(TypeError, match="extra_keys"):
        hs.retrieve_hidden_states(list(range(16)), extra_keys="img")
    engine.close()


def test_mask_must_be_zero_one_and_prefix_shaped():
    spec = KVSpec(num_blocks=8, block_size=8)
    engine = make_engine(spec)
    kv, slots = random_kv_caches(spec), random_slot_mapping(spec, 32)
    with pytest.raises(TypeError, match="mask"):
        engine.store(list(range(32)), torch.ones(32, dtype=torch.complex64), kvcaches=kv, slot_mapping=slots)
    with pytest.raises(ValueError, match="mask: value 2"):
        engine.store(list(range(32)), torch.full((32,), 2.0), kvcaches=kv, slot_mapping=slots)
    with pytest.raises(ValueError, match="mask"):
        engine.store(list(range(32)), torch.ones(31, dtype=torch.bool), kvcaches=kv, slot_mapping=slots)
    bad = torch.ones(32, dtype=torch.bool)
    bad[20] = False
    with pytest.raises(ValueError, match="mask"):
        engine.retrieve(list(range(32)), bad, kvcaches=kv, slot_mapping=slots)
    engine.close()


# ----------------------------------------------------------------------------- item 5
@pytest.mark.parametrize("layerwise", [False, True])
def test_item5_entry_of_another_shape_is_a_miss_removed_and_counted(layerwise):
    from lmcache.v1.layerwise import layer_keys

    spec = KVSpec(num_blocks=8, block_size=8)
    engine = make_engine(spec, layerwise=layerwise)
    kv, slots, tokens = random_kv_caches(spec), random_slot_mapping(spec, 32), list(range(32))
    sm = engine.storage_manager
    key = engine.keys(tokens)[0]
    if layerwise:
        per_layer = [layer[0] for layer in layer_keys([key], spec.num_layers)]
        key = per_layer[0]
        shape = (2, 1, CHUNK // 2, spec.hidden)  # well-formed, wrong token count
        for other in per_layer[1:]:  # the other layers are fine: the chunk looks cached
            good = sm.allocate((2, 1, CHUNK, spec.hidden), spec.dtype, engine.gpu_connector.fmt)
            sm.put(other, good)
            good.ref_count_down()
    else:
        shape = (2, spec.num_layers, CHUNK // 2, spec.hidden)
    bad = sm.allocate(shape, spec.dtype, engine.gpu_connector.fmt)
    sm.put(key, bad)
    bad.ref_count_down()
    out = [torch.zeros_like(t) for t in kv]
    for _ in range(2):  # never an exception, every time
        ret = engine.retrieve(tokens, kvcaches=out, slot_mapping=slots)
        assert not bool(ret.any())
    assert engine.stats.corrupt_entries == 1
    assert not sm.contains(key)
    assert engine.store(tokens, kvcaches=kv, slot_mapping=slots) == 32  # the prefix is usable again
    assert bool(engine.retrieve(tokens, kvcaches=out, slot_mapping=slots).all())
    engine.close()


# ----------------------------------------------------------------------------- EC engine boundary
def test_ec_engine_validates_its_arguments():
    from lmcache.v1.config import LMCacheEngineConfig
    from lmcache.v1.ec_engine import ECCacheEngine

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
