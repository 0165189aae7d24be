"""The admin API's HTTP layer (FastAPI): routes, error mapping, and how it is served.

Routes (docs/admin.md): ``GET /health`` (no token), ``GET /instances``, ``POST /lookup``,
``POST /clear``, ``POST /pin``, ``POST /unpin``. Every request passes, in this order:

1. :class:`~lmcache.admin.guard.AccessGuard`: an allowed ``Host`` (421 otherwise), then
   ``Authorization: Bearer <token>`` on every route but ``/health`` (401 otherwise). The
   token is always required.
2. :class:`lmcache.http_server.BodyLimit`: the body read whole within
   :data:`ADMIN_LIMITS` (413 over :data:`MAX_BODY_BYTES`, chunked bodies included; 408 when
   too slow).
3. The route: its body is parsed and validated (:func:`~lmcache.admin.schemas.parse_body`)
   and the operation run on the thread pool, never on the event loop, so a large body
   or a blocking socket or Redis call does not stall other requests (``/health``).

Errors are JSON ``{"error": "<field or thing>: <why>"}``: 422 for an invalid body (the
field's path first, and ``detail``), 404 for an unknown instance, 400 for a request that
cannot be served as asked, 429 when a worker's limit is reached (admin pins), 502 when an
instance or the remote store fails.
"""

from __future__ import annotations

import logging
import os
import socket
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse
from starlette.concurrency import run_in_threadpool

from lmcache import __version__
from lmcache.admin.auth import DEFAULT_HOSTS
from lmcache.admin.guard import AccessGuard
from lmcache.admin.schemas import ClearBody, InvalidBody, LookupBody, PinBody, UnpinBody, parse_body
from lmcache.admin.service import AdminService, BadRequest, LimitReached, NotFound
from lmcache.http_server import ASGIApp, BodyLimit, ServerLimits, uvicorn_config
from lmcache.v1.private_files import (
    check_parent_dir,
    ensure_private_dir,
    peer_is_us,
    peer_uid,
    remove_stale_socket,
)

if TYPE_CHECKING:
    import uvicorn

logger = logging.getLogger(__name__)

MAX_BODY_BYTES = 16 << 20
"""Largest request body: 1,000,000 token ids as JSON take about 8 MB."""
ADMIN_LIMITS = ServerLimits(max_body_bytes=MAX_BODY_BYTES, body_timeout=30.0, header_timeout=10.0,
                            limit_concurrency=64, timeout_keep_alive=5)
"""How the admin API is served: body size and time, header deadline (slowloris), connections at once, keep-alive."""


def error_body(status: int, message: str) -> dict[str, Any]:
    """The JSON of an error answered before the app (413, 408: :class:`~lmcache.http_server.BodyLimit`)."""
    return {"error": message}


def _invalid(_: Request, exc: Exception) -> JSONResponse:
    assert isinstance(exc, InvalidBody)
    return JSONResponse({"error": str(exc), "detail": exc.details}, status_code=422)


def _api(service: AdminService) -> FastAPI:
    """The routes over ``service`` (no access checks or body limits: see :func:`create_app`)."""
    app = FastAPI(title="lmcache admin", version=__version__, docs_url=None, redoc_url=None, openapi_url=None)
    app.add_exception_handler(InvalidBody, _invalid)

    @app.exception_handler(NotFound)
    def _not_found(_: Request, exc: Exception) -> JSONResponse:
        return JSONResponse({"error": str(exc)}, status_code=404)

    @app.exception_handler(BadRequest)
    def _bad_request(_: Request, exc: Exception) -> JSONResponse:
        return JSONResponse({"error": str(exc)}, status_code=400)

    @app.exception_handler(LimitReached)
    def _limit(_: Request, exc: Exception) -> JSONResponse:
        return JSONResponse({"error": str(exc)}, status_code=429)

    @app.exception_handler(RuntimeError)
    def _upstream(_: Request, exc: Exception) -> JSONResponse:
        logger.warning("lmcache admin: %s", exc)
        return JSONResponse({"error": str(exc)}, status_code=502)

    async def run(request: Request, op: Callable[[Any], dict[str, Any]], model: type) -> dict[str, Any]:
        raw = await request.body()  # already read whole by BodyLimit
        return await run_in_threadpool(lambda: op(parse_body(model, raw)))

    @app.get("/health")
    def health() -> dict[str, Any]:
        return {"status": "ok"}

    @app.get("/instances")
    def instances() -> dict[str, Any]:
        return service.instances()

    @app.post("/lookup")
    async def lookup(request: Request) -> dict[str, Any]:
        return await run(request, service.lookup, LookupBody)

    @app.post("/clear")
    async def clear(request: Request) -> dict[str, Any]:
        return await run(request, service.clear, ClearBody)

    @app.post("/pin")
    async def pin(request: Request) -> dict[str, Any]:
        return await run(request, service.pin, PinBody)

    @app.post("/unpin")
    async def unpin(request: Request) -> dict[str, Any]:
        return await run(request, service.unpin, UnpinBody)

    return app


