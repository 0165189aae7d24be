"""The CUDA path measured on a real GPU (run by scripts/gpu_check.sh), with targets.

Sections (each measured against a limit taken in the same run):

* ``copy``: paged gather (GPU KV -> pinned pool objects) and scatter (pool -> GPU KV)
  through the project's bulk connector (``VLLMPagedMemGPUConnectorV2``: side stream,
  native CUDA kernels when built, else the torch fallback) for the Llama-3-8B KV shape
  (32 layers, 8 KV heads, head 128, bf16, block 16, chunk 256), flash-attn and
  flashinfer layouts, 8k and 32k tokens; against torch's own pinned-memory copy of the
  same number of bytes (one DMA transfer). Target: >= 0.9 x torch, both directions.
  Bit-exact round trip checked.
* ``overlap``: layerwise retrieve (``engine.retrieve_layer``, 8k tokens) driven the way
  the vLLM adapter drives it, with a per-layer matmul sized like one Llama-3-8B decoder
  layer (218M parameters: x[n, 4096] @ w[4096, 53248]) on the default stream after each
  layer's wait. Target: total <= 1.1 x max(compute alone, retrieve alone). A second,
  informational run shrinks the matmul until compute ~ copy (the hard case).
* ``pool``: start-up of a 64 GiB pinned pool: constructor plus the first allocation
  (which creates and pins the first 1 GiB slab; slabs are created lazily). Target < 1 s.
  Also reports the pinned bytes that slab took from torch's host allocator.
* ``hs_ec``: HiddenStateStore store/retrieve of CUDA bf16 rows and ECCacheEngine
  put/get of a CUDA bf16 encoder output, bit-exact, with ``get(mm_hash, "cuda")``
  returning a CUDA tensor.

``--device cpu --small`` runs every section on CPU tensors with tiny sizes (the
``--cpu-dry-run`` of gpu_check.sh); targets are then not evaluated.

Output: a table on stdout and, with ``--json PATH``, the same rows as JSON. Exit status
0 when every correctness check passed (a missed performance target is reported, not
failed, unless ``--strict``), 1 otherwise.

Usage: python benchmarks/bench_gpu.py [--device cuda] [--small] [--json out.json]
       [--sections copy,overlap,pool,hs_ec] [--tokens 8192,32768] [--reps 5]
"""

from __future__ import annotations

import argparse
import json
import math
import platform
import sys
import time
import traceback
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Callable

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the checkout's lmcache first

from lmcache.bench.limits import GB, LLAMA3_8B, torch_copy_seconds  # noqa: E402
from lmcache.v1.config import LMCacheEngineConfig  # noqa: E402
from lmcache.v1.ec_engine import ECCacheEngine  # noqa: E402
from lmcache.v1.gpu_connector import copy_ops, native  # noqa: E402
from lmcache.v1.memory_management import GiB, MemoryFormat, PoolAllocator  # noqa: E402
from lmcache.v1.testing import KVSpec, make_connector, make_engine, random_kv_caches, random_slot_mapping  # noqa: E402

SECTIONS = ("pool", "copy", "overlap", "hs_ec")
CHUNK = 256
LLAMA_LAYER_PARAMS = 218_103_808  # q, o: 4096^2; k, v: 4096x1024; gate, up, down: 4096x14336
LLAMA_HIDDEN = 4096


# ----------------------------------------------------------------------------- results
@dataclass(slots=True)
class Row:
    section: str
    name: str
    value: float
    unit: str
    target: str = ""
    met: bool | None = None  # None: no target, or not evaluated (dry run)


@dataclass(slots=True)
class Check:
    name: str
    ok: bool
    detail: str = ""


