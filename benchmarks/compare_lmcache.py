"""Side by side with LMCache 0.5.6 on the same shapes, one process per implementation.

    python benchmarks/compare_lmcache.py --install      # once: LMCache 0.5.6 into its OWN venv
    python benchmarks/compare_lmcache.py                # run both sides, print us / LMCache

``--install`` creates ``--venv`` (default ``~/.cache/lmcache-compare/venv``; never this
project's venv) with torch 2.13.0 CPU and builds LMCache 0.5.6 from its sdist without GPU
extensions (``NO_GPU_EXT=1``: its CPU-only C++ module ``lmcache_native`` is still built,
which its imports need; ``NO_NATIVE_EXT=1`` skips that too and leaves a package that cannot
import its copy code). The sdist's version comes from setuptools-scm, so the build runs
with ``SETUPTOOLS_SCM_PRETEND_VERSION=0.5.6``, ``--no-build-isolation`` and the build
requirements (grpcio/grpcio-tools 1.78.0, setuptools-scm, ninja) installed first.

The run starts processes one after the other: this interpreter (``--side ours``) and the
LMCache venv's (``--side lmcache``), one each for the copies and lookups, then one per side
and disk round, alternating ours / LMCache, so that both see the same shared disk over time.
Each measures, on CPU tensors, with torch threads 1:

* paged store / retrieve of a Llama-3-8B-like KV (32 layers, 8 KV heads, head 128, bf16,
  vLLM flash-attn layout, block size 16, chunks of 256 tokens) through each project's
  ``GPUConnectorInterface`` (``batched_from_gpu`` / ``batched_to_gpu``). LMCache's CUDA
  kernels are not built on CPU, so its own torch fallback (``multi_layer_kv_transfer``) runs;
  its connector insists on CUDA streams and a CUDA device in two places, which this script
  bypasses (no-op streams, and a CPU variant of its pointer set-up that calls its own helpers);
* lookup of an 8k and a 32k-token prompt given as a Python list, everything cached
  (``engine.lookup`` on both sides);
* the local-disk tier on the same bytes (``--disk-mib`` of 32 MiB KV_2LTD chunks, fresh keys
  each round, ``--disk-rounds`` rounds, files under ``--dir``, removed at the end):
  - store-to-durable: ours ``submit_put`` of every chunk then ``flush()`` (which fdatasyncs
    every entry file and the directory); LMCache ``batched_submit_put_task`` until its
    completion callback fired for every chunk ("written": its own notion of done, the data
    is in the page cache only, LMCache never fsyncs) and then this script's fdatasync of
    every file ("durable"), which is the figure compared;
  - cold read: the page cache of every entry file is dropped first
    (``posix_fadvise(DONTNEED)`` after the data is durable, so the pages are clean; no root
    and no global ``drop_caches`` needed), checked with ``mincore`` (the resident bytes left
    are printed), then every chunk is read back one by one (``get_blocking`` on both sides)
    and all at once (ours ``get_non_blocking`` for every key; LMCache
    ``batched_get_blocking``, its thread-pool read), into pool memory faulted in beforehand
    on both sides; the first chunk's bytes are verified;
* numpy memcpy of the KV bytes (the machine's limit, in both processes).

Each side prints its results as it goes (``PART`` lines); the parent stops a side after
``--timeout`` seconds (its process group is killed) and still shows what it printed. LMCache
leaves non-daemon threads behind, so its side exits with ``os._exit`` after the last line.
The table shows us (best of ``--reps`` after a warm-up; lookups: median of 30; disk: best
and median of the rounds) and ours / LMCache (< 1: we are faster), next to the memcpy limit
of each process.

Defaults finish in a few minutes on a 2-vCPU machine; ``--paged-tokens 8192,32768``,
``--disk-mib 1024`` and more ``--reps``/``--disk-rounds`` for a fuller run.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path
from types import SimpleNamespace
from typing import Any, Callable


def _load_limits() -> Any:
    """lmcache/bench/limits.py, loaded by path: on the LMCache side ``lmcache`` is LMCache's package."""
    import importlib.util

    path = Path(__file__).resolve().parents[1] / "lmcache" / "bench" / "limits.py"
    spec = importlib.util.spec_from_file_location("_lmcache_bench_limits", path)
    assert spec is not None and spec.loader is not None, path
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up there
    spec.loader.exec_module(module)
    return module


