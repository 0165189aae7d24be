"""``lmcache remote ping URL``: reachability, round-trip latency, our entry count and bytes."""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("remote", help="remote-tier tools", description="Remote-tier (Redis/Valkey) tools.")
    rsub = p.add_subparsers(dest="remote_cmd", metavar="COMMAND", required=True)
    ping = rsub.add_parser(
        "ping",
        help="reachability, round-trip latency, lmcache entry count and bytes of a remote server",
        description=(
            "Connect to URL (redis://, rediss://, unix://, redis-cluster://; the remote_url forms), time PING "
            "round trips and count the entries and value bytes under the lmcache key prefix. Credentials: in "
            "the URL, or LMCACHE_REMOTE_USERNAME / LMCACHE_REMOTE_PASSWORD. Exit 0 if reachable, 1 if not, "
            "2 for a malformed URL."
        ),
    )
    ping.add_argument("url", help="remote_url, e.g. redis://127.0.0.1:6379")
    ping.add_argument("--prefix", default="lmcache", help="remote_key_prefix (default: lmcache)")
    ping.add_argument("--count", type=int, default=5, help="PING round trips to time (default: 5)")
    ping.add_argument("--timeout", type=float, default=5.0, help="seconds per call (default: 5)")
    ping.add_argument("--no-scan", action="store_true", help="do not count entries (SCAN walks the keyspace)")
    ping.add_argument("--json", action="store_true", help="print JSON")
    ping.set_defaults(func=run_ping)


def run_ping(args: argparse.Namespace) -> int:
    from lmcache.v1.storage_backend.connector import RemoteError, create_connector, mask_url

    shown = mask_url(args.url)
    if args.count < 1 or args.timeout <= 0:
        print("lmcache: --count: expected >= 1; --timeout: expected seconds > 0", file=sys.stderr)
        return 2
    try:
        conn = create_connector(
            args.url,
            timeout=args.timeout,
            username=os.environ.get("LMCACHE_REMOTE_USERNAME") or None,
            password=os.environ.get("LMCACHE_REMOTE_PASSWORD") or None,
        )
    except ValueError as exc:
        print(f"lmcache: {exc}", file=sys.stderr)
        return 2
    result: dict[str, object] = {"url": shown}
    try:
        t0 = time.perf_counter()
        conn.ping()  # connects
        result["connect_ms"] = round((time.perf_counter() - t0) * 1e3, 3)
        rtts = []
        for _ in range(args.count):
            t0 = time.perf_counter()
            conn.ping()
            rtts.append((time.perf_counter() - t0) * 1e3)
        result["rtt_ms"] = {
            "min": round(min(rtts), 3),
            "median": round(statistics.median(rtts), 3),
            "max": round(max(rtts), 3),
        }
        if not args.no_scan:
            entries = nbytes = 0
            for _, size in conn.scan_sizes(f"{args.prefix}:*"):
                entries += 1
                nbytes += size
            result["entries"], result["bytes"] = entries, nbytes
    except RemoteError as exc:
        result["error"] = f"{type(exc).__name__}: {exc}"
        if args.json:
            print(json.dumps(result, indent=2))
        else:
            print(f"{shown}: UNREACHABLE ({result['error']})")
        return 1
    finally:
        conn.close()
    if args.json:
        print(json.dumps(result, indent=2))
        return 0
    rtt = result["rtt_ms"]
    line = (
        f"{shown}: reachable, connect {result['connect_ms']} ms, "
        f"PING rtt min/median/max {rtt['min']}/{rtt['median']}/{rtt['max']} ms"  # type: ignore[index]
    )
    if "entries" in result:
        line += f", {result['entries']} lmcache entries ({result['bytes']} bytes) under '{args.prefix}:'"
    print(line)
    return 0
