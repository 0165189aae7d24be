"""Native chunk hashing (lmcache._keyhash) gives exactly the keys of the hashlib path."""

from __future__ import annotations

import hashlib

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from lmcache.utils import CacheEngineKey
from lmcache.v1.config import LMCacheEngineConfig
from lmcache.v1.metadata import LMCacheEngineMetadata
import lmcache.v1.request as request_mod
from lmcache.v1.gpu_connector.paged_kv import check_slot_mapping
from lmcache.v1.request import KeyExtras, tokens_to_array
from lmcache.v1.token_database import ChunkedTokenDatabase, native_hashing

native = pytest.mark.skipif(not native_hashing(), reason="lmcache._keyhash not built")

INT32 = st.integers(-(2**31), 2**31 - 1)
text = st.text(max_size=8)
extras_st = st.fixed_dictionaries(
    {},
    optional={
        "cache_salt": text,
        "request_configs": st.dictionaries(st.text(min_size=1, max_size=5), text, max_size=2),
        "extra_keys": st.lists(text, max_size=3),
    },
)


def make_db(chunk_size: int, save_unfull: bool = False) -> ChunkedTokenDatabase:
    cfg = LMCacheEngineConfig.from_dict({"chunk_size": chunk_size, "save_unfull_chunk": save_unfull})
    md = LMCacheEngineMetadata("org/model", 2, 1, "vllm", torch.bfloat16, (2, 2, chunk_size, 2, 8))
    return ChunkedTokenDatabase(cfg, md)


def fields(key: CacheEngineKey) -> tuple:
    return (key.model_name, key.world_size, key.worker_id, key.chunk_hash, key.dtype, key.request_configs)


def reference_hashes(db: ChunkedTokenDatabase, tokens: list[int], extras: KeyExtras, partial: bool) -> list[int]:
    """Independent statement of the key format: chained BLAKE2b-128 over int32 LE chunks."""
    prev = db._seed(extras)
    raw = np.asarray(tokens, dtype="<i4").tobytes()
    out = []
    c = db.chunk_size
    stop = len(tokens) if partial else len(tokens) - len(tokens) % c
    for start in range(0, stop, c):
        prev = hashlib.blake2b(prev + raw[4 * start : 4 * min(start + c, len(tokens))], digest_size=16).digest()
        out.append(int.from_bytes(prev, "little"))
    return out


def all_paths(db, tokens, extras, partial, monkeypatch):
    """Keys from every input form, with the native module on and off."""
    forms = [tokens, tuple(tokens), np.asarray(tokens, dtype=np.int32), np.asarray(tokens, dtype=np.int64),
             torch.tensor(tokens, dtype=torch.int64)]
    results = []
    for flag in ("1", "0"):
        monkeypatch.setattr(request_mod, "_NATIVE_HASH", flag == "1")
        monkeypatch.setattr(request_mod, "_NATIVE_SCANS", flag == "1")
        for form in forms:
            pk = db.prefix_keys(form, extras, include_partial=partial)
            results.append((pk.num_tokens, [fields(k) for k in pk.keys]))
            spans = db.spans(form, include_partial=partial, **extras_kwargs(extras))
            results.append((pk.num_tokens, [fields(s.key) for s in spans]))
    return results


def extras_kwargs(extras: KeyExtras) -> dict:
    return {"cache_salt": extras.cache_salt, "request_configs": dict(extras.request_configs) or None,
            "extra_keys": list(extras.extra_keys) or None}


@native
@settings(max_examples=60, deadline=None)
@given(st.lists(INT32, max_size=70), st.sampled_from([1, 3, 16]), st.booleans(), extras_st)
def test_native_equals_fallback_and_reference(tokens, chunk, partial, extras):
    db = make_db(chunk)
    ex = KeyExtras.from_kwargs(extras)
    with pytest.MonkeyPatch.context() as mp:
        results = all_paths(db, tokens, ex, partial, mp)
    assert all(r == results[0] for r in results)
    n, keys = results[0]
    assert n == len(tokens)
    assert [k[3] for k in keys] == reference_hashes(db, tokens, ex, partial)
    expected = CacheEngineKey("org/model", 2, 1, 0, torch.bfloat16, ex.config_strings)
    assert all(k[:3] == fields(expected)[:3] and k[4:] == fields(expected)[4:] for k in keys)


