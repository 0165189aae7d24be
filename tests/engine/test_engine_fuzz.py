"""Fuzz of the public engine API (issue #13) against a bounds-checked native library.

Hypothesis draws a random model/paged-cache geometry (layout, dtype, layers, heads, head
size, block size, blocks, chunk size), builds a bulk or layerwise engine, then either a valid call or one
invalid mutation (slot mappings with NaN/negative/out-of-range/float/bool values, layers
of other sizes/dtypes/strides, token types, masks, key extras, unknown arguments).

* invalid input -> TypeError or ValueError, raised before any tier or kernel is touched;
* valid input   -> store + retrieve round-trips bit-exact; the retrieve mask is True
  exactly for the tokens whose KV was written;
* never a crash: the copies run in a build with ``-DLMC_BOUNDS_CHECK`` (every read and
  write checked against its tensor's extent: an overrun fails the call with
  RuntimeError, which this test does not accept), and
  :func:`test_fuzz_under_asan` reruns the suite in a subprocess against an
  AddressSanitizer + UBSan build (``LD_PRELOAD=libasan``, loaded via
  ``LMCACHE_NATIVE_LIB``).
"""

from __future__ import annotations

import dataclasses
import os
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st

from lmcache.v1.config import LMCacheEngineConfig
from lmcache.v1.gpu_connector import native
from lmcache.v1.testing import LAYOUT_NAMES, KVSpec, make_engine, random_kv_caches

from tests.native_build import cxx
from tests.engine.test_engine_roundtrip import token_vectors
from tests.kernels.test_native_bounds import asan_build, build

REPO = Path(__file__).resolve().parents[2]
USE_ENV_LIB = os.environ.get("LMCACHE_FUZZ_ENV_LIB") == "1"  # set by the ASan rerun
EXAMPLES = int(os.environ.get("LMCACHE_FUZZ_EXAMPLES", "300"))
DTYPES = (torch.float32, torch.bfloat16, torch.float16, torch.float8_e4m3fn)

INVALID = (
    "slots_nan",
    "slots_float",
    "slots_bool",
    "slots_int8",
    "slots_int16",
    "slots_out_of_range",
    "slots_2d",
    "slots_short",
    "slots_list",
    "slots_missing",
    "layer_fewer_blocks",
    "layer_more_blocks",
    "layer_dtype",
    "layer_transposed",
    "layer_count",
    "layer_not_tensor",
    "layer_rank",
    "layer_hidden",
    "tokens_float",
    "tokens_bool",
    "tokens_2d",
    "tokens_too_big",
    "tokens_str",
    "mask_length",
    "mask_not_prefix",
    "mask_float",
    "mask_not_chunk",
    "extra_keys_str",
    "salt_int",
    "configs_list",
    "unknown_kwarg",
)


@pytest.fixture(scope="module")
def checked_kernels(tmp_path_factory):
    """The bounds-checked build, used by every copy in this module (or the env's ASan build)."""
    if USE_ENV_LIB:
        k = native.load()
        assert k is not None and k.path == os.environ["LMCACHE_NATIVE_LIB"], "LMCACHE_NATIVE_LIB did not load"
        yield k
        return
    if cxx() is None:
        pytest.skip("no C++ compiler")
    path = build(tmp_path_factory.mktemp("fuzzlib") / "checked.so", "-O1", "-DLMC_BOUNDS_CHECK")
    k = native.load_library(path)
    assert k.bounds_checked
    real = native.load
    native.load = lambda: k  # copy_ops asks native.load() on every call
    try:
        yield k
    finally:
        native.load = real


@dataclass
class Geometry:
    spec: KVSpec
    chunk: int
    reuse_block: int | None = None
    """Block size of block-granular reuse (None: whole chunks)."""


@st.composite
def geometries(draw) -> Geometry:
    spec = KVSpec(
        num_layers=draw(st.integers(1, 3)),
        num_heads=draw(st.integers(1, 4)),  # 4 heads, head 16 (or 8 in fp32), block 32: the kernels' head groups
        head_size=draw(st.sampled_from([1, 2, 5, 8, 16])),
        num_blocks=draw(st.integers(2, 10)),
        block_size=draw(st.sampled_from([1, 3, 4, 8, 16, 32])),
        dtype=draw(st.sampled_from(DTYPES)),
        layout=draw(st.sampled_from(LAYOUT_NAMES)),
    )
    chunk = draw(st.sampled_from([2, 4, 8, 16]))
    reuse_block = draw(st.sampled_from([None] + [b for b in (1, 2, 4, 8) if b < chunk]))
    return Geometry(spec, chunk, reuse_block)


def _engine(g: Geometry, layerwise: bool):
    cfg = LMCacheEngineConfig.from_dict({"chunk_size": g.chunk, "max_local_cpu_size": 0.02, "save_unfull_chunk": True})
    return make_engine(g.spec, cfg, layerwise=layerwise, block_size=g.reuse_block)


