"""Key hashing/equality and the prefix probe: the native (C) operations behave exactly like
the pure-Python ones (lmcache/v1/keys.py, ResidentIndex.prefix)."""

from __future__ import annotations

import os
import pickle
import subprocess
import sys
from dataclasses import dataclass

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from lmcache.v1 import keys as keys_mod
from lmcache.v1.keys import CacheEngineKey, LayerCacheEngineKey
from lmcache.v1.storage_backend.cache_policy import make_policy
from lmcache.v1.storage_backend.resident_index import ResidentIndex

native = pytest.mark.skipif(not keys_mod.NATIVE_KEY_OPS, reason="lmcache._keyhash not built (or disabled)")
ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

# small value sets so that equal fields (and equal keys) are frequent
key_st = st.builds(
    CacheEngineKey,
    st.sampled_from(["m", "n"]),
    st.sampled_from([1, 2]),
    st.sampled_from([0, 1]),
    st.sampled_from([0, 5, 2**64 + 5, 2**128 - 1]),
    st.sampled_from([torch.bfloat16, torch.float16]),
    st.sampled_from([(), (("tag", "x"),), (("tag", "y"),)]),
)


def py_equal(a: object, b: object) -> bool:
    """The documented equality: same class and the same fields."""
    fields = ["model_name", "world_size", "worker_id", "chunk_hash", "dtype", "request_configs"]
    if isinstance(a, LayerCacheEngineKey):
        fields.append("layer_id")
    return type(a) is type(b) and all(getattr(a, f) == getattr(b, f) for f in fields)


def py_hash(k: CacheEngineKey) -> int:
    if isinstance(k, LayerCacheEngineKey):
        return hash((k.chunk_hash, k.worker_id, k.layer_id))
    return hash((k.chunk_hash, k.worker_id))


@settings(max_examples=300, deadline=None)
@given(key_st, key_st, st.integers(0, 2))
def test_equality_and_hash_follow_the_fields(a, b, layer):
    # fresh copies: equality must not rest on identity
    a2 = CacheEngineKey.from_string(a.to_string())
    for x, y in [(a, b), (a, a2), (a.split_layers(3)[layer], b.split_layers(3)[layer]),
                 (a.split_layers(3)[layer], a2.split_layers(3)[2 - layer]), (a, a.get_first_layer())]:
        assert (x == y) is py_equal(x, y) and (y == x) is py_equal(x, y)
        assert (x != y) is not py_equal(x, y)
        assert hash(x) == py_hash(x) == x.__hash__()
        if x == y:
            assert hash(x) == hash(y) and {x: 1}[y] == 1
    assert (a == "not a key") is False and (a != 3) is True


@native
def test_native_key_classes_and_pickling():
    k = CacheEngineKey("m", 1, 0, 2**100 + 7, "bfloat16", (("a", "b"),))
    layer = k.split_layers(2)[1]
    assert isinstance(k, keys_mod._native.KeyBase)
    for proto in range(pickle.HIGHEST_PROTOCOL + 1):
        assert pickle.loads(pickle.dumps(k, proto)) == k
        assert pickle.loads(pickle.dumps(layer, proto)) == layer


def test_unregistered_subclass_uses_its_ancestors_fields():
    @dataclass(frozen=True, slots=True, eq=False)
    class TaggedKey(CacheEngineKey):
        note: str = ""

    a = TaggedKey("m", 1, 0, 5, "bfloat16", (), "x")
    b = TaggedKey("m", 1, 0, 5, "bfloat16", (), "y")
    plain = CacheEngineKey("m", 1, 0, 5, "bfloat16")
    # inherited semantics: the chunk fields decide, the class must match
    assert a == b and hash(a) == hash(b) == hash(plain)
    assert a != plain and plain != a


@native
def test_register_key_type_rejects_bad_input():
    class NotAKey:
        __slots__ = ("x",)

    with pytest.raises(TypeError, match="KeyBase"):
        keys_mod._native.register_key_type(NotAKey, (NotAKey.x,), (NotAKey.x,))
    with pytest.raises(ValueError, match="slot descriptor"):
        keys_mod._native.register_key_type(CacheEngineKey, ("chunk_hash",), (CacheEngineKey.chunk_hash,))
    with pytest.raises(ValueError, match="object slot of"):
        keys_mod._native.register_key_type(CacheEngineKey, (LayerCacheEngineKey.layer_id,), (CacheEngineKey.chunk_hash,))
    with pytest.raises(ValueError, match="1 to"):
        keys_mod._native.register_key_type(CacheEngineKey, (), (CacheEngineKey.chunk_hash,))


@settings(max_examples=100, deadline=None)
@given(st.lists(st.integers(0, 20), max_size=30), st.sets(st.integers(0, 20)), st.integers(-2, 35))
def test_prefix_probe_matches_python(keys, present, start):
    index: ResidentIndex = ResidentIndex(make_policy("LRU"))
    for p in present:
        index.insert(p, object(), 1)
    # keys[:start] are taken as present; the answer is the first absent index from there on
    want = min(max(start, 0), len(keys))
    while want < len(keys) and keys[want] in present:
        want += 1
    for form in (list(keys), tuple(keys), iter(keys)):
        assert index.prefix(form, start) == want
    with pytest.raises(TypeError):
        index.prefix([[1], *keys])  # unhashable: the error the dict raises


def test_python_key_ops_in_a_process_without_native(tmp_path):
    """LMCACHE_NATIVE_HASH=0 at import: Python __hash__/__eq__, same keys and hash values."""
    code = (
        "import json; from lmcache.v1 import keys as K; from tests.keys.test_keys import make_db\n"
        "ks = [k for *_, k in make_db().process_tokens(list(range(40)), cache_salt='s')]\n"
        "a, b = ks[0], K.CacheEngineKey.from_string(ks[0].to_string())\n"
        "print(json.dumps([K.NATIVE_KEY_OPS, a == b, hash(a) == hash(b), [k.to_string() for k in ks],"
        " [hash(k) for k in ks]]))\n"
    )
    import json

    from tests.keys.test_keys import make_db

    env = dict(os.environ, LMCACHE_NATIVE_HASH="0", PYTHONPATH=ROOT)
    res = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True, cwd=ROOT)
    native_flag, eq, same_hash, strings, hashes = json.loads(res.stdout.strip().splitlines()[-1])
    assert native_flag is False and eq and same_hash
    local = [k for *_, k in make_db().process_tokens(list(range(40)), cache_salt="s")]
    assert strings == [k.to_string() for k in local]
    assert hashes == [hash(k) for k in local]


@native
def test_unset_fields_raise_instead_of_crashing():
    blank = object.__new__(CacheEngineKey)
    with pytest.raises(AttributeError):
        hash(blank)
    with pytest.raises(AttributeError):
        _ = blank == object.__new__(CacheEngineKey)
    assert blank == blank  # identity needs no field
