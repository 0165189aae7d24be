"""``lmcache proxy`` (lmcache.pd) against fake prefiller and decoder servers, no vLLM.

Every server is real HTTP on 127.0.0.1 (uvicorn in a thread, port 0): fake OpenAI
servers that record what they are sent, and the proxy itself; the client is httpx.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import anyio
import httpx
import pytest
import uvicorn
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

from lmcache.cli import main
from lmcache.pd.proxy import PREFILL_PARAMS, Proxy, ProxyConfig
from lmcache.pd.sse import SSEFilter, strip_json_body

REPO = Path(__file__).resolve().parents[2]
DEADLINE = 10.0
AUTH = {"Authorization": "Bearer test-key"}
PARAMS = {"do_remote_prefill": True, "remote_num_tokens": 7, "lmcache": {"fingerprint": "abc"}}


def _compact(obj: Any) -> str:
    return json.dumps(obj, separators=(",", ":"))


def wait_for(cond, what: str, deadline: float = DEADLINE) -> None:
    """Poll ``cond()`` until it is true; fail after ``deadline`` seconds."""
    end = time.monotonic() + deadline
    while not cond():
        if time.monotonic() > end:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(0.01)


class Served:
    """``app`` served by uvicorn in a daemon thread on a free port of 127.0.0.1."""

    def __init__(self, app: Any) -> None:
        sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind(("127.0.0.1", 0))
        self.url = "http://127.0.0.1:%d" % sock.getsockname()[1]
        self.server = uvicorn.Server(uvicorn.Config(app, log_level="warning", lifespan="on"))
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


def closed_url() -> str:
    """A URL nothing listens on (connection refused)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return "http://127.0.0.1:%d" % s.getsockname()[1]


@dataclass
class Fake:
    """A fake vLLM OpenAI server; ``mode`` chooses how it answers completion requests."""

    name: str
    mode: str = "ok"  # ok | 500 | no_params | hang (until gate is set)
    healthy: bool = True
    calls: list[dict[str, Any]] = field(default_factory=list)
    gate: threading.Event | None = None  # a stream waits for it after its first event
    served: Served | None = None

    # what this fake answers, so tests can compare byte for byte
    def completion(self, chat: bool) -> dict[str, Any]:
        key = "message" if chat else "text"
        value: Any = {"role": "assistant", "content": f"hi from {self.name}"} if chat else f"hi from {self.name}"
        return {"id": "cmpl-1", "object": "chat.completion" if chat else "text_completion",
                "choices": [{"index": 0, key: value, "finish_reason": "length"}],
                "usage": {"prompt_tokens": 3, "completion_tokens": 2, "total_tokens": 5},
                "kv_transfer_params": dict(PARAMS) if self.mode == "ok" else None}

    def events(self, chat: bool) -> list[bytes]:
        out = []
        for i, piece in enumerate(("hi ", "from ", self.name)):
            delta = {"delta": {"content": piece}} if chat else {"text": piece}
            chunk: dict[str, Any] = {"id": "cmpl-1", "choices": [{"index": 0, **delta}]}
            if i == 2:
                chunk["kv_transfer_params"] = {"leak": True}
            out.append(f"data: {_compact(chunk)}\n\n".encode())
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
            self.calls.append({"path": request.url.path, "headers": dict(request.headers), "body": body})
            if self.mode == "hang":
                assert self.gate is not None and await anyio.to_thread.run_sync(self.gate.wait, DEADLINE)
            if self.mode == "500":
                return JSONResponse({"error": {"message": f"{self.name} broke", "code": 500}}, status_code=500)
            if body.get("stream"):
                events = self.events(chat)

                async def gen():
                    yield events[0]
                    if self.gate is not None:
                        assert await anyio.to_thread.run_sync(self.gate.wait, DEADLINE)
                    for e in events[1:]:
                        yield e

                return StreamingResponse(gen(), media_type="text/event-stream")
            answer = self.completion(chat)
            if self.mode == "no_params":
                del answer["kv_transfer_params"]
            return Response(_compact(answer), media_type="application/json")

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