@native
def test_native_keys_behave_like_constructed_keys():
    db = make_db(4)
    tokens = list(range(40))
    pk = db.prefix_keys(tokens, KeyExtras.from_kwargs({"cache_salt": "t"}))
    for i, key in enumerate(pk.keys):
        built = CacheEngineKey(key.model_name, key.world_size, key.worker_id, key.chunk_hash, key.dtype,
                               key.request_configs)
        assert key == built and hash(key) == hash(built) and key.to_string() == built.to_string()
        assert CacheEngineKey.from_string(key.to_string()) == key
        assert pk.end(i + 1) == min(4 * (i + 1), 40)


@pytest.mark.parametrize(
    "tokens",
    [
        [1, 2, True, 4],  # a bool after the first item: numpy's rules decide
        [1, np.int64(2), 3, 4],  # numpy scalars inside a list
        [1, 2, 3, 2**40],  # out of int32 range
        [1, 2, 3, -(2**31) - 1],
        [1, 2, 3, 4, 5, 2**33],  # out of range in the trailing (unhashed) part
        [True, 1, 2, 3],
        [1.5, 2, 3, 4],
        [[1], [2]],
    ],
)
def test_declined_inputs_take_the_validating_path(monkeypatch, tokens):
    db = make_db(4)
    outcomes = []
    for flag in ("1", "0"):
        monkeypatch.setattr(request_mod, "_NATIVE_HASH", flag == "1")
        monkeypatch.setattr(request_mod, "_NATIVE_SCANS", flag == "1")
        try:
            pk = db.prefix_keys(tokens, KeyExtras.from_kwargs({}))
            outcomes.append(("ok", pk.num_tokens, [fields(k) for k in pk.keys]))
        except (TypeError, ValueError) as exc:
            outcomes.append((type(exc), str(exc)))
    assert outcomes[0] == outcomes[1]


@native
def test_large_ints_and_boundaries_match():
    db = make_db(3, save_unfull=True)
    tokens = [0, -1, 2**31 - 1, -(2**31), 2**30, -(2**30), 2**30 - 1, 1 - 2**30]
    ex = KeyExtras.from_kwargs({})
    native_keys = [k.chunk_hash for k in db.prefix_keys(tokens, ex).keys]
    assert native_keys == reference_hashes(db, tokens, ex, True)


def _to_array_outcome(tokens, monkeypatch, flag: str):
    monkeypatch.setattr(request_mod, "_NATIVE_SCANS", flag == "1")
    try:
        arr = tokens_to_array(tokens)
    except (TypeError, ValueError) as exc:
        return (type(exc), str(exc))
    assert arr.dtype == np.dtype("<i4") and arr.ndim == 1 and arr.flags.c_contiguous
    return ("ok", arr.tolist())


@native
@settings(max_examples=60, deadline=None)
@given(st.lists(st.one_of(INT32, st.integers(-(2**40), 2**40), st.booleans()), max_size=40), st.sampled_from(
    ["list", "tuple", "int64 array", "int64 tensor", "strided int64 array", "int32 tensor", "strided int64 tensor",
     "offset int64 tensor"]))
def test_native_token_conversion_equals_numpy(tokens, form):
    """``tokens_to_array`` gives the same int32 array, or the same error, with the native
    one-pass conversion (lists, tuples, int64 arrays and tensors) and without it."""
    if form == "tuple":
        tokens = tuple(tokens)
    elif form != "list":
        ints = [int(t) for t in tokens]
        if form == "int64 tensor":
            tokens = torch.tensor(ints, dtype=torch.int64)
        elif form == "int32 tensor":
            tokens = torch.tensor([min(max(t, -(2**31)), 2**31 - 1) for t in ints], dtype=torch.int32)
        elif form == "strided int64 tensor":
            tokens = torch.tensor(ints, dtype=torch.int64).repeat_interleave(2)[::2]
        elif form == "offset int64 tensor":  # a view that starts inside its storage
            tokens = torch.tensor([7, *ints], dtype=torch.int64)[1:]
        elif form == "strided int64 array":
            tokens = np.repeat(np.asarray(ints, dtype=np.int64), 2)[::2]
        else:
            tokens = np.asarray(ints, dtype=np.int64)
    with pytest.MonkeyPatch.context() as mp:
        assert _to_array_outcome(tokens, mp, "1") == _to_array_outcome(tokens, mp, "0")


def _slots_outcome(slots, n, capacity, monkeypatch, flag: str):
    monkeypatch.setattr(request_mod, "_NATIVE_SCANS", flag == "1")
    try:
        out, first_neg = check_slot_mapping(slots, n, capacity, torch.device("cpu"))
    except (TypeError, ValueError) as exc:
        return (type(exc), str(exc))
    return ("ok", out.tolist(), first_neg)


