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
from pathlib import Path
from typing import Any

import httpx
import pytest

from lmcache.cli import main
from lmcache.pd import signing
from lmcache.pd.proxy import PREFILL_PARAMS, Proxy, ProxyConfig
from lmcache.pd.sse import SSEFilter, strip_json_body
from tests.pd.fakes import (
    DEADLINE,
    PARAMS,
    PROMPT_TOKENS,
    SECRET,
    Fake,
    Served,  # noqa: F401 - tests/vllm_adapter/test_pd_e2e.py imports it from here
    closed_url,
    serve_proxy,
    stop_all,
    wait_for,
)

REPO = Path(__file__).resolve().parents[2]
AUTH = {"Authorization": "Bearer test-key"}


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
        prefill: list[str], decode: list[str], health_interval: float = 3600.0, timeout: float = DEADLINE,
        **options: Any,
    ) -> tuple[Proxy, httpx.Client]:
        config = ProxyConfig(tuple(prefill), tuple(decode), health_interval=health_interval, timeout=timeout,
                             secret=SECRET, **options)
        proxy, served = serve_proxy(config)
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
    # decode leg: the client's body, the prefiller's params signed by the proxy
    (dcall,) = d1.calls
    dparams = dcall["body"]["kv_transfer_params"]
    assert dcall["body"] == {**body, "kv_transfer_params": dparams}
    assert {k: v for k, v in dparams.items() if k != signing.SIGNATURE_KEY} == PARAMS
    assert signing.verify(dparams, SECRET, PROMPT_TOKENS, now=time.time()).ok
    assert not signing.verify(dparams, "another-secret-0123456789", PROMPT_TOKENS, now=time.time()).ok
    assert dparams[signing.SIGNATURE_KEY]["expires"] > time.time() + signing.DEFAULT_TTL_S - 60
    assert dcall["headers"]["x-request-id"] == request_id and dcall["headers"]["authorization"] == AUTH["Authorization"]
    outcome = f'lmcache_proxy_requests_total{{endpoint="{"chat_completions" if kind == "chat" else "completions"}",outcome="ok"}}'
    assert metric(client, outcome) == 1
    assert metric(client, "lmcache_proxy_prefill_seconds_count") == 1
    assert metric(client, "lmcache_proxy_ttfb_seconds_count") == 1
    assert metric(client, "lmcache_proxy_e2e_seconds_count") == 1


# ------------------------------------------------------------------ fallbacks
@pytest.mark.parametrize("cause", ["no_prefiller", "status", "no_params", "unsigned"])
def test_prefill_failure_falls_back_to_a_plain_decode(fakes, make_proxy, cause):
    p1, d1 = fakes["p1"], fakes["d1"]
    prefill_url = closed_url() if cause == "no_prefiller" else p1.url
    p1.mode = {"status": "500", "no_params": "no_params", "unsigned": "unsigned"}.get(cause, "ok")
    proxy, client = make_proxy([prefill_url], [d1.url])
    path, body = REQUESTS["completions"]
    for _ in range(2):
        resp = client.post(path, json=body)
        assert resp.status_code == 200 and resp.json()["choices"][0]["text"] == "hi from d1"
    assert [c["body"] for c in d1.calls] == [body, body]  # no kv_transfer_params
    assert metric(client, 'lmcache_proxy_requests_total{endpoint="completions",outcome="ok"}') == 2
    assert metric(client, f'lmcache_proxy_prefill_fallbacks_total{{cause="{cause}"}}') == 2
    if cause != "no_prefiller":  # a failed request never takes the prefiller out of rotation
        assert len(p1.calls) == 2 and proxy.prefill.down_urls() == []


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
    assert proxy.prefill.down_urls() == []  # until its health check fails


def test_prefill_timeout(fakes, make_proxy):
    """The prefill leg has its own (short) timeout, not the decode leg's."""
    p1, d1 = fakes["p1"], fakes["d1"]
    p1.mode, p1.gate = "hang", threading.Event()
    proxy, client = make_proxy([p1.url], [d1.url], timeout=DEADLINE * 3, prefill_timeout=0.3)
    try:
        resp = client.post("/v1/completions", json=REQUESTS["completions"][1])
    finally:
        p1.gate.set()
    assert resp.status_code == 200 and "kv_transfer_params" not in d1.calls[0]["body"]
    assert metric(client, 'lmcache_proxy_prefill_fallbacks_total{cause="timeout"}') == 1
    assert proxy.prefill.down_urls() == []


