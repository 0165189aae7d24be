"""The model vLLM serves, seen by the blender as a :class:`~lmcache.v1.blend.model.BlendModel`.

Two pieces, both used on the worker side (the process that holds the model's weights):

* :class:`VLLMModelTracker`: a process-wide registry ``instance id -> loaded model``. The
  plugin (:mod:`.blend_plugin`) fills it when vLLM loads a model; the connector reads it
  with :func:`model_for`. One worker process serves one model, so a lookup by an unknown
  id falls back to the only registered model.
* :class:`VLLMBlendModel`: an adapter over vLLM's own modules (Llama layout:
  ``model.embed_tokens``, ``model.layers[i].{input_layernorm, self_attn.{qkv_proj,
  rotary_emb, o_proj}, post_attention_layernorm, mlp}``, ``model.norm``, and the
  ``compute_logits`` head), so the blender's selective recompute runs the served weights
  and vLLM's own RoPE (the KV it produces is what vLLM would have computed). It copies no
  weights and never calls vLLM's attention layer (the blender does the attention itself),
  so it needs no forward context.

Supported: ``LlamaForCausalLM``, ``MistralForCausalLM``, ``Qwen2ForCausalLM`` with the
standard, full-width, neox-style, unscaled RoPE, full causal attention and one
tensor-parallel rank holding all heads. Anything else raises :class:`UnsupportedBlendModel`
with one reason, so the caller can turn blending off (prefix reuse keeps working).

Tensors follow :mod:`lmcache.v1.blend.model`: per sequence, no batch dimension; hidden
``[n, hidden]``, q ``[n, heads, head_dim]``, k/v ``[n, kv_heads, head_dim]``, positions
1-D int64. Results are new tensors owned by the caller.
"""

from __future__ import annotations

import logging
import threading
from typing import Any, ClassVar, Sequence

import torch
from torch import nn

from lmcache.v1.blend.rope import rerotate_with_tables

__all__ = [
    "SUPPORTED_ARCHITECTURES",
    "UnsupportedBlendModel",
    "VLLMBlendModel",
    "VLLMModelTracker",
    "blend_model_for",
    "model_for",
]

logger = logging.getLogger(__name__)

SUPPORTED_ARCHITECTURES = frozenset({"LlamaForCausalLM", "MistralForCausalLM", "Qwen2ForCausalLM"})
"""vLLM model classes with the layout and forward pass this adapter reproduces. Other
classes, even with the same module names, may scale embeddings, residuals or logits in
their forward pass (Gemma, Granite...), which the adapter would silently miss."""


class UnsupportedBlendModel(ValueError):
    """The served model cannot be driven by the blender; the message gives the one reason."""


# ----------------------------------------------------------------------------- tracker
class VLLMModelTracker:
    """Process-wide registry of the models vLLM loaded, by instance (engine) id.

    Thread-safe. Holds references only: the model stays owned by vLLM's model runner."""

    _models: ClassVar[dict[str, nn.Module]] = {}
    _lock: ClassVar[threading.Lock] = threading.Lock()

    @classmethod
    def register_model(cls, instance_id: str, model: nn.Module) -> None:
        """Record ``model`` under ``instance_id`` (replacing an earlier one of that id)."""
        if not isinstance(instance_id, str) or not instance_id:
            raise ValueError(f"instance_id={instance_id!r}: expected a non-empty string")
        with cls._lock:
            cls._models[instance_id] = model
        logger.debug("blend: registered %s as %r", type(model).__name__, instance_id)

    @classmethod
    def get_model(cls, instance_id: str) -> nn.Module | None:
        """The model registered under ``instance_id``, or None (LMCache's raises instead)."""
        with cls._lock:
            return cls._models.get(instance_id)

    @classmethod
    def unregister(cls, instance_id: str) -> nn.Module | None:
        """Forget ``instance_id``; returns the model it named, or None."""
        with cls._lock:
            return cls._models.pop(instance_id, None)

    @classmethod
    def clear(cls) -> None:
        """Forget every model (tests)."""
        with cls._lock:
            cls._models.clear()

    @classmethod
    def instance_ids(cls) -> list[str]:
        """The registered ids, sorted."""
        with cls._lock:
            return sorted(cls._models)


