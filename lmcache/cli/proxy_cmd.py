"""``lmcache proxy``: the disaggregated prefill/decode router (:mod:`lmcache.pd.proxy`).

Serves the OpenAI completion endpoints; each request is prefilled on one of the
``--prefill`` servers (KV stored in the shared remote tier) and generated on one of the
``--decode`` servers (KV loaded from it). The prefillers' parameters are signed for the
decoders with the shared PD secret (``--pd-secret-file`` or ``$LMCACHE_PD_SECRET``; the
proxy does not start without one). See docs/disaggregated.md.
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


def _ttl(value: str) -> float:
    from lmcache.pd.signing import MAX_TTL_S

    out = _seconds(value)
    if out > MAX_TTL_S:
        raise argparse.ArgumentTypeError(f"{value!r}: expected seconds > 0, at most {MAX_TTL_S:g}")
    return out


def _positive_int(value: str) -> int:
    try:
        out = int(value)
    except ValueError:
        out = 0
    if out <= 0:
        raise argparse.ArgumentTypeError(f"{value!r}: expected an integer > 0")
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
    p.add_argument("--prefill-timeout", type=_seconds, default=30.0, metavar="S",
                   help="seconds the whole prefill leg may take; beyond, the decoder computes the prompt itself "
                   "(default: 30)")
    p.add_argument("--max-concurrency", type=_positive_int, default=256, metavar="N",
                   help="requests served at once; more get 503 with Retry-After (default: 256)")
    p.add_argument("--max-body-bytes", type=_positive_int, default=8 << 20, metavar="N",  # lmcache.pd.proxy.DEFAULT_MAX_BODY_BYTES
                   help="largest request body; larger ones get 413 (default: 8388608, 8 MiB)")
    p.add_argument("--pd-secret-file", metavar="FILE",
                   help="file whose first line is the PD secret shared with the prefillers and decoders "
                   "(mode 600); default: $LMCACHE_PD_SECRET")
    p.add_argument("--pd-sign-ttl", type=_ttl, default=None, metavar="S",
                   help="seconds a signed decoder parameter set stays valid (default: 300, at most 3600)")
    p.set_defaults(func=run_proxy)


def run_proxy(args: argparse.Namespace) -> int:
    try:
        from lmcache.http_server import serve
        from lmcache.pd import signing
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
        secret = signing.load_secret(args.pd_secret_file)
    except ValueError as exc:
        print(f"lmcache proxy: {exc}", file=sys.stderr)
        return 2
    if secret is None:
        print(f"lmcache proxy: no PD secret: give --pd-secret-file FILE or set ${signing.SECRET_ENV} (the same "
              "secret as the prefillers' and decoders' pd_secret)", file=sys.stderr)
        return 2
    try:
        config = ProxyConfig(
            prefill_urls=tuple(args.prefill),
            decode_urls=tuple(args.decode),
            health_interval=args.health_interval,
            timeout=args.timeout,
            health_timeout=min(5.0, args.timeout),
            prefill_timeout=args.prefill_timeout,
            max_concurrency=args.max_concurrency,
            max_body_bytes=args.max_body_bytes,
            sign_ttl=signing.DEFAULT_TTL_S if args.pd_sign_ttl is None else args.pd_sign_ttl,
            secret=secret,
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
    logger.info("lmcache proxy: prefill %s, decode %s, on http://%s:%d; PD secret from %s",
                ", ".join(config.prefill_urls), ", ".join(config.decode_urls), args.host, args.port,
                args.pd_secret_file or f"${signing.SECRET_ENV}")
    serve(proxy.app(), host=args.host, port=args.port, limits=config.server_limits(), error_body=proxy.error_body)
    return 0
