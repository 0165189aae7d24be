"""The engine's public calls refuse bad arguments: TypeError for a wrong type or an unknown
keyword, ValueError for a bad value, and nothing is stored or written when they do."""

from __future__ import annotations

import pytest
import torch

from lmcache.v1.request import KeyExtras
from lmcache.v1.testing import KVSpec, make_engine, random_kv_caches, random_slot_mapping


@pytest.mark.parametrize("layout", ["vllm_cpu", "flashinfer", "mla"])
def test_a_shorter_later_layer_is_refused(layout):
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
def test_non_integer_slot_mappings_raise_type_error(slots):
    spec = KVSpec(num_blocks=8, block_size=8)
    engine = make_engine(spec)
    kv = random_kv_caches(spec)
    with pytest.raises(TypeError, match="slot_mapping"):
        engine.store(list(range(32)), kvcaches=kv, slot_mapping=slots)
    with pytest.raises(TypeError, match="slot_mapping"):
        engine.retrieve(list(range(32)), kvcaches=kv, slot_mapping=slots)
    assert engine.storage_manager.allocator.used_bytes == 0
    engine.close()


def test_slot_outside_the_paged_cache_raises_value_error():
    spec = KVSpec(num_blocks=8, block_size=8)
    engine = make_engine(spec)
    slots = random_slot_mapping(spec, 32)
    slots[3] = 64
    with pytest.raises(ValueError, match="outside the paged cache"):
        engine.store(list(range(32)), kvcaches=random_kv_caches(spec), slot_mapping=slots)
    engine.close()


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
