"""``lmcache bench [cpu|disk|remote] [-- ARGS]``: the tier benchmarks' ratio tables.

Runs ``python -m lmcache.bench.<tier>_tier`` (shipped with the package, so an installed
lmcache needs no source checkout) in a child process with ``OMP_NUM_THREADS=1``; each
prints its table with ratios against limits measured in the same run
(docs/performance.md). ``--benchmarks-dir DIR`` runs ``DIR/bench_<tier>_tier.py`` of a
source checkout instead, with that checkout's lmcache (an A/B against another build).
"""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
from pathlib import Path

from lmcache.v1.tiers import TIERS


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "bench",
        help="run the tier benchmarks (ratio tables against this machine's limits)",
        description="Run the CPU, disk and Redis tier benchmarks (all three without TIER), each against "
        "limits measured in the same run. Arguments after '--' go to the benchmark (see "
        "'lmcache bench TIER -- --help'); options of this command go before TIER. The remote benchmark "
        "needs redis-server on PATH (or '-- --url redis://HOST:PORT') and the redis package "
        "(pip install 'lmcache[redis]').",
    )
    p.add_argument("tier", nargs="?", choices=TIERS, help="cpu, disk or remote (default: all)")
    p.add_argument("args", nargs=argparse.REMAINDER, help="-- then arguments for the benchmark")
    p.add_argument(
        "--benchmarks-dir",
        default=None,
        help="run DIR/bench_<tier>_tier.py of a source checkout (and its lmcache) instead of the installed ones",
    )
    p.set_defaults(func=run_bench)


def missing_requirement(tier: str, extra: list[str]) -> str | None:
    """Why ``tier`` cannot run here, or None; checked before starting the child process."""
    if tier != "remote":
        return None
    try:
        import redis  # noqa: F401 - only whether it is installed
    except ImportError:
        return "the remote benchmark needs the redis package (pip install 'lmcache[redis]')"
    if "--url" not in extra and not any(a.startswith("--url=") for a in extra) and shutil.which("redis-server") is None:
        return "the remote benchmark needs redis-server on PATH, or a running server: -- --url redis://HOST:PORT"
    return None


def run_bench(args: argparse.Namespace) -> int:
    where = None
    if args.benchmarks_dir is not None:
        where = Path(args.benchmarks_dir)
        if not (where / "bench_cpu_tier.py").is_file():
            print(f"lmcache: benchmarks not found in {where} (expected bench_cpu_tier.py there: the benchmarks/ "
                  "directory of a source checkout; without --benchmarks-dir the installed ones run)", file=sys.stderr)
            return 2
    extra = list(args.args)
    if extra and extra[0] == "--":
        extra = extra[1:]
    tiers = [args.tier] if args.tier else list(TIERS)
    env = dict(os.environ, OMP_NUM_THREADS="1")  # before the child imports torch
    worst = 0
    for i, tier in enumerate(tiers, 1):
        if where is None:
            cmd, cwd, what = [sys.executable, "-m", f"lmcache.bench.{tier}_tier", *extra], None, f"lmcache.bench.{tier}_tier"
        else:
            script = where / f"bench_{tier}_tier.py"
            cmd, cwd, what = [sys.executable, str(script), *extra], str(where), script.name
            env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(where.resolve().parent), os.environ.get("PYTHONPATH")]))
        print(f"== lmcache bench {tier} [{i}/{len(tiers)}]: {what} {' '.join(extra)}", file=sys.stderr, flush=True)
        if (reason := missing_requirement(tier, extra)) is not None:
            print(f"lmcache: {reason}", file=sys.stderr)
            worst = worst or 2
            continue
        rc = subprocess.call(cmd, env=env, cwd=cwd)
        if rc != 0:
            print(f"lmcache: {what} exited with {rc}", file=sys.stderr)
            worst = worst or rc
    return worst