# ------------------------------------------------------------------ limits
def _body_of_size(size: int) -> bytes:
    """A completion request of exactly ``size`` bytes."""
    head = b'{"model":"tiny","max_tokens":4,"prompt":"'
    out = head + b"x" * (size - len(head) - 2) + b'"}'
    assert len(out) == size
    return out


def test_body_over_the_limit_is_413_and_reaches_no_server(fakes, make_proxy):
    p1, d1 = fakes["p1"], fakes["d1"]
    proxy, client = make_proxy([p1.url], [d1.url], max_body_bytes=4096)
    resp = client.post("/v1/completions", content=_body_of_size(4096))
    assert resp.status_code == 200 and len(p1.calls) == len(d1.calls) == 1
    resp = client.post("/v1/completions", content=_body_of_size(4097))
    assert resp.status_code == 413
    assert resp.json() == {"error": {"message": "body: 4097 bytes; expected at most 4096",
                                     "type": "invalid_request_error", "code": 413}}
    chunks = [_body_of_size(5000)[i:i + 1000] for i in range(0, 5000, 1000)]
    resp = client.post("/v1/chat/completions", content=iter(chunks))  # chunked: no Content-Length
    assert resp.status_code == 413 and resp.json()["error"]["code"] == 413
    port = int(client.base_url.port or 0)
    with socket.create_connection(("127.0.0.1", port), timeout=DEADLINE) as s:  # 150 MB announced, none sent
        s.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: t\r\nContent-Length: 157286400\r\n\r\n")
        assert s.recv(65536).startswith(b"HTTP/1.1 413")
    assert len(p1.calls) == len(d1.calls) == 1
    assert metric(client, 'lmcache_proxy_rejected_total{reason="body_too_large"}') == 3


def test_requests_over_max_concurrency_get_503(fakes, make_proxy):
    """Beyond --max-concurrency requests in flight (a stream counts until its end): 503 with
    Retry-After, no server asked; /health and /metrics still answer."""
    p1, d1 = fakes["p1"], fakes["d1"]
    d1.modes, d1.gate = ["ok", "hang"], threading.Event()
    proxy, client = make_proxy([p1.url], [d1.url], max_concurrency=2)
    path, body = REQUESTS["completions"]
    with client.stream("POST", path, json={**body, "stream": True}) as streamed:
        chunks = streamed.iter_raw()
        assert next(chunks).startswith(b"data: ")  # the decoder holds the rest back
        waiting = threading.Thread(target=lambda: results.append(client.post(path, json=body)))
        results: list[httpx.Response] = []
        waiting.start()
        assert d1.arrivals.acquire(timeout=DEADLINE) and d1.arrivals.acquire(timeout=DEADLINE)
        resp = client.post(path, json=body)
        assert resp.status_code == 503 and resp.headers["retry-after"] == "1"
        assert resp.json()["error"]["type"] == "service_unavailable" and resp.json()["error"]["code"] == 503
        assert client.get("/v1/models").status_code == 503
        assert client.get("/health").status_code == 200
        assert metric(client, "lmcache_proxy_in_flight") == 2
        assert metric(client, 'lmcache_proxy_rejected_total{reason="overloaded"}') == 2
        assert len(p1.calls) == len(d1.calls) == 2
        d1.gate.set()
        rest = b"".join(chunks)
    waiting.join(DEADLINE)
    assert rest.endswith(b"data: [DONE]\n\n") and results[0].status_code == 200
    resp = client.post(path, json=body)  # both finished: room again
    assert resp.status_code == 200 and proxy.in_flight == 0


# ------------------------------------------------------------------ routing
def test_round_robin(fakes, make_proxy):
    ps, ds = [fakes["p1"], fakes["p2"]], [fakes["d1"], fakes["d2"]]
    _, client = make_proxy([p.url for p in ps], [d.url for d in ds])
    texts = [client.post(*REQUESTS["completions"][:1], json=REQUESTS["completions"][1]).json()["choices"][0]["text"]
             for _ in range(4)]
    assert sorted(texts) == ["hi from d1", "hi from d1", "hi from d2", "hi from d2"]
    assert [len(f.calls) for f in ps + ds] == [2, 2, 2, 2]