def model_for(instance_id: str | None) -> nn.Module | None:
    """The model registered under ``instance_id``; else the only model registered in this
    process (one worker serves one model, and ids may differ between the loader and the
    connector); else None (nothing registered, or several and none under that id)."""
    with VLLMModelTracker._lock:
        models = VLLMModelTracker._models
        if instance_id is not None and instance_id in models:
            return models[instance_id]
        if len(models) == 1:
            return next(iter(models.values()))
        return None


# ----------------------------------------------------------------------------- adapter
def _refuse(reason: str) -> UnsupportedBlendModel:
    return UnsupportedBlendModel(f"blending is not supported for this model: {reason}")


def _is_missing(module: Any) -> bool:
    """vLLM puts a ``PPMissingLayer`` where a pipeline-parallel rank holds no weights."""
    return module is None or type(module).__name__ == "PPMissingLayer"


def _check_rope(rope: Any, head_dim: int) -> None:
    if rope is None:
        raise _refuse("the attention has no rotary_emb")
    # get_rope returns exactly RotaryEmbedding for the default RoPE; scaled variants (linear,
    # dynamic, yarn, llama3, longrope, mrope, dual-chunk...) are other classes, most of them
    # subclasses, so the test is on the exact class name.
    if type(rope).__name__ != "RotaryEmbedding":
        raise _refuse(f"rotary embedding {type(rope).__name__} (only the default, unscaled RoPE can be re-rotated)")
    if not getattr(rope, "is_neox_style", False):
        raise _refuse("non-neox (GPT-J style) RoPE pairing")
    if getattr(rope, "rotary_dim", None) != head_dim or getattr(rope, "head_size", head_dim) != head_dim:
        raise _refuse(f"partial rotary embedding (rotary_dim={getattr(rope, 'rotary_dim', None)}, head_dim={head_dim})")
    cache = getattr(rope, "cos_sin_cache", None)
    if not isinstance(cache, torch.Tensor) or cache.dim() != 2 or cache.shape[1] != head_dim:
        raise _refuse("the rotary embedding has no [max_positions, head_dim] cos_sin_cache")


def _check_attention(attn: Any, index: int) -> None:
    if attn is None or getattr(attn, "qkv_proj", None) is None:
        raise _refuse(f"layer {index}'s attention has no fused qkv_proj (e.g. MLA)")
    for name in ("q_size", "kv_size", "num_heads", "num_kv_heads", "head_dim", "scaling", "o_proj"):
        if getattr(attn, name, None) is None:
            raise _refuse(f"layer {index}'s attention has no {name}")
    if (
        getattr(attn, "q_norm", None) is not None
        or getattr(attn, "k_norm", None) is not None
        or getattr(attn, "qk_norm", False)
    ):
        raise _refuse("q/k normalisation in the attention (e.g. Qwen3)")
    total_heads = getattr(attn, "total_num_heads", attn.num_heads)
    tp = getattr(attn.qkv_proj, "tp_size", 1)
    if total_heads != attn.num_heads or (isinstance(tp, int) and tp > 1):
        raise _refuse(f"tensor parallelism (this rank holds {attn.num_heads} of {total_heads} heads)")
    if attn.q_size != attn.num_heads * attn.head_dim or attn.kv_size != attn.num_kv_heads * attn.head_dim:
        raise _refuse(f"layer {index}'s q_size/kv_size disagree with heads x head_dim")
    if getattr(attn, "do_llama_4_scaling", False):
        raise _refuse("position-dependent attention scaling (llama_4_scaling)")
    if getattr(attn, "dual_chunk_attention_config", None):
        raise _refuse("dual-chunk attention")
    inner = getattr(attn, "attn", None)
    if getattr(inner, "sliding_window", None) is not None:
        raise _refuse(f"sliding-window attention in layer {index} (the blender's mask is fully causal)")
    if getattr(inner, "attn_type", "decoder") not in ("decoder", None):
        raise _refuse(f"attention type {inner.attn_type!r} (only causal decoder attention)")
    _check_rope(getattr(attn, "rotary_emb", None), attn.head_dim)


