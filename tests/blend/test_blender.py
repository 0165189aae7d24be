"""Selective recompute on a tiny random Llama (float32, CPU): ratio 1 is a full prefill, ratio 0
keeps the cached KV, and more recomputation never moves the KV further from a full prefill."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from lmcache.v1.blend import BlendConfig, CachedSegmentKV, ReusedKV, assemble, blend, deviation, full_prefill
from lmcache.v1.blend.blender import _budget
from lmcache.v1.blend.hf_llama import HFLlamaBlendModel
from tests.blend.helpers import rag_prompt, tiny_llama

REAL_MODEL = Path(__file__).resolve().parents[2] / "models" / "smollm2-135m"


@pytest.fixture(scope="module")
def hf_model() -> torch.nn.Module:
    return tiny_llama()


@pytest.fixture(scope="module")
def model(hf_model) -> HFLlamaBlendModel:
    return HFLlamaBlendModel(hf_model)


def hf_prefill(hf_model, ids: torch.Tensor):
    with torch.no_grad():
        return hf_model(ids[None], use_cache=True)


def greedy(hf_model, cache, first: int, steps: int) -> list[int]:
    """``steps`` greedy tokens after ``first``, decoding on ``cache`` (an HF cache object)."""
    out, tok = [first], first
    with torch.no_grad():
        for _ in range(steps - 1):
            res = hf_model(torch.tensor([[tok]]), past_key_values=cache, use_cache=True)
            cache = res.past_key_values
            tok = int(res.logits[0, -1].argmax())
            out.append(tok)
    return out


def test_full_prefill_matches_transformers(hf_model, model):
    ids = torch.randint(10, 256, (64,), generator=torch.Generator().manual_seed(3))
    ours, hf = full_prefill(model, ids), hf_prefill(hf_model, ids)
    for li, layer in enumerate(hf.past_key_values.layers):
        torch.testing.assert_close(ours.keys[li], layer.keys[0].transpose(0, 1), rtol=0, atol=1e-5)
        torch.testing.assert_close(ours.values[li], layer.values[0].transpose(0, 1), rtol=0, atol=1e-5)
    torch.testing.assert_close(ours.logits, hf.logits[0, -1], rtol=0, atol=1e-5)


def test_ratio_one_reproduces_a_full_prefill_and_its_decode(hf_model, model):
    from transformers import DynamicCache

    sc = rag_prompt(model)
    res = blend(model, sc.ids, sc.reused, BlendConfig((1.0,), (1,)))
    hf = hf_prefill(hf_model, sc.ids)
    err = 0.0
    for li, layer in enumerate(hf.past_key_values.layers):
        err = max(err, float((res.keys[li] - layer.keys[0].transpose(0, 1)).abs().max()))
        err = max(err, float((res.values[li] - layer.values[0].transpose(0, 1)).abs().max()))
    assert err < 1e-4
    assert int(res.logits.argmax()) == int(hf.logits[0, -1].argmax())
    assert bool(res.recomputed.all())

    cache = DynamicCache()
    for li, (k, v) in enumerate(zip(res.keys, res.values)):
        cache.update(k.transpose(0, 1)[None].contiguous(), v.transpose(0, 1)[None].contiguous(), li)
    blended = greedy(hf_model, cache, int(res.logits.argmax()), 32)
    reference = greedy(hf_model, hf.past_key_values, int(hf.logits[0, -1].argmax()), 32)
    assert blended == reference


def test_ratio_zero_keeps_cached_kv_and_recomputes_the_rest(model):
    sc = rag_prompt(model)
    check = 1
    # rows without cached KV hold NaN: any use of them would poison the result
    keys = [torch.where(sc.reused.mask[:, None, None], k, torch.nan) for k in sc.reused.keys]
    values = [torch.where(sc.reused.mask[:, None, None], v, torch.nan) for v in sc.reused.values]
    reused = ReusedKV(sc.reused.mask, keys, values)
    res = blend(model, sc.ids, reused, BlendConfig((0.0,), (check,)))
    ref = full_prefill(model, sc.ids)

    expected = ~sc.reused.mask
    expected[-1] = True
    assert torch.equal(res.recomputed, expected)  # prefix, separators, question, last token
    assert int(expected[: sc.prefix_len].sum()) == sc.prefix_len
    for li in range(len(res.keys)):
        assert bool(torch.isfinite(res.keys[li]).all() and torch.isfinite(res.values[li]).all())
        if li <= check:  # every token ran through these layers
            torch.testing.assert_close(res.keys[li], ref.keys[li], rtol=0, atol=1e-5)
        else:
            kept = sc.reused.mask.clone()
            kept[-1] = False
            assert torch.equal(res.keys[li][kept], keys[li][kept])
            assert torch.equal(res.values[li][kept], values[li][kept])
    # the tokens before the first document see no cached KV at all: exact
    for li in range(len(res.keys)):
        torch.testing.assert_close(res.keys[li][: sc.prefix_len], ref.keys[li][: sc.prefix_len], rtol=0, atol=1e-5)


def test_the_last_token_is_recomputed_even_when_cached(model):
    sc = rag_prompt(model)
    mask = torch.ones_like(sc.reused.mask)
    reused = ReusedKV(mask, sc.reused.keys, sc.reused.values)
    res = blend(model, sc.ids, reused, BlendConfig((0.0,), (1,)))
    assert res.recomputed.tolist() == [False] * (sc.ids.shape[0] - 1) + [True]


def deviations(model, sc, ratios):
    ref = full_prefill(model, sc.ids)
    return [deviation(blend(model, sc.ids, sc.reused, BlendConfig((r,), (1,))), ref) for r in ratios]


RATIOS = (0.0, 0.05, 0.15, 0.3, 0.6, 1.0)


def test_deviation_does_not_grow_with_the_ratio(model):
    sc = rag_prompt(model)
    devs = deviations(model, sc, RATIOS)
    assert all(b <= a * (1 + 1e-6) for a, b in zip(devs, devs[1:])), devs
    assert devs[2] < devs[0]  # 15 % beats no recompute
    assert devs[-1] < 1e-10


def test_the_selection_budget_per_check_layer(model):
    sc = rag_prompt(model)
    reused = sc.reused.mask.clone()
    reused[-1] = False
    num_reused = int(reused.sum())
    res = blend(model, sc.ids, sc.reused, BlendConfig((0.5, 0.15), (1, 2)))
    assert int(res.recomputed.sum()) == int((~reused).sum()) + math.floor(0.15 * num_reused + 1e-9)
    assert bool(res.recomputed[~reused].all())
    ref = full_prefill(model, sc.ids)
    single = deviation(blend(model, sc.ids, sc.reused, BlendConfig((0.15,), (1,))), ref)
    assert deviation(res, ref) <= single * (1 + 1e-6)  # layer 2 recomputed more tokens


@given(
    ratio=st.floats(0.0, 1.0),
    num_reused=st.integers(0, 5000),
    forced=st.integers(0, 300),
    known=st.booleans(),
)
@settings(max_examples=300, deadline=None)
def test_the_ratio_bounds_the_recomputed_share_of_the_documents(ratio, num_reused, forced, known):
    """Tokens recomputed anyway (first words) count towards the ratio: the recomputed share of
    the documents' tokens is at most the ratio, and one more token would pass it."""
    documents = num_reused + forced if known else None
    budget = _budget(ratio, num_reused, documents)
    base = num_reused + forced if known else num_reused
    assert 0 <= budget <= num_reused
    if ratio >= 1.0:
        assert budget == num_reused
    elif budget > 0:
        assert (base - num_reused) + budget <= ratio * base + 1e-6
    if budget < num_reused and ratio < 1.0:
        assert (base - num_reused) + budget + 1 > ratio * base - 1e-6