def _args(draw, g: Geometry, n: int, seed: int):
    spec = g.spec
    capacity = spec.num_blocks * spec.block_size
    slots = torch.tensor(draw(st.permutations(range(capacity)))[:n], dtype=torch.int64)
    holes = draw(st.lists(st.integers(0, max(0, n - 1)), max_size=3)) if n else []
    for i in holes:
        slots[i] = draw(st.sampled_from([-1, -2, -(2**40)]))
    slots = slots.to(draw(st.sampled_from([torch.int32, torch.int64])))
    kv = random_kv_caches(spec, seed=seed)
    extras = draw(
        st.fixed_dictionaries(
            {},
            optional={
                "cache_salt": st.text(max_size=6),
                "extra_keys": st.lists(st.one_of(st.text(max_size=5), st.integers(-5, 5)), max_size=3),
                "request_configs": st.dictionaries(st.text(max_size=4), st.one_of(st.text(max_size=4), st.integers(), st.booleans(), st.none()), max_size=2),
            },
        )
    )
    skip_chunks = draw(st.integers(0, n // g.chunk)) if n else 0
    mask = None
    if skip_chunks and draw(st.booleans()):
        mask = torch.ones(n, dtype=torch.bool)
        mask[: skip_chunks * g.chunk] = False
    return kv, slots, extras, mask


def _mutate(kind: str, g: Geometry, tokens, mask, kw: dict):
    """Apply one invalid mutation; returns (tokens, mask, kwargs)."""
    spec, n = g.spec, len(tokens)
    kv, slots = list(kw["kvcaches"]), kw["slot_mapping"]
    cap = spec.num_blocks * spec.block_size
    if kind.startswith("slots_"):
        if kind == "slots_nan":
            s = slots.to(torch.float32)
            s[0] = float("nan")
        elif kind == "slots_float":
            s = slots.to(torch.float64)
        elif kind == "slots_bool":
            s = slots >= 0
        elif kind == "slots_int8":
            s = slots.to(torch.int8)
        elif kind == "slots_int16":
            s = slots.to(torch.int16)
        elif kind == "slots_out_of_range":
            s = slots.clone()
            s[n - 1] = cap
        elif kind == "slots_2d":
            s = slots.reshape(1, -1)
        elif kind == "slots_short":
            s = slots[: n - 1]
        elif kind == "slots_list":
            s = slots.tolist()
        else:
            s = None
        kw["slot_mapping"] = s
    elif kind.startswith("layer_"):
        i = len(kv) - 1
        if i == 0 and kind in ("layer_fewer_blocks", "layer_more_blocks", "layer_transposed"):
            kind = "layer_hidden"  # a lone layer of another size/strides is just another (valid) cache
        shorter = dataclasses.replace(spec, num_blocks=1, num_layers=1)
        bigger = dataclasses.replace(spec, num_blocks=spec.num_blocks + 1, num_layers=1)
        if kind == "layer_fewer_blocks":
            kv[i] = random_kv_caches(shorter)[0]
        elif kind == "layer_more_blocks":
            kv[i] = random_kv_caches(bigger)[0]
        elif kind == "layer_dtype":
            kv[i] = kv[i].view(torch.uint8) if kv[i].element_size() == 1 else kv[i].to(torch.float64)
        elif kind == "layer_transposed":
            kv[i] = kv[i].transpose(0, 1).contiguous().transpose(0, 1)  # same shape, other strides

            def order(t: torch.Tensor) -> list[int]:  # strides that matter (a size-1 dim has none)
                return [st for st, size in zip(t.stride(), t.shape) if size > 1]

            if order(kv[i]) == order(kv[0]):  # degenerate dims: another last dim instead
                t = kv[i]
                kv[i] = t[..., :1] if t.shape[-1] > 1 else t.unsqueeze(-1).expand(*t.shape, 2)[..., 0, :]
        elif kind == "layer_count":
            kv = kv + [kv[0]]
        elif kind == "layer_not_tensor":
            kv[i] = kv[i].tolist() if kv[i].numel() < 64 else None
        elif kind == "layer_rank":
            kv = [t.reshape(-1) for t in kv]
        else:  # layer_hidden
            kv = [t[..., :-1] if t.shape[-1] > 1 else t.unsqueeze(-1).expand(*t.shape, 2) for t in kv]
        kw["kvcaches"] = kv
    elif kind.startswith("tokens_"):
        tokens = {
            "tokens_float": [float(t) + 0.5 for t in tokens],
            "tokens_bool": [True] * n,
            "tokens_2d": torch.tensor(tokens).reshape(1, -1),
            "tokens_too_big": [2**40] * n,
            "tokens_str": "x" * n,
        }[kind]
    elif kind.startswith("mask_"):
        if kind == "mask_length":
            mask = torch.ones(n + 1, dtype=torch.bool)
        elif kind == "mask_not_prefix":
            mask = torch.ones(n, dtype=torch.bool)
            mask[n - 1] = False
        elif kind == "mask_float":
            mask = torch.ones(n)
            mask[n // 2] = 0.5  # a float mask is valid only when every value is 0 or 1
        else:
            mask = torch.ones(n, dtype=torch.bool)
            mask[:1] = False  # 1 is never a multiple of chunk_size (>= 2)
    elif kind == "extra_keys_str":
        kw["extra_keys"] = "lora=abc"
    elif kind == "salt_int":
        kw["cache_salt"] = 7
    elif kind == "configs_list":
        kw["request_configs"] = [("a", "b")]
    else:
        kw["slot_mappings"] = kw["slot_mapping"]
    return tokens, mask, kw


def _bytes(t: torch.Tensor) -> torch.Tensor:
    return torch.empty(t.numel(), dtype=t.dtype).copy_(t.reshape(-1)).view(torch.uint8)  # bits (NaN-safe)


def _assert_round_trip(g: Geometry, kv, slots_store, out, slots_ret, ret) -> None:
    for i in torch.nonzero(ret).flatten().tolist():
        s_in, s_out = int(slots_store[i]), int(slots_ret[i])
        assert s_out >= 0
        for la, lb in zip(kv, out):
            for va, vb in zip(token_vectors(la, g.spec, s_in), token_vectors(lb, g.spec, s_out)):
                assert torch.equal(_bytes(va), _bytes(vb))


@settings(max_examples=EXAMPLES, deadline=None, suppress_health_check=list(HealthCheck))
@given(data=st.data())
def test_public_api_fuzz(checked_kernels, data):
    g = data.draw(geometries())
    spec = g.spec
    n = data.draw(st.integers(1, min(spec.num_blocks * spec.block_size, 4 * g.chunk)))
    tokens = data.draw(st.lists(st.integers(0, 2**31 - 1), min_size=n, max_size=n))
    kv, slots, extras, mask = _args(data.draw, g, n, data.draw(st.integers(0, 1000)))
    kind = data.draw(st.sampled_from(("valid",) * 8 + INVALID))
    layerwise = data.draw(st.booleans())
    event(kind)
    engine = _engine(g, layerwise)
    try:
        kw = dict(extras, kvcaches=kv, slot_mapping=slots)
        if kind == "valid":
            stored = engine.store(tokens, mask, **kw)
            assert 0 <= stored <= n
            out = [torch.zeros_like(t) for t in kv]
            ret_slots = slots.clone()
            ret = engine.retrieve(tokens, mask, **dict(extras, kvcaches=out, slot_mapping=ret_slots))
            assert ret.dtype == torch.bool and ret.shape == (n,)
            event(f"valid: {'round trip of ' + str(int(ret.sum())) + ' tokens' if ret.any() else 'nothing retrieved'}"[:40])
            if stored:
                assert bool(ret.any()) or mask is not None
            assert not bool(ret[slots < 0].any()), "mask True where no KV was written"
            _assert_round_trip(g, kv, slots, out, ret_slots, ret)
            hit = engine.lookup(tokens, **extras)
            assert 0 <= hit <= n
            # a prefix that may end inside a stored chunk (block-granular reuse copies part of it)
            m = data.draw(st.integers(1, n))
            out = [torch.zeros_like(t) for t in kv]
            ret = engine.retrieve(tokens[:m], **dict(extras, kvcaches=out, slot_mapping=ret_slots[:m]))
            assert ret.shape == (m,) and not bool(ret[slots[:m] < 0].any())
            _assert_round_trip(g, kv, slots, out, ret_slots, ret)
            return
        bad_tokens, bad_mask, bad_kw = _mutate(kind, g, tokens, mask, dict(kw))
        before = engine.storage_manager.allocator.used_bytes
        calls = ("store", "retrieve", "store_layer", "retrieve_layer") if layerwise else ("store", "retrieve")
        for call in calls:
            with pytest.raises((TypeError, ValueError)):
                getattr(engine, call)(bad_tokens, bad_mask, **bad_kw)
        if kind.startswith(("tokens_", "extra_keys", "salt", "configs")):
            lookup_kw = {k: v for k, v in bad_kw.items() if k not in ("kvcaches", "slot_mapping")}
            with pytest.raises((TypeError, ValueError)):
                engine.lookup(bad_tokens, **lookup_kw)
        assert engine.storage_manager.allocator.used_bytes == before, "an invalid call must not allocate"
    finally:
        engine.close()


@pytest.mark.slow
def test_fuzz_under_asan(tmp_path):
    """The same fuzz in a subprocess against an ASan + UBSan build (fewer examples)."""
    if USE_ENV_LIB:
        pytest.skip("already the ASan run")
    lib, env = asan_build(tmp_path)
    env.update(
        LMCACHE_NATIVE_LIB=str(lib),
        LMCACHE_FUZZ_ENV_LIB="1",
        LMCACHE_FUZZ_EXAMPLES="60",
    )
    out = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-x", "-p", "no:cacheprovider", str(Path(__file__)), "-k", "test_public_api_fuzz"],
        env=env, capture_output=True, text=True, timeout=900, check=False, cwd=REPO,
    )
    assert out.returncode == 0 and "1 passed" in out.stdout, (out.stdout + out.stderr)[-6000:]