def _first(output: Any) -> torch.Tensor:
    """vLLM's linear layers return ``(output, bias)``; others return the tensor."""
    return output[0] if isinstance(output, tuple) else output


class _Layer:
    """One vLLM decoder layer through :class:`~lmcache.v1.blend.model.BlendLayer`."""

    __slots__ = ("_layer", "_attn")

    def __init__(self, layer: Any) -> None:
        self._layer = layer
        self._attn = layer.self_attn

    def input_norm(self, hidden: torch.Tensor) -> torch.Tensor:
        return self._layer.input_layernorm(hidden)  # no residual argument: the plain, unfused form

    def qkv(self, normed: torch.Tensor, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        attn, n = self._attn, normed.shape[0]
        qkv = _first(attn.qkv_proj(normed))
        q, k, v = qkv.split([attn.q_size, attn.kv_size, attn.kv_size], dim=-1)
        # vLLM's rotary op may work in place on its inputs: give it tensors of its own.
        q, k = attn.rotary_emb(positions.to(torch.int64), q.contiguous(), k.contiguous())
        return (
            q.reshape(n, attn.num_heads, attn.head_dim),
            k.reshape(n, attn.num_kv_heads, attn.head_dim),
            v.reshape(n, attn.num_kv_heads, attn.head_dim),
        )

    def o_proj(self, attn_out: torch.Tensor) -> torch.Tensor:
        return _first(self._attn.o_proj(attn_out))

    def post_norm(self, hidden: torch.Tensor) -> torch.Tensor:
        return self._layer.post_attention_layernorm(hidden)

    def mlp(self, normed: torch.Tensor) -> torch.Tensor:
        return _first(self._layer.mlp(normed))


class VLLMBlendModel:
    """A loaded vLLM Llama-family model (:data:`SUPPORTED_ARCHITECTURES`) as a BlendModel.

    Raises :class:`UnsupportedBlendModel` (a ValueError) for anything it cannot reproduce
    exactly. Holds references to the model's modules; run it under ``torch.inference_mode``
    or ``no_grad`` (the blender does) on the device the model lives on."""

    def __init__(self, model: nn.Module) -> None:
        arch = type(model).__name__
        if arch not in SUPPORTED_ARCHITECTURES:
            raise _refuse(f"architecture {arch} (supported: {', '.join(sorted(SUPPORTED_ARCHITECTURES))})")
        decoder = getattr(model, "model", None)
        layers = getattr(decoder, "layers", None)
        if decoder is None or layers is None or len(layers) == 0:
            raise _refuse(f"{arch} has no model.layers")
        for name in ("embed_tokens", "norm"):
            if _is_missing(getattr(decoder, name, None)):
                raise _refuse(f"model.{name} is missing on this rank (pipeline parallelism)")
        start, end = getattr(decoder, "start_layer", 0), getattr(decoder, "end_layer", len(layers))
        if start != 0 or end != len(layers) or any(_is_missing(layer) for layer in layers):
            raise _refuse(f"this rank holds layers {start}..{end} of {len(layers)} (pipeline parallelism)")
        if not callable(getattr(model, "compute_logits", None)):
            raise _refuse(f"{arch} has no compute_logits")
        for i, layer in enumerate(layers):
            for name in ("input_layernorm", "post_attention_layernorm", "mlp"):
                if getattr(layer, name, None) is None:
                    raise _refuse(f"layer {i} has no {name}")
            _check_attention(getattr(layer, "self_attn", None), i)
        first = layers[0].self_attn
        shapes = {(a.num_heads, a.num_kv_heads, a.head_dim, float(a.scaling)) for a in (x.self_attn for x in layers)}
        if len(shapes) != 1:
            raise _refuse("the layers' attention shapes or scales differ")
        self._model = model
        self._decoder = decoder
        self._layers = [_Layer(layer) for layer in layers]
        self._rope = first.rotary_emb
        self._num_heads, self._num_kv_heads, self._head_dim = first.num_heads, first.num_kv_heads, first.head_dim
        self._scaling = float(first.scaling)
        self._fp32_table: torch.Tensor | None = None

    # ------------------------------------------------------------------ BlendModel
    @property
    def layers(self) -> Sequence[_Layer]:
        return self._layers

    @property
    def scaling(self) -> float:
        return self._scaling

    def embed(self, token_ids: torch.Tensor) -> torch.Tensor:
        return self._decoder.embed_tokens(token_ids)

    def final_norm(self, hidden: torch.Tensor) -> torch.Tensor:
        return self._decoder.norm(hidden)

    def logits(self, normed: torch.Tensor) -> torch.Tensor:
        """vLLM's own head (tied embeddings, logit scale and soft cap as vLLM applies them)."""
        out = self._model.compute_logits(normed)
        assert out is not None, "compute_logits returned None (only on a non-first TP rank, which is refused)"
        return out

    # ------------------------------------------------------------------ geometry
    @property
    def num_layers(self) -> int:
        return len(self._layers)

    @property
    def num_heads(self) -> int:
        return self._num_heads

    @property
    def num_kv_heads(self) -> int:
        return self._num_kv_heads

    @property
    def head_dim(self) -> int:
        return self._head_dim

    @property
    def dtype(self) -> torch.dtype:
        """The dtype of the model's weights, and of the KV it computes."""
        return self._decoder.embed_tokens.weight.dtype

    @property
    def max_position(self) -> int:
        """Positions ``0 .. max_position - 1`` have rotary angles (the cos/sin table's length)."""
        return int(self._rope.cos_sin_cache.shape[0])

    # ------------------------------------------------------------------ RoPE
    def _table(self) -> torch.Tensor:
        """The model's ``[max_position, head_dim]`` cos|sin table in float32 (vLLM keeps it in
        the model dtype; a low-precision one is recomputed in float32 by vLLM's own code)."""
        if self._fp32_table is None:
            cache = self._rope.cos_sin_cache
            if cache.dtype != torch.float32:
                compute = getattr(self._rope, "_compute_cos_sin_cache", None)
                fresh = compute() if callable(compute) else None
                if isinstance(fresh, torch.Tensor) and fresh.shape == cache.shape:
                    cache = fresh
            self._fp32_table = cache.detach().to("cpu", torch.float32)
        return self._fp32_table

    def rerotate(self, keys: torch.Tensor, old_positions: torch.Tensor, new_positions: torch.Tensor) -> torch.Tensor:
        """Keys ``[n, kv_heads, head_dim]`` rotated for ``old_positions``, moved to
        ``new_positions`` with the model's own cos/sin table (delta rotation formed in float64,
        applied in float32, returned in ``keys``' dtype on ``keys``' device). Raises ValueError
        for shapes that do not match or positions outside the table."""
        if keys.dim() != 3 or keys.shape[1:] != (self._num_kv_heads, self._head_dim):
            raise ValueError(f"keys of shape {tuple(keys.shape)}: expected [n, {self._num_kv_heads}, {self._head_dim}]")
        n = keys.shape[0]
        for name, pos in (("old_positions", old_positions), ("new_positions", new_positions)):
            if pos.dim() != 1 or pos.shape[0] != n or pos.dtype.is_floating_point:
                raise ValueError(f"{name}: expected a 1-D integer tensor of {n} entries")
            if n and (int(pos.min()) < 0 or int(pos.max()) >= self.max_position):
                raise ValueError(f"{name}: positions must lie in [0, {self.max_position})")
        table = self._table()
        half = self._head_dim // 2
        old = table.index_select(0, old_positions.to("cpu", torch.int64))
        new = table.index_select(0, new_positions.to("cpu", torch.int64))
        return rerotate_with_tables(keys, old[:, :half], old[:, half:], new[:, :half], new[:, half:])


def blend_model_for(model: nn.Module) -> VLLMBlendModel:
    """``model`` as a BlendModel; raises :class:`UnsupportedBlendModel` with the reason."""
    return VLLMBlendModel(model)
