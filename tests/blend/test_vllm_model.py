"""The served vLLM model as the blender's BlendModel (``lmcache.integration.vllm.blend_model``)
and the plugin that records it (``blend_plugin``).

Fast tests use a stand-in with vLLM's module layout built from a tiny transformers Llama's
weights (fused ``qkv_proj`` returning ``(out, bias)``, a neox RoPE over a float32
``cos_sin_cache``): the adapter must reproduce the transformers model, re-rotate keys
exactly, accept a model by its structure (not its class name) and refuse, with the reason,
every layout it cannot reproduce. Other model families (Llama-3.x RoPE, Qwen3's q/k norms,
vLLM's own rotary classes) are in ``test_vllm_model_families.py``.

The vLLM test (marked ``vllm`` and ``slow``) starts real vLLM once, in a child process
(``VLLM_ENABLE_V1_MULTIPROCESSING=0``, so the model lives in that process), with the plugin
registered first. The child runs every check on the model the tracker recorded, under
``torch.inference_mode`` as the connector's worker does, and reports numbers the tests
assert on. A child, not this process: vLLM's CPU worker binds threads and replaces
``torch.set_num_threads`` process-wide, which would leak into the rest of the suite.
"""

from __future__ import annotations

import json
import logging
import sys
import tomllib
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from harness import forkserver

from lmcache.integration.vllm import blend_plugin
from lmcache.integration.vllm.blend_model import (
    UnsupportedBlendModel,
    VLLMBlendModel,
    VLLMModelTracker,
    blend_model_for,
    model_for,
)
from lmcache.v1.blend import BlendConfig, CachedSegmentKV, assemble, blend, deviation, full_prefill
from lmcache.v1.blend.hf_llama import HFLlamaBlendModel
from tests.blend.helpers import vllm_child_env

HERE = Path(__file__).resolve()
REPO = HERE.parents[2]


# ----------------------------------------------------------------------------- stand-in
class _Linear(nn.Module):
    """vLLM's linear layers' calling convention: ``(output, bias)``."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None = None) -> None:
        super().__init__()
        self.weight = nn.Parameter(weight.detach().clone())
        self.bias = None if bias is None else nn.Parameter(bias.detach().clone())

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, None]:
        return F.linear(x, self.weight, self.bias), None


class RotaryEmbedding(nn.Module):
    """vLLM's default RoPE: float32 ``cos|sin`` table, neox pairing, in place like its op."""

    def __init__(self, head_dim: int, base: float, max_position: int) -> None:
        super().__init__()
        self.head_size = self.rotary_dim = head_dim
        self.is_neox_style = True
        inv_freq = 1.0 / (base ** (torch.arange(0, head_dim, 2, dtype=torch.float) / head_dim))
        freqs = torch.outer(torch.arange(max_position, dtype=torch.float), inv_freq)
        self.register_buffer("cos_sin_cache", torch.cat((freqs.cos(), freqs.sin()), dim=-1), persistent=False)

    def forward(self, positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        cos, sin = self.cos_sin_cache.index_select(0, positions).chunk(2, dim=-1)
        cos, sin = cos[:, None, :], sin[:, None, :]
        for x in (q, k):
            view = x.view(x.shape[0], -1, self.head_size)
            x1, x2 = view.chunk(2, dim=-1)
            view.copy_(torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1))
        return q, k


class _Attention(nn.Module):
    def __init__(self, hf_attn: nn.Module, heads: int, kv_heads: int, head_dim: int, base: float) -> None:
        super().__init__()
        w = torch.cat((hf_attn.q_proj.weight, hf_attn.k_proj.weight, hf_attn.v_proj.weight), dim=0)
        self.qkv_proj = _Linear(w)
        self.o_proj = _Linear(hf_attn.o_proj.weight)
        self.rotary_emb = RotaryEmbedding(head_dim, base, 4096)
        self.num_heads = self.total_num_heads = heads
        self.num_kv_heads, self.head_dim = kv_heads, head_dim
        self.q_size, self.kv_size = heads * head_dim, kv_heads * head_dim
        self.scaling = head_dim**-0.5
        self.attn = SimpleNamespace(sliding_window=None, attn_type="decoder")