def create_app(service: AdminService, token: str, *, allowed_hosts: frozenset[str] = frozenset(DEFAULT_HOSTS),
               limits: ServerLimits = ADMIN_LIMITS) -> ASGIApp:
    """The whole admin API as one ASGI app: access guard, body limit, routes (module docstring)."""
    return AccessGuard(BodyLimit(_api(service), limits, error_body), token=token, allowed=allowed_hosts)


def _peer_checked(protocol: type) -> type:
    """``protocol`` (uvicorn's HTTP protocol class) closing unix-socket connections of another uid."""

    class PeerCheckedProtocol(protocol):  # type: ignore[misc, valid-type]
        def connection_made(self, transport: Any) -> None:
            super().connection_made(transport)
            sock = transport.get_extra_info("socket")
            if sock is not None and sock.family == socket.AF_UNIX and not peer_is_us(sock):
                logger.warning("lmcache admin: refused a unix-socket connection from uid %s", peer_uid(sock))
                transport.close()

    return PeerCheckedProtocol


def bind_unix_socket(path: str) -> socket.socket:
    """A listening unix socket at ``path`` (mode 0600) in a private directory (created 0700
    or verified: :mod:`lmcache.v1.private_files`); a dead socket of ours there is replaced.
    Raises UnsafePathError / OSError naming the path (EADDRINUSE when a server listens)."""
    directory = os.path.dirname(os.path.abspath(path))
    check_parent_dir(os.path.dirname(directory), what="parent of the admin socket directory")
    ensure_private_dir(directory, what="admin socket directory")
    if not remove_stale_socket(path):
        raise OSError(f"--unix-socket {path}: a live server already listens there")
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        sock.bind(path)
        os.chmod(path, 0o600)
        sock.listen(128)
    except OSError:
        sock.close()
        raise
    return sock


def build_server(service: AdminService, *, token: str, host: str = "127.0.0.1", port: int = 8100,
                 allowed_hosts: frozenset[str] = frozenset(DEFAULT_HOSTS), limits: ServerLimits = ADMIN_LIMITS,
                 unix_socket: bool = False, log_level: str = "info") -> uvicorn.Server:
    """A uvicorn server for the admin API under ``limits`` (not started: ``.run()`` it, or
    ``.run(sockets=[bind_unix_socket(path)])`` with ``unix_socket``, whose connections are
    then checked with SO_PEERCRED: only our uid is served)."""
    import uvicorn

    app = create_app(service, token, allowed_hosts=allowed_hosts, limits=limits)
    config = uvicorn_config(app, host=host, port=port, limits=limits, log_level=log_level)
    if unix_socket:
        config.http = _peer_checked(config.http)
    return uvicorn.Server(config)


def serve(service: AdminService, *, token: str, host: str, port: int, allowed_hosts: frozenset[str],
          unix_socket: str | None = None) -> None:
    """Run the API until interrupted: on ``unix_socket`` when given, else on ``host:port``."""
    if unix_socket is not None:
        sock = bind_unix_socket(unix_socket)
        logger.info("lmcache admin API on unix socket %s (token required)", unix_socket)
        try:
            build_server(service, token=token, allowed_hosts=allowed_hosts, unix_socket=True).run(sockets=[sock])
        finally:
            sock.close()
            try:
                os.unlink(unix_socket)
            except FileNotFoundError:
                pass
        return
    logger.info("lmcache admin API on http://%s:%d (token required)", host, port)
    build_server(service, token=token, host=host, port=port, allowed_hosts=allowed_hosts).run()
