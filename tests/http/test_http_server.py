"""lmcache.http_server: body limits, body and header deadlines, against a real uvicorn server."""

from __future__ import annotations

import json
import socket
import threading
import time
from collections.abc import Iterator

import pytest

uvicorn = pytest.importorskip("uvicorn")

from lmcache.http_server import BodyLimit, ServerLimits, uvicorn_config  # noqa: E402


async def echo(scope, receive, send):
    """Answers with the size of the body it received, and whether a second receive() waits for the client."""
    if scope["type"] == "lifespan":
        while True:
            msg = await receive()
            if msg["type"] == "lifespan.startup":
                await send({"type": "lifespan.startup.complete"})
            elif msg["type"] == "lifespan.shutdown":
                await send({"type": "lifespan.shutdown.complete"})
                return
    message = await receive()
    body = json.dumps({"size": len(message.get("body", b"")), "more": message.get("more_body", False)}).encode()
    await send({"type": "http.response.start", "status": 200, "headers": [(b"content-type", b"application/json")]})
    await send({"type": "http.response.body", "body": body})


LIMITS = ServerLimits(max_body_bytes=1000, body_timeout=0.5, header_timeout=0.5, limit_concurrency=8)


@pytest.fixture(scope="module")
def server() -> Iterator[int]:
    app = BodyLimit(echo, LIMITS, lambda status, msg: {"error": msg, "status": status})
    srv = uvicorn.Server(uvicorn_config(app, host="127.0.0.1", port=0, limits=LIMITS, log_level="warning"))
    thread = threading.Thread(target=srv.run, daemon=True)
    thread.start()
    deadline = time.monotonic() + 20
    while not srv.started:
        assert time.monotonic() < deadline and thread.is_alive(), "server did not start"
        time.sleep(0.01)
    port = srv.servers[0].sockets[0].getsockname()[1]
    yield port
    srv.should_exit = True
    thread.join(10)


def _request(port: int, raw: bytes, timeout: float = 5.0) -> bytes:
    with socket.create_connection(("127.0.0.1", port), timeout=timeout) as s:
        s.sendall(raw)
        out = b""
        while True:
            data = s.recv(65536)
            if not data:
                return out
            out += data


def _post(size: int, *, declared: int | None = None) -> bytes:
    n = size if declared is None else declared
    return (f"POST /x HTTP/1.1\r\nHost: t\r\nContent-Length: {n}\r\nConnection: close\r\n\r\n").encode() + b"a" * size


def test_body_within_the_limit_reaches_the_app_whole(server):
    out = _request(server, _post(1000))
    assert out.startswith(b"HTTP/1.1 200") and b'"size": 1000' in out and b'"more": false' in out


def test_declared_body_over_the_limit_is_413_before_reading(server):
    out = _request(server, _post(0, declared=10**9))
    assert out.startswith(b"HTTP/1.1 413") and b"expected at most 1000" in out


def test_chunked_body_over_the_limit_is_413(server):
    head = b"POST /x HTTP/1.1\r\nHost: t\r\nTransfer-Encoding: chunked\r\nConnection: close\r\n\r\n"
    chunk = b"%x\r\n%s\r\n" % (600, b"b" * 600)
    out = _request(server, head + chunk + chunk + b"0\r\n\r\n")
    assert out.startswith(b"HTTP/1.1 413")


def test_slow_body_is_408(server):
    with socket.create_connection(("127.0.0.1", server), timeout=5) as s:
        s.sendall(_post(10, declared=100))
        t0 = time.monotonic()
        out = s.recv(65536)
    assert out.startswith(b"HTTP/1.1 408")
    assert time.monotonic() - t0 < 4


def test_half_sent_heads_are_closed(server):
    """Slowloris: connections that never finish their request head are closed after header_timeout,
    so they cannot hold the server's connection slots."""
    socks = [socket.create_connection(("127.0.0.1", server), timeout=5) for _ in range(LIMITS.limit_concurrency)]
    try:
        for s in socks:
            s.sendall(b"POST /x HTTP/1.1\r\nHost: t\r\n")
        for s in socks:
            assert s.recv(1) == b""  # closed by the server (recv returns at EOF; timeout 5 s fails the test)
    finally:
        for s in socks:
            s.close()
    assert _request(server, _post(3)).startswith(b"HTTP/1.1 200")


def test_idle_connection_is_closed(server):
    with socket.create_connection(("127.0.0.1", server), timeout=5) as s:
        assert s.recv(1) == b""


@pytest.mark.parametrize("field,value", [("max_body_bytes", 0), ("body_timeout", -1.0), ("header_timeout", True),
                                         ("limit_concurrency", 1.5)])
def test_bad_limits_name_the_field(field, value):
    kwargs = {"max_body_bytes": 10, field: value}
    with pytest.raises(ValueError, match=field):
        ServerLimits(**kwargs)