class LlamaForCausalLM(nn.Module):
    """vLLM's LlamaForCausalLM layout around a transformers Llama's weights."""

    def __init__(self, hf: nn.Module) -> None:
        super().__init__()
        cfg = hf.config
        head_dim = cfg.hidden_size // cfg.num_attention_heads
        base = float(cfg.rope_parameters["rope_theta"] if getattr(cfg, "rope_parameters", None) else cfg.rope_theta)
        self.model = nn.Module()
        self.model.embed_tokens = hf.model.embed_tokens
        self.model.norm = hf.model.norm
        self.model.layers = nn.ModuleList()
        for hf_layer in hf.model.layers:
            layer = nn.Module()
            layer.input_layernorm = hf_layer.input_layernorm
            layer.post_attention_layernorm = hf_layer.post_attention_layernorm
            layer.mlp = hf_layer.mlp
            layer.self_attn = _Attention(
                hf_layer.self_attn, cfg.num_attention_heads, cfg.num_key_value_heads, head_dim, base
            )
            self.model.layers.append(layer)
        self.model.start_layer, self.model.end_layer = 0, len(self.model.layers)
        self.lm_head = hf.lm_head

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.lm_head(hidden)


@pytest.fixture(scope="module")
def hf_model() -> nn.Module:
    from tests.blend.helpers import tiny_llama

    return tiny_llama(num_layers=3)


@pytest.fixture()
def fake(hf_model) -> LlamaForCausalLM:
    return LlamaForCausalLM(hf_model)


def _ids(n: int, seed: int = 0, vocab: int = 256) -> torch.Tensor:
    return torch.randint(10, vocab, (n,), generator=torch.Generator().manual_seed(seed))


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    """max |a - b| relative to max |b| (at least 1)."""
    return float((a.float() - b.float()).abs().max()) / max(1.0, float(b.float().abs().max()))


def test_adapter_reproduces_the_transformers_model(hf_model, fake):
    ids = _ids(200)
    with torch.inference_mode():
        ours = full_prefill(VLLMBlendModel(fake), ids)
        ref = full_prefill(HFLlamaBlendModel(hf_model), ids)
    assert _rel(ours.logits, ref.logits) < 1e-5
    for li in range(len(ref.keys)):
        assert _rel(ours.keys[li], ref.keys[li]) < 1e-5, li
        assert _rel(ours.values[li], ref.values[li]) < 1e-5, li


def test_geometry(fake):
    model = blend_model_for(fake)
    assert (model.num_layers, model.num_heads, model.num_kv_heads, model.head_dim) == (3, 4, 2, 16)
    assert model.dtype == torch.float32
    assert model.max_position == 4096
    assert model.scaling == pytest.approx(16**-0.5)


def test_rerotate_equals_computing_at_the_new_positions(fake):
    model = VLLMBlendModel(fake)
    layer = model.layers[1]
    normed = layer.input_norm(model.embed(_ids(64, seed=3)))
    old = torch.arange(64)
    new = old + 3001
    with torch.inference_mode():
        _, k_old, _ = layer.qkv(normed, old)
        _, k_new, _ = layer.qkv(normed, new)
        moved = model.rerotate(k_old, old, new)
        back = model.rerotate(moved, new, old)
    assert moved.dtype == k_old.dtype and moved.shape == k_old.shape
    assert _rel(moved, k_new) < 2e-6
    assert _rel(back, k_old) < 2e-6


def test_rerotate_rejects_bad_input(fake):
    model = VLLMBlendModel(fake)
    keys = torch.zeros(4, 2, 16)
    pos = torch.arange(4)
    with pytest.raises(ValueError, match="keys of shape"):
        model.rerotate(torch.zeros(4, 3, 16), pos, pos)
    with pytest.raises(ValueError, match="new_positions"):
        model.rerotate(keys, pos, pos[:3])
    with pytest.raises(ValueError, match=r"\[0, 4096\)"):
        model.rerotate(keys, pos, pos + 4093)
    with pytest.raises(ValueError, match="integer"):
        model.rerotate(keys, pos.float(), pos)