LLAMA3_8B = _load_limits().LLAMA3_8B
DEFAULT_VENV = Path.home() / ".cache" / "lmcache-compare" / "venv"
LMCACHE_VERSION = "0.5.6"
LAYERS, HEADS, HEAD = LLAMA3_8B.num_layers, LLAMA3_8B.num_heads, LLAMA3_8B.head_size
BLOCK, CHUNK = 16, 256


# ---------------------------------------------------------------------------- install
def install(venv: Path) -> None:
    """Create ``venv`` and build LMCache 0.5.6 into it (CPU only)."""
    if venv.resolve() == (Path(__file__).resolve().parents[1] / ".venv").resolve():
        raise SystemExit("--venv: refusing to install LMCache into this project's venv")
    if not (venv / "bin" / "python").exists():
        subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True)
    py = str(venv / "bin" / "python")
    pip = [py, "-m", "pip", "install", "-q"]
    subprocess.run([*pip, "torch==2.13.0", "numpy", "wheel", "setuptools>=77,<81", "setuptools_scm>=8", "ninja",
                    "packaging>=24.2", "grpcio==1.78.0", "grpcio-tools==1.78.0", "pybind11"], check=True)
    env = dict(os.environ, SETUPTOOLS_SCM_PRETEND_VERSION=LMCACHE_VERSION, NO_GPU_EXT="1", MAX_JOBS="2")
    env.pop("NO_NATIVE_EXT", None)
    subprocess.run([*pip, "--no-build-isolation", "--no-binary", "lmcache", f"lmcache=={LMCACHE_VERSION}"],
                   check=True, env=env)
    subprocess.run([py, "-c", "import lmcache, lmcache.v1.gpu_connector.gpu_connectors"], check=True)
    print(f"LMCache {LMCACHE_VERSION} installed in {venv}")


# ---------------------------------------------------------------------------- shared
def best_us(fn: Callable[[], Any], reps: int) -> float:
    """Best of ``reps`` after one warm-up, in microseconds."""
    fn()
    best = float("inf")
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t0)
    return best * 1e6


def median_us(fn: Callable[[], Any], reps: int) -> float:
    fn()
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times) * 1e6


