"""``lmcache proxy``: the disaggregated prefill/decode router (:mod:`lmcache.pd.proxy`).

Serves the OpenAI completion endpoints; each request is prefilled on one of the
``--prefill`` servers (KV stored in the shared remote tier) and generated on one of the
``--decode`` servers (KV loaded from it). See docs/disaggregated.md.
"""

from __future__ import annotations

import argparse
import logging
import os
import sys

logger = logging.getLogger(__name__)

_LOOPBACK = ("127.0.0.1", "localhost", "::1")


def _url(value: str) -> str:
    from lmcache.pd.pool import normalize_url

    try:
        return normalize_url(value)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def _seconds(value: str) -> float:
    try:
        out = float(value)
    except ValueError:
        out = float("nan")
    if not out > 0:
        raise argparse.ArgumentTypeError(f"{value!r}: expected seconds > 0")
    return out


def _port(value: str) -> int:
    try:
        out = int(value)
    except ValueError:
        out = -1
    if not 0 <= out <= 65535:
        raise argparse.ArgumentTypeError(f"{value!r}: expected a port number 0-65535")
    return out


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "proxy",
        help="disaggregated prefill/decode router in front of prefiller and decoder vLLM servers",
        description="Serve /v1/completions and /v1/chat/completions: each request is prefilled on a --prefill "
        "server (kv_role kv_producer; it stores the prompt's KV in the shared remote tier), then generated on a "
        "--decode server (kv_role kv_consumer; it loads that KV). Round-robin over the servers whose /health "
        "answers 200. Also serves /v1/models, /health and /metrics. Exit 2 for bad flags.",
    )
    p.add_argument("--prefill", nargs="+", required=True, type=_url, metavar="URL",
                   help="base URL of each prefiller (e.g. http://127.0.0.1:8100)")
    p.add_argument("--decode", nargs="+", required=True, type=_url, metavar="URL",
                   help="base URL of each decoder (e.g. http://127.0.0.1:8200)")
    p.add_argument("--host", default="127.0.0.1", help="address to listen on (default: 127.0.0.1)")
    p.add_argument("--port", type=_port, default=8000, help="port to listen on (default: 8000)")
    p.add_argument("--health-interval", type=_seconds, default=5.0, metavar="S",
                   help="seconds between health checks of the servers (default: 5)")
    p.add_argument("--timeout", type=_seconds, default=600.0, metavar="S",
                   help="seconds to connect to a server, and seconds without a byte from it, per request "
                   "(default: 600)")
    p.set_defaults(func=run_proxy)


def run_proxy(args: argparse.Namespace) -> int:
    try:
        import uvicorn

        from lmcache.pd.proxy import Proxy, ProxyConfig
    except ImportError as exc:
        print(f"lmcache proxy: needs fastapi, uvicorn and httpx ({exc}); pip install 'lmcache[proxy]'",
              file=sys.stderr)
        return 2
    for flag, urls in (("--prefill", args.prefill), ("--decode", args.decode)):
        dup = next((u for i, u in enumerate(urls) if u in urls[:i]), None)
        if dup is not None:
            print(f"lmcache proxy: {flag}: {dup!r} given twice", file=sys.stderr)
            return 2
    try:
        config = ProxyConfig(
            prefill_urls=tuple(args.prefill),
            decode_urls=tuple(args.decode),
            health_interval=args.health_interval,
            timeout=args.timeout,
            health_timeout=min(5.0, args.timeout),
        )
        proxy = Proxy(config)
    except ValueError as exc:
        print(f"lmcache proxy: {exc}", file=sys.stderr)
        return 2
    if "LMCACHE_LOG_LEVEL" not in os.environ:  # the CLI raised it to WARNING; the proxy reports instance changes
        logging.getLogger("lmcache").setLevel(logging.INFO)
    if args.host not in _LOOPBACK:
        logger.warning("lmcache proxy: listening on %s, reachable from other hosts: it has no authentication of "
                       "its own (the servers' --api-key is checked by them)", args.host)
    logger.info("lmcache proxy: prefill %s, decode %s, on http://%s:%d",
                ", ".join(config.prefill_urls), ", ".join(config.decode_urls), args.host, args.port)
    uvicorn.run(proxy.app(), host=args.host, port=args.port, log_level="info")
    return 0