def test_recomputed_first_words_count_towards_the_ratio(model):
    """Documents cached without their first token (as served: the key starts at the second
    word): at ratio 0.2 at least 80% of the documents' tokens keep their cached KV."""
    gen = torch.Generator().manual_seed(3)
    docs = [torch.randint(10, 256, (n,), generator=gen).tolist() for n in (40, 33, 51)]
    prompt = torch.randint(10, 256, (5,), generator=gen).tolist()
    pieces, doc_tokens = [], 0
    for doc in docs:
        kv = full_prefill(model, torch.tensor(doc))
        pieces.append(CachedSegmentKV(len(prompt) + 1, [k[1:] for k in kv.keys], [v[1:] for v in kv.values],
                                      old_start=1, recomputed_before=1))  # fmt: skip
        prompt += doc + [7, 7]
        doc_tokens += len(doc)
    prompt += torch.randint(10, 256, (9,), generator=gen).tolist()
    reused = assemble(len(prompt), pieces, model.rope)
    assert reused.documents == doc_tokens
    res = blend(model, torch.tensor(prompt), reused, BlendConfig((0.2,), (1,)))
    kept = int((reused.mask & ~res.recomputed).sum())
    assert kept >= 0.8 * doc_tokens and kept - 1 < 0.8 * doc_tokens


