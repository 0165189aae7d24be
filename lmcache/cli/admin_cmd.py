"""``lmcache admin serve``: the admin HTTP API (lookup, clear, pin, unpin; docs/admin.md)."""

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
        help="serve the admin API: per-tier lookups, clear, pin, unpin (never KV bytes)",
        description=(
            "Serve the admin API for the lmcache vLLM instances of this user (lookup sockets) and those "
            "registered in the remote store (--remote-url). A bearer token is always required: --token-file, "
            "else $LMCACHE_ADMIN_TOKEN, else one generated at first start and kept (mode 600) in "
            "<runtime dir>/admin-token, whose path is printed (clients: curl -H \"Authorization: Bearer $(cat "
            "PATH)\"). Only requests whose Host is localhost, 127.0.0.1, [::1], --host or an --allowed-host are "
            "answered. Remote credentials: in the URL, or LMCACHE_REMOTE_USERNAME / LMCACHE_REMOTE_PASSWORD. "
            "Exit 2 for bad usage."
        ),
    )
    s.add_argument("--host", default="127.0.0.1", help="address to listen on (default: 127.0.0.1)")
    s.add_argument("--port", type=int, default=8100, help="port (default: 8100)")
    s.add_argument("--unix-socket", default=None, metavar="PATH",
                   help="listen on this unix socket (mode 600, in a private directory; only this uid is served) "
                        "instead of --host/--port")
    s.add_argument("--token-file", default=None,
                   help="file holding the bearer token (mode 600); default: $LMCACHE_ADMIN_TOKEN, else a token "
                        "generated in <runtime dir>/admin-token")
    s.add_argument("--allowed-host", action="append", default=[], metavar="NAME",
                   help="also answer requests with this Host name (repeatable; localhost, 127.0.0.1, [::1] and "
                        "--host always are)")
    s.add_argument("--remote-url", default=None, help="the instances' remote_url (registrations, remote tier)")
    s.add_argument("--key-prefix", default="lmcache", help="the instances' remote_key_prefix (default: lmcache)")
    s.add_argument("--socket-dir", default=None, help="lookup socket directory (default: the workers' default)")
    s.add_argument("--timeout", type=float, default=5.0, help="seconds per worker or remote call (default: 5)")
    s.set_defaults(func=run_serve)


def resolve_token(token_file: str | None, runtime_dir: str | None = None) -> tuple[str, str]:
    """The bearer token and where it came from (a description naming a file or the
    variable, never the token); generates one when none is given. ValueError, or OSError
    (UnsafePathError for an unsafe runtime directory), with a one-line reason."""
    from lmcache.admin.auth import TOKEN_ENV, load_token
    from lmcache.admin.token_file import ensure_token

    token = load_token(token_file)
    if token is not None:
        return token, f"--token-file {token_file}" if token_file else f"${TOKEN_ENV}"
    kept = ensure_token(runtime_dir)
    verb = "generated" if kept.created else "reused"
    return kept.token, f"{kept.path} ({verb}; clients: curl -H \"Authorization: Bearer $(cat {kept.path})\")"


def run_serve(args: argparse.Namespace) -> int:
    from lmcache.admin.auth import allowed_hosts

    try:
        if not 0 < args.port < 65536:
            raise ValueError(f"--port {args.port}: expected 1..65535")
        if args.timeout <= 0:
            raise ValueError(f"--timeout {args.timeout}: expected seconds > 0")
        hosts = allowed_hosts(None if args.unix_socket else args.host, args.allowed_host)
        token, source = resolve_token(args.token_file)
        service = build_service(args)
    except (ValueError, OSError) as exc:  # OSError: an unsafe or unusable runtime directory
        print(f"lmcache admin: {exc}", file=sys.stderr)
        return 2
    from lmcache.admin.server import serve

    logging.getLogger("lmcache").setLevel(logging.INFO)
    print(f"lmcache admin: bearer token from {source}", file=sys.stderr)
    try:
        serve(service, token=token, host=args.host, port=args.port, allowed_hosts=hosts,
              unix_socket=args.unix_socket)
    except OSError as exc:  # the unix socket cannot be bound (unsafe directory, a live server there)
        print(f"lmcache admin: {exc}", file=sys.stderr)
        return 2
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
