"""Per-layer-group slot rows in the bulk connector (vLLM's hybrid KV cache manager).

Layers belong to KV cache groups (``set_layer_groups``); a 2-D slot mapping has one row
per group and each layer is copied with its group's row. Checked against a reference
built from the single-group path (a 1-D copy of every layer with one group's row, keeping
the layers of that group), with native kernels and with the torch fallback.
"""

from __future__ import annotations

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from lmcache.v1.config import LMCacheEngineConfig
from lmcache.v1.gpu_connector import copy_ops, native
from lmcache.v1.gpu_connector.paged import VLLMPagedMemGPUConnectorV2
from lmcache.v1.gpu_connector.paged_kv import PagedKV, check_layer_groups, layer_runs
from lmcache.v1.memory_management import MemoryObj
from lmcache.v1.request import KeyExtras, TransferRequest
from lmcache.v1.testing import KVSpec, make_connector, make_engine, random_kv_caches, random_slot_mapping

CHUNK = 16
GROUPINGS = ((0, 1, 0, 1, 0, 1), (0, 0, 1, 0, 0, 1), (1, 0, 0, 0, 0, 0))
_INT = {1: torch.uint8, 2: torch.int16, 4: torch.int32}


# ----------------------------------------------------------------------------- helpers
@pytest.fixture(params=["fallback", "native"])
def kernels(request, monkeypatch):
    """Run a test with the torch fallback (LMCACHE_USE_NATIVE=0) and with native kernels."""
    if request.param == "fallback":
        monkeypatch.setattr(copy_ops, "USE_NATIVE", False)
    else:
        if native.load() is None:
            pytest.skip("native kernels (lmcache._c_ops) are not built")
        monkeypatch.setattr(copy_ops, "USE_NATIVE", True)
    return request.param


def bits(t: torch.Tensor) -> torch.Tensor:
    """Bit-identical integer view, so NaN payloads (fp8 random bytes) compare exactly."""
    return t.view(_INT[t.element_size()])


def same(a: torch.Tensor, b: torch.Tensor) -> bool:
    return bool(torch.equal(bits(a), bits(b)))


def spec_of(layout: str = "vllm_cpu", num_layers: int = 6, dtype: torch.dtype = torch.float32) -> KVSpec:
    return KVSpec(
        num_layers=num_layers, num_heads=2, head_size=8, num_blocks=24, block_size=16, dtype=dtype, layout=layout
    )


def group_rows(spec: KVSpec, n: int, num_groups: int, seed: int) -> torch.Tensor:
    """``[num_groups, n]`` int64 slots: each row distinct whole blocks in its own random order."""
    return torch.stack([random_slot_mapping(spec, n, seed=seed * 31 + g) for g in range(num_groups)])


def connector(spec: KVSpec, groups=None, primary: int = 0) -> VLLMPagedMemGPUConnectorV2:
    conn = make_connector(spec, CHUNK)
    assert isinstance(conn, VLLMPagedMemGPUConnectorV2)
    if groups is not None:
        conn.set_layer_groups(groups, primary)
    return conn


def objects(conn, counts, *, seed: int | None = None) -> list[MemoryObj]:
    """One object per chunk: zeros, or random bits when ``seed`` is given."""
    fmt = conn.fmt
    out = []
    for i, n in enumerate(counts):
        shape = tuple(conn.get_shape(n))
        if seed is None:
            t = torch.zeros(shape, dtype=conn.dtype)
        else:
            g = torch.Generator().manual_seed(seed + i)
            t = torch.randn(shape, generator=g).to(conn.dtype)
        out.append(MemoryObj.from_tensor(t, fmt))
    return out


def reference_gather(spec, groups, rows, starts, ends) -> list[torch.Tensor]:
    """Per layer, a 1-D copy with its group's row (the single-group path, no groups set)."""
    plain = connector(spec)
    kv = random_kv_caches(spec)
    out = [torch.zeros(tuple(plain.get_shape(e - s)), dtype=spec.dtype) for s, e in zip(starts, ends)]
    for g in range(rows.shape[0]):
        objs = objects(plain, [e - s for s, e in zip(starts, ends)])
        plain.batched_from_gpu(objs, starts, ends, kvcaches=kv, slot_mapping=rows[g])
        for layer, lg in enumerate(groups):
            if lg == g:
                for o, t in zip(objs, out):
                    t[:, layer] = o.tensor[:, layer]
    return out