def paged_inputs(num_tokens: int):
    """flash-attn layer tensors [2, blocks, block, heads, head], a block-shuffled slot
    mapping and one KV_2LTD tensor [2, layers, 256, hidden] per chunk (same seed both sides)."""
    import torch

    g = torch.Generator().manual_seed(0)
    nb = num_tokens // BLOCK
    kv = [torch.randn(2, nb, BLOCK, HEADS, HEAD, generator=g).to(torch.bfloat16) for _ in range(LAYERS)]
    blocks = torch.randperm(nb, generator=g)
    slots = (blocks[:, None] * BLOCK + torch.arange(BLOCK)[None, :]).reshape(-1)[:num_tokens].to(torch.int64)
    mems = [torch.zeros(2, LAYERS, CHUNK, HEADS * HEAD, dtype=torch.bfloat16) for _ in range(num_tokens // CHUNK)]
    starts = list(range(0, num_tokens, CHUNK))
    ends = [s + CHUNK for s in starts]
    nbytes = sum(m.numel() * m.element_size() for m in mems)
    return kv, slots, mems, starts, ends, nbytes


def check_gathered(kv, slots, mems) -> None:
    """Both sides must have copied the same bytes: token 0 and the last token of chunk 0."""
    import torch

    for t in (0, CHUNK - 1):
        s = int(slots[t])
        for layer in (0, LAYERS - 1):
            for comp in (0, 1):
                want = kv[layer][comp, s // BLOCK, s % BLOCK].reshape(-1)
                if not torch.equal(mems[0][comp, layer, t], want):
                    raise RuntimeError(f"store copied wrong data (token {t}, layer {layer}, component {comp})")


def memcpy_us(nbytes: int, reps: int) -> float:
    import numpy as np

    src = np.ones(nbytes, dtype=np.uint8)
    dst = np.zeros_like(src)
    return best_us(lambda: np.copyto(dst, src), reps)


def emit(part: dict[str, Any]) -> None:
    """Print one partial result for the parent (it keeps whatever arrived before a timeout)."""
    print("PART " + json.dumps(part), flush=True)


def chunk_bytes_for_round(i: int, nbytes: int):
    """The bytes of chunk ``i`` (same on both sides): a seeded random uint8 tensor."""
    import torch

    g = torch.Generator().manual_seed(1000 + i)
    return torch.randint(0, 256, (nbytes,), dtype=torch.uint8, generator=g)


def obj_bytes(obj: Any):
    """A memory object's bytes as a flat uint8 tensor (both projects' objects have ``tensor``)."""
    import torch

    return obj.tensor.reshape(-1).view(torch.uint8)


def touch_read_memory(allocate: Callable[[], Any], n: int) -> None:
    """Fault in the pool memory the reads will land in (``n`` chunks, then freed): both
    pools reuse freed memory, and a first touch of fresh pages would otherwise be timed
    as part of the read (on whichever side happens to hand out fresh pages)."""
    held = []
    for _ in range(n):
        obj = allocate()
        assert obj is not None, "pool too small"
        obj_bytes(obj).zero_()
        held.append(obj)
    for obj in held:
        obj.ref_count_down()


def fdatasync_files(paths: list[str]) -> None:
    for path in paths:
        fd = os.open(path, os.O_RDONLY)
        try:
            os.fdatasync(fd)
        finally:
            os.close(fd)


def drop_cache(paths: list[str]) -> int:
    """Drop the (clean) cached pages of ``paths``; returns the bytes still resident (mincore)."""
    left = 0
    for path in paths:
        fd = os.open(path, os.O_RDONLY)
        try:
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)
        left += resident_bytes(path)
    return left


def resident_bytes(path: str) -> int:
    """Bytes of ``path`` in the page cache (mincore over a read-only mapping); -1 if unknown."""
    import ctypes
    import ctypes.util

    size = os.path.getsize(path)
    if size == 0:
        return 0
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c"), use_errno=True)
        libc.mmap.restype = ctypes.c_void_p
        libc.mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_long]
        libc.munmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
        libc.mincore.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_char_p]
    except (OSError, AttributeError):
        return -1
    page = os.sysconf("SC_PAGE_SIZE")
    fd = os.open(path, os.O_RDONLY)
    try:
        addr = libc.mmap(None, size, 1, 1, fd, 0)  # PROT_READ, MAP_SHARED
        if addr in (None, ctypes.c_void_p(-1).value):
            return -1
        try:
            vec = ctypes.create_string_buffer((size + page - 1) // page)
            if libc.mincore(addr, size, vec) != 0:
                return -1
            return sum(b & 1 for b in vec.raw) * page
        finally:
            libc.munmap(addr, size)
    finally:
        os.close(fd)


def timed_cold_reads(
    disk: Any, keys: list[Any], first: Any, paths: list[str], times: dict[str, list[float]], left: list[int],
    read_all: Callable[[], list[Any]],
) -> None:
    """Cold reads of one round, either side: drop the entries' pages, read them one by one
    (``disk.get_blocking``; the first checked against ``first``), drop again, read them all
    at once with ``read_all``. Appends to ``times["get"]``/``times["batched"]`` and the
    bytes left cached after each drop to ``left``; releases what it read."""
    left.append(drop_cache(paths))
    t0 = time.perf_counter()
    for i, key in enumerate(keys):
        got = disk.get_blocking(key)
        assert got is not None, "a stored chunk missed"
        if i == 0 and not obj_bytes(got).equal(obj_bytes(first)):
            raise RuntimeError("disk read returned other bytes")
        got.ref_count_down()
    times["get"].append(time.perf_counter() - t0)
    left.append(drop_cache(paths))
    t0 = time.perf_counter()
    got_all = read_all()
    times["batched"].append(time.perf_counter() - t0)
    assert all(g is not None for g in got_all), "a stored chunk missed"
    for g in got_all:
        g.ref_count_down()


def disk_chunks(args: argparse.Namespace) -> int:
    return max(1, args.disk_mib * (1 << 20) // (2 * LAYERS * CHUNK * HEADS * HEAD * 2))


def summarize(name: str, seconds: list[float], nbytes: int, out: dict[str, Any]) -> None:
    """The round times under ``disk_<name>_s`` (the parent turns them into GB/s)."""
    out[f"disk_{name}_s"] = list(seconds)


def lookup_tokens(n: int) -> list[int]:
    import numpy as np

    return np.random.default_rng(1).integers(0, 128000, n).tolist()


# ---------------------------------------------------------------------------- our side
def run_ours(args: argparse.Namespace) -> None:
    import torch

    from lmcache.v1.config import LMCacheEngineConfig
    from lmcache.v1.testing import KVSpec, make_connector, make_engine, random_kv_caches

    torch.set_num_threads(1)
    emit({"side": "ours"})
    for n in args.paged_tokens:
        kv, slots, mems, starts, ends, nbytes = paged_inputs(n)
        spec = KVSpec(num_layers=LAYERS, num_heads=HEADS, head_size=HEAD, block_size=BLOCK, num_blocks=n // BLOCK,
                      dtype=torch.bfloat16, layout="flash_attn")
        conn = make_connector(spec, CHUNK)
        objs = [SimpleNamespace(tensor=m) for m in mems]
        part: dict[str, Any] = {}
        part[f"store_{n}"] = best_us(
            lambda: conn.batched_from_gpu(objs, starts, ends, kvcaches=kv, slot_mapping=slots), args.reps
        )
        check_gathered(kv, slots, mems)
        part[f"retrieve_{n}"] = best_us(
            lambda: conn.batched_to_gpu(objs, starts, ends, kvcaches=kv, slot_mapping=slots), args.reps
        )
        part[f"memcpy_{n}"] = memcpy_us(nbytes, args.reps)
        emit(part)
        kv = mems = objs = None  # free before the next size
    for n in args.lookup_tokens:
        spec = KVSpec(num_layers=2, num_heads=2, head_size=8, block_size=16, num_blocks=n // 16)
        engine = make_engine(spec, LMCacheEngineConfig.from_dict({"chunk_size": CHUNK, "max_local_cpu_size": 0.1}))
        tokens = lookup_tokens(max(args.lookup_tokens))[:n]
        engine.store(tokens, kvcaches=random_kv_caches(spec), slot_mapping=torch.arange(n))
        assert engine.lookup(tokens) == n
        emit({f"lookup_{n}": median_us(lambda: engine.lookup(tokens), 30)})
        engine.close()
    if args.disk_mib > 0:
        emit(_our_disk(args))


def _our_disk(args: argparse.Namespace) -> dict[str, Any]:
    import shutil
    import tempfile

    import torch

    from lmcache.utils import CacheEngineKey
    from lmcache.v1.config import LMCacheEngineConfig
    from lmcache.v1.memory_management import MemoryFormat
    from lmcache.v1.storage_backend.disk_file import entry_file_name
    from lmcache.v1.storage_backend.local_disk_backend import LocalDiskBackend
    from lmcache.v1.storage_backend.storage_manager import StorageManager

    n = disk_chunks(args)
    shape = (2, LAYERS, CHUNK, HEADS * HEAD)
    nbytes_chunk = 2 * LAYERS * CHUNK * HEADS * HEAD * 2
    root = tempfile.mkdtemp(prefix="cmp-ours-", dir=args.dir)
    gib = n * nbytes_chunk / (1 << 30)
    cfg = LMCacheEngineConfig.from_dict({
        "max_local_cpu_size": 2 * gib + 0.25, "local_disk": root,
        "max_local_disk_size": gib * (args.disk_rounds + 1) + 0.1,
    })
    manager = StorageManager(cfg)
    out: dict[str, Any] = {"disk_chunks": n, "disk_bytes": n * nbytes_chunk}
    times: dict[str, list[float]] = {"store": [], "get": [], "batched": []}
    left = []
    try:
        disk = manager.lower[0]
        assert isinstance(disk, LocalDiskBackend)
        objs = []
        for i in range(n):
            obj = manager.allocate(shape, torch.bfloat16, MemoryFormat.KV_2LTD)
            assert obj is not None, "pool too small"
            obj_bytes(obj).copy_(chunk_bytes_for_round(i, nbytes_chunk))
            objs.append(obj)
        touch_read_memory(lambda: manager.allocate(shape, torch.bfloat16, MemoryFormat.KV_2LTD), n)
        for r in range(args.disk_rounds):
            keys = [CacheEngineKey("cmp", 1, 0, (r << 32) | i, torch.bfloat16) for i in range(n)]
            paths = [os.path.join(disk.directory, entry_file_name(k.to_string())) for k in keys]
            t0 = time.perf_counter()
            for key, obj in zip(keys, objs):
                disk.submit_put(key, obj)
            assert disk.flush(600), "flush timed out"
            times["store"].append(time.perf_counter() - t0)
            timed_cold_reads(
                disk, keys, objs[0], paths, times, left, lambda: [f.result() for f in map(disk.get_non_blocking, keys)]
            )
        for obj in objs:
            obj.ref_count_down()
    finally:
        manager.close()
        shutil.rmtree(root, ignore_errors=True)
    for name, secs in times.items():
        summarize(name, secs, n * nbytes_chunk, out)
    out["disk_resident_after_drop"] = max(left) if left else 0
    return out


# ---------------------------------------------------------------------------- LMCache side
def run_lmcache(args: argparse.Namespace) -> None:
    import contextlib

    import torch

    torch.set_num_threads(1)
    # LMCache's paged connector creates CUDA streams in __init__ and enters one around its
    # copies; on a CPU-only torch those are replaced by no-ops for this process.
    torch.cuda.Stream = lambda *a, **k: SimpleNamespace(synchronize=lambda: None)  # type: ignore[assignment]
    torch.cuda.stream = lambda *a, **k: contextlib.nullcontext()  # type: ignore[assignment]
    import lmcache
    from lmcache.v1.gpu_connector import gpu_connectors as gc
    from lmcache.v1.memory_management import MemoryFormat

    emit({"side": "lmcache", "version": getattr(lmcache, "__version__", "?")})

    class CpuV2(gc.VLLMPagedMemGPUConnectorV2):
        """LMCache's V2 connector with its pointer set-up allowed on a CPU device."""

        def _initialize_pointers(self, kv_caches):
            self.device = kv_caches[0].device
            self.engine_kv_format, kv_caches = gc.normalize_kv_and_discover_format(
                kv_caches, gc.EngineType.VLLM, layout_hints=self.layout_hints
            )
            self.kv_cache_pointers.numpy()[:] = [t.data_ptr() for t in kv_caches]
            self.num_blocks = gc.get_num_blocks(kv_caches, self.engine_kv_format)
            self.block_size = gc.get_block_size(kv_caches, self.engine_kv_format)
            self.page_buffer_size = self.num_blocks * self.block_size
            self.head_size = gc.get_head_size(kv_caches, self.engine_kv_format)
            self.block_stride_elems = (
                gc.resolve_block_stride_and_log_layout(kv_caches, self.engine_kv_format, layer_idx=0, group_idx=0) or 0
            )
            return self.kv_cache_pointers

    for n in args.paged_tokens:
        kv, slots, mems, starts, ends, nbytes = paged_inputs(n)
        conn = CpuV2(HEADS * HEAD, LAYERS, use_gpu=False, layout_hints={"kv_layout": "NHD"})
        objs = [SimpleNamespace(tensor=m, metadata=SimpleNamespace(fmt=MemoryFormat.KV_2LTD)) for m in mems]
        out: dict[str, Any] = {}
        try:
            out[f"store_{n}"] = best_us(
                lambda: conn.batched_from_gpu(objs, starts, ends, kvcaches=kv, slot_mapping=slots), args.reps
            )
            check_gathered(kv, slots, mems)
            out[f"retrieve_{n}"] = best_us(
                lambda: conn.batched_to_gpu(objs, starts, ends, kvcaches=kv, slot_mapping=slots), args.reps
            )
        except Exception as exc:  # noqa: BLE001 - report what LMCache could not do
            out[f"store_{n}"] = out[f"retrieve_{n}"] = f"failed: {type(exc).__name__}: {exc}"[:300]
        out[f"memcpy_{n}"] = memcpy_us(nbytes, args.reps)
        emit(out)
        kv = mems = objs = None  # free before the next size
    if not args.lookup_tokens and args.disk_mib <= 0:
        return
    # One engine for the lookups and the disk tier: a second one in the same process hangs
    # in LMCache 0.5.6 here.
    import shutil
    import tempfile

    root = tempfile.mkdtemp(prefix="cmp-lmcache-", dir=args.dir)
    try:
        conn = CpuV2(16, 2, use_gpu=False, layout_hints={"kv_layout": "NHD"})
        engine = _lmcache_engine(args, conn, root)
    except Exception as exc:  # noqa: BLE001 - report what LMCache could not do
        emit({"engine": f"failed: {type(exc).__name__}: {exc}"[:300]})
        shutil.rmtree(root, ignore_errors=True)
        return
    try:
        if args.lookup_tokens:
            try:
                emit({f"lookup_{n}": us for n, us in _lmcache_lookups_us(args.lookup_tokens, engine).items()})
            except Exception as exc:  # noqa: BLE001
                emit({f"lookup_{n}": f"failed: {type(exc).__name__}: {exc}"[:300] for n in args.lookup_tokens})
        if args.disk_mib > 0:
            try:
                emit(_lmcache_disk(args, engine))
            except Exception as exc:  # noqa: BLE001
                emit({"disk_store_best_gbps": f"failed: {type(exc).__name__}: {exc}"[:300]})
    finally:
        shutil.rmtree(root, ignore_errors=True)


def _lmcache_engine(args: argparse.Namespace, connector: Any, disk_root: str) -> Any:
    import torch
    from lmcache.v1.cache_engine import LMCacheEngineBuilder
    from lmcache.v1.config import LMCacheEngineConfig
    from lmcache.v1.metadata import LMCacheMetadata

    gib = disk_chunks(args) * 2 * LAYERS * CHUNK * HEADS * HEAD * 2 / (1 << 30) if args.disk_mib > 0 else 0.0
    disk = {"local_disk": disk_root, "max_local_disk_size": gib * (args.disk_rounds + 1) + 0.1} if gib else {}
    cfg = LMCacheEngineConfig.from_defaults(chunk_size=CHUNK, local_cpu=True, max_local_cpu_size=2 * gib + 1.0, **disk)
    md = LMCacheMetadata(model_name="cmp", world_size=1, local_world_size=1, worker_id=0, local_worker_id=0,
                         kv_dtype=torch.bfloat16, kv_shape=(2, 2, CHUNK, 2, 8), chunk_size=CHUNK)
    engine = LMCacheEngineBuilder.get_or_create("cmp", cfg, md, connector, None, None)
    engine.post_init()
    return engine


def _lmcache_disk(args: argparse.Namespace, engine: Any) -> dict[str, Any]:
    """LMCache's LocalDiskBackend on the same chunks as :func:`_our_disk`."""
    import threading

    import numpy as np
    import torch
    from lmcache.v1.memory_management import MemoryFormat

    sm = engine.storage_manager
    disk = sm.storage_backends["LocalDiskBackend"]
    n = disk_chunks(args)
    nbytes_chunk = 2 * LAYERS * CHUNK * HEADS * HEAD * 2
    shape = torch.Size([2, LAYERS, CHUNK, HEADS * HEAD])
    out: dict[str, Any] = {"disk_chunks": n, "disk_bytes": n * nbytes_chunk}
    times: dict[str, list[float]] = {"store": [], "written": [], "get": [], "batched": []}
    left = []
    objs = []
    for i in range(n):
        obj = sm.allocate(shape, torch.bfloat16, MemoryFormat.KV_2LTD)
        assert obj is not None, "LMCache pool too small"
        obj_bytes(obj).copy_(chunk_bytes_for_round(i, nbytes_chunk))
        objs.append(obj)
    touch_read_memory(lambda: sm.allocate(shape, torch.bfloat16, MemoryFormat.KV_2LTD), n)
    for r in range(args.disk_rounds):
        tokens = np.random.default_rng(100 + r).integers(0, 128000, n * CHUNK).tolist()
        keys = [key for _, _, key in engine.token_database.process_tokens(tokens)]
        assert len(keys) == n
        paths = [disk._key_to_path(k) for k in keys]
        done = threading.Semaphore(0)
        t0 = time.perf_counter()
        disk.batched_submit_put_task(keys, objs, on_complete_callback=lambda _k: done.release())
        for _ in keys:
            if not done.acquire(timeout=600):
                raise RuntimeError("LMCache disk writes did not complete")
        times["written"].append(time.perf_counter() - t0)
        fdatasync_files(paths)  # LMCache never fsyncs: make the data durable as ours is
        times["store"].append(time.perf_counter() - t0)
        timed_cold_reads(disk, keys, objs[0], paths, times, left, lambda: disk.batched_get_blocking(keys))
    for name, secs in times.items():
        summarize(name, secs, n * nbytes_chunk, out)
    out["disk_resident_after_drop"] = max(left) if left else 0
    return out


def _lmcache_lookups_us(sizes: list[int], engine: Any) -> dict[int, float]:
    """LMCache engine.lookup of n-token lists (prefixes of one prompt) whose chunks are all in
    its CPU tier."""
    import torch

    prompt = lookup_tokens(max(sizes))
    keys = [key for _, _, key in engine.token_database.process_tokens(prompt)]
    sm = engine.storage_manager
    # every chunk present in the CPU tier (the lookup only checks presence)
    sm.batched_put(keys, [sm.allocate(torch.Size([2, 2, CHUNK, 16]), torch.bfloat16) for _ in keys])
    for _ in range(200):  # puts may complete on LMCache's own thread
        if engine.lookup(prompt) == len(prompt):
            break
        time.sleep(0.01)
    else:
        raise RuntimeError(f"LMCache lookup does not find the {len(prompt)} tokens stored")
    out = {}
    for n in sizes:
        tokens = prompt[:n]
        out[n] = median_us(lambda: engine.lookup(tokens), 30)
    return out


# ---------------------------------------------------------------------------- driver
def run_side(side: str, py: str, env: dict[str, str], cwd: str, common: list[str], timeout: float) -> dict[str, Any]:
    """Run one side in its own process group; merge its PART lines (all it printed before a
    timeout or a failure, plus ``error`` saying what happened)."""
    import signal

    proc = subprocess.Popen([py, __file__, "--side", side, *common], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True, env=env, cwd=cwd, start_new_session=True)
    error = None
    try:
        stdout, stderr = proc.communicate(timeout=timeout)
        if proc.returncode != 0:
            error = f"exit code {proc.returncode}: {stderr[-1500:]}"
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        stdout, stderr = proc.communicate()
        error = f"timed out after {timeout:.0f} s"
    merged: dict[str, Any] = {}
    for line in stdout.splitlines():
        if line.startswith("PART "):
            merged.update(json.loads(line[len("PART "):]))
    if error:
        merged["error"] = error
    return merged


def fmt(value: Any, unit: str) -> str:
    return f"{value:.1f}" if unit == "us" else f"{value:.2f}"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--install", action="store_true", help="install LMCache 0.5.6 into --venv, then exit")
    ap.add_argument("--venv", type=Path, default=DEFAULT_VENV, help=f"LMCache's venv (default {DEFAULT_VENV})")
    ap.add_argument("--side", choices=["ours", "lmcache"], help=argparse.SUPPRESS)
    ap.add_argument("--paged-tokens", default="8192", help="comma-separated prompt lengths ('' skips)")
    ap.add_argument("--lookup-tokens", default="8192,32768", help="comma-separated prompt lengths ('' skips)")
    ap.add_argument("--reps", type=int, default=3, help="paged copies: best of this many after a warm-up")
    ap.add_argument("--disk-mib", type=int, default=512, help="disk tier data per round (0 skips)")
    ap.add_argument("--disk-rounds", type=int, default=3, help="disk rounds, alternating the sides (one process each)")
    ap.add_argument("--dir", default=None, help="directory for the disk tiers (default: a temp dir under /tmp)")
    ap.add_argument("--timeout", type=float, default=600, help="seconds per side")
    args = ap.parse_args()
    args.paged_tokens = [int(x) for x in args.paged_tokens.split(",") if x]
    args.lookup_tokens = [int(x) for x in args.lookup_tokens.split(",") if x]
    if args.install:
        install(args.venv)
        return
    if args.side:
        (run_ours if args.side == "ours" else run_lmcache)(args)
        sys.stdout.flush()
        if args.side == "lmcache":
            os._exit(0)  # LMCache's non-daemon threads would keep the process alive
        return
    lmc_py = args.venv / "bin" / "python"
    if not lmc_py.exists():
        raise SystemExit(f"no LMCache venv at {args.venv}: run with --install first")
    common = ["--paged-tokens", ",".join(map(str, args.paged_tokens)),
              "--lookup-tokens", ",".join(map(str, args.lookup_tokens)), "--reps", str(args.reps),
              "--disk-mib", str(args.disk_mib)]
    if args.dir:
        common += ["--dir", os.path.abspath(args.dir)]
    root = Path(__file__).resolve().parents[1]
    runs = {
        "ours": (sys.executable, dict(os.environ, PYTHONPATH=str(root)), str(root)),
        "lmcache": (str(lmc_py), {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}, "/"),
    }
    results: dict[str, dict[str, Any]] = {"ours": {}, "lmcache": {}}
    # copies and lookups: one process per side; the disk: one process per side and round,
    # alternating, so that both sides see the same (shared, noisy) disk over time
    plan = [(side, [*common, "--disk-mib", "0"]) for side in runs] if (args.paged_tokens or args.lookup_tokens) else []
    disk_args = [*common, "--paged-tokens", "", "--lookup-tokens", "", "--disk-rounds", "1"]
    plan += [(side, disk_args) for _ in range(args.disk_rounds if args.disk_mib > 0 else 0) for side in runs]
    for side, argv in plan:
        got = run_side(side, *runs[side], argv, args.timeout)
        merged = results[side]
        for key, value in got.items():
            if key.endswith("_s") and isinstance(value, list):
                merged.setdefault(key, []).extend(value)
            elif key == "error":
                merged["error"] = f"{merged['error']}; {value}" if "error" in merged else value
            else:
                merged[key] = value
    for merged in results.values():
        for key in [k for k in merged if k.startswith("disk_") and k.endswith("_s")]:
            secs = merged.pop(key)
            name = key[len("disk_") : -len("_s")]
            if secs:
                merged[f"disk_{name}_best_gbps"] = merged["disk_bytes"] / min(secs) / 1e9
                merged[f"disk_{name}_median_gbps"] = merged["disk_bytes"] / statistics.median(secs) / 1e9
    ours, theirs = results["ours"], results["lmcache"]
    print(f"LMCache {theirs.get('version', '?')} vs ours, CPU tensors, torch threads 1 (ratio = ours / LMCache)")
    for side, res in (("ours", ours), ("LMCache", theirs)):
        if "error" in res:
            print(f"{side} side: {res['error']}")
    print(f"{'metric':<28}{'ours':>12}{'LMCache':>12}{'ratio':>8}   notes")
    skip = ("side", "version", "error", "disk_chunks", "disk_bytes", "disk_resident_after_drop")
    for key in dict.fromkeys([*ours, *theirs]):
        if key in skip or key.startswith("memcpy"):
            continue
        a, b = ours.get(key), theirs.get(key)
        unit = "GB/s" if key.endswith("gbps") else "us"
        note = ""
        if key.split("_")[0] in ("store", "retrieve"):
            n = key.split("_")[1]
            if f"memcpy_{n}" in ours and f"memcpy_{n}" in theirs:
                note = f"memcpy us: ours {ours[f'memcpy_{n}']:.0f} / LMCache process {theirs[f'memcpy_{n}']:.0f}"
        elif key.startswith("disk_written"):
            note = "LMCache only: its writes done (page cache, it never fsyncs)"
        elif key.startswith("disk_store"):
            note = "to durable (fdatasync'ed)"
        elif key.startswith(("disk_get", "disk_batched")):
            note = "cold (page cache dropped)"
        if isinstance(a, (int, float)) and isinstance(b, (int, float)):
            # us: ours / LMCache time; GB/s: LMCache / ours throughput = ours / LMCache time
            ratio = a / b if unit == "us" else b / a
            print(f"{key:<28}{fmt(a, unit):>12}{fmt(b, unit):>12}{ratio:>8.2f}   {unit}; {note}")
        else:
            sa = fmt(a, unit) if isinstance(a, (int, float)) else "n/a"
            sb = fmt(b, unit) if isinstance(b, (int, float)) else "n/a"
            why = " ".join(str(v) for v in (a, b) if isinstance(v, str))
            print(f"{key:<28}{sa:>12}{sb:>12}{'':>8}   {unit}; {note} {why}"[:400])
    if "disk_bytes" in ours:
        print(f"disk: {ours['disk_chunks']} chunks x 32 MiB per round; bytes left in the page cache after the drop: "
              f"ours {ours.get('disk_resident_after_drop')} / LMCache {theirs.get('disk_resident_after_drop')}; "
              "ratio = ours time / LMCache time (< 1: we are faster)")


if __name__ == "__main__":
    main()