@dataclass
class Report:
    device: str
    small: bool
    rows: list[Row] = field(default_factory=list)
    checks: list[Check] = field(default_factory=list)
    env: dict[str, Any] = field(default_factory=dict)

    def row(self, section: str, name: str, value: float, unit: str, target: str = "",
            ok: Callable[[float], bool] | None = None) -> None:
        met = None if (ok is None or self.small or self.device != "cuda") else bool(ok(value))
        self.rows.append(Row(section, name, float(value), unit, target, met))

    def check(self, name: str, ok: bool, detail: str = "") -> None:
        self.checks.append(Check(name, bool(ok), detail))
        if not ok:
            print(f"CHECK FAILED: {name}: {detail}", flush=True)

    def to_json(self) -> dict[str, Any]:
        met = sum(r.met is True for r in self.rows)
        missed = sum(r.met is False for r in self.rows)
        return {
            "device": self.device,
            "small": self.small,
            "env": self.env,
            "rows": [asdict(r) for r in self.rows],
            "checks": [asdict(c) for c in self.checks],
            "targets_met": met,
            "targets_missed": missed,
            "checks_failed": sum(not c.ok for c in self.checks),
            "ok": all(c.ok for c in self.checks),
        }

    def print_table(self) -> None:
        print(f"\n{'section':<8} {'measurement':<62} {'value':>10} {'unit':<6} {'target':<12} status")
        for r in self.rows:
            status = {True: "MET", False: "MISSED", None: ""}[r.met]
            if r.met is None and r.target:
                status = "n/a (dry run)" if (self.small or self.device != "cuda") else ""
            print(f"{r.section:<8} {r.name:<62} {r.value:>10.4g} {r.unit:<6} {r.target:<12} {status}")
        bad = [c for c in self.checks if not c.ok]
        print(f"checks: {len(self.checks) - len(bad)}/{len(self.checks)} passed"
              + "".join(f"\n  FAILED {c.name}: {c.detail}" for c in bad))
        j = self.to_json()
        print(f"targets: {j['targets_met']} met, {j['targets_missed']} missed", flush=True)