def reference_scatter(spec, groups, rows, starts, ends, srcs, base) -> list[torch.Tensor]:
    """``base`` after writing ``srcs``, each layer with its group's row (1-D copies)."""
    plain = connector(spec)
    out = [t.clone() for t in base]
    for g in range(rows.shape[0]):
        target = [t.clone() for t in base]
        plain.batched_to_gpu(srcs, starts, ends, kvcaches=target, slot_mapping=rows[g])
        for layer, lg in enumerate(groups):
            if lg == g:
                out[layer] = target[layer]
    return out


def spans(n_chunks: int, gap: int = 0) -> tuple[list[int], list[int]]:
    """Chunk spans of CHUNK tokens, ``gap`` tokens apart (tokens in a gap are in no chunk)."""
    starts = [i * (CHUNK + gap) for i in range(n_chunks)]
    return starts, [s + CHUNK for s in starts]


# ----------------------------------------------------------------------------- runs and groups
def test_layer_runs_are_maximal_arithmetic_runs():
    assert layer_runs((0, 1, 0, 1, 0, 1)) == (((0, 5, 2),), ((1, 6, 2),))
    assert layer_runs((0, 0, 1, 0)) == (((0, 2, 1), (3, 4, 1)), ((2, 3, 1),))
    assert layer_runs((1, 0, 0, 0, 0, 0)) == (((1, 6, 1),), ((0, 1, 1),))
    assert layer_runs((0, 0, 1, 0, 0, 1)) == (((0, 2, 1), (3, 5, 1)), ((2, 6, 3),))
    for groups in GROUPINGS + ((2, 0, 1, 0, 2, 2, 1),):
        covered = {}
        for g, runs in enumerate(layer_runs(groups)):
            for a, b, step in runs:
                for layer in range(a, b, step):
                    assert layer not in covered
                    covered[layer] = g
        assert covered == dict(enumerate(groups))


def test_set_layer_groups_keeps_an_immutable_tuple_and_one_group_means_none():
    spec = spec_of()
    conn = connector(spec, [0, 1, 0, 1, 0, 1], primary=1)
    assert conn.layer_groups == (0, 1, 0, 1, 0, 1) and conn.primary_group == 1
    assert conn.group_runs == (((0, 5, 2),), ((1, 6, 2),))
    conn.set_layer_groups([0] * 6)
    assert conn.layer_groups is None and conn.group_runs == ()
    conn.set_layer_groups(None)
    assert conn.layer_groups is None and conn.primary_group == 0


@pytest.mark.parametrize(
    "groups, primary, exc, words",
    [
        ([0, 1, 0], 0, ValueError, ("groups", "3 entries", "6")),
        ([0, 1, 0, 1, 0, 2.0], 0, TypeError, ("groups[5]", "2.0", "int")),
        ([0, 1, 0, 1, 0, True], 0, TypeError, ("groups[5]", "True")),
        ([0, 2, 0, 2, 0, 2], 0, ValueError, ("groups", "[1]", "no layer")),
        ([0, -1, 0, 1, 0, 1], 0, ValueError, ("groups", "-1", "negative")),
        ([0, 1, 0, 1, 0, 1], 2, ValueError, ("primary=2", "0..1")),
        ([0, 1, 0, 1, 0, 1], -1, ValueError, ("primary=-1",)),
        ([0, 1, 0, 1, 0, 1], "0", TypeError, ("primary='0'",)),
        ("010101", 0, TypeError, ("groups='010101'", "sequence of ints")),
        (torch.tensor([0, 1, 0, 1, 0, 1]), 0, TypeError, ("groups=", "sequence of ints")),
        (None, 1, ValueError, ("primary=1",)),
    ],
)
def test_bad_layer_groups_are_refused_with_a_clear_message(groups, primary, exc, words):
    conn = connector(spec_of(), [1, 0, 0, 0, 0, 0])
    with pytest.raises(exc) as info:
        conn.set_layer_groups(groups, primary)
    for word in words:
        assert word in str(info.value), (word, str(info.value))
    assert conn.layer_groups == (1, 0, 0, 0, 0, 0)  # unchanged by the refused call


