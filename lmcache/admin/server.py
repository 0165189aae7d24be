"""The admin API's HTTP layer (FastAPI): routes, authentication and error mapping.

Routes (docs/admin.md): ``GET /health`` (never authenticated), ``GET /instances``,
``POST /lookup``, ``POST /clear``, ``POST /pin``. With a token every route but
``/health`` needs ``Authorization: Bearer <token>`` (401 otherwise). Errors are JSON
``{"error": "<field or thing>: <why>"}``: 422 for an invalid body (the field's path
first), 404 for an unknown instance, 400 for a request that cannot be served as asked,
502 when an instance or the remote store fails; a POST needs a Content-Length of at
most :data:`MAX_BODY_BYTES` (411/413 otherwise). Routes are plain functions: FastAPI
runs them on its thread pool, so blocking socket and Redis calls never stall the loop.
"""

from __future__ import annotations

import logging
from collections.abc import Awaitable, Callable
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response

from lmcache import __version__
from lmcache.admin.auth import check_bind, token_matches
from lmcache.admin.schemas import ClearBody, LookupBody, PinBody
from lmcache.admin.service import AdminService, BadRequest, NotFound

logger = logging.getLogger(__name__)

MAX_BODY_BYTES = 64 << 20
"""Largest request body (1M token ids as JSON take about 8 MB; a prompt at most 8M characters)."""


def _field_path(loc: tuple[Any, ...] | list[Any]) -> str:
    parts = [str(p) for p in loc if p != "body"]
    return ".".join(parts) or "body"


def _validation_error(_: Request, exc: Exception) -> JSONResponse:
    assert isinstance(exc, RequestValidationError)
    details = [{"field": _field_path(e.get("loc", ())), "msg": e.get("msg", "")} for e in exc.errors()[:20]]
    text = "; ".join(f"{d['field']}: {d['msg']}" for d in details) or "invalid request body"
    return JSONResponse({"error": text, "detail": details}, status_code=422)


def create_app(service: AdminService, token: str | None = None) -> FastAPI:
    """The app over ``service``; ``token`` (None: no authentication) guards every route but /health."""
    app = FastAPI(title="lmcache admin", version=__version__, docs_url=None, redoc_url=None, openapi_url=None)

    @app.middleware("http")
    async def auth(request: Request, call_next: Callable[[Request], Awaitable[Response]]) -> Response:
        # before routing and body parsing: an unauthenticated caller learns nothing but 401
        if token is not None and request.url.path != "/health":
            if not token_matches(token, request.headers.get("authorization")):
                return JSONResponse({"error": "authorization: expected 'Bearer <token>' with the admin token"},
                                    status_code=401, headers={"WWW-Authenticate": "Bearer"})
        if request.method == "POST":
            size = request.headers.get("content-length")
            if size is None or not size.isdigit():
                return JSONResponse({"error": "content-length: required for a request body"}, status_code=411)
            if int(size) > MAX_BODY_BYTES:
                return JSONResponse({"error": f"body: {size} bytes; expected at most {MAX_BODY_BYTES}"},
                                    status_code=413)
        return await call_next(request)

    app.add_exception_handler(RequestValidationError, _validation_error)

    @app.exception_handler(NotFound)
    def _not_found(_: Request, exc: Exception) -> JSONResponse:
        return JSONResponse({"error": str(exc)}, status_code=404)

    @app.exception_handler(BadRequest)
    def _bad_request(_: Request, exc: Exception) -> JSONResponse:
        return JSONResponse({"error": str(exc)}, status_code=400)

    @app.exception_handler(RuntimeError)
    def _upstream(_: Request, exc: Exception) -> JSONResponse:
        logger.warning("lmcache admin: %s", exc)
        return JSONResponse({"error": str(exc)}, status_code=502)

    @app.get("/health")
    def health() -> dict[str, Any]:
        return {"status": "ok", "version": __version__}

    @app.get("/instances")
    def instances() -> dict[str, Any]:
        return service.instances()

    @app.post("/lookup")
    def lookup(body: LookupBody) -> dict[str, Any]:
        return service.lookup(body)

    @app.post("/clear")
    def clear(body: ClearBody) -> dict[str, Any]:
        return service.clear(body)

    @app.post("/pin")
    def pin(body: PinBody) -> dict[str, Any]:
        return service.pin(body)

    return app


def serve(service: AdminService, *, host: str, port: int, token: str | None) -> None:
    """Run the API until interrupted (ValueError from :func:`check_bind` before listening)."""
    import uvicorn

    check_bind(host, token)
    logger.info("lmcache admin API on http://%s:%d (%s)", host, port, "token required" if token else "no token")
    uvicorn.run(create_app(service, token), host=host, port=port, log_level="info", access_log=False)
