"""Adapter: a Hugging Face Llama-family causal LM as a :class:`~lmcache.v1.blend.model.BlendModel`.

Works for ``LlamaForCausalLM`` and models with the same module layout (Mistral, Qwen2):
``model.embed_tokens``, ``model.layers[i].{input_layernorm, self_attn.{q,k,v,o}_proj,
post_attention_layernorm, mlp}``, ``model.norm``, ``lm_head``. RoPE comes from
:class:`RopeSpec` (the standard one only: :class:`UnsupportedRope` otherwise). Sliding-window
attention is not applied (the mask is fully causal): use prompts shorter than the window.
The adapter holds references to the model's modules; it copies no weights.
"""

from __future__ import annotations

from typing import Any, Sequence

import torch

from lmcache.v1.blend.rope import RopeSpec

__all__ = ["HFLlamaBlendModel"]


class _Layer:
    __slots__ = ("_layer", "_rope", "_heads", "_kv_heads", "_head_dim")

    def __init__(self, layer: Any, rope: RopeSpec, heads: int, kv_heads: int, head_dim: int) -> None:
        attn = layer.self_attn
        for name in ("q_norm", "k_norm"):
            if getattr(attn, name, None) is not None:
                raise ValueError(f"attention with {name} (e.g. Qwen3) is not supported by this adapter")
        self._layer = layer
        self._rope = rope
        self._heads, self._kv_heads, self._head_dim = heads, kv_heads, head_dim

    def input_norm(self, hidden: torch.Tensor) -> torch.Tensor:
        return self._layer.input_layernorm(hidden)

    def qkv(self, normed: torch.Tensor, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        attn, n, d = self._layer.self_attn, normed.shape[0], self._head_dim
        q = attn.q_proj(normed).view(n, self._heads, d)
        k = attn.k_proj(normed).view(n, self._kv_heads, d)
        v = attn.v_proj(normed).view(n, self._kv_heads, d)
        return self._rope.apply(q, positions), self._rope.apply(k, positions), v

    def o_proj(self, attn: torch.Tensor) -> torch.Tensor:
        return self._layer.self_attn.o_proj(attn)

    def post_norm(self, hidden: torch.Tensor) -> torch.Tensor:
        return self._layer.post_attention_layernorm(hidden)

    def mlp(self, normed: torch.Tensor) -> torch.Tensor:
        return self._layer.mlp(normed)


class HFLlamaBlendModel:
    """A loaded HF Llama-family causal LM seen through the blender's interface."""

    def __init__(self, model: Any) -> None:
        cfg = model.config
        self.rope = RopeSpec.from_hf_config(cfg)
        heads = cfg.num_attention_heads
        kv_heads = getattr(cfg, "num_key_value_heads", None) or heads
        self._model = model
        decoder = model.model
        self._layers = [_Layer(layer, self.rope, heads, kv_heads, self.rope.head_dim) for layer in decoder.layers]
        self._scaling = float(getattr(decoder.layers[0].self_attn, "scaling", self.rope.head_dim**-0.5))

    @property
    def layers(self) -> Sequence[_Layer]:
        return self._layers

    @property
    def scaling(self) -> float:
        return self._scaling

    @property
    def num_layers(self) -> int:
        return len(self._layers)

    def rerotate(self, keys: torch.Tensor, old: torch.Tensor, new: torch.Tensor) -> torch.Tensor:
        """Keys computed at positions ``old`` moved to ``new`` (:meth:`RopeSpec.rerotate`)."""
        return self.rope.rerotate(keys, old, new)

    def embed(self, token_ids: torch.Tensor) -> torch.Tensor:
        return self._model.model.embed_tokens(token_ids)

    def final_norm(self, hidden: torch.Tensor) -> torch.Tensor:
        return self._model.model.norm(hidden)

    def logits(self, normed: torch.Tensor) -> torch.Tensor:
        return self._model.lm_head(normed)