def test_no_reuse_is_a_full_prefill(model):
    ids = torch.randint(10, 256, (20,), generator=torch.Generator().manual_seed(5))
    res = blend(model, ids, None)
    ref = full_prefill(model, ids)
    assert all(torch.equal(a, b) for a, b in zip(res.keys, ref.keys))


@pytest.mark.parametrize(
    "kwargs",
    [
        {"recompute_ratios": (0.1, 0.2), "check_layers": (1, 2)},  # increasing ratio
        {"recompute_ratios": (0.1,), "check_layers": (1, 2)},
        {"recompute_ratios": (1.5,), "check_layers": (1,)},
        {"recompute_ratios": (0.1, 0.1), "check_layers": (2, 1)},
        {"recompute_ratios": (), "check_layers": ()},
    ],
)
def test_bad_configs(kwargs):
    with pytest.raises(ValueError):
        BlendConfig(**kwargs)


def test_bad_inputs(model):
    sc = rag_prompt(model)
    with pytest.raises(ValueError, match="check layer"):
        blend(model, sc.ids, sc.reused, BlendConfig((0.1,), (4,)))
    with pytest.raises(ValueError):
        blend(model, sc.ids[:-1], sc.reused)
    with pytest.raises(ValueError):
        blend(model, sc.ids, ReusedKV(sc.reused.mask, sc.reused.keys[:2], sc.reused.values[:2]))


@pytest.mark.slow
@pytest.mark.skipif(not (REAL_MODEL / "config.json").exists(), reason="models/smollm2-135m is not present")
def test_real_model_ratio_one_and_deviation_order():
    from transformers import AutoModelForCausalLM

    hf_model = AutoModelForCausalLM.from_pretrained(str(REAL_MODEL), dtype=torch.float32).eval()
    model = HFLlamaBlendModel(hf_model)
    sc = rag_prompt(model, doc_lens=(60, 40, 50))
    res = blend(model, sc.ids, sc.reused, BlendConfig((1.0,), (1,)))
    hf = hf_prefill(hf_model, sc.ids)
    for li, layer in enumerate(hf.past_key_values.layers):
        torch.testing.assert_close(res.keys[li], layer.keys[0].transpose(0, 1), rtol=0, atol=1e-3)
    assert int(res.logits.argmax()) == int(hf.logits[0, -1].argmax())
    devs = deviations(model, sc, (0.0, 0.15, 0.6))
    assert devs[0] > devs[1] > devs[2], devs


def test_cached_kv_given_late_is_read_once_at_the_first_check_layer(model):
    sc = rag_prompt(model)
    calls = []

    def late():
        calls.append(1)
        return sc.reused

    cfg = BlendConfig((0.3, 0.1), (1, 2))
    eager = blend(model, sc.ids, sc.reused, cfg)
    lazy = blend(model, sc.ids, late, cfg)
    assert calls == [1]
    assert torch.equal(eager.recomputed, lazy.recomputed)
    for a, b in zip(eager.keys + eager.values, lazy.keys + lazy.values):
        assert torch.equal(a, b)
    nothing = blend(model, sc.ids, lambda: None, cfg)  # nothing could be read: a full prefill
    assert bool(nothing.recomputed.all())
    torch.testing.assert_close(nothing.logits, full_prefill(model, sc.ids).logits)