# ----------------------------------------------------------------------------- helpers
def sync(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


def best_seconds(fn: Callable[[], Any], reps: int, device: str) -> float:
    """Best wall time of ``fn`` over ``reps`` runs after one warm-up, device work included."""
    times = []
    for i in range(reps + 1):
        sync(device)
        t0 = time.perf_counter()
        fn()
        sync(device)
        if i:
            times.append(time.perf_counter() - t0)
    return min(times)


def bits(t: torch.Tensor) -> torch.Tensor:
    return t.view({1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}[t.element_size()])


def same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.shape == b.shape and a.dtype == b.dtype and torch.equal(bits(a), bits(b.to(a.device)))


def make_kv(spec: KVSpec, device: str, seed: int) -> list[torch.Tensor]:
    """Random per-layer KV generated on ``device`` (CPU generation of 4 GiB would take long)."""
    if device == "cpu":
        return random_kv_caches(spec, seed=seed)
    g = torch.Generator(device=device).manual_seed(seed)
    full = torch.randn((spec.num_layers, *spec.layer_shape()), generator=g, device=device, dtype=spec.dtype)
    return [full[i] for i in range(spec.num_layers)]


def llama_spec(tokens: int, layout: str, layers: int) -> KVSpec:
    return KVSpec(num_layers=layers, num_heads=LLAMA3_8B.num_heads, head_size=LLAMA3_8B.head_size, block_size=16,
                  num_blocks=(tokens + 15) // 16, dtype=LLAMA3_8B.dtype, layout=layout)


def kv_bytes(spec: KVSpec, tokens: int) -> int:
    return tokens * spec.num_layers * 2 * spec.hidden * spec.dtype.itemsize


DEFAULT_USE_NATIVE = copy_ops.USE_NATIVE


def set_native(use: bool) -> None:
    copy_ops.USE_NATIVE = use


def free_memory(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()
        torch.cuda.empty_cache()


# ----------------------------------------------------------------------------- sections
def section_pool(rep: Report, args: argparse.Namespace) -> None:
    """Start-up of a big pinned pool: constructor + first allocation (first slab pinned)."""
    stats = getattr(torch.cuda, "host_memory_stats", None) if args.device == "cuda" else None

    def pinned_bytes() -> int | None:
        """Bytes torch's pinned host allocator holds (key names differ between versions)."""
        try:
            found = stats() if stats else {}
        except (RuntimeError, TypeError, AttributeError):
            return None
        for key in ("allocated_bytes.current", "allocated_bytes.all.current", "reserved_bytes.current"):
            if key in found:
                return int(found[key])
        return None

    before = pinned_bytes()
    t0 = time.perf_counter()
    pool = PoolAllocator(int(args.pool_gib * GiB))
    t1 = time.perf_counter()
    obj = pool.allocate((2, LLAMA3_8B.num_layers, CHUNK, LLAMA3_8B.hidden), LLAMA3_8B.dtype, MemoryFormat.KV_2LTD)
    t2 = time.perf_counter()
    after = pinned_bytes()
    ok = obj is not None and obj.tensor is not None
    rep.check("pool: first allocation succeeds", ok)
    if args.device == "cuda":
        rep.check("pool: slabs are pinned when CUDA exists", ok and obj.tensor.is_pinned() and pool.pin_memory)
    gib = args.pool_gib
    rep.row("pool", f"{gib:g} GiB pool: constructor", (t1 - t0) * 1e3, "ms")
    rep.row("pool", f"{gib:g} GiB pool: first allocation (creates + pins 1st slab)", (t2 - t1) * 1e3, "ms")
    rep.row("pool", f"{gib:g} GiB pool: start-up total", t2 - t0, "s", "< 1 s", lambda v: v < 1.0)
    if before is not None and after is not None:
        rep.row("pool", f"pinned bytes taken by the first slab ({pool.slab_bytes / GiB:g} GiB)",
                (after - before) / GiB, "GiB", f"<= {pool.slab_bytes / GiB:g}",
                lambda v: v <= pool.slab_bytes / GiB + 1e-9)
    if obj is not None:
        obj.ref_count_down()
    pool.close()


def section_copy(rep: Report, args: argparse.Namespace) -> None:
    """Bulk connector gather/scatter vs torch's pinned copy of the same bytes."""
    dev = args.device
    have_native = native.load() is not None
    native_cuda = have_native and native.load().has_cuda  # type: ignore[union-attr]
    usable_native = native_cuda if dev == "cuda" else have_native
    if dev == "cuda":
        rep.check("native CUDA kernels loaded (lmcache/_c_ops_cuda.so)", native_cuda,
                  "not loaded: the copy section measures the torch fallback only")
    paths = ([("native", True)] if usable_native else []) + [("torch", False)]
    max_bytes = max(kv_bytes(llama_spec(n, "flash_attn", args.layers), n) for n in args.tokens)
    # the baseline's buffers, allocated once at the largest size
    base_dev = torch.empty(max_bytes, dtype=torch.uint8, device=dev)
    base_host = torch.empty(max_bytes, dtype=torch.uint8, pin_memory=(dev == "cuda"))
    base_dev.random_(0, 255)
    try:
        for layout in args.layouts:
            for n in args.tokens:
                spec = llama_spec(n, layout, args.layers)
                nbytes = kv_bytes(spec, n)
                d2h = torch_copy_seconds(base_host[:nbytes], base_dev[:nbytes], args.reps)
                h2d = torch_copy_seconds(base_dev[:nbytes], base_host[:nbytes], args.reps)
                tag = f"{layout} {n} tok {nbytes / GiB:.2f} GiB"
                rep.row("copy", f"{tag}: torch pinned copy D2H", nbytes / d2h / GB, "GB/s")
                rep.row("copy", f"{tag}: torch pinned copy H2D", nbytes / h2d / GB, "GB/s")
                for path, use_native in paths:
                    set_native(use_native)
                    try:
                        g, s, exact = _time_connector(spec, n, dev, args.reps if use_native else max(1, args.reps // 2))
                    finally:
                        set_native(DEFAULT_USE_NATIVE)
                    rep.check(f"copy {tag} {path}: round trip bit-exact", exact)
                    target = use_native or not usable_native  # the path users get by default
                    rep.row("copy", f"{tag}: {path} gather GPU->pool", nbytes / g / GB, "GB/s")
                    rep.row("copy", f"{tag}: {path} scatter pool->GPU", nbytes / s / GB, "GB/s")
                    rep.row("copy", f"{tag}: {path} gather / torch D2H", d2h / g, "x",
                            ">= 0.9" if target else "", (lambda v: v >= 0.9) if target else None)
                    rep.row("copy", f"{tag}: {path} scatter / torch H2D", h2d / s, "x",
                            ">= 0.9" if target else "", (lambda v: v >= 0.9) if target else None)
                free_memory(dev)
    finally:
        del base_dev, base_host
        free_memory(dev)


def _time_connector(spec: KVSpec, n: int, dev: str, reps: int) -> tuple[float, float, bool]:
    """(best gather s, best scatter s, bit-exact) of the bulk connector over pool objects."""
    kv = make_kv(spec, dev, seed=1)
    out = [torch.zeros_like(t) for t in kv]
    slots = random_slot_mapping(spec, n, seed=2).to(dev)
    conn = make_connector(spec, CHUNK, dev)
    pool = PoolAllocator(kv_bytes(spec, n) + (64 << 20))
    starts = list(range(0, n, CHUNK))
    ends = [min(s + CHUNK, n) for s in starts]
    objs = [pool.allocate(conn.get_shape(e - s), spec.dtype, conn.fmt) for s, e in zip(starts, ends)]
    if any(o is None for o in objs):
        raise RuntimeError("pool too small for the benchmark's objects")
    try:
        g = best_seconds(lambda: conn.batched_from_gpu(objs, starts, ends, kvcaches=kv, slot_mapping=slots), reps, dev)
        s = best_seconds(lambda: conn.batched_to_gpu(objs, starts, ends, kvcaches=out, slot_mapping=slots), reps, dev)
        exact = all(same_bits(a, b) for a, b in zip(out, kv))  # slots cover every block
    finally:
        for o in objs:
            o.ref_count_down()
        pool.close()
    return g, s, exact


def section_overlap(rep: Report, args: argparse.Namespace) -> None:
    """Layerwise retrieve overlapped with per-layer compute on the default stream."""
    dev, n = args.device, args.overlap_tokens
    spec = llama_spec(n, "flash_attn", args.layers)
    nbytes = kv_bytes(spec, n)
    cfg = LMCacheEngineConfig.from_dict(
        {"chunk_size": CHUNK, "max_local_cpu_size": (nbytes * 1.1 + (64 << 20)) / GiB, "use_layerwise": True}
    )
    engine = make_engine(spec, cfg, device=dev)
    try:
        kv = make_kv(spec, dev, seed=3)
        out = [torch.zeros_like(t) for t in kv]
        slots = random_slot_mapping(spec, n, seed=4).to(dev)
        tokens = list(range(1000, 1000 + n))
        stored = engine.store(tokens, kvcaches=kv, slot_mapping=slots)
        rep.check("overlap: layerwise store stored every token", stored == n, f"{stored} of {n}")

        if args.small:
            hidden, cols, cdtype = 256, 512, torch.float32
        else:
            hidden, cols, cdtype = LLAMA_HIDDEN, LLAMA_LAYER_PARAMS // LLAMA_HIDDEN, torch.bfloat16
        x = torch.randn(n, hidden, device=dev).to(cdtype)
        w = torch.randn(hidden, cols, device=dev).to(cdtype) / math.sqrt(hidden)
        y = torch.empty(n, cols, device=dev, dtype=cdtype)

        def compute(layer: int, w_: torch.Tensor = w, y_: torch.Tensor = y) -> None:
            torch.matmul(x, w_, out=y_)

        def compute_only(w_: torch.Tensor = w, y_: torch.Tensor = y) -> None:
            for layer in range(spec.num_layers):
                compute(layer, w_, y_)

        masks: list[torch.Tensor] = []

        def retrieve_only() -> None:
            mask = None
            for mask in engine.retrieve_layer(tokens, kvcaches=out, slot_mapping=slots):
                pass
            masks.append(mask)

        def overlapped(w_: torch.Tensor = w, y_: torch.Tensor = y) -> None:
            # as the vLLM adapter: start_load_kv = setup + layer 0; wait_for_layer_load(i)
            # = the next call (layer i+1's copy; the default stream waits for layer i); then
            # the forward pass computes layer i on the default stream
            gen = engine.retrieve_layer(tokens, kvcaches=out, slot_mapping=slots)
            next(gen)
            next(gen)
            for layer in range(spec.num_layers):
                step = next(gen)
                compute(layer, w_, y_)
            masks.append(step)

        reps = args.reps
        t_comp = best_seconds(compute_only, reps, dev)
        t_copy = best_seconds(retrieve_only, reps, dev)
        for t in out:
            t.zero_()
        t_both = best_seconds(overlapped, reps, dev)
        exact = all(same_bits(a, b) for a, b in zip(out, kv))
        full = all(m is not None and int(m.sum()) == n for m in masks)
        rep.check("overlap: layerwise retrieve bit-exact, full mask", exact and full,
                  f"bit-exact={exact} full-mask={full}")
        flops = 2 * n * hidden * cols * spec.num_layers
        tag = f"{n} tok, {spec.num_layers} layers"
        rep.row("overlap", f"{tag}: compute alone ({flops / t_comp / 1e12:.0f} TFLOP/s)", t_comp * 1e3, "ms")
        rep.row("overlap", f"{tag}: layerwise retrieve alone ({nbytes / t_copy / GB:.1f} GB/s)", t_copy * 1e3, "ms")
        rep.row("overlap", f"{tag}: retrieve + compute overlapped", t_both * 1e3, "ms")
        rep.row("overlap", f"{tag}: overlapped / max(compute, retrieve)", t_both / max(t_comp, t_copy), "x",
                "<= 1.1", lambda v: v <= 1.1)

        # informational: a compute stand-in about as long as the retrieve (hardest to hide)
        if t_comp > t_copy and not args.small:
            cols_b = max(128, int(cols * t_copy / t_comp) // 128 * 128)
            w_b = w[:, :cols_b].contiguous()
            y_b = torch.empty(n, cols_b, device=dev, dtype=cdtype)
            tc_b = best_seconds(lambda: compute_only(w_b, y_b), reps, dev)
            tb_b = best_seconds(lambda: overlapped(w_b, y_b), reps, dev)
            rep.row("overlap", f"{tag}: balanced compute ({cols_b} cols) alone", tc_b * 1e3, "ms")
            rep.row("overlap", f"{tag}: balanced overlapped / max(compute, retrieve)", tb_b / max(tc_b, t_copy), "x")
    finally:
        engine.close()
        free_memory(dev)


def section_hs_ec(rep: Report, args: argparse.Namespace) -> None:
    """HiddenStateStore and ECCacheEngine from device tensors, bit-exact."""
    dev = args.device
    n, dim = (512, 256) if args.small else (8192, LLAMA_HIDDEN)
    spec = KVSpec(num_layers=1, num_heads=1, head_size=2, num_blocks=(n + 15) // 16, block_size=16)
    rows = torch.randn(n, dim, device=dev).to(torch.bfloat16)
    nbytes = rows.numel() * rows.element_size()
    cfg = LMCacheEngineConfig.from_dict(
        {"chunk_size": CHUNK, "max_local_cpu_size": 0.05, "enable_hidden_state_cache": True,
         "max_hidden_state_cpu_size": 3 * nbytes / GiB + 0.01}
    )
    engine = make_engine(spec, cfg)  # the KV (tiny, CPU) only has to be present
    try:
        tokens = list(range(5, 5 + n))
        engine.store(tokens, kvcaches=random_kv_caches(spec), slot_mapping=random_slot_mapping(spec, n))
        hs = engine.hidden_state_store
        assert hs is not None
        salt = iter(range(1 << 30))
        t_store = best_seconds(lambda: hs.store_hidden_states(tokens, rows, cache_salt=f"s{next(salt)}"), args.reps, dev)
        stored = hs.store_hidden_states(tokens, rows)
        got = hs.retrieve_hidden_states(tokens)
        ok = got is not None and got.device.type == "cpu" and same_bits(got, rows.float().cpu())
        chunks = -(-n // CHUNK) if cfg.save_unfull_chunk else n // CHUNK  # store_hidden_states counts chunks
        rep.check(f"hs: store from {dev} bf16 [{n}, {dim}] and retrieve, bit-exact", ok and stored == chunks,
                  f"stored={stored} got={None if got is None else (tuple(got.shape), got.dtype)}")
        t_get = best_seconds(lambda: hs.retrieve_hidden_states(tokens), args.reps, dev)
        rep.row("hs_ec", f"HiddenStateStore store from {dev} bf16 [{n}, {dim}]", nbytes / t_store / GB, "GB/s")
        rep.row("hs_ec", "HiddenStateStore retrieve (payload bytes; new CPU float32)", nbytes / t_get / GB, "GB/s")
    finally:
        engine.close()

    items, edim = (64, 256) if args.small else (2880, LLAMA_HIDDEN)
    item = torch.randn(items, edim, device=dev).to(torch.bfloat16)
    ebytes = item.numel() * item.element_size()
    ec = ECCacheEngine(LMCacheEngineConfig.from_dict({"max_local_cpu_size": 4 * ebytes / GiB + 0.01}),
                       "bench/vlm", torch.bfloat16)
    try:
        hashes = iter(range(1 << 30))
        t_put = best_seconds(lambda: ec.put(f"warm{next(hashes)}", item), min(args.reps, 2), dev)
        ok_put = ec.put("img", item)
        back = ec.get("img", dev)
        ok_dev = back is not None and back.device.type == dev and same_bits(back, item)
        back_cpu = ec.get("img")
        ok_cpu = back_cpu is not None and back_cpu.device.type == "cpu" and same_bits(back_cpu, item.cpu())
        rep.check(f'ec: put from {dev}, get(mm_hash, "{dev}") is a {dev} tensor, bit-exact', ok_put and ok_dev,
                  f"put={ok_put} got={None if back is None else (back.device, back.dtype)}")
        rep.check("ec: get(mm_hash) on CPU, bit-exact", ok_cpu)
        t_get = best_seconds(lambda: ec.get("img", dev), args.reps, dev)
        rep.row("hs_ec", f"ECCacheEngine put from {dev} bf16 [{items}, {edim}]", ebytes / t_put / GB, "GB/s")
        rep.row("hs_ec", f'ECCacheEngine get(mm_hash, "{dev}")', ebytes / t_get / GB, "GB/s")
    finally:
        ec.close()
        free_memory(dev)


# ----------------------------------------------------------------------------- main
def environment(device: str) -> dict[str, Any]:
    env: dict[str, Any] = {
        "python": platform.python_version(),
        "torch": torch.__version__,
        "torch_cuda": torch.version.cuda,
        "native_cpu": native.load() is not None,
        "native_cuda": bool(native.load() is not None and native.load().has_cuda),  # type: ignore[union-attr]
    }
    if device == "cuda":
        env["gpu"] = torch.cuda.get_device_name()
        env["capability"] = ".".join(map(str, torch.cuda.get_device_capability()))
    return env


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--device", choices=["cuda", "cpu"], default="cuda")
    ap.add_argument("--small", action="store_true", help="tiny sizes (CPU dry run); targets not evaluated")
    ap.add_argument("--sections", default=",".join(SECTIONS), help=f"comma list of {', '.join(SECTIONS)}")
    ap.add_argument("--tokens", default=None, help="copy section token counts (default 8192,32768)")
    ap.add_argument("--layouts", default="flash_attn,flashinfer")
    ap.add_argument("--overlap-tokens", type=int, default=None, help="default 8192")
    ap.add_argument("--layers", type=int, default=None, help="KV layers (default 32)")
    ap.add_argument("--reps", type=int, default=None, help="timed repetitions after one warm-up (default 5)")
    ap.add_argument("--pool-gib", type=float, default=64.0)
    ap.add_argument("--json", type=Path, default=None, help="write the results here")
    ap.add_argument("--strict", action="store_true", help="exit 1 also when a performance target is missed")
    args = ap.parse_args(argv)
    args.sections = [s for s in args.sections.split(",") if s]
    for s in args.sections:
        if s not in SECTIONS:
            ap.error(f"--sections: {s!r} is not one of {', '.join(SECTIONS)}")
    args.layouts = [s for s in args.layouts.split(",") if s]
    small = args.small
    args.tokens = [int(t) for t in (args.tokens or ("512,1024" if small else "8192,32768")).split(",")]
    args.overlap_tokens = args.overlap_tokens or (512 if small else 8192)
    args.layers = args.layers or (4 if small else LLAMA3_8B.num_layers)
    args.reps = args.reps or (2 if small else 5)
    if args.device == "cuda" and not torch.cuda.is_available():
        ap.error("--device cuda: CUDA is not available (use --device cpu --small for a dry run)")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    torch.manual_seed(0)
    if args.device == "cuda":
        torch.zeros(1, device="cuda")  # CUDA context start-up is not part of any measurement
    else:
        torch.set_num_threads(1)
    rep = Report(args.device, args.small, env=environment(args.device))
    print(f"bench_gpu: device={args.device} small={args.small} sections={','.join(args.sections)} "
          f"env={json.dumps(rep.env)}", flush=True)
    for name in SECTIONS:  # fixed order: the pool start-up runs before anything pins memory
        if name not in args.sections:
            continue
        t0 = time.perf_counter()
        try:
            globals()[f"section_{name}"](rep, args)
        except Exception as exc:  # noqa: BLE001 - one broken section must not hide the others
            traceback.print_exc()
            rep.check(f"section {name} ran", False, f"{type(exc).__name__}: {exc}")
        print(f"section {name}: {time.perf_counter() - t0:.1f} s", flush=True)
    rep.print_table()
    result = rep.to_json()
    if args.json is not None:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(result, indent=2) + "\n")
    failed = not result["ok"] or (args.strict and result["targets_missed"] > 0)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
