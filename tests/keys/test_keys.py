from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from lmcache.utils import KEY_DTYPE_NAMES, CacheEngineKey, LayerCacheEngineKey, parse_cache_key
from lmcache.v1.config import LMCacheEngineConfig
from lmcache.v1.metadata import LMCacheEngineMetadata
from lmcache.v1.request import KeyExtras
from lmcache.v1.token_database import KEY_FORMAT_VERSION, ChunkedTokenDatabase

REPO = Path(__file__).resolve().parents[2]

text = st.text(min_size=1, max_size=20)


@given(text, st.integers(1, 8), st.integers(0, 2**128 - 1), st.sampled_from(sorted(KEY_DTYPE_NAMES, key=str)),
       st.lists(st.tuples(text, text), max_size=3))
def test_key_string_round_trip(model, world, chash, dtype, cfgs):
    key = CacheEngineKey(model, world, world - 1, chash, dtype, tuple(cfgs))
    assert CacheEngineKey.from_string(key.to_string()) == key
    assert parse_cache_key(key.to_string()) == key
    for layer_key in key.split_layers(3):
        assert LayerCacheEngineKey.from_string(layer_key.to_string()) == layer_key
        assert parse_cache_key(layer_key.to_string()) == layer_key
        assert layer_key.base_key() == key


def test_split_layers():
    key = CacheEngineKey("m", 1, 0, 5, "bfloat16")
    layers = key.split_layers(4)
    assert [k.layer_id for k in layers] == [0, 1, 2, 3]
    assert len(set(layers)) == 4 and key not in layers
    with pytest.raises(ValueError):
        key.split_layers(0)
    with pytest.raises(ValueError, match="malformed"):
        CacheEngineKey.from_string("a@b")


def make_db(chunk_size=4, model="m", dtype=torch.bfloat16, save_unfull=False, worker=0, world=1):
    cfg = LMCacheEngineConfig.from_dict({"chunk_size": chunk_size, "save_unfull_chunk": save_unfull})
    md = LMCacheEngineMetadata(model, world, worker, "vllm", dtype, (2, 2, chunk_size, 2, 8))
    return ChunkedTokenDatabase(cfg, md)


def test_chunks_spans_and_partial():
    tokens = list(range(10))
    assert [(s, e) for s, e, _ in make_db().process_tokens(tokens)] == [(0, 4), (4, 8)]
    assert [(s, e) for s, e, _ in make_db(save_unfull=True).process_tokens(tokens)] == [(0, 4), (4, 8), (8, 10)]


def test_chained_prefix_property():
    db = make_db()
    a = [k for *_, k in db.process_tokens(list(range(12)))]
    b = [k for *_, k in db.process_tokens(list(range(8)) + [99, 98, 97, 96])]
    assert a[:2] == b[:2] and a[2] != b[2]
    c = [k for *_, k in db.process_tokens([7] + list(range(1, 12)))]
    assert all(x != y for x, y in zip(a, c))  # a change in the head changes every later key


def test_input_types_agree():
    db = make_db()
    ref = [k for *_, k in db.process_tokens(list(range(16)))]
    assert [k for *_, k in db.process_tokens(np.arange(16, dtype=np.int64))] == ref
    assert [k for *_, k in db.process_tokens(torch.arange(16, dtype=torch.int32))] == ref
    with pytest.raises(ValueError, match="tokens"):
        list(db.process_tokens(torch.zeros(4, 2, dtype=torch.long)))
    with pytest.raises(ValueError, match="int32"):
        list(db.process_tokens([2**40] * 4))


def test_mask_rules():
    db = make_db()
    tokens = list(range(12))
    mask = torch.tensor([False] * 4 + [True] * 8)
    assert [(s, e) for s, e, _ in db.process_tokens(tokens, mask)] == [(4, 8), (8, 12)]
    full = [k for *_, k in db.process_tokens(tokens)]
    assert [k for *_, k in db.process_tokens(tokens, mask)] == full[1:]
    with pytest.raises(ValueError, match="multiple of chunk_size=4"):
        list(db.process_tokens(tokens, torch.tensor([False] * 3 + [True] * 9)))
    with pytest.raises(ValueError, match="False followed only by True"):
        list(db.process_tokens(tokens, torch.tensor([True] * 4 + [False] * 4 + [True] * 4)))
    with pytest.raises(ValueError, match="shape"):
        list(db.process_tokens(tokens, torch.ones(5, dtype=torch.bool)))