@pytest.fixture
def fakes() -> Iterator[dict[str, Fake]]:
    made = {name: Fake(name).start() for name in ("p1", "p2", "d1", "d2")}
    yield made
    stop_all([f.served for f in made.values() if f.served is not None])


@pytest.fixture
def make_proxy() -> Iterator[Any]:
    started: list[Served] = []
    clients: list[httpx.Client] = []

    def make(
        prefill: list[str], decode: list[str], health_interval: float = 3600.0, timeout: float = DEADLINE
    ) -> tuple[Proxy, httpx.Client]:
        proxy = Proxy(ProxyConfig(tuple(prefill), tuple(decode), health_interval=health_interval, timeout=timeout))
        served = Served(proxy.app())
        started.append(served)
        clients.append(httpx.Client(base_url=served.url, timeout=DEADLINE))
        return proxy, clients[-1]

    yield make
    for c in clients:
        c.close()
    stop_all(started)


REQUESTS = {
    "completions": ("/v1/completions", {"model": "tiny", "prompt": "hello there", "max_tokens": 16, "n": 1}),
    "chat": ("/v1/chat/completions", {"model": "tiny", "messages": [{"role": "user", "content": "hello"}],
                                      "max_tokens": 16, "max_completion_tokens": 16}),
}


def metric(client: httpx.Client, line_prefix: str) -> float:
    for line in client.get("/metrics").text.splitlines():
        if line.startswith(line_prefix + " "):
            return float(line.rsplit(" ", 1)[1])
    raise AssertionError(f"{line_prefix} not in /metrics")


# ------------------------------------------------------------------ the two legs
@pytest.mark.parametrize("stream", [False, True], ids=["json", "sse"])
@pytest.mark.parametrize("kind", ["completions", "chat"])
def test_prefill_then_decode(fakes, make_proxy, kind, stream):
    path, body = REQUESTS[kind]
    body = {**body, "stream": stream, "kv_transfer_params": {"from": "client"}}
    if stream:
        body["stream_options"] = {"include_usage": True}
    p1, d1 = fakes["p1"], fakes["d1"]
    _, client = make_proxy([p1.url], [d1.url])
    if stream:
        d1.gate = threading.Event()
        with client.stream("POST", path, json=body, headers=AUTH) as resp:
            assert resp.status_code == 200 and resp.headers["content-type"].startswith("text/event-stream")
            chunks = resp.iter_raw()
            got = b""
            while b"\n\n" not in got:  # the first event arrives while the decoder holds the rest back
                got += next(chunks)
            d1.gate.set()
            got += b"".join(chunks)
        sse = SSEFilter()
        expected = b"".join(sse.feed(e) for e in d1.events(kind == "chat"))
        assert got == expected and b"kv_transfer_params" not in got
        assert b'"content":"hi "' in got or b'"text":"hi "' in got
        request_id = resp.headers["x-request-id"]
    else:
        resp = client.post(path, json=body, headers=AUTH)
        assert resp.status_code == 200
        expected = d1.completion(kind == "chat")
        del expected["kv_transfer_params"]
        assert resp.json() == expected
        request_id = resp.headers["x-request-id"]
    # prefill leg
    (pcall,) = p1.calls
    pb = pcall["body"]
    assert pcall["path"] == path and pb["max_tokens"] == 1 and pb["stream"] is False
    assert "stream_options" not in pb and pb["kv_transfer_params"] == PREFILL_PARAMS
    if kind == "chat":
        assert pb["max_completion_tokens"] == 1 and pb["messages"] == body["messages"]
    else:
        assert pb["prompt"] == body["prompt"] and pb["n"] == 1
    assert pcall["headers"]["x-request-id"] == request_id and pcall["headers"]["authorization"] == AUTH["Authorization"]
    # decode leg: the client's body, the prefiller's params
    (dcall,) = d1.calls
    assert dcall["body"] == {**body, "kv_transfer_params": PARAMS}
    assert dcall["headers"]["x-request-id"] == request_id and dcall["headers"]["authorization"] == AUTH["Authorization"]
    outcome = f'lmcache_proxy_requests_total{{endpoint="{"chat_completions" if kind == "chat" else "completions"}",outcome="ok"}}'
    assert metric(client, outcome) == 1
    assert metric(client, "lmcache_proxy_prefill_seconds_count") == 1
    assert metric(client, "lmcache_proxy_ttfb_seconds_count") == 1
    assert metric(client, "lmcache_proxy_e2e_seconds_count") == 1


