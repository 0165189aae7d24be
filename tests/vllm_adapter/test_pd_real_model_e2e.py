"""Disaggregated prefill/decode with the real model (SmolLM2-135M-Instruct): a prefiller and
a decoder share a ``redis-server``; a question about a long document (~1.3k tokens of the
Apache License 2.0) goes through both legs, streamed and not, and the decoder's answer is the
one server's answer, names Apache, and costs the decoder one computed prompt token."""

from __future__ import annotations

import pytest

from harness.openai_server import metric_value
from harness.real_model import RealModelUnavailable, real_model_dir
from lmcache.v1.testing_redis import RedisServer
from tests.vllm_adapter.test_pd_e2e import disaggregated, single, start_pd_servers
from tests.vllm_adapter.test_real_model_e2e import first_turn

pytestmark = [pytest.mark.vllm, pytest.mark.slow]


def test_real_model_answer_through_both_legs(tmp_path):
    try:
        model = real_model_dir()
    except RealModelUnavailable as exc:
        pytest.skip(f"the real model (SmolLM2-135M-Instruct) cannot be built: {exc}")
    redis = RedisServer().start()
    try:
        servers = start_pd_servers(model, tmp_path, redis.url, {"prefiller": "kv_producer", "decoder": "kv_consumer"})
        try:
            prefiller, decoder = servers
            path = "/v1/chat/completions"
            for stream in (False, True):
                body = {"model": "tiny", "messages": first_turn(), "max_tokens": 24, "temperature": 0, "stream": stream}
                if stream:
                    body["stream_options"] = {"include_usage": True}
                want = single(prefiller, path, body)
                assert "Apache" in want["text"], want
                assert disaggregated(prefiller, decoder, path, body) == want
            text = decoder.metrics()
            assert metric_value(text, "vllm:prompt_tokens_by_source_total", source="local_compute") == 2
            assert metric_value(text, "vllm:prompt_tokens_by_source_total", source="external_kv_transfer") == 2 * (
                want["prompt_tokens"] - 1
            )
        finally:
            for server in servers:
                server.stop()
    finally:
        redis.stop()
