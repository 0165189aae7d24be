"""``lmcache admin serve``: the admin HTTP API (lookup, clear, pin; docs/admin.md)."""

from __future__ import annotations

import argparse
import logging
import os
import sys


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("admin", help="the admin HTTP API", description="The admin HTTP API (docs/admin.md).")
    asub = p.add_subparsers(dest="admin_cmd", metavar="COMMAND", required=True)
    s = asub.add_parser(
        "serve",
        help="serve the admin API: per-tier lookups, clear, pin (never KV bytes)",
        description=(
            "Serve the admin API for the lmcache vLLM instances of this user (lookup sockets) and those "
            "registered in the remote store (--remote-url). Listens on 127.0.0.1 by default; any other address "
            "needs a bearer token (--token-file or $LMCACHE_ADMIN_TOKEN). Remote credentials: in the URL, or "
            "LMCACHE_REMOTE_USERNAME / LMCACHE_REMOTE_PASSWORD. Exit 2 for bad usage."
        ),
    )
    s.add_argument("--host", default="127.0.0.1", help="address to listen on (default: 127.0.0.1)")
    s.add_argument("--port", type=int, default=8100, help="port (default: 8100)")
    s.add_argument("--token-file", default=None, help="file holding the bearer token (mode 600)")
    s.add_argument("--remote-url", default=None, help="the instances' remote_url (registrations, remote tier)")
    s.add_argument("--key-prefix", default="lmcache", help="the instances' remote_key_prefix (default: lmcache)")
    s.add_argument("--socket-dir", default=None, help="lookup socket directory (default: the workers' default)")
    s.add_argument("--timeout", type=float, default=5.0, help="seconds per worker or remote call (default: 5)")
    s.set_defaults(func=run_serve)


def run_serve(args: argparse.Namespace) -> int:
    from lmcache.admin.auth import check_bind, load_token

    try:
        token = load_token(args.token_file)
        check_bind(args.host, token)
        if not 0 < args.port < 65536:
            raise ValueError(f"--port {args.port}: expected 1..65535")
        if args.timeout <= 0:
            raise ValueError(f"--timeout {args.timeout}: expected seconds > 0")
        service = build_service(args)
    except ValueError as exc:
        print(f"lmcache admin: {exc}", file=sys.stderr)
        return 2
    from lmcache.admin.server import serve

    logging.getLogger("lmcache").setLevel(logging.INFO)
    serve(service, host=args.host, port=args.port, token=token)
    return 0


def build_service(args: argparse.Namespace):  # -> AdminService (imported lazily: keeps --help fast)
    from lmcache.admin.directory import InstanceDirectory
    from lmcache.admin.remote import RemoteStore
    from lmcache.admin.service import AdminService
    from lmcache.integration.vllm.naming import default_socket_dir

    remote = None
    if args.remote_url:
        remote = RemoteStore(
            args.remote_url,
            key_prefix=args.key_prefix,
            timeout=args.timeout,
            username=os.environ.get("LMCACHE_REMOTE_USERNAME") or None,
            password=os.environ.get("LMCACHE_REMOTE_PASSWORD") or None,
        )
    directory = InstanceDirectory(remote, args.socket_dir or default_socket_dir())
    return AdminService(directory, timeout=args.timeout)