@pytest.mark.parametrize("stream", [False, True], ids=["json", "sse"])
def test_failed_decoder_is_retried_on_another_and_stays_up(fakes, make_proxy, stream):
    d1, d2 = fakes["d1"], fakes["d2"]
    d1.mode = "500"
    proxy, client = make_proxy([fakes["p1"].url], [d1.url, d2.url])
    body = {**REQUESTS["completions"][1], "stream": stream}
    for _ in range(2):
        resp = client.post("/v1/completions", json=body)
        assert resp.status_code == 200 and b"hi " in resp.content
    assert len(d1.calls) == 2 and len(d2.calls) == 2  # d1 is still tried: only its health check takes it out
    assert d2.calls[0]["body"]["kv_transfer_params"] == d1.calls[0]["body"]["kv_transfer_params"]
    assert d2.calls[0]["headers"]["x-request-id"] == d1.calls[0]["headers"]["x-request-id"]
    assert proxy.decode.down_urls() == []


def test_decoder_gone_is_retried_on_another(fakes, make_proxy):
    d1, d2 = fakes["d1"], fakes["d2"]
    proxy, client = make_proxy([fakes["p1"].url], [d1.url, d2.url])
    assert d1.served is not None
    d1.served.stop()  # passed its health check, then went away: connection refused, nothing sent
    resp = client.post("/v1/completions", json={**REQUESTS["completions"][1], "stream": True})
    assert resp.status_code == 200 and b"d2" in resp.content and len(d2.calls) == 1
    assert resp.content.endswith(b"data: [DONE]\n\n")
    assert proxy.decode.down_urls() == []  # until its health check fails


def test_decoder_errors_reach_the_client(fakes, make_proxy):
    d1 = fakes["d1"]
    d1.mode = "500"
    _, client = make_proxy([fakes["p1"].url], [d1.url, closed_url()], health_interval=0.05)
    for _ in range(2):  # the only decoder up fails, and stays in rotation
        resp = client.post("/v1/completions", json=REQUESTS["completions"][1])
        assert resp.status_code == 500 and resp.json()["error"]["message"] == "d1 broke"
    assert metric(client, 'lmcache_proxy_requests_total{endpoint="completions",outcome="error"}') == 2
    d1.healthy = False  # only a failed health check takes it out
    wait_for(lambda: client.get("/health").status_code == 503, "d1's failed health check")
    resp = client.post("/v1/completions", json=REQUESTS["completions"][1])
    assert resp.status_code == 503 and "no decode instance" in resp.json()["error"]["message"]
    assert metric(client, 'lmcache_proxy_requests_total{endpoint="completions",outcome="unavailable"}') == 1
    resp = client.post("/v1/completions", content=b"[1, 2]")
    assert resp.status_code == 400


def test_one_bad_request_does_not_take_the_decoders_down(fakes, make_proxy):
    """A request that makes every decoder answer 500: the next ordinary request is served."""
    d1, d2 = fakes["d1"], fakes["d2"]
    d1.modes, d2.modes = ["500"], ["500"]
    proxy, client = make_proxy([fakes["p1"].url], [d1.url, d2.url])
    resp = client.post("/v1/completions", json=REQUESTS["completions"][1])
    assert resp.status_code == 500 and len(d1.calls) == len(d2.calls) == 1
    resp = client.post("/v1/completions", json=REQUESTS["completions"][1])
    assert resp.status_code == 200 and resp.json()["choices"][0]["text"] == "hi from d1"
    assert proxy.decode.down_urls() == [] and client.get("/health").status_code == 200


