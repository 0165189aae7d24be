"""The native CPU copy kernels alone (no engine), against numpy memcpy, for A/B runs of builds.

Times ``paged_gather`` (store direction) and ``paged_scatter`` (retrieve direction) of one
or more builds of ``csrc/paged_copy.cpp`` on a Llama-3-8B-like KV (32 layers, 8 KV heads of
128, bf16; MLA: one 576-element latent), whole 256-token chunks in dense ``KV_2LTD``
objects, one kernel thread. Every rep times numpy memcpy of the same bytes and then every
build in turn, so load changes on a shared machine hit all of them alike; it prints the
best/best ratio and the median of the per-rep ratios. ``--check`` first verifies that
every build produces the same bytes as the first one.

Build variants by hand (an edited copy of the source; it has no tuning switches) and pass
their paths, e.g.::

    g++ -O3 -std=c++17 -shared -fPIC -fvisibility=hidden -pthread -Icsrc \\
        /tmp/paged_copy_variant.cpp -o /tmp/variant.so
    python benchmarks/bench_copy_kernels.py lmcache/_c_ops_cpu.so /tmp/variant.so --layouts vllm_cpu

A path may end in ``:ntnever`` / ``:ntalways`` to force the store mode of that entry.
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

import numpy as np
import torch

from lmcache.bench.limits import GB, LLAMA3_8B
from lmcache.v1.gpu_connector import native
from lmcache.v1.gpu_connector.layouts import get_layout
from lmcache.v1.testing import KVSpec, random_slot_mapping


def load(entry: str) -> native.NativeKernels:
    path, _, mode = entry.partition(":")
    mod = native.load_library(path)
    mod.num_threads = 1
    modes = {"": native.NT_AUTO, "ntnever": native.NT_NEVER, "ntalways": native.NT_ALWAYS}
    if mode not in modes:
        raise ValueError(f"{entry!r}: mode {mode!r}, expected one of {', '.join(m for m in modes if m)}")
    mod.nt_mode = modes[mode]
    return mod


def run_case(entries: list[str], mods: list[native.NativeKernels], layout: str, block_size: int, tokens: int,
             reps: int, check: bool) -> None:
    heads, head = (1, 576) if layout == "mla" else (LLAMA3_8B.num_heads, LLAMA3_8B.head_size)
    spec = KVSpec(num_layers=LLAMA3_8B.num_layers, num_heads=heads, head_size=head, block_size=block_size,
                  num_blocks=(tokens + block_size - 1) // block_size, dtype=LLAMA3_8B.dtype, layout=layout)
    # random bit patterns written in place (no float32 temporary: 32k tokens stay at 2 x 4 GiB)
    full = torch.empty((spec.num_layers, *spec.layer_shape()), dtype=torch.int16)
    full.random_(generator=torch.Generator().manual_seed(0))
    kv = list(full.view(spec.dtype).unbind(0))
    geom = get_layout(layout).geometry(kv[0])
    slots = random_slot_mapping(spec, tokens)
    chunks = tokens // 256
    mem = torch.ones(chunks, len(geom.components), spec.num_layers, 256, geom.hidden, dtype=spec.dtype)
    mems, starts = [mem[i] for i in range(chunks)], [256 * i for i in range(chunks)]
    nbytes = mem.numel() * mem.element_size()
    flat = mem.view(-1).view(torch.uint8).numpy()
    dst = np.empty(min(256 << 20, flat.size), dtype=np.uint8)
    np.copyto(dst, flat[: dst.size])

    def memcpy() -> float:
        t0 = time.perf_counter()
        for off in range(0, flat.size, dst.size):
            part = flat[off : off + dst.size]
            np.copyto(dst[: part.size], part)
        return time.perf_counter() - t0

    if check:
        mods[0].paged_gather(kv, geom, slots, starts, mems)
        ref_mem = mem.clone()
        ref_kv = [torch.zeros_like(x) for x in kv]
        mods[0].paged_scatter(ref_kv, geom, slots, starts, mems)
        for entry, mod in zip(entries[1:], mods[1:]):
            mem.zero_()
            mod.paged_gather(kv, geom, slots, starts, mems)
            out = [torch.zeros_like(x) for x in kv]
            mod.paged_scatter(out, geom, slots, starts, mems)
            same = torch.equal(mem.view(torch.int16), ref_mem.view(torch.int16)) and all(
                torch.equal(a.view(torch.int16), b.view(torch.int16)) for a, b in zip(out, ref_kv)
            )
            if not same:
                raise SystemExit(f"{entry}: result differs from {entries[0]}")
    mods[0].paged_gather(kv, geom, slots, starts, mems)  # warm
    times: dict[str, list[float]] = {"memcpy": []}
    for _ in range(reps):
        times["memcpy"].append(memcpy())
        for i, mod in enumerate(mods):
            for name, fn in (("store", mod.paged_gather), ("retrieve", mod.paged_scatter)):
                t0 = time.perf_counter()
                fn(kv, geom, slots, starts, mems)
                times.setdefault(f"{name}{i}", []).append(time.perf_counter() - t0)
    mc = times.pop("memcpy")
    print(f"{layout} block {block_size}, {tokens} tokens, {nbytes / (1 << 30):.2f} GiB: memcpy {nbytes / min(mc) / GB:.1f}"
          f" GB/s (load average {os.getloadavg()[0]:.2f})")
    for key, ts in times.items():
        name, i = key.rstrip("0123456789"), int(key[len(key.rstrip("0123456789")):])
        median = statistics.median(m / t for m, t in zip(mc, ts))
        print(f"  {name:<9}{entries[i]:<40} {nbytes / min(ts) / GB:6.2f} GB/s  x memcpy best {min(mc) / min(ts):5.2f}"
              f"  median {median:5.2f}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("libs", nargs="*", default=[str(native.CPU_LIBRARY)], help="kernel builds (default: the packaged one)")
    ap.add_argument("--layouts", default="vllm_cpu,flash_attn,flashinfer,mla")
    ap.add_argument("--block-sizes", default="16,128")
    ap.add_argument("--tokens", default="8192")
    ap.add_argument("--reps", type=int, default=7)
    ap.add_argument("--check", action="store_true", help="verify every build against the first one")
    args = ap.parse_args()
    torch.set_num_threads(1)
    mods = [load(e) for e in args.libs]
    for layout in args.layouts.split(","):
        for bs in (int(x) for x in args.block_sizes.split(",")):
            for n in (int(x) for x in args.tokens.split(",")):
                run_case(args.libs, mods, layout, bs, n, args.reps, args.check)


if __name__ == "__main__":
    main()
