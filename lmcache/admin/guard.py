"""ASGI middleware in front of the admin API: Host allow-list, then the bearer token.

Runs before the request body is read (it is the outermost layer: :class:`AccessGuard`
wraps :class:`lmcache.http_server.BodyLimit`, which wraps the app), so a caller with a
wrong ``Host`` or without the token gets 421 or 401 after sending headers only, and
never makes the service buffer or parse a body. ``/health`` needs no token (it reveals
nothing but "ok") but does need an allowed ``Host``.

Threads: runs on the server's event loop; never blocks.
"""

from __future__ import annotations

from lmcache.admin.auth import host_allowed, token_matches
from lmcache.http_server import ASGIApp, Receive, Scope, Send, send_json

OPEN_PATHS = frozenset({"/health"})
"""Paths answered without a token."""


def _header(scope: Scope, name: bytes) -> str | None:
    values = [v for k, v in scope.get("headers", ()) if k.lower() == name]
    if len(values) != 1:  # absent, or repeated (ambiguous: refused)
        return None
    return values[0].decode("latin-1")


class AccessGuard:
    """Refuses a request unless its ``Host`` is in ``allowed`` (421) and, outside
    :data:`OPEN_PATHS`, it carries ``Authorization: Bearer <token>`` (401)."""

    def __init__(self, app: ASGIApp, *, token: str, allowed: frozenset[str]) -> None:
        if not token:
            raise ValueError("token: expected a non-empty bearer token (the admin API always requires one)")
        self.app = app
        self.token = token
        self.allowed = allowed

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "lifespan":
            await self.app(scope, receive, send)
            return
        if scope["type"] != "http":
            if scope["type"] == "websocket":
                await send({"type": "websocket.close", "code": 1008})
            return
        host = _header(scope, b"host")
        if not host_allowed(host, self.allowed):
            shown = "missing or repeated" if host is None else repr(host[:100])
            await send_json(send, 421, {"error": f"host: {shown} is not a Host this admin API answers (allowed: "
                                              f"{', '.join(sorted(self.allowed))}, any port; add names with "
                                              "--allowed-host)"})
            return
        if scope.get("path") not in OPEN_PATHS and not token_matches(self.token, _header(scope, b"authorization")):
            await send_json(send, 401, {"error": "authorization: expected 'Bearer <token>' with the admin token (see "
                                              "docs/admin.md: the token file)"},
                         ((b"www-authenticate", b"Bearer"),))
            return
        await self.app(scope, receive, send)
