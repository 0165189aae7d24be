"""Native copy kernels (csrc/) against the torch fallback: bit-exact for every layout, dtype,
block size, slot pattern (partial chunks, partial blocks, negative slots), memory view shape
(KV_2LTD, strided 4-D views, KV_T2D objects seen as [2, 1, T, hidden]), store mode
(plain / non-temporal), ISA path and thread count, in both directions; plus dispatch,
argument errors and the CUDA kernels (only where CUDA exists).
"""

from __future__ import annotations

import itertools
import logging
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from lmcache.v1.gpu_connector import copy_ops, native
from lmcache.v1.gpu_connector.layouts import PagedGeometry, get_layout
from lmcache.v1.testing import LAYOUT_NAMES, KVSpec, make_connector, random_kv_caches, random_slot_mapping
from tests.native_build import build_cpu_kernels, build_cuda_kernels, child_env, cxx

DTYPES = (torch.float32, torch.bfloat16, torch.float16, torch.float8_e4m3fn)
BLOCK_SIZES = (16, 32, 128)
REPO = Path(__file__).resolve().parents[2]


# ----------------------------------------------------------------------------- helpers
@pytest.fixture(scope="module")
def lib_path() -> str:
    mod = native.load()
    if mod is None:
        if shutil.which("c++") or shutil.which("g++"):
            pytest.fail("a C++ compiler exists but lmcache/_c_ops_cpu.so is not built (run `pip install -e .`)")
        pytest.skip("no C++ compiler: native kernels are not built on this machine")
    return mod.path


def kernels(path: str, *, nt: int = native.NT_AUTO, threads: int = 1) -> native.NativeKernels:
    k = native.load_library(path)
    k.nt_mode, k.num_threads = nt, threads
    return k


def random_bytes(n: int, dtype: torch.dtype, gen: torch.Generator) -> torch.Tensor:
    """n elements of dtype holding random bits (NaN patterns included: comparisons are bitwise)."""
    size = torch.empty((), dtype=dtype).element_size()
    return torch.randint(0, 256, (n * size,), generator=gen, dtype=torch.uint8).view(dtype)


def slot_mapping(spec: KVSpec, n: int, pattern: str, gen: torch.Generator, neg_frac: float = 0.1) -> torch.Tensor:
    """n distinct slots in one of several patterns, some of them negative."""
    bs, total = spec.block_size, spec.num_blocks * spec.block_size
    if pattern == "blocks":  # whole blocks in random order (what vLLM hands out)
        slots = random_slot_mapping(spec, n, seed=int(torch.randint(0, 1 << 30, (1,), generator=gen)))
    elif pattern == "offset":  # the request starts in the middle of a block
        k = int(torch.randint(1, bs, (1,), generator=gen))
        blocks = torch.randperm(spec.num_blocks, generator=gen)
        slots = (blocks[:, None] * bs + torch.arange(bs)[None, :]).reshape(-1)[k : k + n]
    else:  # any slot anywhere: runs of one token
        slots = torch.randperm(total, generator=gen)[:n]
    slots = slots.to(torch.int64).clone()
    if neg_frac > 0 and n > 4:
        slots[torch.rand(n, generator=gen) < neg_frac] = -1
        a = int(torch.randint(0, n - 3, (1,), generator=gen))
        slots[a : a + 3] = -1
    return slots