def test_check_layer_groups_accepts_numpy_ints():
    import numpy as np

    assert check_layer_groups(list(np.array([0, 1, 1])), np.int64(1), 3) == ((0, 1, 1), 2)


# ----------------------------------------------------------------------------- bind
def test_bind_with_a_2d_mapping_keeps_the_groups_and_the_primary_row():
    spec = spec_of()
    conn = connector(spec, GROUPINGS[0], primary=1)
    rows = group_rows(spec, 40, 2, seed=1).to(torch.int32)
    rows[0, 5] = -1
    rows[1, 30] = -1
    kv = conn.bind(40, kvcaches=random_kv_caches(spec), slot_mapping=rows)
    assert kv.grouped and kv.layer_groups == GROUPINGS[0] and kv.primary == 1
    assert kv.first_unmapped == 30 and kv.group_first_unmapped == (5, 30)
    assert torch.equal(kv.token_slots, rows[1])
    one_d = conn.bind(40, kvcaches=random_kv_caches(spec), slot_mapping=rows[0])
    assert not one_d.grouped and one_d.first_unmapped == 5 and one_d.token_slots is one_d.slot_mapping


def test_bind_refuses_bad_2d_mappings():
    spec = spec_of()
    kv = random_kv_caches(spec)
    rows = group_rows(spec, 32, 2, seed=2)
    plain = connector(spec)
    with pytest.raises(ValueError, match=r"slot_mapping: shape \(2, 32\) is 2-D .* no layer groups are set"):
        plain.bind(32, kvcaches=kv, slot_mapping=rows)
    conn = connector(spec, GROUPINGS[1])
    with pytest.raises(ValueError, match=r"slot_mapping: shape \(3, 32\); expected \[2, >= 32\]"):
        conn.bind(32, kvcaches=kv, slot_mapping=torch.cat([rows, rows[:1]]))
    with pytest.raises(ValueError, match=r"slot_mapping: shape \(2, 32\); expected \[2, >= 33\]"):
        conn.bind(33, kvcaches=kv, slot_mapping=rows)
    with pytest.raises(TypeError, match="slot_mapping: dtype torch.float32"):
        conn.bind(32, kvcaches=kv, slot_mapping=rows.float())
    bad = rows.clone()
    bad[1, 7] = spec.num_blocks * spec.block_size
    with pytest.raises(ValueError, match=r"slot_mapping row 1 \(KV cache group 1\): slot 384 is outside"):
        conn.bind(32, kvcaches=kv, slot_mapping=bad)


def test_one_group_accepts_a_single_row_mapping(kernels):
    spec = spec_of()
    conn = connector(spec, [0] * 6)
    rows = group_rows(spec, 32, 1, seed=3)
    kv = random_kv_caches(spec)
    bound = conn.bind(32, kvcaches=kv, slot_mapping=rows)
    assert not bound.grouped and bound.slot_mapping.dim() == 1
    objs = objects(conn, [CHUNK, CHUNK])
    conn.batched_from_gpu(objs, [0, 16], [16, 32], bound)
    want = reference_gather(spec, [0] * 6, rows, [0, 16], [16, 32])
    assert all(same(o.tensor, w) for o, w in zip(objs, want))


# ----------------------------------------------------------------------------- copies
@pytest.mark.parametrize("layout", ["vllm_cpu", "flash_attn", "flashinfer", "mla", "mla_cpu"])
@pytest.mark.parametrize("groups", GROUPINGS)
def test_gather_copies_each_layer_with_its_group_row(kernels, layout, groups):
    spec = spec_of(layout)
    num_groups = max(groups) + 1
    starts, ends = spans(3, gap=3)
    n = ends[-1] + 2
    rows = group_rows(spec, n, num_groups, seed=4)
    for g in range(num_groups):
        if g != 0:
            rows[g, ends[0] : starts[1]] = -1  # tokens in no chunk: a freed window is fine there
            rows[g, ends[-1] :] = -1
    conn = connector(spec, groups, primary=0)
    objs = objects(conn, [CHUNK] * 3, seed=9)
    conn.batched_from_gpu(objs, starts, ends, kvcaches=random_kv_caches(spec), slot_mapping=rows)
    want = reference_gather(spec, groups, rows, starts, ends)
    for o, w in zip(objs, want):
        assert same(o.tensor, w)