def test_decode_timeout_is_504_and_not_run_again(fakes, make_proxy):
    """A non-streaming decode that times out may have generated: 504, not re-run on another decoder."""
    d1, d2 = fakes["d1"], fakes["d2"]
    d1.mode, d1.gate = "hang", threading.Event()
    proxy, client = make_proxy([fakes["p1"].url], [d1.url, d2.url], timeout=0.3)
    try:
        resp = client.post("/v1/completions", json=REQUESTS["completions"][1])
    finally:
        d1.gate.set()
    assert resp.status_code == 504 and resp.json()["error"]["code"] == 504
    assert len(d1.calls) == 1 and d2.calls == [] and proxy.decode.down_urls() == []
    resp = client.post("/v1/completions", json=REQUESTS["completions"][1])  # round robin: d2
    assert resp.status_code == 200 and len(d2.calls) == 1


def _events(raw: bytes) -> list[bytes]:
    return [e for e in raw.split(b"\n\n") if e.strip()]


@pytest.mark.parametrize("mode", ["break", "no_done"])
def test_a_stream_cut_short_ends_with_an_error_event(fakes, make_proxy, mode):
    """A decoder that dies mid-stream (or ends it without [DONE]): the client's stream ends
    with an SSE error event, never a [DONE]."""
    d1 = fakes["d1"]
    d1.mode = mode
    proxy, client = make_proxy([fakes["p1"].url], [d1.url])
    resp = client.post("/v1/completions", json={**REQUESTS["completions"][1], "stream": True})
    assert resp.status_code == 200
    events = _events(resp.content)
    assert b"data: [DONE]" not in events and events[0].startswith(b"data: {")
    last = json.loads(events[-1].removeprefix(b"data: "))
    assert last["error"]["type"] == "upstream_error" and last["error"]["code"] == 502
    assert metric(client, 'lmcache_proxy_requests_total{endpoint="completions",outcome="stream_error"}') == 1
    assert proxy.decode.down_urls() == []


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
    env[signing.SECRET_ENV] = SECRET
    log = (tmp_path / "proxy.log").open("w+")
    proc = subprocess.Popen(
        [sys.executable, "-m", "lmcache", "proxy", "--prefill", closed_url(), "--decode", closed_url(),
         "--port", str(port), "--health-interval", "0.5", "--max-body-bytes", "1000"],
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
        resp = httpx.post(f"http://127.0.0.1:{port}/v1/completions", content=b"x" * 1001, timeout=DEADLINE)
        assert resp.status_code == 413 and resp.json()["error"]["code"] == 413
    finally:
        proc.terminate()
        proc.wait(DEADLINE)
    log.seek(0)
    text = log.read()
    assert "lmcache proxy: prefill http://127.0.0.1:" in text and "PD secret from $LMCACHE_PD_SECRET" in text
    assert SECRET not in text


@pytest.fixture
def served_by_cli(monkeypatch) -> Iterator[dict[str, Any]]:
    """``lmcache proxy`` run in-process up to the point where it would serve: what it would serve."""
    seen: dict[str, Any] = {}

    def fake_serve(app: Any, **kwargs: Any) -> None:
        seen.update(kwargs, app=app)

    def not_this_way(*args: Any, **kwargs: Any) -> None:
        raise AssertionError("the proxy must be served by lmcache.http_server.serve (limits)")

    monkeypatch.setattr("lmcache.http_server.serve", fake_serve)
    monkeypatch.setattr("uvicorn.run", not_this_way)
    monkeypatch.delenv(signing.SECRET_ENV, raising=False)
    yield seen


def test_cli_without_a_secret_exits_2(served_by_cli, capsys):
    assert main(["proxy", "--prefill", "http://p:1", "--decode", "http://d:1"]) == 2
    err = capsys.readouterr().err
    assert "--pd-secret-file" in err and "$LMCACHE_PD_SECRET" in err and len(err.strip().splitlines()) == 1
    assert served_by_cli == {}


def test_cli_secret_file_and_limits(served_by_cli, tmp_path, capsys):
    secret_file = tmp_path / "pd.secret"
    secret_file.write_text(SECRET + "\n")
    secret_file.chmod(0o644)
    argv = ["proxy", "--prefill", "http://p:1", "--decode", "http://d:1", "--pd-secret-file", str(secret_file)]
    assert main(argv) == 2  # readable by others
    assert "chmod 600" in capsys.readouterr().err and served_by_cli == {}
    secret_file.chmod(0o600)
    assert main([*argv, "--max-concurrency", "8", "--max-body-bytes", "1000", "--prefill-timeout", "2",
                 "--pd-sign-ttl", "60"]) == 0
    limits = served_by_cli["limits"]
    assert limits.max_body_bytes == 1000 and limits.limit_concurrency > 8
    assert served_by_cli["error_body"](413, "too big") == {
        "error": {"message": "too big", "type": "invalid_request_error", "code": 413}}
    proxy = served_by_cli["error_body"].__self__
    assert proxy.config.secret == SECRET and SECRET not in repr(proxy.config)
    assert (proxy.config.max_concurrency, proxy.config.prefill_timeout, proxy.config.sign_ttl) == (8, 2.0, 60.0)


def test_cli_defaults(served_by_cli, monkeypatch):
    monkeypatch.setenv(signing.SECRET_ENV, SECRET)
    assert main(["proxy", "--prefill", "http://p:1", "--decode", "http://d:1"]) == 0
    config = served_by_cli["error_body"].__self__.config
    assert (config.timeout, config.prefill_timeout, config.max_concurrency, config.max_body_bytes, config.sign_ttl) == (
        600.0, 30.0, 256, 8 << 20, signing.DEFAULT_TTL_S)
    monkeypatch.setenv(signing.SECRET_ENV, "short")
    assert main(["proxy", "--prefill", "http://p:1", "--decode", "http://d:1"]) == 2


def test_config_checks_its_fields():
    urls = (("http://p:1",), ("http://d:1",))
    for field_name, value in [("prefill_timeout", 0), ("max_concurrency", 0), ("max_concurrency", 1.5),
                              ("max_body_bytes", -1), ("sign_ttl", 7200.0), ("timeout", True)]:
        with pytest.raises(ValueError, match=f"{field_name}="):
            ProxyConfig(*urls, secret=SECRET, **{field_name: value})
    with pytest.raises(ValueError, match="at least 16"):
        ProxyConfig(*urls, secret="short")
    with pytest.raises(TypeError, match="secret"):
        ProxyConfig(*urls, secret=None)  # type: ignore[arg-type]
    with pytest.raises(TypeError):
        ProxyConfig(*urls)  # type: ignore[call-arg] # the secret is required


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


def test_sse_end_of_stream():
    sse = SSEFilter()
    assert sse.feed(b'data: {"a":1}\n\ndata: [DO') == b'data: {"a":1}\n\n' and not sse.done
    assert sse.feed(b"NE]\r\n") == b"data: [DONE]\r\n" and sse.done
    event = b'data: {"error":{"message":"gone","type":"upstream_error","code":502}}\n\n'
    cut = SSEFilter()
    assert cut.feed(b'data: {"a":1}\n\n') and cut.error_event("gone", 502) == event
    cut = SSEFilter()  # broke off inside an event: it is ended first, its unterminated tail dropped
    assert cut.feed(b'data: {"a":1}\ndata: {"b"') == b'data: {"a":1}\n'
    assert cut.error_event("gone", 502) == b"\n" + event and cut.flush() == b""
    assert not cut.done
    other = SSEFilter()
    assert other.feed(b"data: [DONE] x\n") == b"data: [DONE] x\n" and not other.done


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
        (["--prefill", "http://p:1", "--decode", "http://d:1", "--prefill-timeout", "0"], "--prefill-timeout: '0'"),
        (["--prefill", "http://p:1", "--decode", "http://d:1", "--max-concurrency", "0"], "--max-concurrency: '0'"),
        (["--prefill", "http://p:1", "--decode", "http://d:1", "--max-body-bytes", "1k"], "--max-body-bytes: '1k'"),
        (["--prefill", "http://p:1", "--decode", "http://d:1", "--pd-sign-ttl", "4000"], "--pd-sign-ttl: '4000'"),
    ],
)
def test_bad_flags_exit_2(capsys, argv, message):
    with pytest.raises(SystemExit) as exc:
        main(["proxy", *argv])
    assert exc.value.code == 2 and message in capsys.readouterr().err


def test_duplicate_url_exits_2(capsys):
    assert main(["proxy", "--prefill", "http://p:1", "--decode", "http://d:1", "http://d:1/"]) == 2
    assert "--decode: 'http://d:1' given twice" in capsys.readouterr().err