def test_namespace_and_salt_make_keys_disjoint():
    tokens = list(range(16))
    base = {k.chunk_hash for *_, k in make_db().process_tokens(tokens)}
    others = [
        {k.chunk_hash for *_, k in make_db(model="other").process_tokens(tokens)},
        {k.chunk_hash for *_, k in make_db(dtype=torch.float16).process_tokens(tokens)},
        {k.chunk_hash for *_, k in make_db(world=2, worker=1).process_tokens(tokens)},
        {k.chunk_hash for *_, k in make_db().process_tokens(tokens, cache_salt="tenant-a")},
        {k.chunk_hash for *_, k in make_db().process_tokens(tokens, extra_keys=["lora:x"])},
        {k.chunk_hash for *_, k in make_db().process_tokens(tokens, request_configs={"tag": "1"})},
    ]
    for other in others:
        assert base.isdisjoint(other)
    salted_a = [k for *_, k in make_db().process_tokens(tokens, cache_salt="a")]
    salted_b = [k for *_, k in make_db().process_tokens(tokens, cache_salt="b")]
    assert set(salted_a).isdisjoint(salted_b)
    assert salted_a == [k for *_, k in make_db().process_tokens(tokens, cache_salt="a")]


_CHILD = """
import json, torch
from tests.keys.test_keys import make_db
print(json.dumps([k.to_string() for *_, k in make_db().process_tokens(list(range(40)), cache_salt="s")]))
"""


@pytest.mark.slow  # child processes
def test_keys_identical_across_processes_and_hash_seeds():
    outs = []
    for seed in ("0", "12345"):
        env = dict(os.environ, PYTHONHASHSEED=seed)
        res = subprocess.run([sys.executable, "-c", _CHILD], env=env, capture_output=True, text=True, check=True,
                             cwd=os.path.dirname(os.path.dirname(os.path.dirname(__file__))))
        outs.append(json.loads(res.stdout))
    local = [k.to_string() for *_, k in make_db().process_tokens(list(range(40)), cache_salt="s")]
    assert outs[0] == outs[1] == local
    assert len(local) == 10


def test_key_equality_and_hash():
    a = CacheEngineKey("m", 1, 0, 5, "bfloat16")
    same = CacheEngineKey("m", 1, 0, 5, "bfloat16")
    others = [
        CacheEngineKey("n", 1, 0, 5, "bfloat16"),
        CacheEngineKey("m", 2, 0, 5, "bfloat16"),
        CacheEngineKey("m", 2, 1, 5, "bfloat16"),
        CacheEngineKey("m", 1, 0, 6, "bfloat16"),
        CacheEngineKey("m", 1, 0, 5, "float16"),
        CacheEngineKey("m", 1, 0, 5, "bfloat16", (("tag", "x"),)),
    ]
    assert a == same and hash(a) == hash(same) and {a: 1}[same] == 1
    assert all(a != o for o in others) and len({a, *others}) == 7
    layers, layers2 = a.split_layers(3), same.split_layers(3)
    assert layers == layers2 and {k: i for i, k in enumerate(layers)}[layers2[2]] == 2
    assert layers[0] != a and a != layers[0] and layers[0] != layers[1]
    assert LayerCacheEngineKey("m", 1, 0, 5, "bfloat16", (), 0) == layers[0]


# ---------------------------------------------------------------------- extras (salt, extra_keys, request_configs)
def test_salt_and_extra_keys_do_not_collide():
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
def test_key_extras_encoding_is_injective(x, y):
    assert KeyExtras.build(**x).encode() != KeyExtras.build(**y).encode()
    db = make_db()
    ka = [k.chunk_hash for *_, k in db.process_tokens(list(range(16)), **x)]
    kb = [k.chunk_hash for *_, k in db.process_tokens(list(range(16)), **y)]
    assert ka != kb


_EXTRAS_CHILD = """
import json
from tests.keys.test_keys import make_db
db = make_db()
out = [k.to_string() for *_, k in db.process_tokens(list(range(40)), cache_salt="s",
       extra_keys=["lora=X", 7], request_configs={"b": 1.5, "a": "x"})]
print(json.dumps(out))
"""


@pytest.mark.slow  # child processes
def test_keys_with_extras_identical_across_processes_and_hash_seeds():
    outs = []
    for seed in ("1", "98765"):
        env = dict(os.environ, PYTHONHASHSEED=seed, PYTHONPATH=str(REPO))
        res = subprocess.run([sys.executable, "-c", _EXTRAS_CHILD], env=env, capture_output=True, text=True, check=True, cwd=REPO)
        outs.append(json.loads(res.stdout))
    local = [
        k.to_string()
        for *_, k in make_db().process_tokens(
            list(range(40)), cache_salt="s", extra_keys=["lora=X", 7], request_configs={"a": "x", "b": 1.5}
        )
    ]
    assert outs[0] == outs[1] == local


def test_key_format_version_is_v2():
    assert KEY_FORMAT_VERSION == "lmcache-key-v2"