@pytest.mark.parametrize("layout", ["vllm_cpu", "flash_attn", "mla"])
@pytest.mark.parametrize("groups", GROUPINGS)
def test_scatter_writes_each_layer_at_its_group_slots_and_skips_unheld_tokens(kernels, layout, groups):
    spec = spec_of(layout)
    num_groups = max(groups) + 1
    primary = groups[0]
    starts, ends = spans(3)
    rows = group_rows(spec, ends[-1], num_groups, seed=5)
    for g in range(num_groups):
        if g != primary:
            rows[g, :20] = -1  # the group freed the window's oldest tokens
            rows[g, 37] = -1
    conn = connector(spec, groups, primary=primary)
    srcs = objects(conn, [CHUNK] * 3, seed=11)
    base = random_kv_caches(spec, seed=7)
    target = [t.clone() for t in base]
    conn.batched_to_gpu(srcs, starts, ends, kvcaches=target, slot_mapping=rows)
    want = reference_scatter(spec, groups, rows, starts, ends, srcs, base)
    for layer, (got, w) in enumerate(zip(target, want)):
        assert same(got, w), layer


@pytest.mark.parametrize("groups", GROUPINGS)
def test_roundtrip_restores_each_layer_at_its_group_slots_only(kernels, groups):
    spec = spec_of("flash_attn", dtype=torch.bfloat16)
    num_groups = max(groups) + 1
    starts, ends = spans(2, gap=5)
    n = ends[-1]
    rows = group_rows(spec, n, num_groups, seed=6)
    rows[:, ends[0] : starts[1]] = -1  # between the chunks: no slot in any group
    conn = connector(spec, groups)
    src = random_kv_caches(spec, seed=1)
    objs = objects(conn, [CHUNK, CHUNK])
    conn.batched_from_gpu(objs, starts, ends, kvcaches=src, slot_mapping=rows)
    dst = [torch.zeros_like(t) for t in src]
    conn.batched_to_gpu(objs, starts, ends, kvcaches=dst, slot_mapping=rows)
    bs = spec.block_size
    for layer, g in enumerate(groups):
        written = torch.zeros_like(dst[layer], dtype=torch.bool)
        for s, e in zip(starts, ends):
            for slot in rows[g, s:e].tolist():
                written[:, slot // bs, slot % bs] = True  # flash_attn: [2, blocks, block_size, heads, head]
        assert same(dst[layer][written], src[layer][written]), layer
        assert not bool(dst[layer][~written].any()), f"layer {layer}: written outside its group's slots"


def test_native_kernels_take_the_strided_views_one_call_per_run(monkeypatch):
    mod = native.load()
    if mod is None:
        pytest.skip("native kernels (lmcache._c_ops) are not built")
    monkeypatch.setattr(copy_ops, "USE_NATIVE", True)
    spec = spec_of()
    groups = (0, 0, 1, 0, 0, 1)  # group 0: runs 0:2, 3:5; group 1: 2:6:3
    conn = connector(spec, groups)
    calls = []
    real = mod._run
    monkeypatch.setattr(mod, "_run", lambda *a, **kw: (calls.append(len(a[1])), real(*a, **kw))[1])
    rows = group_rows(spec, 32, 2, seed=8)
    objs = objects(conn, [CHUNK, CHUNK])
    conn.batched_from_gpu(objs, [0, 16], [16, 32], kvcaches=random_kv_caches(spec), slot_mapping=rows)
    assert calls == [2, 2, 2]
    calls.clear()
    conn.batched_to_gpu(objs, [0, 16], [16, 32], kvcaches=random_kv_caches(spec), slot_mapping=rows)
    assert calls == [2, 2, 2]
    calls.clear()
    conn.batched_from_gpu(objs, [0, 16], [16, 32], kvcaches=random_kv_caches(spec), slot_mapping=rows[0])
    assert calls == [6], "a 1-D mapping keeps the one-call path"


def test_a_1d_mapping_with_groups_set_copies_as_without_groups(kernels):
    spec = spec_of()
    rows = group_rows(spec, 48, 1, seed=10)
    kv = random_kv_caches(spec)
    got = objects(connector(spec), [CHUNK] * 3)
    connector(spec).batched_from_gpu(got, [0, 16, 32], [16, 32, 48], kvcaches=kv, slot_mapping=rows[0])
    grouped = connector(spec, GROUPINGS[1])
    objs = objects(grouped, [CHUNK] * 3)
    bound = grouped.bind(48, kvcaches=kv, slot_mapping=rows[0])
    assert not bound.grouped
    grouped.batched_from_gpu(objs, [0, 16, 32], [16, 32, 48], bound)
    assert all(same(a.tensor, b.tensor) for a, b in zip(objs, got))


# ----------------------------------------------------------------------------- stores refuse unheld tokens
@pytest.mark.parametrize("row, token", [(1, 20), (1, 31), (0, 16)])
def test_gather_refuses_a_token_some_group_does_not_hold(kernels, row, token):
    spec = spec_of()
    conn = connector(spec, GROUPINGS[0], primary=0)
    rows = group_rows(spec, 48, 2, seed=12)
    rows[1, 40:] = -1  # outside the stored spans: fine
    rows[row, token] = -1
    objs = objects(conn, [CHUNK, CHUNK])
    with pytest.raises(ValueError) as info:
        conn.batched_from_gpu(objs, [0, 16], [16, 32], kvcaches=random_kv_caches(spec), slot_mapping=rows)
    msg = str(info.value)
    assert "slot_mapping" in msg and f"token {token}" in msg and f"row(s) [{row}]" in msg and "[16, 32)" in msg
    assert not any(bool(o.tensor.any()) for o in objs), "nothing copied before the refusal"
    # the same row on a load: the token is skipped for that group, no error
    conn.batched_to_gpu(
        objects(conn, [CHUNK, CHUNK], seed=1), [0, 16], [16, 32], kvcaches=random_kv_caches(spec), slot_mapping=rows
    )


# ----------------------------------------------------------------------------- requests and the engine
def test_mark_written_follows_the_primary_row():
    spec = spec_of()
    conn = connector(spec, GROUPINGS[0], primary=1)
    rows = group_rows(spec, 32, 2, seed=13)
    rows[1, [3, 17]] = -1
    rows[0, [5, 6]] = -1  # not the primary row: does not change what a request marks
    kv = conn.bind(32, kvcaches=random_kv_caches(spec), slot_mapping=rows)
    req: TransferRequest[PagedKV] = TransferRequest(
        torch.zeros(32, dtype=torch.int32).numpy(), 0, KeyExtras.build(), kv
    )
    ret = torch.zeros(32, dtype=torch.bool)
    req.mark_written(ret, 0, 32)
    assert torch.equal(ret, rows[1] >= 0)
    full = conn.bind(32, kvcaches=random_kv_caches(spec), slot_mapping=rows[[1, 1]].abs())
    ret.zero_()
    TransferRequest(req.tokens, 0, req.extras, full).mark_written(ret, 4, 20)
    assert bool(ret[4:20].all()) and not bool(ret[:4].any()) and not bool(ret[20:].any())


def test_engine_store_and_retrieve_with_group_rows(kernels):
    spec = spec_of()
    groups = (1, 0, 1, 0, 1, 0)  # group 0 (primary): full attention; group 1: sliding window
    cfg = LMCacheEngineConfig.from_dict({"chunk_size": CHUNK, "max_local_cpu_size": 0.0625})
    engine = make_engine(spec, cfg, layerwise=False)
    try:
        conn = engine.gpu_connector
        conn.set_layer_groups(groups, primary=0)
        tokens = list(range(3 * CHUNK))
        rows = group_rows(spec, 3 * CHUNK, 2, seed=14)
        src = random_kv_caches(spec, seed=2)
        assert engine.store(tokens, kvcaches=src, slot_mapping=rows) == 3 * CHUNK
        load_rows = group_rows(spec, 3 * CHUNK, 2, seed=15)
        load_rows[1, :CHUNK] = -1  # the sliding group no longer holds the oldest tokens
        load_rows[0, 40] = -1  # a token vLLM already holds
        dst = [torch.zeros_like(t) for t in src]
        ret = engine.retrieve(tokens, kvcaches=dst, slot_mapping=load_rows)
        assert torch.equal(ret, load_rows[0] >= 0)
        objs = objects(conn, [CHUNK] * 3)
        conn.batched_from_gpu(objs, [0, 16, 32], [16, 32, 48], kvcaches=src, slot_mapping=rows)
        want = reference_scatter(
            spec, groups, load_rows, [0, 16, 32], [16, 32, 48], objs, [torch.zeros_like(t) for t in src]
        )
        assert all(same(a, b) for a, b in zip(dst, want))
        # a store where the sliding group lacks a token of a chunk: refused, nothing cached
        other = list(range(1000, 1000 + 2 * CHUNK))
        gappy = group_rows(spec, 2 * CHUNK, 2, seed=16)
        gappy[1, 3] = -1
        with pytest.raises(ValueError, match="KV cache group"):
            engine.store(other, kvcaches=src, slot_mapping=gappy)
        assert engine.lookup(other) == 0
    finally:
        engine.close()


def test_layerwise_connector_refuses_group_rows():
    spec = spec_of()
    conn = make_connector(spec, CHUNK, layerwise=True)
    with pytest.raises(ValueError, match="per-group slot rows .* not supported by the layerwise connector"):
        conn.set_layer_groups(GROUPINGS[0])
    conn.set_layer_groups([0] * 6)  # one group: fine
    rows = group_rows(spec, 32, 2, seed=17)
    with pytest.raises(ValueError, match="not supported by the layerwise connector"):
        conn.bind(32, kvcaches=random_kv_caches(spec), slot_mapping=rows)
    grouped = connector(spec, GROUPINGS[0]).bind(32, kvcaches=random_kv_caches(spec), slot_mapping=rows)
    with pytest.raises(ValueError, match="not supported by the layerwise connector"):
        conn.batched_to_gpu([0], [16], grouped)
    with pytest.raises(ValueError, match="not supported by the layerwise connector"):
        conn.batched_from_gpu([[]] * 6, [], [], grouped)


# ----------------------------------------------------------------------------- property
@st.composite
def grouped_case(draw):
    num_layers = draw(st.integers(1, 8))
    num_groups = draw(st.integers(1, min(4, num_layers)))
    groups = list(range(num_groups)) + draw(
        st.lists(st.integers(0, num_groups - 1), min_size=num_layers - num_groups, max_size=num_layers - num_groups)
    )
    groups = draw(st.permutations(groups))
    primary = draw(st.integers(0, num_groups - 1))
    n_chunks = draw(st.integers(1, 3))
    seed = draw(st.integers(0, 10_000))
    holes = draw(st.lists(st.integers(0, n_chunks * CHUNK - 1), max_size=6))
    use_native = draw(st.booleans())
    return tuple(groups), primary, n_chunks, seed, holes, use_native


@settings(max_examples=40, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(case=grouped_case())
def test_grouped_copies_match_the_per_layer_reference(case, monkeypatch):
    groups, primary, n_chunks, seed, holes, use_native = case
    if use_native and native.load() is None:
        use_native = False
    monkeypatch.setattr(copy_ops, "USE_NATIVE", use_native)
    spec = spec_of(num_layers=len(groups))
    num_groups = max(groups) + 1
    starts, ends = spans(n_chunks)
    rows = group_rows(spec, ends[-1], num_groups, seed)
    conn = connector(spec, groups, primary)
    # gather: every group holds every token
    objs = objects(conn, [CHUNK] * n_chunks)
    conn.batched_from_gpu(objs, starts, ends, kvcaches=random_kv_caches(spec), slot_mapping=rows)
    want = reference_gather(spec, groups, rows, starts, ends)
    assert all(same(o.tensor, w) for o, w in zip(objs, want))
    # scatter: non-primary groups miss some tokens
    for t in holes:
        if num_groups > 1:
            rows[(primary + 1 + t % (num_groups - 1)) % num_groups, t] = -1
    base = random_kv_caches(spec, seed=seed + 1)
    target = [t.clone() for t in base]
    conn.batched_to_gpu(objs, starts, ends, kvcaches=target, slot_mapping=rows)
    want_kv = reference_scatter(spec, groups, rows, starts, ends, objs, base)
    assert all(same(a, b) for a, b in zip(target, want_kv))
    if holes and num_groups > 1:
        with pytest.raises(ValueError, match="slot_mapping: token"):
            conn.batched_from_gpu(objs, starts, ends, kvcaches=base, slot_mapping=rows)