# ------------------------------------------------------------------ fallbacks
@pytest.mark.parametrize("cause", ["no_prefiller", "status", "no_params"])
def test_prefill_failure_falls_back_to_a_plain_decode(fakes, make_proxy, cause):
    p1, d1 = fakes["p1"], fakes["d1"]
    prefill_url = closed_url() if cause == "no_prefiller" else p1.url
    p1.mode = {"status": "500", "no_params": "no_params"}.get(cause, "ok")
    proxy, client = make_proxy([prefill_url], [d1.url])
    path, body = REQUESTS["completions"]
    for _ in range(2):
        resp = client.post(path, json=body)
        assert resp.status_code == 200 and resp.json()["choices"][0]["text"] == "hi from d1"
    assert [c["body"] for c in d1.calls] == [body, body]  # no kv_transfer_params
    assert metric(client, 'lmcache_proxy_requests_total{endpoint="completions",outcome="ok"}') == 2
    if cause == "status":  # a 5xx takes the prefiller out of rotation until its next good health check
        assert len(p1.calls) == 1 and proxy.prefill.down_urls() == [p1.url]
        assert metric(client, 'lmcache_proxy_prefill_fallbacks_total{cause="status"}') == 1
        assert metric(client, 'lmcache_proxy_prefill_fallbacks_total{cause="no_prefiller"}') == 1
    else:
        assert metric(client, f'lmcache_proxy_prefill_fallbacks_total{{cause="{cause}"}}') == 2


def test_prefill_connection_error(fakes, make_proxy):
    """A prefiller that passed its health check and then went away: cause "connect"."""
    p1, d1 = fakes["p1"], fakes["d1"]
    proxy, client = make_proxy([p1.url], [d1.url])
    assert proxy.prefill.down_urls() == []
    assert p1.served is not None
    p1.served.stop()
    resp = client.post("/v1/completions", json=REQUESTS["completions"][1])
    assert resp.status_code == 200 and "kv_transfer_params" not in d1.calls[0]["body"]
    assert metric(client, 'lmcache_proxy_prefill_fallbacks_total{cause="connect"}') == 1
    assert proxy.prefill.down_urls() == [p1.url]


def test_prefill_timeout(fakes, make_proxy):
    p1, d1 = fakes["p1"], fakes["d1"]
    p1.mode, p1.gate = "hang", threading.Event()
    proxy, client = make_proxy([p1.url], [d1.url], timeout=0.5)
    try:
        resp = client.post("/v1/completions", json=REQUESTS["completions"][1])
    finally:
        p1.gate.set()
    assert resp.status_code == 200 and "kv_transfer_params" not in d1.calls[0]["body"]
    assert metric(client, 'lmcache_proxy_prefill_fallbacks_total{cause="timeout"}') == 1
    assert proxy.prefill.down_urls() == [p1.url]


# ------------------------------------------------------------------ routing
def test_round_robin(fakes, make_proxy):
    ps, ds = [fakes["p1"], fakes["p2"]], [fakes["d1"], fakes["d2"]]
    _, client = make_proxy([p.url for p in ps], [d.url for d in ds])
    texts = [client.post(*REQUESTS["completions"][:1], json=REQUESTS["completions"][1]).json()["choices"][0]["text"]
             for _ in range(4)]
    assert sorted(texts) == ["hi from d1", "hi from d1", "hi from d2", "hi from d2"]
    assert [len(f.calls) for f in ps + ds] == [2, 2, 2, 2]


