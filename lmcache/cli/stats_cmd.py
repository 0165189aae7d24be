"""``lmcache stats``: the counters of running vLLM workers, over their lookup sockets.

Every worker of a vLLM instance using the lmcache connector serves its engine's
stats snapshot on its lookup socket (``lookup-<engine digest>-r<rank>.sock`` in the
socket directory, default ``$XDG_RUNTIME_DIR/lmcache`` or ``$TMPDIR/lmcache-<uid>``). It finds the sockets,
asks each rank, merges the ranks of each instance like ``collect_stats`` does and
prints the numbers by tier.
"""

from __future__ import annotations

import argparse
import json
import sys

from lmcache.v1.tiers import TIERS, Tier


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "stats",
        help="counters of running vLLM workers (over their lookup sockets), by tier",
        description="Ask the lookup socket of every running lmcache vLLM worker for its counters and print them "
        "by tier, one block per vLLM instance. Exit 1 if no worker answers.",
    )
    p.add_argument("--socket-dir", default=None, help="lookup socket directory (default: the workers' default)")
    p.add_argument("--socket", action="append", default=None, help="a lookup socket path (repeatable; no search)")
    p.add_argument("--timeout", type=float, default=2.0, help="seconds per worker (default: 2)")
    p.add_argument("--json", action="store_true", help="print JSON (all counters)")
    p.set_defaults(func=run_stats)


def find_instances(socket_dir: str) -> dict[str, list[str]]:
    """``{engine digest: [socket path by rank]}`` of the sockets in ``socket_dir``."""
    from lmcache.integration.vllm.naming import find_lookup_sockets

    return find_lookup_sockets(socket_dir)


def run_stats(args: argparse.Namespace) -> int:
    from lmcache.integration.vllm.lookup_service import LookupClient
    from lmcache.integration.vllm.naming import default_socket_dir
    from lmcache.observability.snapshot import merge_rank_snapshots

    if args.socket:
        instances = {"given": list(args.socket)}
    else:
        socket_dir = args.socket_dir or default_socket_dir()
        instances = find_instances(socket_dir)
        if not instances:
            print(f"lmcache: no lookup sockets in {socket_dir} (is a vLLM server with lmcache running as this user?)",
                  file=sys.stderr)
            return 1
    out: dict[str, dict[str, float]] = {}
    for name, paths in instances.items():
        client = LookupClient(paths, timeout=args.timeout)
        try:
            snaps = client.stats()
        finally:
            client.close()
        if snaps:
            out[name] = merge_rank_snapshots(snaps)
            out[name]["workers_answering"] = len(snaps)
            out[name]["workers"] = len(paths)
        elif client.last_error:
            print(f"lmcache: instance {name}: no answer ({client.last_error})", file=sys.stderr)
    if not out:
        return 1
    if args.json:
        print(json.dumps(out, indent=2, sort_keys=True))
        return 0
    for name, s in out.items():
        print(format_stats(name, s))
    return 0


def format_stats(name: str, s: dict[str, float]) -> str:
    def g(key: str) -> int:
        return int(s.get(key, 0))

    lines = [f"instance {name}: {g('workers_answering')}/{g('workers')} workers answering"]
    lines.append(f"  lookups {g('lookup_requests')}, tokens looked up {g('lookup_tokens')}, "
                 f"reported cached {g('lookup_hit_tokens')}")
    lines.append(f"  loads {g('retrieve_requests')}, load errors {g('load_errors')}; "
                 f"stores {g('store_requests')}, stored tokens {g('stored_tokens')}")
    lines.append(f"  {'tier':<7}{'loaded tokens':>15}{'loaded bytes':>15}{'stored bytes':>15}{'used bytes':>15}"
                 f"{'capacity':>15}{'evictions':>11}{'corrupt':>9}")
    stored = {Tier.CPU: g("stored_bytes"), Tier.DISK: g("disk_bytes_written"), Tier.REMOTE: g("remote_bytes_written")}
    evict = {Tier.CPU: g("evictions"), Tier.DISK: g("disk_evictions"), Tier.REMOTE: 0}
    corrupt = {Tier.CPU: 0, Tier.DISK: g("disk_corrupt_entries"), Tier.REMOTE: g("remote_corrupt_entries")}
    for tier in TIERS:
        if tier == Tier.DISK and "pool_capacity_bytes_disk" not in s:
            continue
        if tier == Tier.REMOTE and "remote_available" not in s:
            continue
        used = g(f"pool_used_bytes_{tier}") if tier != Tier.REMOTE else "-"
        cap = g(f"pool_capacity_bytes_{tier}") if tier != Tier.REMOTE else "-"
        lines.append(f"  {tier:<7}{g(f'hit_tokens_{tier}'):>15}{g(f'hit_bytes_{tier}'):>15}{stored[tier]:>15}"
                     f"{used:>15}{cap:>15}{evict[tier]:>11}{corrupt[tier]:>9}")
    if "remote_available" in s:
        lines.append(f"  remote: {'available' if s['remote_available'] else 'UNAVAILABLE'}, "
                     f"errors {g('remote_errors')}, breaker trips {g('remote_breaker_open')}")
    return "\n".join(lines)
