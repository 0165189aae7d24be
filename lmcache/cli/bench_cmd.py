"""``lmcache bench [cpu|disk|remote] [-- ARGS]``: the benchmarks' ratio tables.

Runs ``benchmarks/bench_<tier>_tier.py`` of a source checkout (the benchmarks are not
part of the installed package) with ``OMP_NUM_THREADS=1``; each prints its table
with ratios against limits measured in the same run (docs/performance.md).
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
from pathlib import Path

from lmcache.v1.tiers import TIERS


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "bench",
        help="run the tier benchmarks (ratio tables against this machine's limits)",
        description="Run benchmarks/bench_<tier>_tier.py (all three without TIER). Arguments after '--' go to "
        "the benchmark script (see its --help); options of this command go before TIER. Needs a source "
        "checkout of lmcache.",
    )
    p.add_argument("tier", nargs="?", choices=TIERS, help="cpu, disk or remote (default: all)")
    p.add_argument("args", nargs=argparse.REMAINDER, help="-- then arguments for the benchmark script")
    p.add_argument("--benchmarks-dir", default=None, help="directory of the bench_*.py scripts")
    p.set_defaults(func=run_bench)


def benchmarks_dir(given: str | None) -> Path | None:
    source_checkout = Path(__file__).resolve().parents[2] / "benchmarks"
    candidates = [Path(given)] if given else [source_checkout, Path.cwd() / "benchmarks"]
    for c in candidates:
        if (c / "bench_cpu_tier.py").is_file():
            return c
    return None


def run_bench(args: argparse.Namespace) -> int:
    where = benchmarks_dir(args.benchmarks_dir)
    if where is None:
        print("lmcache: benchmarks not found (they ship with the source checkout: run from it, or pass "
              "--benchmarks-dir)", file=sys.stderr)
        return 2
    extra = list(args.args)
    if extra and extra[0] == "--":
        extra = extra[1:]
    tiers = [args.tier] if args.tier else list(TIERS)
    env = dict(os.environ, OMP_NUM_THREADS="1")
    repo = str(where.parent)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [repo, env.get("PYTHONPATH")]))
    worst = 0
    for i, tier in enumerate(tiers, 1):
        script = where / f"bench_{tier}_tier.py"
        header = f"== lmcache bench {tier} [{i}/{len(tiers)}]: {script.name} {' '.join(extra)}"
        print(header, file=sys.stderr, flush=True)
        rc = subprocess.call([sys.executable, str(script), *extra], env=env, cwd=str(where))
        if rc != 0:
            print(f"lmcache: {script.name} exited with {rc}", file=sys.stderr)
            worst = worst or rc
    return worst
