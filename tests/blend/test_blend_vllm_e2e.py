"""Blending end to end through vLLM's OpenAI server (real processes, tiny random Llama).

The server runs our connector with ``enable_blending`` (vLLM's prefix caching off). Four
documents are sent alone (each is cached as a segment); then prompts hold them in other
orders after a new prefix. The blended prompts must be served without errors, with the
documents' tokens really reused (lmcache's Prometheus counters, and vLLM's cached-token
count: every prompt token but the last came from the connector), and with the KV of
the reused documents never stored as an exact prefix.
"""

from __future__ import annotations

import json
import random
import urllib.request
from pathlib import Path
from typing import Any

import pytest

from harness.openai_server import DYNAMIC, OpenAIServer, metric_value

pytestmark = [pytest.mark.vllm, pytest.mark.slow]

SEPARATOR = " # # "
DOC_TOKENS = 300


def post(url: str, body: dict[str, Any]) -> dict[str, Any]:
    req = urllib.request.Request(url + "/v1/completions", json.dumps(body).encode(), {"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=300) as r:
        return json.loads(r.read())


def complete(server: OpenAIServer, ids: list[int], max_tokens: int = 8) -> dict[str, Any]:
    return post(server.url, {"model": "tiny", "prompt": ids, "max_tokens": max_tokens, "temperature": 0})


@pytest.fixture(scope="module")
def tiny() -> Path:
    from harness.vllm_utils import tiny_model_path, vllm_available

    if not vllm_available():
        pytest.skip("vllm is not installed")
    return tiny_model_path()


@pytest.fixture(scope="module")
def separator(tiny) -> list[int]:
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(tiny)).encode(SEPARATOR, add_special_tokens=False)


@pytest.fixture(scope="module", params=[False, True], ids=["sync", "async"])
def server(tiny, tmp_path_factory, request):
    """Blending on; ``async``: with ``enable_async_loading`` (a blend runs while the request waits)."""
    tmp = tmp_path_factory.mktemp("blend-e2e")
    cfg = tmp / "lmcache.yaml"
    cfg.write_text(
        "chunk_size: 64\nmax_local_cpu_size: 0.25\nenable_blending: true\nblend_special_str: \" # # \"\n"
        "blend_recompute_ratios: 0.15\nblend_check_layers: 1\nblend_min_tokens: 256\nlog_summary_interval: 0\n"
        f"enable_async_loading: {str(request.param).lower()}\n"
    )
    srv = OpenAIServer(
        str(tiny), DYNAMIC, tmp / "server.log",
        env={"LMCACHE_CONFIG_FILE": str(cfg), "VLLM_CPU_NUM_OF_RESERVED_CPU": "1"},
        extra_args=["--max-model-len", "2560", "--served-model-name", "tiny"],
    ).start()  # fmt: skip
    yield srv
    srv.stop()


def documents(separator: list[int]) -> list[list[int]]:
    rng = random.Random(7)
    avoid = set(separator)
    return [[rng.choice([t for t in range(3, 1000) if t not in avoid]) for _ in range(DOC_TOKENS)] for _ in range(4)]


def counters(server: OpenAIServer) -> dict[str, float]:
    text = server.metrics()
    names = ("requests", "reused_tokens", "recomputed_tokens", "failures", "stored_segment_tokens")
    return {n: metric_value(text, f"lmcache_blend_{n}_total") for n in names}


def test_reordered_documents_are_reused_through_vllm(server, separator):
    docs = documents(separator)
    for doc in docs:  # each document alone, ended by the separator: cached as a segment
        assert complete(server, doc + separator, max_tokens=1)["choices"][0]["finish_reason"] in ("length", "stop")
    before = counters(server)
    assert before["stored_segment_tokens"] >= 0.95 * 4 * DOC_TOKENS  # from each document's second word on
    rng = random.Random(3)
    for i, order in enumerate(([2, 0, 3, 1], [1, 3, 0, 2])):
        ids = [rng.randrange(3, 1000) for _ in range(11)]  # a new prefix each time
        for d in order:
            ids += separator + docs[d]
        ids += separator + [rng.randrange(3, 1000) for _ in range(9)]
        resp = complete(server, ids)
        assert resp["choices"][0]["text"] is not None and resp["usage"]["prompt_tokens"] == len(ids)
        details = resp["usage"].get("prompt_tokens_details") or {}
        assert details.get("cached_tokens") == len(ids) - 1, details  # all but the last token from lmcache
        now = counters(server)
        assert now["requests"] - before["requests"] == 1 and now["failures"] == 0
        reused = now["reused_tokens"] - before["reused_tokens"]
        assert reused >= 0.8 * 4 * DOC_TOKENS, (i, reused)
        assert reused + now["recomputed_tokens"] - before["recomputed_tokens"] == len(ids) - 1
        before = now
    asynchronous = metric_value(server.metrics(), "lmcache_async_loads_total")
    config = Path(server.env["LMCACHE_CONFIG_FILE"]).read_text()
    assert asynchronous == (2 if "enable_async_loading: true" in config else 0)
    assert "Traceback" not in server.log()