def reference_blend(model, ids: torch.Tensor, reused: ReusedKV, config: BlendConfig):
    """The selective recompute written plainly: every check layer runs for all the tokens it
    carries, then selects (the blender selects right after the check layer's q/k/v)."""
    from lmcache.v1.blend.model import causal_attention

    n = ids.shape[0]
    pos = torch.arange(n)
    is_reused = reused.mask.clone()
    is_reused[-1] = False
    num_reused = int(is_reused.sum())
    checks = dict(zip(config.check_layers, config.recompute_ratios))
    sel, hidden, keys, values = pos.clone(), model.embed(ids), [], []
    for li, layer in enumerate(model.layers):
        q, k, v = layer.qkv(layer.input_norm(hidden), pos[sel])
        k_all, v_all = reused.keys[li].clone(), reused.values[li].clone()
        k_all[sel], v_all[sel] = k, v
        keys.append(k_all)
        values.append(v_all)
        hidden = hidden + layer.o_proj(causal_attention(q, k_all, v_all, pos[sel], pos, model.scaling))
        hidden = hidden + layer.mlp(layer.post_norm(hidden))
        if li in checks:
            dev_k = (k - reused.keys[li][sel]).pow(2).sum(dim=(1, 2))
            dev = dev_k + (v - reused.values[li][sel]).pow(2).sum(dim=(1, 2))
            cand = is_reused[sel]
            keep = ~cand
            base = reused.documents if reused.documents is not None else num_reused
            forced = base - num_reused
            share = num_reused if checks[li] >= 1 else math.floor(checks[li] * base + 1e-9) - forced
            budget = max(0, min(share, int(cand.sum())))
            keep[torch.topk(torch.where(cand, dev, torch.tensor(-1.0)), budget).indices] = True
            sel, hidden = sel[keep], hidden[keep]
    logits = model.logits(model.final_norm(hidden[-1:]))[0]
    return keys, values, logits, sel


@pytest.mark.parametrize("ratios,layers", [((0.2,), (1,)), ((0.5, 0.15), (1, 2)), ((0.0,), (0,))])
def test_selecting_after_the_check_layers_qkv_changes_nothing(model, ratios, layers):
    """The check layer's attention and MLP run for the selected tokens only: the KV, the
    logits and the recomputed tokens equal those of running them for every token first."""
    sc = rag_prompt(model)
    config = BlendConfig(ratios, layers)
    with torch.no_grad():
        keys, values, logits, sel = reference_blend(model, sc.ids, sc.reused, config)
    res = blend(model, sc.ids, sc.reused, config)
    assert res.recomputed.nonzero().flatten().tolist() == sel.tolist()
    for li in range(len(keys)):
        torch.testing.assert_close(res.keys[li], keys[li], rtol=0, atol=1e-5)
        torch.testing.assert_close(res.values[li], values[li], rtol=0, atol=1e-5)
    torch.testing.assert_close(res.logits, logits, rtol=0, atol=1e-4)


def test_consume_writes_into_the_reused_kv_and_gives_the_same_result(model):
    sc = rag_prompt(model)
    config = BlendConfig((0.5, 0.15), (1, 2))
    before = [k.clone() for k in sc.reused.keys]
    kept = blend(model, sc.ids, sc.reused, config)
    assert all(torch.equal(a, b) for a, b in zip(before, sc.reused.keys))  # consume=False: untouched
    owned = ReusedKV(sc.reused.mask, [k.clone() for k in sc.reused.keys], [v.clone() for v in sc.reused.values])
    consumed = blend(model, sc.ids, owned, config, consume=True)
    assert torch.equal(consumed.recomputed, kept.recomputed)
    for li in range(len(kept.keys)):
        assert torch.equal(consumed.keys[li], kept.keys[li]) and torch.equal(consumed.values[li], kept.values[li])
        if li > 1:  # after the first check layer: the reused tensor itself, written in place
            assert consumed.keys[li] is owned.keys[li]
    torch.testing.assert_close(consumed.logits, kept.logits, rtol=0, atol=0)