@native
@settings(max_examples=80, deadline=None)
@given(
    st.lists(st.integers(-3, 70), max_size=40),
    st.integers(0, 45),
    st.sampled_from(["int64", "int32", "strided int64", "offset int32"]),
)
def test_native_slot_scan_equals_numpy(slots, n, form):
    """``check_slot_mapping`` finds the same first unmapped token and rejects the same
    out-of-range slots with the one-pass native scan (contiguous CPU tensors) as with numpy."""
    if form == "int64":
        t = torch.tensor(slots, dtype=torch.int64)
    elif form == "int32":
        t = torch.tensor(slots, dtype=torch.int32)
    elif form == "strided int64":
        t = torch.tensor(slots, dtype=torch.int64).repeat_interleave(2)[::2]
    else:
        t = torch.tensor([5, *slots], dtype=torch.int32)[1:]
    with pytest.MonkeyPatch.context() as mp:
        assert _slots_outcome(t, n, 64, mp, "1") == _slots_outcome(t, n, 64, mp, "0")


@native
@settings(max_examples=80, deadline=None)
@given(
    base=st.lists(st.integers(0, 3), max_size=60),  # a small alphabet: many shared prefixes
    edits=st.lists(
        st.tuples(st.sampled_from(["prefix", "extend", "change", "salt"]), st.integers(0, 60), st.integers(0, 3)),
        min_size=1,
        max_size=12,
    ),
    chunk=st.sampled_from([1, 3, 8]),
    partial=st.booleans(),
)
def test_recent_digest_reuse_gives_the_reference_keys(base, edits, chunk, partial):
    """A stream of requests through one database (prefixes, extensions, one changed token,
    another cache salt): whatever it remembered from earlier requests, every request's keys
    are the reference chain (the remembered digests are reused only for equal tokens and seed)."""
    db = make_db(chunk)
    tokens, salt = list(base), None
    for kind, pos, val in edits:
        if kind == "prefix":
            tokens = tokens[:pos]
        elif kind == "extend":
            tokens = tokens + [val] * (pos % 7 + 1)
        elif kind == "change" and tokens:
            tokens = list(tokens)
            tokens[pos % len(tokens)] = val + 100
        elif kind == "salt":
            salt = None if val == 0 else str(val)
        ex = KeyExtras.from_kwargs({} if salt is None else {"cache_salt": salt})
        spans = db.spans(np.asarray(tokens, dtype=np.int32), include_partial=partial, **extras_kwargs(ex))
        assert [s.key.chunk_hash for s in spans] == reference_hashes(db, tokens, ex, partial)


@native
def test_recent_digests_stay_within_their_bounds(monkeypatch):
    db = make_db(4)
    monkeypatch.setattr(type(db._recent), "MAX_BYTES", 4 * 40)
    ex = KeyExtras.from_kwargs({})
    for i in range(12):
        db.spans(np.full(16, i, dtype=np.int32))
    before = [t for _, t, _ in db._recent._entries]
    assert before == [np.full(16, i, dtype="<i4").tobytes() for i in (11, 10)]  # 40 tokens: two arrays of 16
    db.spans(np.zeros(41, dtype=np.int32))  # longer than the whole budget: not remembered
    assert [t for _, t, _ in db._recent._entries] == before
    assert [s.key.chunk_hash for s in db.spans(np.full(16, 11, dtype=np.int32))] == reference_hashes(db, [11] * 16, ex, False)


@native
def test_hash_and_scan_switches_are_independent(monkeypatch):
    """``LMCACHE_NATIVE_HASH=0`` turns off native chunk hashing only; ``LMCACHE_NATIVE_SCANS=0``
    turns off the native token conversion and slot scans only."""
    t = torch.arange(8, dtype=torch.int64)
    monkeypatch.setattr(request_mod, "_NATIVE_HASH", False)
    monkeypatch.setattr(request_mod, "_NATIVE_SCANS", True)
    assert not native_hashing()
    assert request_mod._native_int32([1, 2, 3]) is not None
    assert request_mod.native_int_stats(t, 8) == (7, 8)
    monkeypatch.setattr(request_mod, "_NATIVE_HASH", True)
    monkeypatch.setattr(request_mod, "_NATIVE_SCANS", False)
    assert native_hashing()
    assert request_mod._native_int32([1, 2, 3]) is None
    assert request_mod.native_int_stats(t, 8) is None
