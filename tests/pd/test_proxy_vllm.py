"""``lmcache proxy`` in front of real vLLM servers: a prefiller (kv_producer) and a decoder
(kv_consumer) sharing a real ``redis-server``. The decoder loads every prompt from the
remote tier (all but its last token) and answers exactly what a plain request gets."""

from __future__ import annotations

import json

import httpx
import pytest

from lmcache.pd.proxy import Proxy, ProxyConfig
from harness.openai_server import DYNAMIC, OpenAIServer, metric_value
from tests.pd.test_proxy import Served

pytestmark = [pytest.mark.vllm, pytest.mark.slow]


def _server(model: str, role: str, redis_url: str, tmp_path) -> OpenAIServer:
    extra = {
        "lmcache.chunk_size": 32,
        "lmcache.max_local_cpu_size": 0.25,
        "lmcache.remote_url": redis_url,
        "lmcache.enable_pd": True,
        "lmcache.pd_wait_timeout": 30,
    }
    ktc = {**DYNAMIC, "kv_role": role, "kv_connector_extra_config": extra}
    return OpenAIServer(model, ktc, tmp_path / f"{role}.log")


def test_prefill_on_one_server_decode_on_another(tiny_llama_dir, redis_server, tmp_path):
    model = str(tiny_llama_dir)
    prefiller = _server(model, "kv_producer", redis_server.url, tmp_path)
    decoder = _server(model, "kv_consumer", redis_server.url, tmp_path)
    served = None
    try:
        prefiller.start()
        decoder.start()
        served = Served(Proxy(ProxyConfig((prefiller.url,), (decoder.url,))).app())
        client = httpx.Client(base_url=served.url, timeout=300)
        body = {"model": model, "max_tokens": 12, "temperature": 0}

        def plain(prompt: str) -> str:
            resp = httpx.post(f"{prefiller.url}/v1/completions", json={**body, "prompt": prompt}, timeout=300)
            return resp.json()["choices"][0]["text"]

        prompt = " ".join(f"word{i}" for i in range(100))
        resp = client.post("/v1/completions", json={**body, "prompt": prompt})
        answer = resp.json()
        assert resp.status_code == 200 and "kv_transfer_params" not in answer
        prompt_tokens = [answer["usage"]["prompt_tokens"]]

        prompt2 = " ".join(f"tok{i}" for i in range(80))
        stream = {**body, "prompt": prompt2, "stream": True, "stream_options": {"include_usage": True}}
        with client.stream("POST", "/v1/completions", json=stream) as s:
            assert s.status_code == 200
            events = [json.loads(line[6:]) for line in s.iter_lines() if line.startswith("data: {")]
        text2 = "".join(e["choices"][0]["text"] for e in events if e["choices"])
        prompt_tokens.append(events[-1]["usage"]["prompt_tokens"])

        assert answer["choices"][0]["text"] == plain(prompt) and text2 == plain(prompt2)
        hits = metric_value(decoder.metrics(), "lmcache_hit_tokens_total", tier="remote")
        assert hits == sum(n - 1 for n in prompt_tokens)  # every prompt but its last token, from the prefiller
        metrics = client.get("/metrics").text
        assert metric_value(metrics, "lmcache_proxy_prefill_fallbacks_total") == 0
        assert metric_value(metrics, "lmcache_proxy_requests_total", endpoint="completions", outcome="ok") == 2
    finally:
        if served is not None:
            served.stop()
        prefiller.stop()
        decoder.stop()
