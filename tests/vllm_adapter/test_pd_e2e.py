"""Disaggregated prefill/decode end to end, real processes: a ``redis-server``, a prefiller
and a decoder (two vLLM OpenAI servers with our connector, ``kv_producer`` /
``kv_consumer``, ``enable_pd``), on the tiny random-weight Llama.

Every request goes through both legs as a proxy sends them (the prefill leg with
``max_tokens`` 1 and ``do_remote_decode``; the decode leg with the parameters the
prefiller returned) and is compared with the same request served whole by one server
(the prefiller without transfer parameters computes everything itself, like a server
without cache): text, ``finish_reason`` and ``prompt_tokens`` identical, and the decoder
computes exactly one prompt token per request (vLLM's prompt-tokens-by-source counters).
"""

from __future__ import annotations

import json
import random
import time
import urllib.error
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import pytest

from harness.openai_server import DYNAMIC, OpenAIServer, metric_value
from lmcache.pd import signing
from lmcache.pd.proxy import Proxy, ProxyConfig
from tests.pd.test_proxy import Served
from tests.redis_fixtures import RedisServer

pytestmark = pytest.mark.vllm

WAIT = 3.0  # pd_wait_timeout of both servers
SECRET = "e2e-pd-secret-0123456789abcdef"  # pd_secret of the servers and the proxy
CHAT_TEMPLATE = "{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}assistant:"
SEND = {"do_remote_decode": True, "do_remote_prefill": False}
WORDS = ("cache", "token", "layer", "prefill", "decode", "chunk", "block", "store", "model", "engine",
         "request", "server", "vector", "tensor", "memory", "disk", "remote", "latency", "query", "answer")  # fmt: skip


def text_of(n_words: int, seed: int) -> str:
    rng = random.Random(seed)
    return " ".join(rng.choice(WORDS) for _ in range(n_words))


