"""The ``lmcache`` command line (console script ``lmcache`` and ``python -m lmcache``).

Commands: ``config check``, ``disk inspect``, ``disk verify``, ``remote ping``,
``stats``, ``bench``, ``proxy`` (the disaggregated prefill/decode router, a server
that runs until interrupted), ``admin serve`` (docs/admin.md); ``--help`` on each. Exit
codes: 0 success, 1 a problem was found (corrupt entries, unreachable server, no worker
answering), 2 bad usage or an invalid configuration (the message names the file or
variable, key, value and
expectation). See docs/observability.md.
"""

from __future__ import annotations

import argparse
import logging
import sys

from lmcache import __version__


def build_parser() -> argparse.ArgumentParser:
    from lmcache.cli import admin_cmd, bench_cmd, config_cmd, disk_cmd, proxy_cmd, remote_cmd, stats_cmd

    parser = argparse.ArgumentParser(
        prog="lmcache",
        description="lmcache operations: validate configs, inspect and verify disk caches, check remote "
        "servers, read a running server's counters, run the benchmarks, route disaggregated prefill/decode, "
        "serve the admin API.",
    )
    parser.add_argument("--version", action="version", version=f"lmcache {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    config_cmd.add_parser(sub)
    disk_cmd.add_parser(sub)
    remote_cmd.add_parser(sub)
    stats_cmd.add_parser(sub)
    bench_cmd.add_parser(sub)
    proxy_cmd.add_parser(sub)
    admin_cmd.add_parser(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    """Run the CLI; returns the exit code."""
    parser = build_parser()
    args = parser.parse_args(argv)
    logging.getLogger("lmcache").setLevel(max(logging.getLogger("lmcache").level, logging.WARNING))
    try:
        return int(args.func(args) or 0)
    except KeyboardInterrupt:
        return 130
    except BrokenPipeError:
        return 0


def entry_point() -> None:
    sys.exit(main())