@pytest.mark.parametrize("stream", [False, True], ids=["json", "sse"])
def test_failed_decoder_is_retried_on_another_and_marked_down(fakes, make_proxy, stream):
    d1, d2 = fakes["d1"], fakes["d2"]
    d1.mode = "500"
    proxy, client = make_proxy([fakes["p1"].url], [d1.url, d2.url])
    body = {**REQUESTS["completions"][1], "stream": stream}
    for _ in range(2):
        resp = client.post("/v1/completions", json=body)
        assert resp.status_code == 200 and b"hi " in resp.content
    assert len(d1.calls) == 1 and len(d2.calls) == 2
    assert d2.calls[0]["body"]["kv_transfer_params"] == PARAMS
    assert d2.calls[0]["headers"]["x-request-id"] == d1.calls[0]["headers"]["x-request-id"]
    assert proxy.decode.down_urls() == [d1.url]


def test_decoder_gone_is_retried_on_another(fakes, make_proxy):
    d1, d2 = fakes["d1"], fakes["d2"]
    proxy, client = make_proxy([fakes["p1"].url], [d1.url, d2.url])
    assert d1.served is not None
    d1.served.stop()  # passed its health check, then went away
    resp = client.post("/v1/completions", json={**REQUESTS["completions"][1], "stream": True})
    assert resp.status_code == 200 and b"d2" in resp.content and len(d2.calls) == 1
    assert proxy.decode.down_urls() == [d1.url]


def test_decoder_errors_reach_the_client(fakes, make_proxy):
    d1 = fakes["d1"]
    d1.mode = "500"
    _, client = make_proxy([fakes["p1"].url], [d1.url, closed_url()])
    resp = client.post("/v1/completions", json=REQUESTS["completions"][1])  # the only decoder up fails
    assert resp.status_code == 500 and resp.json()["error"]["message"] == "d1 broke"
    resp = client.post("/v1/completions", json=REQUESTS["completions"][1])  # now none is up
    assert resp.status_code == 503 and "no decode instance" in resp.json()["error"]["message"]
    assert metric(client, 'lmcache_proxy_requests_total{endpoint="completions",outcome="error"}') == 1
    assert metric(client, 'lmcache_proxy_requests_total{endpoint="completions",outcome="unavailable"}') == 1
    resp = client.post("/v1/completions", content=b"[1, 2]")
    assert resp.status_code == 400


def test_health_reflects_the_instances(fakes, make_proxy):
    d1 = fakes["d1"]
    dead = closed_url()
    _, client = make_proxy([fakes["p1"].url], [d1.url, dead], health_interval=0.05)
    resp = client.get("/health")
    assert resp.status_code == 200 and resp.json()["decode"] == {"up": [d1.url], "down": [dead]}
    assert metric(client, f'lmcache_proxy_instance_up{{role="decode",url="{dead}"}}') == 0
    d1.healthy = False
    wait_for(lambda: client.get("/health").status_code == 503, "/health 503 with every decoder down")
    assert client.get("/health").json()["decode"]["down"] == [d1.url, dead]
    d1.healthy = True
    wait_for(lambda: client.get("/health").status_code == 200, "/health 200 again")


def test_models_is_forwarded_to_a_decoder(fakes, make_proxy):
    _, client = make_proxy([fakes["p1"].url], [fakes["d1"].url])
    resp = client.get("/v1/models")
    assert resp.status_code == 200 and resp.json()["data"][0] == {"id": "tiny", "owned_by": "d1"}
    assert metric(client, 'lmcache_proxy_requests_total{endpoint="models",outcome="ok"}') == 1


def test_client_leaving_mid_stream(fakes, make_proxy):
    """A client that leaves mid-stream: the proxy stops waiting for the decoder at once."""
    d1 = fakes["d1"]
    d1.gate = threading.Event()
    _, client = make_proxy([fakes["p1"].url], [d1.url])
    key = 'lmcache_proxy_requests_total{endpoint="completions",outcome="disconnected"}'
    try:
        with client.stream("POST", "/v1/completions", json={**REQUESTS["completions"][1], "stream": True}) as resp:
            assert next(resp.iter_raw()).startswith(b"data: ")
        wait_for(lambda: key in client.get("/metrics").text, "the disconnect counted")
    finally:
        d1.gate.set()
    assert metric(client, key) == 1


