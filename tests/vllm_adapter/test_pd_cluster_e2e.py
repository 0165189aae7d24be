"""Disaggregated prefill/decode over a Redis Cluster: two prefillers and two decoders (four
vLLM servers, tiny model) share one 3-master cluster; every prefiller/decoder pairing gives
the single-server answer with one prompt token computed on the decoder."""

from __future__ import annotations

import pytest

from harness.openai_server import metric_value
from tests.vllm_adapter.test_pd_e2e import disaggregated, request_body, single, start_pd_servers

pytestmark = [pytest.mark.vllm, pytest.mark.slow]


def test_two_prefillers_and_two_decoders_share_one_cluster(tiny_llama_dir, redis_cluster, tmp_path):
    roles = {"p0": "kv_producer", "p1": "kv_producer", "d0": "kv_consumer", "d1": "kv_consumer"}
    servers = start_pd_servers(tiny_llama_dir, tmp_path, redis_cluster.url, roles)
    try:
        prefillers, decoders = servers[:2], servers[2:]
        for i in range(4):
            path, body = request_body("completions" if i % 2 else "chat", 60 + 20 * i, 500 + i, bool(i % 2))
            want = single(prefillers[0], path, body)
            got = disaggregated(prefillers[i % 2], decoders[(i // 2) % 2], path, body)
            assert got == want, i
        for decoder in decoders:
            text = decoder.metrics()
            assert metric_value(text, "vllm:prompt_tokens_by_source_total", source="local_compute") == 2
            assert metric_value(text, "lmcache_pd_fallbacks_total") == 0
            assert "lmcache PD" not in decoder.log()
    finally:
        for server in servers:
            server.stop()
