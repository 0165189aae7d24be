"""Serving an ASGI app (the admin API, the PD proxy) with limits a hostile client cannot outlast.

* :class:`ServerLimits`: the numbers (body size, seconds to send headers and body,
  concurrent connections, keep-alive).
* :class:`BodyLimit`: ASGI middleware that reads a request's whole body before the app
  sees it: over the size limit -> 413 (by ``Content-Length`` before reading, or as soon as
  the bytes read pass it), not complete within ``body_timeout`` -> 408. The app then gets
  the body in one message; later ``receive()`` calls (``http.disconnect``) go to the server.
* :func:`serve`: uvicorn with ``limit_concurrency``, ``timeout_keep_alive`` and a header
  deadline: a connection that has not sent a complete request head within
  ``header_timeout`` seconds of opening (or of its previous response) is closed, so
  half-sent requests (slowloris) cannot hold connections and push others over the limit.

Threads: everything runs on the server's event loop; nothing here blocks.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import Awaitable, Callable, MutableMapping
from dataclasses import dataclass
from typing import Any

Scope = MutableMapping[str, Any]
Message = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[Message]]
Send = Callable[[Message], Awaitable[None]]
ASGIApp = Callable[[Scope, Receive, Send], Awaitable[None]]
ErrorBody = Callable[[int, str], Any]
"""``(status, message) -> JSON-ready body`` of an error answer (each app has its own shape)."""

_BODY_METHODS = frozenset({"POST", "PUT", "PATCH"})


def _positive(name: str, value: Any, kind: type = float) -> None:
    if isinstance(value, bool) or not isinstance(value, (int, float) if kind is float else int) or not value > 0:
        raise ValueError(f"{name}={value!r}: expected {'seconds' if kind is float else 'an integer'} > 0")


@dataclass(frozen=True, slots=True)
class ServerLimits:
    """Limits of one HTTP server (ValueError naming the field for a bad value)."""

    max_body_bytes: int
    """Largest request body (413 beyond)."""
    body_timeout: float = 30.0
    """Seconds a client may take to send a whole request body (408 beyond)."""
    header_timeout: float = 10.0
    """Seconds a connection may take to send a complete request head (closed beyond)."""
    limit_concurrency: int = 256
    """Connections and requests at once; uvicorn answers 503 beyond."""
    timeout_keep_alive: int = 5
    """Seconds an idle keep-alive connection stays open."""

    def __post_init__(self) -> None:
        _positive("max_body_bytes", self.max_body_bytes, int)
        _positive("body_timeout", self.body_timeout)
        _positive("header_timeout", self.header_timeout)
        _positive("limit_concurrency", self.limit_concurrency, int)
        _positive("timeout_keep_alive", self.timeout_keep_alive, int)


async def send_json(send: Send, status: int, body: Any, headers: tuple[tuple[bytes, bytes], ...] = ()) -> None:
    """Send a whole JSON response and close the connection (the request body may be unread)."""
    data = json.dumps(body).encode()
    head = [(b"content-type", b"application/json"), (b"content-length", str(len(data)).encode()),
            (b"connection", b"close"), *headers]
    await send({"type": "http.response.start", "status": status, "headers": head})
    await send({"type": "http.response.body", "body": data})


class BodyLimit:
    """ASGI middleware: the request body read whole, within ``limits``, before ``app`` runs."""

    def __init__(self, app: ASGIApp, limits: ServerLimits, error_body: ErrorBody) -> None:
        self.app = app
        self.limits = limits
        self.error_body = error_body

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or scope.get("method") not in _BODY_METHODS:
            await self.app(scope, receive, send)
            return
        limit = self.limits.max_body_bytes
        declared = next((v for k, v in scope.get("headers", ()) if k == b"content-length"), None)
        if declared is not None and (not declared.isdigit() or int(declared) > limit):
            await send_json(send, 413, self.error_body(413, f"body: {declared.decode(errors='replace')} bytes; "
                                                          f"expected at most {limit}"))
            return
        parts: list[bytes] = []
        size = 0
        try:
            async with asyncio.timeout(self.limits.body_timeout):
                while True:
                    message = await receive()
                    if message["type"] == "http.disconnect":
                        return  # the client left: nobody to answer
                    chunk = message.get("body", b"")
                    size += len(chunk)
                    if size > limit:
                        await send_json(send, 413, self.error_body(413, f"body: more than {limit} bytes; "
                                                                      f"expected at most {limit}"))
                        return
                    parts.append(chunk)
                    if not message.get("more_body", False):
                        break
        except TimeoutError:
            await send_json(send, 408, self.error_body(408, f"body: not received within {self.limits.body_timeout:g} s"))
            return
        body = b"".join(parts)
        sent = False

        async def replay() -> Message:
            nonlocal sent
            if not sent:
                sent = True
                return {"type": "http.request", "body": body, "more_body": False}
            return await receive()

        await self.app(scope, replay, send)


def _header_deadline_protocol(header_timeout: float) -> type:
    """uvicorn's h11 protocol, closing connections that send no complete request head in time."""
    from uvicorn.protocols.http.h11_impl import H11Protocol

    class DeadlineH11Protocol(H11Protocol):
        _deadline: asyncio.TimerHandle | None = None

        def _arm(self) -> None:
            self._disarm()
            self._deadline = self.loop.call_later(header_timeout, self._expire)

        def _disarm(self) -> None:
            if self._deadline is not None:
                self._deadline.cancel()
                self._deadline = None

        def _expire(self) -> None:
            self._deadline = None
            waiting = self.cycle is None or self.cycle.response_complete
            if waiting and not self.transport.is_closing():
                self.transport.close()

        def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
            super().connection_made(transport)
            self._arm()

        def handle_events(self) -> None:
            before = self.cycle
            super().handle_events()
            if self.cycle is not before and self.cycle is not None and not self.cycle.response_complete:
                self._disarm()  # a request head arrived: the body has its own deadline (BodyLimit)

        def on_response_complete(self) -> None:
            super().on_response_complete()
            self._arm()

        def connection_lost(self, exc: Exception | None) -> None:
            self._disarm()
            super().connection_lost(exc)

    return DeadlineH11Protocol


def uvicorn_config(app: ASGIApp, *, host: str, port: int, limits: ServerLimits, log_level: str = "info",
                   access_log: bool = False, uds: str | None = None) -> Any:
    """A ``uvicorn.Config`` for ``app`` (wrap it in :class:`BodyLimit` first) under ``limits``."""
    import uvicorn

    return uvicorn.Config(
        app,
        host=host,
        port=port,
        uds=uds,
        http=_header_deadline_protocol(limits.header_timeout),
        limit_concurrency=limits.limit_concurrency,
        timeout_keep_alive=limits.timeout_keep_alive,
        log_level=log_level,
        access_log=access_log,
    )


def serve(app: ASGIApp, *, host: str, port: int, limits: ServerLimits, error_body: ErrorBody,
          log_level: str = "info", access_log: bool = False, uds: str | None = None) -> None:
    """Run ``app`` behind :class:`BodyLimit` until interrupted."""
    import uvicorn

    config = uvicorn_config(BodyLimit(app, limits, error_body), host=host, port=port, limits=limits,
                            log_level=log_level, access_log=access_log, uds=uds)
    uvicorn.Server(config).run()
