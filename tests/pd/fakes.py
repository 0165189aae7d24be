"""Fake prefiller and decoder servers for the ``lmcache proxy`` tests, and the proxy served.

Every server is real HTTP on 127.0.0.1: :class:`Fake` (a FastAPI app under uvicorn in a
thread) records what it is sent; :class:`RawDecoder` (a bare asyncio server in a thread)
streams SSE and can be killed mid-stream (every connection reset). The proxy is served
as ``lmcache proxy`` serves it: behind :class:`lmcache.http_server.BodyLimit`, with the
server limits of its config.
"""

from __future__ import annotations

import asyncio
import json
import socket
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import anyio
import uvicorn
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

from lmcache.http_server import BodyLimit, ServerLimits, uvicorn_config
from lmcache.pd import signing
from lmcache.pd.proxy import Proxy, ProxyConfig

DEADLINE = 10.0
SECRET = "test-pd-secret-0123456789abcdef"
PROMPT_TOKENS = [101, 102, 103, 7]
PARAMS = {"do_remote_prefill": True, "remote_num_tokens": 7, "lmcache": {"fingerprint": "abc"},
          "prompt_digest": signing.prompt_digest(PROMPT_TOKENS)}
"""What a fake prefiller answers (a real one: the digest of the prompt it computed)."""


def compact(obj: Any) -> str:
    return json.dumps(obj, separators=(",", ":"))


def wait_for(cond: Callable[[], bool], what: str, deadline: float = DEADLINE) -> None:
    """Poll ``cond()`` until it is true; fail after ``deadline`` seconds."""
    end = time.monotonic() + deadline
    while not cond():
        if time.monotonic() > end:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(0.01)


def free_socket() -> socket.socket:
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind(("127.0.0.1", 0))
    return sock


class Served:
    """``app`` served by uvicorn in a daemon thread on a free port of 127.0.0.1; with
    ``limits``, as :func:`lmcache.http_server.serve` serves it (header deadline, limits)."""

    def __init__(self, app: Any, limits: ServerLimits | None = None) -> None:
        sock = free_socket()
        self.url = "http://127.0.0.1:%d" % sock.getsockname()[1]
        if limits is None:
            config = uvicorn.Config(app, log_level="warning", lifespan="on")
        else:
            config = uvicorn_config(app, host="127.0.0.1", port=0, limits=limits, log_level="warning")
        self.server = uvicorn.Server(config)
        self.thread = threading.Thread(target=self.server.run, kwargs={"sockets": [sock]}, daemon=True)
        self.thread.start()
        wait_for(lambda: self.server.started or not self.thread.is_alive(), "server start")
        assert self.server.started, "server failed to start"

    def stop(self) -> None:
        self.server.should_exit = True
        self.thread.join(DEADLINE)


def stop_all(served: list[Served]) -> None:
    """Stop several servers at once (each takes a tenth of a second to notice)."""
    for s in served:
        s.server.should_exit = True
    for s in served:
        s.thread.join(DEADLINE)


def serve_proxy(config: ProxyConfig) -> tuple[Proxy, Served]:
    """``Proxy(config)`` served as ``lmcache proxy`` serves it."""
    proxy = Proxy(config)
    limits = config.server_limits()
    return proxy, Served(BodyLimit(proxy.app(), limits, proxy.error_body), limits)