def post(url: str, path: str, body: dict[str, Any], timeout: float = 300) -> dict[str, Any]:
    req = urllib.request.Request(url + path, json.dumps(body).encode(), {"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=timeout) as r:
            return json.loads(r.read())
    except urllib.error.HTTPError as exc:
        raise AssertionError(f"{url}{path}: HTTP {exc.code}: {exc.read()[:2000]!r}") from None


def post_stream(url: str, path: str, body: dict[str, Any], timeout: float = 300) -> dict[str, Any]:
    """A streamed answer folded into the shape of a non-streamed one (text, finish_reason, usage)."""
    req = urllib.request.Request(url + path, json.dumps(body).encode(), {"Content-Type": "application/json"})
    text, finish, usage = [], None, None
    with urllib.request.urlopen(req, timeout=timeout) as r:
        for raw in r:
            line = raw.decode().strip()
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[len("data: ") :])
            assert "kv_transfer_params" not in chunk
            usage = chunk.get("usage") or usage
            for choice in chunk.get("choices") or ():
                text.append(choice.get("text") or (choice.get("delta") or {}).get("content") or "")
                finish = choice.get("finish_reason") or finish
    return {"text": "".join(text), "finish_reason": finish, "prompt_tokens": (usage or {}).get("prompt_tokens")}


def outcome(resp: dict[str, Any]) -> dict[str, Any]:
    choice = resp["choices"][0]
    text = choice.get("text") if "text" in choice else choice["message"]["content"]
    return {"text": text, "finish_reason": choice["finish_reason"], "prompt_tokens": resp["usage"]["prompt_tokens"]}


def request_body(kind: str, words: int, seed: int, stream: bool) -> tuple[str, dict[str, Any]]:
    body: dict[str, Any] = {"model": "tiny", "max_tokens": 12, "temperature": 0, "stream": stream}
    if stream:
        body["stream_options"] = {"include_usage": True}
    if kind == "chat":
        body["messages"] = [{"role": "user", "content": text_of(words, seed)}]
        body["chat_template"] = CHAT_TEMPLATE
        return "/v1/chat/completions", body
    body["prompt"] = text_of(words, seed)
    return "/v1/completions", body


def single(server: OpenAIServer, path: str, body: dict[str, Any]) -> dict[str, Any]:
    return post_stream(server.url, path, body) if body["stream"] else outcome(post(server.url, path, body))


def disaggregated(prefiller: OpenAIServer, decoder: OpenAIServer, path: str, body: dict[str, Any]) -> dict[str, Any]:
    """Both legs, as a proxy sends them (the decoder's parameters signed with the shared secret)."""
    leg = {k: v for k, v in body.items() if k != "stream_options"}
    leg.update(max_tokens=1, stream=False, kv_transfer_params=dict(SEND))
    params = post(prefiller.url, path, leg)["kv_transfer_params"]
    assert params["do_remote_prefill"] is True and params["remote_num_tokens"] > 0
    return single(decoder, path, dict(body, kv_transfer_params=signing.sign(params, SECRET, now=time.time())))


def start_pd_servers(model: Path, tmp: Path, redis_url: str, roles: dict[str, str]) -> list[OpenAIServer]:
    """One vLLM server per ``{name: kv_role}`` with ``enable_pd`` on ``redis_url``, started at once."""
    servers = []
    try:
        for name, role in roles.items():
            cfg = tmp / f"{name}.yaml"
            cfg.write_text(
                f"chunk_size: 256\nmax_local_cpu_size: 0.25\nremote_url: {redis_url}\nenable_pd: true\n"
                f"pd_wait_timeout: {WAIT}\nlog_summary_interval: 0\npd_secret: {SECRET}\n"
            )
            server = OpenAIServer(
                str(model),
                dict(DYNAMIC, kv_role=role),
                tmp / f"{name}.log",
                env={"LMCACHE_CONFIG_FILE": str(cfg), "VLLM_CPU_NUM_OF_RESERVED_CPU": "1"},
                extra_args=["--max-model-len", "2560", "--served-model-name", "tiny", "--trust-request-chat-template"],
            )
            servers.append(server.launch())
        for server in servers:
            server.wait_ready()
    except BaseException:
        for server in servers:
            server.stop()
        raise
    return servers


@pytest.fixture(scope="module")
def pd(tiny_llama_dir, tmp_path_factory):
    """(redis, prefiller, decoder, proxy): ``lmcache proxy``'s app served in this process."""
    tmp = tmp_path_factory.mktemp("pd")
    redis = RedisServer().start()
    try:
        servers = start_pd_servers(tiny_llama_dir, tmp, redis.url, {"prefiller": "kv_producer", "decoder": "kv_consumer"})
        proxy = Served(Proxy(ProxyConfig((servers[0].url,), (servers[1].url,), secret=SECRET)).app())
        try:
            yield redis, servers[0], servers[1], proxy
        finally:
            proxy.stop()
            for server in servers:
                server.stop()
    finally:
        redis.stop()


def routed(pd, route: str, path: str, body: dict[str, Any]) -> dict[str, Any]:
    """A request through both legs: sent by the test itself, or by the proxy."""
    _, prefiller, decoder, proxy = pd
    return disaggregated(prefiller, decoder, path, body) if route == "legs" else single(proxy, path, body)


CASES = [(kind, words, stream) for kind in ("completions", "chat") for words in (2, 68, 450)
         for stream in (False, True)]  # fmt: skip


@pytest.mark.parametrize("route", ["legs", "proxy"])
def test_both_legs_give_the_single_server_answer_and_the_decoder_computes_one_token(pd, route):
    _, prefiller, decoder, _ = pd
    before = decoder.metrics()
    prompt_tokens = []
    for i, (kind, words, stream) in enumerate(CASES):
        path, body = request_body(kind, words, i + (100 if route == "proxy" else 0), stream)
        want = single(prefiller, path, body)
        got = routed(pd, route, path, body)
        assert got == want, (kind, words, stream)
        prompt_tokens.append(want["prompt_tokens"])
    assert min(prompt_tokens) < 32 and max(prompt_tokens) > 1500  # shorter than a block .. ~2k tokens
    after = decoder.metrics()

    def by_source(text: str, source: str) -> float:
        return metric_value(text, "vllm:prompt_tokens_by_source_total", source=source)

    assert by_source(after, "local_compute") - by_source(before, "local_compute") == len(CASES)
    loaded = by_source(after, "external_kv_transfer") - by_source(before, "external_kv_transfer")
    assert loaded == sum(prompt_tokens) - len(CASES)
    assert "lmcache PD" not in decoder.log()  # no fallback, no mismatch
    received = metric_value(after, "lmcache_pd_received_requests_total") - metric_value(
        before, "lmcache_pd_received_requests_total"
    )
    assert received == len(CASES) and metric_value(after, "lmcache_pd_fallbacks_total") == 0
    if route == "proxy":
        proxied = urllib.request.urlopen(pd[3].url + "/metrics").read().decode()
        assert metric_value(proxied, "lmcache_proxy_prefill_fallbacks_total") == 0
    sent = prefiller.metrics()
    assert metric_value(sent, "lmcache_pd_sent_requests_total") >= len(CASES)
    assert metric_value(sent, "lmcache_dropped_writes_total") == 0  # every write reached Redis


@pytest.mark.parametrize("route", ["legs", "proxy"])
def test_eight_requests_at_once(pd, route):
    _, prefiller, decoder, _ = pd
    seed = 200 if route == "proxy" else 100
    cases = [request_body("completions" if i % 2 else "chat", 30 + 10 * i, seed + i, bool(i % 3)) for i in range(8)]
    want = [single(prefiller, path, body) for path, body in cases]
    with ThreadPoolExecutor(8) as pool:
        got = list(pool.map(lambda c: routed(pd, route, *c), cases))
    assert got == want
    assert "lmcache PD" not in decoder.log()


def test_a_prefiller_of_another_model_namespace_is_named_in_the_log(pd):
    """(Its chunk keys differ, so nothing of it could be found; the decoder does not wait.)"""
    _, prefiller, decoder, _ = pd
    path, body = request_body("completions", 80, 777, False)
    want = single(prefiller, path, body)
    leg = dict(body, max_tokens=1, kv_transfer_params=dict(SEND))
    params = post(prefiller.url, path, leg)["kv_transfer_params"]
    params["lmcache"]["namespace"] = "another-model"  # what a prefiller serving other weights announces
    params = signing.sign(params, SECRET, now=time.time())
    assert single(decoder, path, dict(body, kv_transfer_params=params)) == want  # no wait, a normal request
    assert "namespace: prefiller 'another-model' != decoder" in decoder.log()
    assert metric_value(decoder.metrics(), "lmcache_pd_fingerprint_mismatches_total") == 1


def test_redis_down_falls_back_to_computing_within_the_deadline(pd):
    redis, prefiller, decoder, _ = pd
    path, body = request_body("completions", 90, 999, False)
    want = single(prefiller, path, body)
    redis.stop()
    start = time.monotonic()
    got = disaggregated(prefiller, decoder, path, body)
    took = time.monotonic() - start
    assert got == want
    assert took < WAIT + 60  # bounded by pd_wait_timeout (plus compute), never a hang
    assert "lmcache PD" in decoder.log()  # the breaker opened on the first failed call: no wait, or a timeout
    assert metric_value(decoder.metrics(), "lmcache_pd_fallbacks_total") == 1


def test_a_client_of_the_decoder_cannot_make_it_wait(pd):
    """``do_remote_prefill`` sent straight to the decoder's API (unsigned, or signed for
    another prompt) is served at once as a normal request: same answer, counted, no wait."""
    _, prefiller, decoder, _ = pd
    path, body = request_body("completions", 70, 31337, False)
    want = single(prefiller, path, body)
    forged = {"do_remote_prefill": True, "remote_num_tokens": 10**6}
    before = decoder.metrics()
    assert single(decoder, path, dict(body, kv_transfer_params=forged)) == want
    after = decoder.metrics()
    for name, grew in (("lmcache_pd_refused_total", 1), ("lmcache_pd_waits_total", 0),
                       ("lmcache_pd_received_requests_total", 0)):  # fmt: skip
        assert metric_value(after, name) - metric_value(before, name) == grew, name



def test_prefiller_killed_the_proxy_sends_the_request_to_a_decoder_as_a_normal_one(pd):
    _, prefiller, _, proxy = pd
    path, body = request_body("chat", 50, 4242, True)
    want = single(prefiller, path, body)
    prefiller.stop()
    assert single(proxy, path, body) == want
    assert metric_value(urllib.request.urlopen(proxy.url + "/metrics").read().decode(), "lmcache_proxy_prefill_fallbacks_total") == 1
