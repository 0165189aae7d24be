"""The CUDA paths end to end: paged KV on the GPU, cache memory in the pinned pool.

Covers what the CPU suite cannot: the connectors' side streams (bulk and layerwise, both
layerwise variants), the native CUDA kernels reading and writing pinned pool memory
through unified addressing (and the torch fallback on the same tensors), the pinned
slabs of :class:`PoolAllocator`, and the device copies of HiddenStateStore and
ECCacheEngine. Every comparison is bitwise.

All tests carry the ``cuda`` marker (``scripts/gpu_check.sh`` selects ``-m cuda``) and
skip when CUDA is not available.
"""

from __future__ import annotations

import pytest
import torch

from lmcache.v1.config import LMCacheEngineConfig
from lmcache.v1.ec_engine import ECCacheEngine
from lmcache.v1.gpu_connector import copy_ops, native
from lmcache.v1.gpu_connector.layouts import get_layout
from lmcache.v1.memory_management import ALIGN, GiB, MemoryFormat, PoolAllocator
from lmcache.v1.testing import KVSpec, make_connector, make_engine, random_kv_caches, random_slot_mapping

pytestmark = [
    pytest.mark.cuda,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA is not available"),
]

CHUNK = 64
KV_LAYOUTS = ("flash_attn", "flashinfer", "mla")


def bits(t: torch.Tensor) -> torch.Tensor:
    """Integer view for bitwise comparison (works for every float type, NaN patterns too)."""
    return t.view({1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}[t.element_size()])


def assert_bits_equal(got: torch.Tensor, want: torch.Tensor) -> None:
    assert got.shape == want.shape and got.dtype == want.dtype
    assert torch.equal(bits(got.cpu()), bits(want.cpu()))


@pytest.fixture(params=["native", "torch"])
def copy_path(request, monkeypatch) -> str:
    """Run a test once with the native CUDA kernels and once with the torch fallback."""
    if request.param == "native":
        mod = native.load()
        if mod is None or not mod.has_cuda:
            pytest.skip("native CUDA kernels not built (python setup.py build_ext --inplace with nvcc)")
        monkeypatch.setattr(copy_ops, "USE_NATIVE", True)
    else:
        monkeypatch.setattr(copy_ops, "USE_NATIVE", False)
    return request.param


def spec_for(layout: str, dtype: torch.dtype = torch.bfloat16) -> KVSpec:
    return KVSpec(num_layers=3, num_heads=4, head_size=64, num_blocks=48, block_size=16, dtype=dtype, layout=layout)


# ----------------------------------------------------------------------------- pool
def test_pool_slabs_are_pinned_and_page_aligned_when_cuda_exists():
    pool = PoolAllocator(64 * GiB, slab_bytes=64 << 20)
    assert pool.pin_memory
    a = pool.allocate((2, 3, 100, 256), torch.bfloat16, MemoryFormat.KV_2LTD)
    b = pool.allocate((7, 5), torch.float32, MemoryFormat.HS_TD)
    assert a is not None and b is not None
    for obj in (a, b):
        assert obj.tensor is not None and obj.tensor.is_pinned()
        assert obj.tensor.data_ptr() % ALIGN == 0
        obj.ref_count_down()
    pool.close()


# ----------------------------------------------------------------------------- bulk connector
@pytest.mark.parametrize("layout", KV_LAYOUTS)
def test_bulk_connector_roundtrip_through_pinned_pool(layout, copy_path):
    spec = spec_for(layout)
    n = 5 * CHUNK - 7  # a partial last chunk and a partial last block
    kv = random_kv_caches(spec, seed=3, device="cuda")
    slots = random_slot_mapping(spec, n, seed=4).cuda()
    conn = make_connector(spec, CHUNK, "cuda")
    pool = PoolAllocator(1 << 28)
    starts = list(range(0, n, CHUNK))
    ends = [min(s + CHUNK, n) for s in starts]
    objs = [pool.allocate(conn.get_shape(e - s), spec.dtype, conn.fmt) for s, e in zip(starts, ends)]
    assert all(o is not None and o.tensor.is_pinned() for o in objs)

    conn.batched_from_gpu(objs, starts, ends, kvcaches=kv, slot_mapping=slots)
    # the call returns after its side stream finished: objects are readable at once
    kv_cpu = [layer.cpu() for layer in kv]
    geom = get_layout(layout).geometry(kv_cpu[0])
    want = [torch.empty(o.tensor.shape, dtype=spec.dtype) for o in objs]
    copy_ops.paged_gather(kv_cpu, geom, slots.cpu(), starts, want, use_native=False)
    for obj, ref in zip(objs, want):
        assert_bits_equal(obj.tensor, ref)

    out = [torch.zeros_like(layer) for layer in kv]
    conn.batched_to_gpu(objs, starts, ends, kvcaches=out, slot_mapping=slots)
    want_kv = [torch.zeros_like(layer) for layer in kv_cpu]
    copy_ops.paged_scatter(want_kv, geom, slots.cpu(), starts, want, use_native=False)
    for got, ref in zip(out, want_kv):
        assert_bits_equal(got, ref)
    for obj in objs:
        obj.ref_count_down()
    pool.close()