def closed_url() -> str:
    """A URL nothing listens on (connection refused)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return "http://127.0.0.1:%d" % s.getsockname()[1]


@dataclass
class Fake:
    """A fake vLLM OpenAI server; ``mode`` chooses how it answers completion requests:
    ok | 500 | no_params | unsigned (params without prompt_digest) | hang (until ``gate``
    is set) | no_done (a stream that ends without [DONE]) | break (a stream that breaks off
    after its first event). ``modes``: modes for the next requests, used up first."""

    name: str
    mode: str = "ok"
    modes: list[str] = field(default_factory=list)
    healthy: bool = True
    calls: list[dict[str, Any]] = field(default_factory=list)
    arrivals: threading.Semaphore = field(default_factory=lambda: threading.Semaphore(0))
    gate: threading.Event | None = None  # a stream waits for it after its first event
    served: Served | None = None

    # what this fake answers, so tests can compare byte for byte
    def completion(self, chat: bool, mode: str = "ok") -> dict[str, Any]:
        key = "message" if chat else "text"
        value: Any = {"role": "assistant", "content": f"hi from {self.name}"} if chat else f"hi from {self.name}"
        params: Any = None
        if mode == "ok":
            params = dict(PARAMS)
        elif mode == "unsigned":
            params = {k: v for k, v in PARAMS.items() if k != "prompt_digest"}
        return {"id": "cmpl-1", "object": "chat.completion" if chat else "text_completion",
                "choices": [{"index": 0, key: value, "finish_reason": "length"}],
                "usage": {"prompt_tokens": 3, "completion_tokens": 2, "total_tokens": 5},
                "kv_transfer_params": params}

    def events(self, chat: bool) -> list[bytes]:
        out = []
        for i, piece in enumerate(("hi ", "from ", self.name)):
            delta = {"delta": {"content": piece}} if chat else {"text": piece}
            chunk: dict[str, Any] = {"id": "cmpl-1", "choices": [{"index": 0, **delta}]}
            if i == 2:
                chunk["kv_transfer_params"] = {"leak": True}
            out.append(f"data: {compact(chunk)}\n\n".encode())
        out.append(b"data: [DONE]\n\n")
        return out

    def app(self) -> FastAPI:
        app = FastAPI()

        @app.get("/health")
        async def health() -> Response:
            return Response(status_code=200 if self.healthy else 503)

        @app.get("/v1/models")
        async def models() -> Response:
            return JSONResponse({"object": "list", "data": [{"id": "tiny", "owned_by": self.name}]})

        async def generate(request: Request, chat: bool) -> Response:
            body = await request.json()
            mode = self.modes.pop(0) if self.modes else self.mode
            self.calls.append({"path": request.url.path, "headers": dict(request.headers), "body": body})
            self.arrivals.release()
            if mode == "hang":
                assert self.gate is not None and await anyio.to_thread.run_sync(self.gate.wait, DEADLINE)
            if mode == "500":
                return JSONResponse({"error": {"message": f"{self.name} broke", "code": 500}}, status_code=500)
            if body.get("stream"):
                events = self.events(chat)
                if mode == "no_done":
                    events = events[:-1]

                async def gen():
                    yield events[0]
                    if mode == "break":
                        raise RuntimeError(f"{self.name} broke off mid-stream")
                    if self.gate is not None:
                        assert await anyio.to_thread.run_sync(self.gate.wait, DEADLINE)
                    for e in events[1:]:
                        yield e

                return StreamingResponse(gen(), media_type="text/event-stream")
            answer = self.completion(chat, mode)
            if mode == "no_params":
                del answer["kv_transfer_params"]
            return Response(compact(answer), media_type="application/json")

        @app.post("/v1/completions")
        async def completions(request: Request) -> Response:
            return await generate(request, chat=False)

        @app.post("/v1/chat/completions")
        async def chat(request: Request) -> Response:
            return await generate(request, chat=True)

        return app

    def start(self) -> Fake:
        self.served = Served(self.app())
        return self

    @property
    def url(self) -> str:
        assert self.served is not None
        return self.served.url


class RawDecoder:
    """A fake decoder on a bare asyncio server in its own thread, so that :meth:`kill` can
    reset every connection mid-stream (uvicorn would wait for its streams to end).

    ``GET /health``: 200. ``POST``: an SSE stream of ``events`` events then ``[DONE]``
    (chunked, keep-alive). While :attr:`hold` is true a stream stops after its first event
    until :meth:`release`. ``streams``: streams started. Connections are kept alive.
    """

    def __init__(self, name: str, events: int = 4) -> None:
        self.name = name
        self.events = events
        self.hold = False
        self.streams = 0
        self._writers: set[asyncio.StreamWriter] = set()
        self._tasks: set[asyncio.Task[None]] = set()
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, daemon=True)
        self._thread.start()
        self._released = self._call(self._make_event)
        self._server = self._call(lambda: asyncio.start_server(self._handle, "127.0.0.1", 0))
        self.url = "http://127.0.0.1:%d" % self._server.sockets[0].getsockname()[1]

    async def _make_event(self) -> asyncio.Event:
        return asyncio.Event()

    def _call(self, make: Callable[[], Any]) -> Any:
        return asyncio.run_coroutine_threadsafe(make(), self._loop).result(DEADLINE)

    def release(self) -> None:
        """Let the held streams (and later ones) go on."""
        self._loop.call_soon_threadsafe(self._released.set)

    def kill(self) -> None:
        """Stop listening and reset every connection (streams in flight break off)."""

        async def kill() -> None:
            self._server.close()
            for w in list(self._writers):
                w.transport.abort()
            for t in list(self._tasks):
                t.cancel()

        self._call(kill)

    def stop(self) -> None:
        self.kill()
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(DEADLINE)

    def _sse(self) -> list[bytes]:
        out = [f"data: {compact({'id': 'cmpl-raw', 'choices': [{'index': 0, 'text': f'{self.name}-{i} '}]})}\n\n"
               .encode() for i in range(self.events)]
        return [*out, b"data: [DONE]\n\n"]

    async def _handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self._writers.add(writer)
        task = asyncio.current_task()
        assert task is not None
        self._tasks.add(task)
        try:
            while True:
                head = await reader.readuntil(b"\r\n\r\n")
                lines = head.decode("latin-1").split("\r\n")
                method = lines[0].split(" ", 1)[0]
                headers = {k.strip().lower(): v.strip() for k, _, v in (ln.partition(":") for ln in lines[1:] if ln)}
                await reader.readexactly(int(headers.get("content-length", "0")))
                if method == "GET":
                    writer.write(b"HTTP/1.1 200 OK\r\nContent-Length: 0\r\n\r\n")
                    await writer.drain()
                    continue
                self.streams += 1
                writer.write(b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\nTransfer-Encoding: chunked\r\n\r\n")
                for i, event in enumerate(self._sse()):
                    writer.write(b"%x\r\n%s\r\n" % (len(event), event))
                    await writer.drain()
                    if i == 0 and self.hold:
                        await self._released.wait()
                writer.write(b"0\r\n\r\n")
                await writer.drain()
        except (asyncio.IncompleteReadError, ConnectionError):
            pass
        finally:
            self._writers.discard(writer)
            self._tasks.discard(task)
            writer.close()