@pytest.mark.parametrize("leg", ["prefill", "decode"])
def test_client_leaving_before_the_answer(fakes, make_proxy, leg):
    """A client that leaves while a leg runs: the proxy gives the request up at once."""
    waiting = fakes["p1"] if leg == "prefill" else fakes["d1"]
    waiting.mode, waiting.gate = "hang", threading.Event()
    _, client = make_proxy([fakes["p1"].url], [fakes["d1"].url])
    key = 'lmcache_proxy_requests_total{endpoint="completions",outcome="disconnected"}'
    try:
        with pytest.raises(httpx.ReadTimeout):
            client.post("/v1/completions", json=REQUESTS["completions"][1], timeout=0.3)
        wait_for(lambda: key in client.get("/metrics").text, "the disconnect counted")
    finally:
        waiting.gate.set()
    assert metric(client, key) == 1 and len(fakes["d1"].calls) == (leg == "decode")


def test_cli_serves(tmp_path):
    """``python -m lmcache proxy`` starts, checks its servers and answers /health (503: none is up)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")])))
    log = (tmp_path / "proxy.log").open("w+")
    proc = subprocess.Popen(
        [sys.executable, "-m", "lmcache", "proxy", "--prefill", closed_url(), "--decode", closed_url(),
         "--port", str(port), "--health-interval", "0.5"],
        stdout=log, stderr=subprocess.STDOUT, env=env,
    )
    try:
        def answered() -> bool:
            assert proc.poll() is None, "the proxy exited"
            try:
                return httpx.get(f"http://127.0.0.1:{port}/health", timeout=1).status_code == 503
            except httpx.TransportError:
                return False

        wait_for(answered, "the proxy's /health", deadline=60)
    finally:
        proc.terminate()
        proc.wait(DEADLINE)
    log.seek(0)
    assert "lmcache proxy: prefill http://127.0.0.1:" in log.read()


# ------------------------------------------------------------------ stripping
def test_strip_helpers():
    assert strip_json_body(b'{"a":1,"kv_transfer_params":{"x":2}}') == b'{"a":1}'
    assert strip_json_body(b'{"a": 1}') == b'{"a": 1}'  # untouched bytes when there is nothing to strip
    assert strip_json_body(b"kv_transfer_params not json") == b"kv_transfer_params not json"
    sse = SSEFilter()
    stream = b'data: {"a":1}\r\n\r\ndata: {"b":2,"kv_transfer_params":null}\n\ndata: [DONE]\n\n'
    out = b"".join(sse.feed(stream[i:i + 5]) for i in range(0, len(stream), 5)) + sse.flush()
    assert out == b'data: {"a":1}\r\n\r\ndata: {"b":2}\n\ndata: [DONE]\n\n'
    assert sse.feed(b'data: {"c":3') == b"" and sse.flush() == b'data: {"c":3'


# ------------------------------------------------------------------ CLI
@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--prefill", "ftp://p:1", "--decode", "http://d:1"], "--prefill: 'ftp://p:1'"),
        (["--prefill", "http://p:1", "--decode", "d:1"], "--decode: 'd:1'"),
        (["--prefill", "http://p:1", "--decode", "http://d:99999"], "--decode: 'http://d:99999': invalid port"),
        (["--prefill", "http://p:1"], "--decode"),
        (["--prefill", "http://p:1", "--decode", "http://d:1", "--timeout", "-1"], "--timeout: '-1'"),
        (["--prefill", "http://p:1", "--decode", "http://d:1", "--health-interval", "x"], "--health-interval: 'x'"),
        (["--prefill", "http://p:1", "--decode", "http://d:1", "--port", "70000"], "--port: '70000'"),
    ],
)
def test_bad_flags_exit_2(capsys, argv, message):
    with pytest.raises(SystemExit) as exc:
        main(["proxy", *argv])
    assert exc.value.code == 2 and message in capsys.readouterr().err


def test_duplicate_url_exits_2(capsys):
    assert main(["proxy", "--prefill", "http://p:1", "--decode", "http://d:1", "http://d:1/"]) == 2
    assert "--decode: 'http://d:1' given twice" in capsys.readouterr().err
