"""RoPE re-rotation: moving cached keys equals computing them at the new positions."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from lmcache.v1.blend.rope import RopeSpec, UnsupportedRope, rerotate_with_tables

SPEC = RopeSpec.from_base(64, 10000.0)


@settings(max_examples=60, deadline=None)
@given(
    old=st.lists(st.integers(0, 131072), min_size=1, max_size=8),
    delta=st.integers(-65536, 65536),
    base=st.sampled_from([10000.0, 100000.0, 1000000.0]),
    seed=st.integers(0, 2**16),
)
def test_rerotation_equals_direct_computation_at_new_positions(old, delta, base, seed):
    spec = RopeSpec.from_base(64, base)
    old_pos = torch.tensor(old)
    new_pos = (old_pos + delta).clamp(min=0)
    raw = torch.randn(len(old), 3, 64, generator=torch.Generator().manual_seed(seed))
    moved = spec.rerotate(spec.apply(raw, old_pos), old_pos, new_pos)
    torch.testing.assert_close(moved, spec.apply(raw, new_pos), rtol=0, atol=4e-6)


def test_shift_and_tables_agree_with_rerotate():
    raw = torch.randn(10, 2, 64)
    keys = SPEC.apply(raw, torch.arange(10))
    torch.testing.assert_close(SPEC.shift(keys, 1234), SPEC.apply(raw, torch.arange(1234, 1244)), rtol=0, atol=4e-6)
    co, so = (t[:, 0, :] for t in SPEC.cos_sin(torch.arange(10)))
    cn, sn = (t[:, 0, :] for t in SPEC.cos_sin(torch.arange(500, 510)))
    torch.testing.assert_close(rerotate_with_tables(keys, co, so, cn, sn), SPEC.apply(raw, torch.arange(500, 510)))
    half = [t[:, :32] for t in (co, so, cn, sn)]  # tables of head_dim / 2 (a vLLM-style cache)
    torch.testing.assert_close(rerotate_with_tables(keys, *half), SPEC.apply(raw, torch.arange(500, 510)))


def test_apply_matches_transformers_llama():
    from transformers import LlamaConfig
    from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding, apply_rotary_pos_emb

    cfg = LlamaConfig(hidden_size=256, num_attention_heads=4, head_dim=64, rope_theta=500000.0)
    spec = RopeSpec.from_hf_config(cfg)
    pos = torch.arange(0, 512, 7)
    x = torch.randn(1, 4, pos.shape[0], 64)  # HF layout [batch, heads, tokens, dim]
    cos, sin = LlamaRotaryEmbedding(cfg)(x, pos[None])
    hf, _ = apply_rotary_pos_emb(x, x, cos, sin)
    ours = spec.apply(x[0].transpose(0, 1), pos).transpose(0, 1)[None]
    torch.testing.assert_close(ours, hf, rtol=0, atol=1e-4)


@pytest.mark.parametrize(
    "params",
    [
        {"rope_type": "linear", "factor": 2.0, "rope_theta": 10000.0},
        {"rope_type": "llama3", "factor": 8.0, "rope_theta": 500000.0},
        {"rope_type": "yarn", "factor": 4.0, "rope_theta": 10000.0},
        {"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.5},
    ],
)
def test_unsupported_rope_variants_raise(params):
    from types import SimpleNamespace

    cfg = SimpleNamespace(rope_parameters=params, hidden_size=64, num_attention_heads=2, head_dim=32)
    with pytest.raises(UnsupportedRope, match="(?i)rope"):
        RopeSpec.from_hf_config(cfg)


def test_legacy_rope_fields_are_read():
    from types import SimpleNamespace

    ok = SimpleNamespace(rope_theta=1e6, rope_scaling=None, hidden_size=128, num_attention_heads=4)
    assert RopeSpec.from_hf_config(ok).head_dim == 32
    scaled = SimpleNamespace(rope_theta=1e4, rope_scaling={"type": "dynamic", "factor": 2.0}, hidden_size=64,
                             num_attention_heads=2)
    with pytest.raises(UnsupportedRope):
        RopeSpec.from_hf_config(scaled)
    partial = SimpleNamespace(rope_theta=1e4, partial_rotary_factor=0.25, hidden_size=64, num_attention_heads=2)
    with pytest.raises(UnsupportedRope):
        RopeSpec.from_hf_config(partial)


def test_bad_arguments():
    with pytest.raises(ValueError):
        RopeSpec.from_base(63, 10000.0)
    with pytest.raises(ValueError):
        SPEC.apply(torch.zeros(3, 1, 64), torch.arange(4))
    with pytest.raises(ValueError):
        SPEC.rerotate(torch.zeros(3, 1, 64), torch.arange(3), torch.arange(4))