def test_blend_through_the_adapter(fake):
    """Documents prefilled alone, moved with the adapter's rerotate: ratio 1 is the full
    prefill exactly; more recompute is never further from it."""
    model = VLLMBlendModel(fake)
    ids, cached = _rag(model, seed=5)
    reused = assemble(ids.shape[0], cached, model)  # the adapter re-rotates like a RopeSpec
    with torch.inference_mode():
        full = full_prefill(model, ids)
        one = blend(model, ids, reused, BlendConfig((1.0,), (1,)))
        devs = [deviation(blend(model, ids, reused, BlendConfig((r,), (1,))), full) for r in (0.0, 0.3)]
    assert all(torch.equal(a, b) for a, b in zip(one.keys + one.values, full.keys + full.values))
    assert torch.equal(one.logits, full.logits)
    assert devs[0] > devs[1] > 0


def _rag(model: Any, seed: int, doc_lens: tuple[int, ...] = (40, 30, 50), vocab: int = 256):
    """A prompt ``prefix + doc + sep + doc + sep ... + question`` and its documents' KV,
    each prefilled alone from position 0."""
    sep = [7, 8, 7]
    gen = torch.Generator().manual_seed(seed)
    prompt = torch.randint(10, vocab, (5,), generator=gen).tolist()
    cached = []
    with torch.inference_mode():
        for n in doc_lens:
            doc = torch.randint(10, vocab, (n,), generator=gen)
            kv = full_prefill(model, doc)
            cached.append(CachedSegmentKV(len(prompt), kv.keys, kv.values))
            prompt += doc.tolist() + sep
    prompt += torch.randint(10, vocab, (12,), generator=gen).tolist()
    return torch.tensor(prompt), cached


# ----------------------------------------------------------------------------- refusals
class Qwen3ForCausalLM(LlamaForCausalLM):
    pass


class Llama3RotaryEmbedding(RotaryEmbedding):
    """Another table, the standard forward: accepted (the test below)."""