def test_bulk_copy_is_ordered_after_work_on_the_current_stream(copy_path):
    """KV written by a kernel still queued on the current stream is what gets stored."""
    spec = spec_for("flash_attn")
    kv = [torch.zeros(spec.layer_shape(), dtype=spec.dtype, device="cuda") for _ in range(spec.num_layers)]
    slots = random_slot_mapping(spec, CHUNK, seed=1).cuda()
    conn = make_connector(spec, CHUNK, "cuda")
    pool = PoolAllocator(1 << 26)
    obj = pool.allocate(conn.get_shape(CHUNK), spec.dtype, conn.fmt)
    big = torch.randn(4096, 4096, device="cuda")
    for _ in range(8):  # keep the current stream busy before the writes below
        big = big @ big / 64
    for layer in kv:
        layer.fill_(1.5)
    conn.from_gpu(obj, 0, CHUNK, kvcaches=kv, slot_mapping=slots)
    assert bool((obj.tensor.float() == 1.5).all())
    obj.ref_count_down()
    pool.close()


# ----------------------------------------------------------------------------- layerwise
@pytest.mark.parametrize("buffered", [False, True], ids=["paged", "buffered"])
@pytest.mark.parametrize("layout", ["flash_attn", "flashinfer"])
def test_layerwise_engine_roundtrip_on_cuda(layout, buffered, copy_path):
    spec = spec_for(layout)
    n = 4 * CHUNK + 5
    cfg = LMCacheEngineConfig.from_dict(
        {"chunk_size": CHUNK, "max_local_cpu_size": 0.05, "use_layerwise": True, "save_unfull_chunk": True}
    )
    engine = make_engine(spec, cfg, buffered=buffered, device="cuda")
    try:
        kv = random_kv_caches(spec, seed=11, device="cuda")
        slots = random_slot_mapping(spec, n, seed=12).cuda()
        tokens = torch.arange(500, 500 + n)
        assert engine.store(tokens, kvcaches=kv, slot_mapping=slots) == n

        out = [torch.zeros_like(layer) for layer in kv]
        gen = engine.retrieve_layer(tokens, kvcaches=out, slot_mapping=slots)
        mask = None
        for step in gen:
            mask = step
        # the generator made the current stream wait for every layer: no explicit sync here
        got = [layer.clone() for layer in out]
        torch.cuda.synchronize()
        assert mask is not None and int(mask.sum()) == n
        geom = get_layout(layout).geometry(kv[0])
        want = [torch.zeros_like(layer) for layer in kv]
        tmp = [torch.empty((2, spec.num_layers, n, spec.hidden), dtype=spec.dtype, device="cuda")]
        copy_ops.paged_gather(kv, geom, slots, [0], tmp, use_native=False)
        copy_ops.paged_scatter(want, geom, slots, [0], tmp, use_native=False)
        for g, w in zip(got, want):
            assert_bits_equal(g, w)
    finally:
        engine.close()


# ----------------------------------------------------------------------------- hidden states, encoder cache
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_hidden_state_store_takes_cuda_rows_bit_exact(dtype):
    n, dim = 3 * 256 + 40, 512
    spec = KVSpec(num_layers=1, num_heads=1, head_size=2, num_blocks=(n + 15) // 16, block_size=16)
    cfg = LMCacheEngineConfig.from_dict(
        {"chunk_size": 256, "max_local_cpu_size": 0.05, "enable_hidden_state_cache": True,
         "max_hidden_state_cpu_size": 0.05, "save_unfull_chunk": True}
    )
    engine = make_engine(spec, cfg)
    try:
        tokens = list(range(7, 7 + n))
        engine.store(tokens, kvcaches=random_kv_caches(spec), slot_mapping=random_slot_mapping(spec, n))
        hs = engine.hidden_state_store
        assert hs is not None
        rows = torch.randn(n, dim, device="cuda").to(dtype)
        assert hs.store_hidden_states(tokens, rows) == 4  # chunks stored: three full and the 40-token one
        got = hs.retrieve_hidden_states(tokens)
        assert got is not None and got.device.type == "cpu" and got.dtype == torch.float32
        assert_bits_equal(got, rows.float().cpu())
    finally:
        engine.close()


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_ec_engine_put_from_cuda_and_get_on_cuda(dtype):
    config = LMCacheEngineConfig.from_dict({"max_local_cpu_size": 0.05})
    engine = ECCacheEngine(config, "tiny/vlm", dtype)
    try:
        item = torch.randn(577, 1024, device="cuda").to(dtype)
        assert engine.put("img-0", item)
        on_gpu = engine.get("img-0", "cuda")
        assert on_gpu is not None and on_gpu.device.type == "cuda" and on_gpu.dtype == dtype
        assert_bits_equal(on_gpu, item)
        on_cpu = engine.get("img-0")
        assert on_cpu is not None and on_cpu.device.type == "cpu"
        assert_bits_equal(on_cpu, item)
        # the returned tensor is the caller's: writing it leaves the cache alone
        on_gpu.zero_()
        again = engine.get("img-0", torch.device("cuda", torch.cuda.current_device()))
        assert again is not None
        assert_bits_equal(again, item)
    finally:
        engine.close()