def chunking(n: int, gen: torch.Generator, max_chunks: int = 4) -> tuple[list[int], list[int]]:
    """Random chunk starts/lengths inside [0, n); some tokens may belong to no chunk."""
    cuts = sorted({0, n, *torch.randint(1, n, (max_chunks - 1,), generator=gen).tolist()})
    starts, counts = [], []
    for a, b in itertools.pairwise(cuts):
        gap = int(torch.randint(0, max(1, (b - a) // 4), (1,), generator=gen))
        starts.append(a + gap)
        counts.append(b - a - gap)
    return starts, counts


def make_mems(kind: str, geom: PagedGeometry, layers: int, counts: list[int], dtype: torch.dtype, gen: torch.Generator):
    """(base buffers, [C, L, T, hidden] views) for one memory-view kind."""
    c, h = len(geom.components), geom.hidden
    bases, views = [], []
    for n in counts:
        if kind == "2ltd":
            base = random_bytes(c * layers * n * h, dtype, gen)
            view = base.view(c, layers, n, h)
        elif kind == "strided":  # [T, L, C, hidden + pad] seen as [C, L, T, hidden]
            base = random_bytes(n * layers * c * (h + 8), dtype, gen)
            view = base.view(n, layers, c, h + 8).permute(2, 1, 0, 3)[..., :h]
        else:  # "t2d": a KV_T2D object [T, C, hidden] of one layer, as copy_ops sees it
            assert layers == 1
            base = random_bytes(n * c * h, dtype, gen)
            view = base.view(n, c, h).permute(1, 0, 2).unsqueeze(1)
        bases.append(base)
        views.append(view)
    return bases, views


def bits(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().view(-1).view(torch.uint8)


def assert_same(xs, ys) -> None:
    for i, (x, y) in enumerate(zip(xs, ys)):
        assert torch.equal(bits(x), bits(y)), f"tensor {i} differs"


def check_both_directions(k, spec: KVSpec, slots, starts, counts, kind: str, seed: int) -> None:
    """Gather and scatter with kernels ``k`` and with the fallback; everything bit-equal."""
    gen = torch.Generator().manual_seed(seed)
    kv = random_kv_caches(spec, seed=seed)
    geom = get_layout(spec.layout).geometry(kv[0])
    calls = [(kv, 0)] if kind != "t2d" else [([layer], i) for i, layer in enumerate(kv)]
    for layers, _ in calls:
        # gather: the same garbage-filled destinations through both paths
        bases_n, views_n = make_mems(kind, geom, len(layers), counts, spec.dtype, gen)
        bases_t = [b.clone() for b in bases_n]
        bases_a = [b.clone() for b in bases_n]  # contiguous objects only: the address entry
        views_t = [b.as_strided(v.shape, v.stride(), v.storage_offset()) for b, v in zip(bases_t, views_n)]
        k.paged_gather(layers, geom, slots, starts, views_n)
        copy_ops.paged_gather(layers, geom, slots, starts, views_t, use_native=False)
        assert_same(bases_n, bases_t)
        if kind == "2ltd":
            k.paged_copy_at(native.GATHER, layers, geom, slots, starts, counts, [b.data_ptr() for b in bases_a])
            assert_same(bases_a, bases_t)
        # scatter: random sources into two copies of the cache
        src_bases, srcs = make_mems(kind, geom, len(layers), counts, spec.dtype, gen)
        full_n = torch.stack(layers).clone()
        full_t = full_n.clone()
        full_a = full_n.clone()
        k.paged_scatter(list(full_n.unbind(0)), geom, slots, starts, srcs)
        copy_ops.paged_scatter(list(full_t.unbind(0)), geom, slots, starts, srcs, use_native=False)
        assert_same([full_n], [full_t])
        if kind == "2ltd":
            k.paged_copy_at(native.SCATTER, list(full_a.unbind(0)), geom, slots, starts, counts, [m.data_ptr() for m in srcs])
            assert_same([full_a], [full_t])
        del src_bases


# ----------------------------------------------------------------------------- the matrix
@pytest.mark.parametrize("block_size", BLOCK_SIZES)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("layout", LAYOUT_NAMES)
def test_matches_fallback_every_layout_dtype_block(lib_path, layout, dtype, block_size):
    """Whole blocks, block-offset start and random slots; negative slots; partial chunks."""
    n = 2 * block_size + 37
    spec = KVSpec(
        num_layers=2,
        num_heads=2,
        head_size=16,
        num_blocks=n // block_size + 4,
        block_size=block_size,
        dtype=dtype,
        layout=layout,
    )
    for i, pattern in enumerate(("blocks", "offset", "random")):
        gen = torch.Generator().manual_seed(i)
        slots = slot_mapping(spec, n, pattern, gen)
        starts, counts = chunking(n, gen)
        for nt in (native.NT_NEVER, native.NT_ALWAYS):
            check_both_directions(kernels(lib_path, nt=nt), spec, slots, starts, counts, "2ltd", seed=i)


@pytest.mark.parametrize("kind", ["strided", "t2d"])
@pytest.mark.parametrize("layout", LAYOUT_NAMES)
def test_matches_fallback_strided_and_t2d_memory_views(lib_path, layout, kind):
    for i, dtype in enumerate(DTYPES):
        spec = KVSpec(num_layers=2, num_heads=2, head_size=32, num_blocks=12, block_size=32, dtype=dtype, layout=layout)
        gen = torch.Generator().manual_seed(10 + i)
        slots = slot_mapping(spec, 300, "offset", gen)
        starts, counts = chunking(300, gen)
        for nt in (native.NT_NEVER, native.NT_ALWAYS):
            check_both_directions(kernels(lib_path, nt=nt), spec, slots, starts, counts, kind, seed=i)


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    layout=st.sampled_from(LAYOUT_NAMES),
    dtype=st.sampled_from(DTYPES),
    block_size=st.sampled_from([1, 2, 5, 8, 16, 24, 32]),
    heads=st.integers(1, 3),
    head_size=st.sampled_from([1, 2, 3, 8, 12, 16, 20, 40]),
    n=st.integers(1, 120),
    pattern=st.sampled_from(["blocks", "offset", "random"]),
    kind=st.sampled_from(["2ltd", "strided", "t2d"]),
    nt=st.sampled_from([native.NT_NEVER, native.NT_ALWAYS]),
    seed=st.integers(0, 2**16),
)
def test_matches_fallback_random_shapes(
    lib_path, layout, dtype, block_size, heads, head_size, n, pattern, kind, nt, seed
):
    """Odd head sizes and short runs exercise every tile-edge path."""
    if pattern == "offset" and block_size == 1:
        pattern = "blocks"
    spec = KVSpec(
        num_layers=2,
        num_heads=heads,
        head_size=head_size,
        num_blocks=n // block_size + 3,
        block_size=block_size,
        dtype=dtype,
        layout=layout,
    )
    gen = torch.Generator().manual_seed(seed)
    slots = slot_mapping(spec, n, pattern, gen)
    starts, counts = chunking(n, gen) if n > 4 else ([0], [n])
    check_both_directions(kernels(lib_path, nt=nt), spec, slots, starts, counts, kind, seed=seed)


@pytest.mark.slow  # builds the library twice more (capped ISA)
@pytest.mark.parametrize("isa", ["sse2", "avx2"])
def test_capped_isa_and_scalar_paths_match(lib_path, tmp_path, isa):
    """LMCACHE_NATIVE_ISA=sse2 (no AVX2) / avx2 (no AVX-512) and a -DLMC_NO_SIMD build (what
    non-x86 runs) agree; the shapes include runs and heads of 32+ rows (the widest tiles)."""
    script = "\n".join(
        [
            "import sys, torch",
            "from tests.kernels.test_native_kernels import *",
            "for layout in LAYOUT_NAMES:",
            "  for dtype in DTYPES:",
            "   for block_size, head_size in ((16, 24), (32, 40)):",
            "    spec = KVSpec(num_layers=2, num_heads=2, head_size=head_size, num_blocks=12, block_size=block_size,",
            "                  dtype=dtype, layout=layout)",
            "    gen = torch.Generator().manual_seed(1)",
            "    slots = slot_mapping(spec, 150, 'offset', gen); starts, counts = chunking(150, gen)",
            "    for nt in (native.NT_NEVER, native.NT_ALWAYS):",
            "      check_both_directions(kernels(sys.argv[1], nt=nt), spec, slots, starts, counts, '2ltd', seed=1)",
            "print('ok')",
        ]
    )
    env = child_env(LMCACHE_NATIVE_ISA=isa)
    builds = [lib_path]
    if cxx():
        builds.append(str(build_cpu_kernels(tmp_path / "scalar.so", "-O1", "-DLMC_NO_SIMD")))
    for build in builds:
        out = subprocess.run(
            [sys.executable, "-c", script, build], env=env, capture_output=True, text=True, timeout=300, check=False
        )
        assert out.returncode == 0 and out.stdout.strip().endswith("ok"), out.stderr[-3000:]


def test_thread_split_matches(lib_path):
    """Large enough for the work to be split over threads (>= 4 MiB per thread)."""
    spec = KVSpec(
        num_layers=4, num_heads=8, head_size=128, num_blocks=80, block_size=16, dtype=torch.bfloat16, layout="vllm_cpu"
    )
    gen = torch.Generator().manual_seed(3)
    slots = slot_mapping(spec, 1200, "blocks", gen, neg_frac=0.02)
    starts, counts = [0, 256, 512, 768, 1024], [256, 256, 256, 256, 176]
    for threads in (2, 3):
        check_both_directions(kernels(lib_path, threads=threads), spec, slots, starts, counts, "2ltd", seed=3)


@pytest.mark.parametrize("layout", ["flash_attn", "flashinfer", "mla"])
def test_long_dense_runs_match(lib_path, layout):
    """Dense runs over 8 KiB (copied as four interleaved streams) whose length is no multiple
    of the stream slices, at odd and 32-byte aligned destinations; partial blocks."""
    spec = KVSpec(num_layers=2, num_heads=3, head_size=40, num_blocks=8, block_size=128, dtype=torch.bfloat16,
                  layout=layout)
    for i, pattern in enumerate(("blocks", "offset", "random")):
        gen = torch.Generator().manual_seed(20 + i)
        slots = slot_mapping(spec, 2 * 128 + 37, pattern, gen, neg_frac=0.0 if pattern == "blocks" else 0.02)
        starts, counts = chunking(2 * 128 + 37, gen)
        for kind in ("2ltd", "strided"):
            for nt in (native.NT_NEVER, native.NT_ALWAYS):
                check_both_directions(kernels(lib_path, nt=nt), spec, slots, starts, counts, kind, seed=i)


@pytest.mark.parametrize("block_size", [16, 128])
@pytest.mark.parametrize("head_size", [32, 96, 288])
def test_whole_line_k_page_transposes_match(lib_path, block_size, head_size):
    """The vllm-cpu K page in whole 64-byte lines (2-byte types, head sizes that are multiples
    of 32): whole blocks, partial runs, negative slots, odd memory views, both store modes
    (288 rows: the non-temporal gather without its L1 buffer)."""
    for i, dtype in enumerate((torch.bfloat16, torch.float16)):
        spec = KVSpec(num_layers=2, num_heads=2, head_size=head_size, num_blocks=600 // block_size + 4,
                      block_size=block_size, dtype=dtype, layout="vllm_cpu")
        check_slot_patterns(lib_path, spec, 30 + 3 * i, data_seed=i)


def check_slot_patterns(lib_path, spec: KVSpec, gen_seed: int, data_seed: int | None = None) -> None:
    """Both directions against the fallback for whole blocks, offset runs and random slots
    (2 % negative), every memory-view kind and both store modes (``data_seed`` None: the
    pattern's index)."""
    for j, pattern in enumerate(("blocks", "offset", "random")):
        gen = torch.Generator().manual_seed(gen_seed + j)
        n = 2 * spec.block_size + 21
        slots = slot_mapping(spec, n, pattern, gen, neg_frac=0.0 if pattern == "blocks" else 0.02)
        starts, counts = chunking(n, gen)
        seed = j if data_seed is None else data_seed
        for kind in ("2ltd", "strided", "t2d"):
            for nt in (native.NT_NEVER, native.NT_ALWAYS):
                check_both_directions(kernels(lib_path, nt=nt), spec, slots, starts, counts, kind, seed=seed)


@pytest.mark.parametrize("block_size", [32, 128])
@pytest.mark.parametrize(
    "heads, head_size, dtype", [(8, 128, torch.bfloat16), (4, 64, torch.float32), (12, 16, torch.float16)]
)
def test_head_group_rows_match(lib_path, block_size, heads, head_size, dtype):
    """A gather copies the vllm-cpu V rows of 8 (or 4) heads per piece from block size 32
    (rows of 32-byte multiples; 12 heads: groups of 4): whole blocks, partial runs, negative
    slots, odd memory views, both store modes."""
    spec = KVSpec(num_layers=2, num_heads=heads, head_size=head_size, num_blocks=600 // block_size + 4,
                  block_size=block_size, dtype=dtype, layout="vllm_cpu")
    check_slot_patterns(lib_path, spec, 50)


def test_llama_shape_auto_mode_matches(lib_path):
    """The benchmark's per-layer shape (8 heads x 128) big enough for the automatic NT mode."""
    for layout in ("vllm_cpu", "flash_attn"):
        spec = KVSpec(
            num_layers=2, num_heads=8, head_size=128, num_blocks=70, block_size=16, dtype=torch.bfloat16, layout=layout
        )
        gen = torch.Generator().manual_seed(4)
        slots = slot_mapping(spec, 1024, "blocks", gen, neg_frac=0.0)
        check_both_directions(kernels(lib_path), spec, slots, [0, 256, 512, 768], [256] * 4, "2ltd", seed=4)


# ----------------------------------------------------------------------------- dispatch
def test_connector_dispatches_to_native_and_env_forces_fallback(lib_path, monkeypatch):
    spec = KVSpec(num_layers=2, num_heads=2, head_size=8, num_blocks=8, block_size=16, layout="vllm_cpu")
    kv = random_kv_caches(spec)
    slots = random_slot_mapping(spec, 40)
    conn = make_connector(spec, chunk_size=16)
    from lmcache.v1.memory_management import MemoryFormat, MemoryObj

    objs = [MemoryObj.from_tensor(torch.zeros(tuple(conn.get_shape(16))), MemoryFormat.KV_2LTD) for _ in range(2)]
    mod = native.load()
    calls = []
    real = mod._run  # every native CPU copy (tensor or address entry) runs through it
    monkeypatch.setattr(mod, "_run", lambda *a, **kw: (calls.append(1), real(*a, **kw))[1])
    monkeypatch.setattr(copy_ops, "USE_NATIVE", True)
    conn.batched_from_gpu(objs, [0, 16], [16, 32], kvcaches=kv, slot_mapping=slots)
    assert calls == [1]
    native_out = [o.tensor.clone() for o in objs]
    monkeypatch.setattr(copy_ops, "USE_NATIVE", False)
    for o in objs:
        o.tensor.zero_()
    conn.batched_from_gpu(objs, [0, 16], [16, 32], kvcaches=kv, slot_mapping=slots)
    assert calls == [1], "LMCACHE_USE_NATIVE=0 must not reach the native kernels"
    assert_same(native_out, [o.tensor for o in objs])


def test_missing_library_means_fallback_with_one_log_line(monkeypatch, caplog, tmp_path):
    monkeypatch.setenv("LMCACHE_NATIVE_LIB", str(tmp_path / "absent.so"))
    with caplog.at_level(logging.INFO, logger=native.__name__):
        assert native.load.__wrapped__() is None
    lines = [r for r in caplog.records if r.name == native.__name__]
    assert len(lines) == 1 and "torch fallback" in lines[0].getMessage()


# ----------------------------------------------------------------------------- argument errors
def _small(layout: str = "flash_attn"):
    spec = KVSpec(num_layers=2, num_heads=2, head_size=8, num_blocks=4, block_size=16, layout=layout)
    kv = random_kv_caches(spec)
    return spec, kv, get_layout(layout).geometry(kv[0])


def test_address_entry_checks_spans_and_slots(lib_path):
    _, kv, geom = _small()
    k = kernels(lib_path)
    dst = torch.zeros(2, 2, 16, geom.hidden)
    slots = torch.arange(16, dtype=torch.int64)
    with pytest.raises(ValueError, match=r"chunk needs \[8, 24\)"):
        k.paged_copy_at(native.GATHER, kv, geom, slots, [8], [16], [dst.data_ptr()])
    with pytest.raises(ValueError, match="lengths differ"):
        k.paged_copy_at(native.GATHER, kv, geom, slots, [0], [16], [])
    slots[5] = 4 * 16  # one past the last slot
    with pytest.raises(IndexError, match=r"slot_mapping\[5\] = 64"):
        k.paged_copy_at(native.GATHER, kv, geom, slots, [0], [16], [dst.data_ptr()])


def test_out_of_range_slot_raises_index_error(lib_path):
    _, kv, geom = _small()
    slots = torch.arange(16, dtype=torch.int64)
    slots[5] = 4 * 16  # one past the last slot
    dst = torch.zeros(2, 2, 16, geom.hidden)
    with pytest.raises(IndexError, match=r"slot_mapping\[5\] = 64"):
        kernels(lib_path).paged_gather(kv, geom, slots, [0], [dst])


@pytest.mark.parametrize(
    ("dst", "exc", "match"),
    [
        (torch.zeros(2, 2, 16, 8), ValueError, "expected"),  # wrong hidden
        (torch.zeros(1, 2, 16, 16), ValueError, "expected"),  # wrong component count
        (torch.zeros(2, 2, 16, 16, dtype=torch.float16), TypeError, "dtype"),
        (torch.zeros(2, 2, 16, 32)[..., ::2], ValueError, "contiguous"),
        (torch.zeros(2, 2, 40, 16), ValueError, "slot_mapping"),  # chunk past the mapping
    ],
)
def test_bad_memory_views_are_rejected(lib_path, dst, exc, match):
    _, kv, geom = _small()
    with pytest.raises(exc, match=match):
        kernels(lib_path).paged_gather(kv, geom, torch.arange(32), [0], [dst])


def test_mixed_layer_strides_are_rejected(lib_path):
    _, kv, geom = _small()
    odd = torch.zeros(kv[1].shape[::-1]).permute(4, 3, 2, 1, 0)  # same shape, other strides
    with pytest.raises(ValueError, match="differ"):
        kernels(lib_path).paged_gather([kv[0], odd], geom, torch.arange(16), [0], [torch.zeros(2, 2, 16, 16)])


def test_supports_requires_cpu_memory_for_cpu_kv(lib_path):
    k = kernels(lib_path)
    kv = torch.zeros(2, 4, 16, 2, 8)
    assert native.supports(k, kv, [torch.zeros(1)])
    assert native.supports(k, kv, torch.zeros(1))
    assert not native.supports(k, kv, [torch.zeros(1), torch.zeros(1, device="meta")])


# ----------------------------------------------------------------------------- CUDA
@pytest.fixture(scope="module")
def cuda_kernels(lib_path, tmp_path_factory) -> native.NativeKernels:
    if not torch.cuda.is_available():
        pytest.skip("CUDA is not available")
    path = native.CUDA_LIBRARY
    if not path.exists():
        major, minor = torch.cuda.get_device_capability()
        path = build_cuda_kernels(tmp_path_factory.mktemp("cuda") / "_c_ops_cuda.so", f"{major}{minor}")
    k = native.load_library(lib_path, path)
    assert k.has_cuda
    return k


@pytest.mark.cuda
@pytest.mark.parametrize("pinned_host", [False, True], ids=["device-mem", "pinned-host-mem"])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("layout", LAYOUT_NAMES)
def test_cuda_matches_fallback(cuda_kernels, layout, dtype, pinned_host):
    spec = KVSpec(num_layers=3, num_heads=4, head_size=64, num_blocks=40, block_size=16, dtype=dtype, layout=layout)
    gen = torch.Generator().manual_seed(7)
    kv = random_kv_caches(spec, seed=7, device="cuda")
    geom = get_layout(layout).geometry(kv[0])
    slots = slot_mapping(spec, 500, "offset", gen).cuda()
    starts, counts = chunking(500, gen)
    mem_dev = "cpu" if pinned_host else "cuda"

    def mems():
        c, h = len(geom.components), geom.hidden
        out = [random_bytes(c * 3 * n * h, dtype, gen).view(c, 3, n, h) for n in counts]
        return [m.pin_memory() if pinned_host else m.to(mem_dev) for m in out]

    got, want = mems(), None
    want = [m.clone() for m in got]
    cuda_kernels.paged_gather(kv, geom, slots, starts, got)
    copy_ops.paged_gather(kv, geom, slots, starts, want, use_native=False)
    torch.cuda.synchronize()
    assert_same([m.cpu() for m in got], [m.cpu() for m in want])

    srcs = mems()
    kv_n = [layer.clone() for layer in kv]
    kv_t = [layer.clone() for layer in kv]
    cuda_kernels.paged_scatter(kv_n, geom, slots, starts, srcs)
    copy_ops.paged_scatter(kv_t, geom, slots, starts, srcs, use_native=False)
    torch.cuda.synchronize()
    assert_same([x.cpu() for x in kv_n], [x.cpu() for x in kv_t])