class OwnForwardRotaryEmbedding(RotaryEmbedding):
    """A subclass that replaces the rotation (as mrope and dual-chunk RoPE do)."""

    def forward(self, positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return super().forward(positions, q, k)


class Phi3LongRoPEScaledRotaryEmbedding(nn.Module):
    """Not a RotaryEmbedding at all (vLLM's longrope class is a plain Module)."""


class FusedMoE(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x


class PPMissingLayer(nn.Module):
    pass


def _attn(m: nn.Module, i: int = 0) -> Any:
    return m.model.layers[i].self_attn


def _retype_rope(cls: type) -> Any:
    def mutate(m: nn.Module) -> None:
        for layer in m.model.layers:
            layer.self_attn.rotary_emb.__class__ = cls

    return mutate


def _scale_table(m: nn.Module) -> None:
    """YaRN's table: cos and sin multiplied by an mscale (one module shared by the layers)."""
    rope = _attn(m).rotary_emb
    rope.cos_sin_cache.mul_(1.1)
    for layer in m.model.layers:
        layer.self_attn.rotary_emb = rope


def _set(path: str, name: str, value: Any) -> Any:
    """A mutation that sets ``name`` on the object at dotted ``path`` under the model."""

    def mutate(m: nn.Module) -> None:
        target: Any = m
        for part in filter(None, path.split(".")):
            target = target[int(part)] if part.isdigit() else getattr(target, part)
        setattr(target, name, value() if callable(value) else value)

    return mutate


def _norms(width: int, only_k: bool = False) -> Any:
    def mutate(m: nn.Module) -> None:
        attn = _attn(m, 1)
        attn.k_norm = nn.RMSNorm(width)
        if not only_k:
            attn.q_norm = nn.RMSNorm(width)

    return mutate


REFUSALS = {
    "extra_layer_module": (_set("model.layers.0", "pre_feedforward_layernorm", lambda: nn.RMSNorm(64)),
                           "modules the blender does not drive: pre_feedforward_layernorm"),
    "extra_attention_module": (_set("model.layers.1.self_attn", "qk_norm", lambda: nn.RMSNorm(16)),
                               "attention has modules the blender does not drive: qk_norm"),
    "attention_sinks": (_set("model.layers.0.self_attn", "sinks", lambda: nn.Parameter(torch.zeros(4))),
                        "own parameter sinks"),
    "decoder_module": (_set("model", "vision_tower", lambda: nn.Linear(2, 2)), "decoder has modules"),
    "decoder_buffer": (lambda m: m.model.register_buffer("normalizer", torch.tensor(8.0)), "normaliser"),
    "residual_multiplier": (_set("", "config", SimpleNamespace(residual_multiplier=0.22)), "residual_multiplier=0.22"),
    "moe": (_set("model.layers.1", "mlp", lambda: FusedMoE()), "mixture of experts"),
    "one_qk_norm": (_norms(16, only_k=True), "only one of q_norm/k_norm"),
    "full_width_qk_norm": (_norms(64), "not a per-head norm"),
    "mla": (lambda m: setattr(_attn(m), "qkv_proj", None), "fused qkv_proj"),
    "sliding_window": (lambda m: setattr(_attn(m, 2).attn, "sliding_window", 64), "sliding-window"),
    "non_neox": (lambda m: setattr(_attn(m).rotary_emb, "is_neox_style", False), "non-neox"),
    "own_rotation": (_retype_rope(OwnForwardRotaryEmbedding), "OwnForwardRotaryEmbedding replaces the standard"),
    "not_rotary": (_retype_rope(Phi3LongRoPEScaledRotaryEmbedding), "Phi3LongRoPEScaledRotaryEmbedding is not"),
    "scaled_table": (_scale_table, "scales its cos/sin table"),
    "stacked_factors": (lambda m: setattr(_attn(m).rotary_emb, "scaling_factors", [1.0, 4.0]), "stacked scaling"),
    "per_layer_rope": (_set("model.layers.2.self_attn", "rotary_emb", lambda: RotaryEmbedding(16, 500.0, 4096)),
                       "layer 2's rotary embedding differs"),
    "partial_rope": (lambda m: setattr(_attn(m).rotary_emb, "rotary_dim", 8), "partial rotary"),
    "tensor_parallel": (lambda m: setattr(_attn(m), "total_num_heads", 8), "tensor parallelism"),
    "tp_linear": (lambda m: setattr(_attn(m).qkv_proj, "tp_size", 2), "tensor parallelism"),
    "pipeline_parallel": (lambda m: setattr(m.model, "norm", PPMissingLayer()), "pipeline parallelism"),
    "llama4_scaling": (lambda m: setattr(_attn(m), "do_llama_4_scaling", True), "llama_4_scaling"),
    "dual_chunk": (lambda m: setattr(_attn(m), "dual_chunk_attention_config", {"chunk_size": 8}), "dual-chunk"),
    "encoder_attention": (lambda m: setattr(_attn(m).attn, "attn_type", "encoder_only"), "attention type"),
}  # fmt: skip


@pytest.mark.parametrize("case", sorted(REFUSALS))
def test_refusals_name_one_reason(fake, case):
    mutate, reason = REFUSALS[case]
    mutate(fake)
    with pytest.raises(UnsupportedBlendModel, match=reason) as info:
        blend_model_for(fake)
    assert isinstance(info.value, ValueError)
    assert str(info.value).startswith("blending is not supported for this model: ")


def test_accepted_by_structure_not_by_class_name(fake):
    """The same modules under another model class, with a scaled-RoPE subclass that keeps the
    standard forward, and Qwen3's per-head q/k norms: all driven."""
    model: nn.Module = Qwen3ForCausalLM.__new__(Qwen3ForCausalLM)
    model.__dict__.update(fake.__dict__)
    _retype_rope(Llama3RotaryEmbedding)(model)
    for layer in model.model.layers:
        layer.self_attn.q_norm, layer.self_attn.k_norm = nn.RMSNorm(16), nn.RMSNorm(16)
    ours = blend_model_for(model)
    assert ours.num_layers == 3 and all(layer._qk_norm for layer in ours.layers)


# ----------------------------------------------------------------------------- tracker
@pytest.fixture(autouse=True)
def _clean_tracker_and_plugin():
    VLLMModelTracker.clear()
    blend_plugin.unregister()
    yield
    VLLMModelTracker.clear()
    blend_plugin.unregister()


def test_tracker_lookup_and_fallback():
    a, b = nn.Linear(1, 1), nn.Linear(1, 1)
    assert VLLMModelTracker.get_model("x") is None and model_for(None) is None
    VLLMModelTracker.register_model("a", a)
    assert VLLMModelTracker.get_model("a") is a
    assert model_for("a") is a and model_for("other") is a and model_for(None) is a  # the only model
    VLLMModelTracker.register_model("b", b)
    assert model_for("b") is b
    assert model_for("other") is None and model_for(None) is None  # ambiguous
    assert VLLMModelTracker.instance_ids() == ["a", "b"]
    assert VLLMModelTracker.unregister("a") is a and VLLMModelTracker.unregister("a") is None
    assert model_for(None) is b
    with pytest.raises(ValueError, match="instance_id"):
        VLLMModelTracker.register_model("", a)


# ----------------------------------------------------------------------------- plugin
def _base_loader() -> type:
    pytest.importorskip("vllm")
    from vllm.model_executor.model_loader.base_loader import BaseModelLoader

    return BaseModelLoader


def test_register_with_blending_off_leaves_vllm_untouched(monkeypatch):
    loader = _base_loader()
    before = vars(loader)["load_model"]
    monkeypatch.delenv(blend_plugin.ENABLE_ENV, raising=False)
    monkeypatch.delenv("LMCACHE_CONFIG_FILE", raising=False)
    blend_plugin.register()
    assert vars(loader)["load_model"] is before


def test_blending_enabled_reads_the_config(monkeypatch, tmp_path, caplog):
    monkeypatch.delenv(blend_plugin.ENABLE_ENV, raising=False)
    monkeypatch.delenv("LMCACHE_CONFIG_FILE", raising=False)
    assert not blend_plugin.blending_enabled()
    for value, expected in (("1", True), ("TRUE", True), ("on", True), ("0", False), ("", False)):
        monkeypatch.setenv(blend_plugin.ENABLE_ENV, value)
        assert blend_plugin.blending_enabled() is expected, value
    monkeypatch.delenv(blend_plugin.ENABLE_ENV)
    good = tmp_path / "on.yaml"
    good.write_text("enable_blending: true\n")
    monkeypatch.setenv("LMCACHE_CONFIG_FILE", str(good))
    assert blend_plugin.blending_enabled()
    bad = tmp_path / "bad.yaml"
    bad.write_text("chunk_size: -3\n")
    monkeypatch.setenv("LMCACHE_CONFIG_FILE", str(bad))
    with caplog.at_level(logging.WARNING, logger=blend_plugin.__name__):
        assert not blend_plugin.blending_enabled()
    assert any("does not load" in r.getMessage() for r in caplog.records)


def test_register_wraps_once_and_unregister_restores(monkeypatch):
    loader = _base_loader()
    before = vars(loader)["load_model"]
    monkeypatch.setenv(blend_plugin.ENABLE_ENV, "true")
    for _ in range(3):  # vLLM calls plugins in every process, maybe several times
        blend_plugin.register()
    wrapped = vars(loader)["load_model"]
    assert wrapped is not before and wrapped.__wrapped__ is before
    blend_plugin.unregister()
    assert vars(loader)["load_model"] is before


def test_register_never_raises(monkeypatch, caplog):
    loader = _base_loader()
    before = vars(loader)["load_model"]
    monkeypatch.setenv(blend_plugin.ENABLE_ENV, "1")

    def broken() -> list[type]:
        raise RuntimeError("no loaders here")

    monkeypatch.setattr(blend_plugin, "_loader_classes", broken)
    with caplog.at_level(logging.WARNING, logger=blend_plugin.__name__):
        blend_plugin.register()
        blend_plugin.register()
    assert vars(loader)["load_model"] is before
    assert sum("plugin registration failed" in r.getMessage() for r in caplog.records) == 1


def test_wrapped_loader_records_the_main_model_not_drafts():
    main_cfg, draft_cfg = object(), object()
    vllm_config = SimpleNamespace(model_config=main_cfg, kv_transfer_config=SimpleNamespace(engine_id="engine-7"))
    served, draft = nn.Linear(1, 1), nn.Linear(1, 1)

    def load_model(self, vllm_config, model_config, prefix=""):
        return served if model_config is main_cfg else draft

    wrapped = blend_plugin._wrap(load_model)
    assert wrapped(None, vllm_config=vllm_config, model_config=draft_cfg) is draft
    assert VLLMModelTracker.instance_ids() == []
    assert wrapped(None, vllm_config, main_cfg) is served
    assert VLLMModelTracker.get_model("engine-7") is served
    assert blend_plugin.instance_id_of(SimpleNamespace(kv_transfer_config=None)) == "default"


def test_entry_point_is_declared():
    meta = tomllib.loads((REPO / "pyproject.toml").read_text())
    target = meta["project"]["entry-points"]["vllm.general_plugins"]["lmcache_blend"]
    module, _, attr = target.partition(":")
    assert (module, attr) == (blend_plugin.__name__, "register")


# ----------------------------------------------------------------------------- real vLLM
RESULT_PREFIX = "BLEND_VLLM_RESULT "


def child_main(model_dir: str) -> None:
    """Start vLLM in this process with the plugin registered, run every check on the model
    the tracker recorded, print one JSON line of measurements."""
    from vllm import LLM, SamplingParams
    from vllm.forward_context import set_forward_context

    blend_plugin.register()
    llm = LLM(model=model_dir, dtype="float32", enforce_eager=True, max_model_len=512, block_size=32, seed=0)
    params = SamplingParams(temperature=0.0, max_tokens=4, logprobs=5, ignore_eos=True)
    model = model_for(None)
    out: dict[str, Any] = {
        "instance_ids": VLLMModelTracker.instance_ids(),
        "model_class": type(model).__name__,
        "rope_class": type(model.model.layers[0].self_attn.rotary_emb).__name__,
    }
    vocab = model.config.vocab_size
    ours = VLLMBlendModel(model)
    out["dtype"] = str(ours.dtype)
    out["geometry"] = [ours.num_layers, ours.num_heads, ours.num_kv_heads, ours.head_dim]

    ids = _ids(300, seed=1, vocab=vocab)
    (before,) = llm.generate([{"prompt_token_ids": ids.tolist()}], params, use_tqdm=False)

    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    with torch.inference_mode():
        res = full_prefill(ours, ids)
        ref = full_prefill(HFLlamaBlendModel(hf), ids)
        with set_forward_context(None, llm.llm_engine.vllm_config):
            in_ctx = full_prefill(ours, ids)
    out["vs_hf"] = {
        "logits": _rel(res.logits, ref.logits),
        "keys": [_rel(a, b) for a, b in zip(res.keys, ref.keys)],
        "values": [_rel(a, b) for a, b in zip(res.values, ref.values)],
    }
    out["in_forward_context_identical"] = all(
        torch.equal(a, b)
        for a, b in zip(res.keys + res.values + [res.logits], in_ctx.keys + in_ctx.values + [in_ctx.logits])
    )

    # vLLM's own forward: its first generated token and top-5 logprobs.
    first = before.outputs[0]
    logprobs = torch.log_softmax(res.logits.double(), dim=-1)
    out["greedy_token"] = [int(res.logits.argmax()), int(first.token_ids[0])]
    out["logprob_diff"] = max(abs(float(logprobs[t]) - lp.logprob) for t, lp in first.logprobs[0].items())

    # Re-rotation with the model's own table against computing at the new positions.
    layer = ours.layers[1]
    with torch.inference_mode():
        normed = layer.input_norm(ours.embed(ids[:64]))
        old, new = torch.arange(64), torch.arange(64) + 4000
        _, k_old, _ = layer.qkv(normed, old)
        _, k_new, _ = layer.qkv(normed, new)
        out["rerotate"] = _rel(ours.rerotate(k_old, old, new), k_new)

        prompt, cached = _rag(ours, seed=2, vocab=vocab)
        reused = assemble(prompt.shape[0], cached, ours)
        full = full_prefill(ours, prompt)
        one = blend(ours, prompt, reused, BlendConfig((1.0,), (1,)))
        out["ratio_one_max_diff"] = max(
            float((a - b).abs().max())
            for a, b in zip(one.keys + one.values + [one.logits], full.keys + full.values + [full.logits])
        )
        out["deviation"] = [deviation(blend(ours, prompt, reused, BlendConfig((r,), (0,))), full) for r in (0.0, 0.3)]

    (after,) = llm.generate([{"prompt_token_ids": ids.tolist()}], params, use_tqdm=False)
    out["generate_unchanged"] = list(after.outputs[0].token_ids) == list(first.token_ids)
    print(RESULT_PREFIX + json.dumps(out), flush=True)


@pytest.fixture(scope="module")
def vllm_run(tiny_llama_dir) -> dict[str, Any]:
    """One vLLM start for the module: the child's measurements (printed when ``-s``)."""
    env = vllm_child_env(REPO)
    proc = forkserver.run([sys.executable, str(HERE), str(tiny_llama_dir)], env=env, cwd=REPO, timeout=600)
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith(RESULT_PREFIX)]
    if proc.returncode != 0 or not lines:
        tail = "\n".join((proc.stdout + proc.stderr).splitlines()[-60:])
        pytest.fail(f"vLLM child failed (rc={proc.returncode}):\n{tail}")
    result = json.loads(lines[-1][len(RESULT_PREFIX) :])
    print(json.dumps(result, indent=1))
    return result


@pytest.mark.vllm
@pytest.mark.slow
def test_plugin_records_the_served_model(vllm_run):
    assert vllm_run["instance_ids"] == ["default"]  # no kv_transfer_config: the default id
    assert vllm_run["model_class"] == "LlamaForCausalLM"
    assert vllm_run["rope_class"] == "RotaryEmbedding"
    assert vllm_run["dtype"] == "torch.float32"
    assert vllm_run["geometry"] == [2, 4, 2, 64]


@pytest.mark.vllm
@pytest.mark.slow
def test_vllm_full_prefill_matches_transformers_and_vllm(vllm_run):
    """Against transformers: RoPE angles differ (vLLM float32 table, the HF adapter float64),
    a few 1e-5 relative over 300 positions. Against vLLM's own forward: logprobs and token."""
    diffs = vllm_run["vs_hf"]
    assert diffs["logits"] < 1e-4
    assert max(diffs["keys"]) < 1e-4 and max(diffs["values"]) < 1e-4
    assert diffs["values"][0] < 5e-6  # layer 0's values carry no RoPE error
    assert vllm_run["greedy_token"][0] == vllm_run["greedy_token"][1]
    assert vllm_run["logprob_diff"] < 1e-4
    assert vllm_run["in_forward_context_identical"]
    assert vllm_run["generate_unchanged"]  # the adapter left vLLM's modules as they were


@pytest.mark.vllm
@pytest.mark.slow
def test_vllm_rerotate_and_blend(vllm_run):
    assert vllm_run["rerotate"] < 2e-6
    assert vllm_run["ratio_one_max_diff"] == 0.0
    dev0, dev03 = vllm_run["deviation"]
    assert dev0 > dev03 > 0


if __name__ == "__main__":
    child_main(sys.argv[1])
