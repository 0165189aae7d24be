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

The run starts two processes: this interpreter (``--side ours``) and the LMCache venv's
(``--side lmcache``). Each measures, on CPU tensors, with torch threads 1:

* paged store / retrieve of a Llama-3-8B-like KV (32 layers, 8 KV heads, head 128, bf16,
  vLLM flash-attn layout, block size 16, chunks of 256 tokens) through each project's
  ``GPUConnectorInterface`` (``batched_from_gpu`` / ``batched_to_gpu``). LMCache's CUDA
  kernels are not built on CPU, so its own torch fallback (``multi_layer_kv_transfer``) runs;
  its connector insists on CUDA streams and a CUDA device in two places, which this script
  bypasses (no-op streams, and a CPU variant of its pointer set-up that calls its own helpers);
* lookup of an 8k and a 32k-token prompt given as a Python list, everything cached
  (``engine.lookup`` on both sides);
* numpy memcpy of the KV bytes (the machine's limit, in both processes).

and prints one JSON line; the parent prints a table with ours / LMCache ratios (< 1: we are
faster) next to the memcpy limit of each process. Disk store-to-durable and cold read are
not compared here (see bench_disk_tier.py for ours against raw file I/O).
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

DEFAULT_VENV = Path.home() / ".cache" / "lmcache-compare" / "venv"
LMCACHE_VERSION = "0.5.6"
LAYERS, HEADS, HEAD, BLOCK, CHUNK = 32, 8, 128, 16, 256


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


def lookup_tokens(n: int) -> list[int]:
    import numpy as np

    return np.random.default_rng(1).integers(0, 128000, n).tolist()


# ---------------------------------------------------------------------------- our side
def run_ours(args: argparse.Namespace) -> dict[str, Any]:
    import torch

    from lmcache.v1.config import LMCacheEngineConfig
    from lmcache.v1.testing import KVSpec, make_connector, make_engine, random_kv_caches

    torch.set_num_threads(1)
    out: dict[str, Any] = {"side": "ours"}
    for n in args.paged_tokens:
        kv, slots, mems, starts, ends, nbytes = paged_inputs(n)
        spec = KVSpec(num_layers=LAYERS, num_heads=HEADS, head_size=HEAD, block_size=BLOCK, num_blocks=n // BLOCK,
                      dtype=torch.bfloat16, layout="flash_attn")
        conn = make_connector(spec, CHUNK)
        objs = [SimpleNamespace(tensor=m) for m in mems]
        out[f"store_{n}"] = best_us(lambda: conn.batched_from_gpu(objs, starts, ends, kvcaches=kv, slot_mapping=slots),
                                    args.reps)
        check_gathered(kv, slots, mems)
        out[f"retrieve_{n}"] = best_us(lambda: conn.batched_to_gpu(objs, starts, ends, kvcaches=kv, slot_mapping=slots),
                                       args.reps)
        out[f"memcpy_{n}"] = memcpy_us(nbytes, args.reps)
    for n in args.lookup_tokens:
        spec = KVSpec(num_layers=2, num_heads=2, head_size=8, block_size=16, num_blocks=n // 16)
        engine = make_engine(spec, LMCacheEngineConfig.from_dict({"chunk_size": CHUNK, "max_local_cpu_size": 0.1}))
        tokens = lookup_tokens(max(args.lookup_tokens))[:n]
        engine.store(tokens, kvcaches=random_kv_caches(spec), slot_mapping=torch.arange(n))
        assert engine.lookup(tokens) == n
        out[f"lookup_{n}"] = median_us(lambda: engine.lookup(tokens), 30)
        engine.close()
    return out


# ---------------------------------------------------------------------------- LMCache side
def run_lmcache(args: argparse.Namespace) -> dict[str, Any]:
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

    out: dict[str, Any] = {"side": "lmcache", "version": getattr(lmcache, "__version__", "?")}

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
    if args.lookup_tokens:
        try:
            conn = CpuV2(16, 2, use_gpu=False, layout_hints={"kv_layout": "NHD"})
            for n, us in _lmcache_lookups_us(args.lookup_tokens, conn).items():
                out[f"lookup_{n}"] = us
        except Exception as exc:  # noqa: BLE001
            for n in args.lookup_tokens:
                out[f"lookup_{n}"] = f"failed: {type(exc).__name__}: {exc}"[:300]
    return out


def _lmcache_lookups_us(sizes: list[int], connector: Any) -> dict[int, float]:
    """LMCache engine.lookup of n-token lists (prefixes of one prompt) whose chunks are all in
    its CPU tier. One engine: a second one in the same process hangs in LMCache 0.5.6 here."""
    import torch
    from lmcache.v1.cache_engine import LMCacheEngineBuilder
    from lmcache.v1.config import LMCacheEngineConfig
    from lmcache.v1.metadata import LMCacheMetadata

    cfg = LMCacheEngineConfig.from_defaults(chunk_size=CHUNK, local_cpu=True, max_local_cpu_size=1.0)
    md = LMCacheMetadata(model_name="cmp", world_size=1, local_world_size=1, worker_id=0, local_worker_id=0,
                         kv_dtype=torch.bfloat16, kv_shape=(2, 2, CHUNK, 2, 8), chunk_size=CHUNK)
    engine = LMCacheEngineBuilder.get_or_create("cmp", cfg, md, connector, None, None)
    engine.post_init()
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
def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--install", action="store_true", help="install LMCache 0.5.6 into --venv, then exit")
    ap.add_argument("--venv", type=Path, default=DEFAULT_VENV, help=f"LMCache's venv (default {DEFAULT_VENV})")
    ap.add_argument("--side", choices=["ours", "lmcache"], help=argparse.SUPPRESS)
    ap.add_argument("--paged-tokens", default="8192")
    ap.add_argument("--lookup-tokens", default="8192,32768")
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--timeout", type=float, default=900, help="seconds per side")
    args = ap.parse_args()
    args.paged_tokens = [int(x) for x in args.paged_tokens.split(",") if x]
    args.lookup_tokens = [int(x) for x in args.lookup_tokens.split(",") if x]
    if args.install:
        install(args.venv)
        return
    if args.side:
        result = run_ours(args) if args.side == "ours" else run_lmcache(args)
        print("RESULT " + json.dumps(result), flush=True)
        return
    lmc_py = args.venv / "bin" / "python"
    if not lmc_py.exists():
        raise SystemExit(f"no LMCache venv at {args.venv}: run with --install first")
    common = ["--paged-tokens", ",".join(map(str, args.paged_tokens)),
              "--lookup-tokens", ",".join(map(str, args.lookup_tokens)), "--reps", str(args.reps)]
    root = Path(__file__).resolve().parents[1]
    sides = {}
    for side, py, env in (
        ("ours", sys.executable, dict(os.environ, PYTHONPATH=str(root))),
        ("lmcache", str(lmc_py), {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}),
    ):
        proc = subprocess.run([py, __file__, "--side", side, *common], capture_output=True, text=True, env=env, timeout=args.timeout,
                              cwd="/" if side == "lmcache" else str(root))
        lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT ")]
        if proc.returncode != 0 or not lines:
            raise SystemExit(f"{side} side failed (rc {proc.returncode}):\n{proc.stderr[-3000:]}")
        sides[side] = json.loads(lines[-1][len("RESULT "):])
    ours, theirs = sides["ours"], sides["lmcache"]
    print(f"LMCache {theirs.get('version')} vs ours, CPU tensors, torch threads 1 (us; ratio = ours / LMCache)")
    print(f"{'metric':<22}{'ours us':>12}{'LMCache us':>14}{'ratio':>8}   limit (memcpy of the same bytes, us)")
    for key in ours:
        if key == "side" or key.startswith("memcpy"):
            continue
        a, b = ours[key], theirs.get(key)
        limit = ""
        if key.split("_")[0] in ("store", "retrieve"):
            n = key.split("_")[1]
            limit = f"ours {ours[f'memcpy_{n}']:.0f} / LMCache process {theirs[f'memcpy_{n}']:.0f}"
        if isinstance(b, (int, float)):
            print(f"{key:<22}{a:>12.1f}{b:>14.1f}{a / b:>8.2f}   {limit}")
        else:
            print(f"{key:<22}{a:>12.1f}{'n/a':>14}{'':>8}   {b}")


if __name__ == "__main__":
    main()
