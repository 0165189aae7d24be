"""Shared pieces of the blending tests: a tiny random Llama (in memory, float32) and a RAG-like
prompt whose documents were prefilled on their own."""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

import torch

from lmcache.v1.blend import CachedSegmentKV, ReusedKV, Segment, assemble, full_prefill, split_segments
from lmcache.v1.blend.hf_llama import HFLlamaBlendModel

SEP = [7, 8, 7]
"""Separator token ids (stands for the tokenized " # # ")."""


def tiny_llama(num_layers: int = 4, seed: int = 0) -> torch.nn.Module:
    """A random-weight Llama small enough to run every test on a CPU in well under a second."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    cfg = LlamaConfig(
        vocab_size=256,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=num_layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        max_position_embeddings=4096,
        rope_theta=10000.0,
    )
    return LlamaForCausalLM(cfg).to(torch.float32).eval()


@dataclass(frozen=True, slots=True, eq=False)
class Scenario:
    """``prefix`` (uncached) + docs joined by SEP + SEP + question (uncached)."""

    ids: torch.Tensor
    segments: list[Segment]
    reused: ReusedKV
    prefix_len: int


def rag_prompt(
    model: HFLlamaBlendModel, doc_lens: tuple[int, ...] = (40, 30, 50), prefix_len: int = 5, seed: int = 1
) -> Scenario:
    """Documents prefilled alone (positions 0..), placed after an uncached prefix, re-rotated."""
    gen = torch.Generator().manual_seed(seed)

    def rnd(n: int) -> list[int]:
        return torch.randint(10, 256, (n,), generator=gen).tolist()

    prompt = rnd(prefix_len)
    docs = [rnd(n) for n in doc_lens]
    for doc in docs:
        prompt += doc + SEP
    prompt += rnd(12)
    segments = split_segments(prompt, SEP)
    cached = []
    start = prefix_len
    for doc in docs:
        kv = full_prefill(model, torch.tensor(doc))
        cached.append(CachedSegmentKV(start, kv.keys, kv.values))
        start += len(doc) + len(SEP)
    return Scenario(torch.tensor(prompt), segments, assemble(len(prompt), cached, model.rope), prefix_len)


def vllm_child_env(repo: Path) -> dict[str, str]:
    """Environment of a child process that starts vLLM (one process, offline, one thread,
    blending on), without the caller's ``LMCACHE_*`` variables."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("LMCACHE_")}
    env.update(
        HF_HUB_OFFLINE="1",
        TRANSFORMERS_OFFLINE="1",
        VLLM_ENABLE_V1_MULTIPROCESSING="0",
        VLLM_CPU_NUM_OF_RESERVED_CPU="1",
        VLLM_CPU_KVCACHE_SPACE="1",
        OMP_NUM_THREADS="1",
        LMCACHE_ENABLE_BLENDING="1",
        PYTHONPATH=os.pathsep.join(filter(None, [str(repo), os.environ.get("PYTHONPATH")])),
    )
    return env
