"""The model vLLM serves, seen by the blender as a :class:`~lmcache.v1.blend.model.BlendModel`.

Two pieces, both used on the worker side (the process that holds the model's weights):

* :class:`VLLMModelTracker`: a process-wide registry ``instance id -> loaded model``. The
  plugin (:mod:`.blend_plugin`) fills it when vLLM loads a model; the connector reads it
  with :func:`model_for`. One worker process serves one model, so a lookup by an unknown
  id falls back to the only registered model.
* :class:`VLLMBlendModel`: an adapter over vLLM's own modules (Llama layout:
  ``model.embed_tokens``, ``model.layers[i].{input_layernorm, self_attn.{qkv_proj,
  [q_norm, k_norm,] rotary_emb, o_proj}, post_attention_layernorm, mlp}``, ``model.norm``,
  and the ``compute_logits`` head), so the blender's selective recompute runs the served
  weights and vLLM's own RoPE (the KV it produces is what vLLM would have computed). It
  copies no weights and never calls vLLM's attention layer (the blender does the attention
  itself), so it needs no forward context.

Which models: decided by structure, not by class name. The adapter reproduces a decoder
whose every layer is exactly ``h += o_proj(attn(rope(norm_qk(qkv_proj(input_layernorm(h))))))``
then ``h += mlp(post_attention_layernorm(h))``, so it checks that the model holds those
modules and nothing else that the forward pass could use (:func:`check_structure`):

* the decoder has only ``embed_tokens``, ``layers`` and ``norm``, no buffers (Gemma's
  embedding normaliser) and no embedding/residual multipliers in its config (Granite,
  MiniCPM); each layer has only the four modules above, a dense (not mixture-of-experts)
  MLP; each attention only ``qkv_proj``, ``o_proj``, ``rotary_emb``, ``attn`` and
  optionally ``q_norm``/``k_norm`` of the Qwen3 form (a norm over ``head_dim`` applied to
  each head before RoPE, as vLLM's ``Qwen3Attention.forward`` does);
* full causal decoder attention (no sliding window, not encoder-only, no dual-chunk, no
  position-dependent scaling), one tensor-parallel rank holding all heads, one pipeline
  rank holding all layers;
* a RoPE that re-rotates exactly (:func:`check_rope`): vLLM's ``RotaryEmbedding`` or a
  subclass that keeps its forward (``cos_sin_cache[positions]``, one row per integer
  position, neox pairing), full width (``rotary_dim == head_size == head_dim``), a single
  table shared by every layer, of unit amplitude (``cos^2 + sin^2 == 1``). The delta
  rotation ``R(new) R(old)^T`` of two rows of such a table is itself a rotation, so moving a
  cached key gives the key computed at the new position, whatever the angles are.

With vLLM 0.32 that admits Llama and Llama-3.x, Mistral (without a window), Qwen2 and Qwen3,
and the RoPE classes ``RotaryEmbedding``, ``Llama3RotaryEmbedding`` (only the inverse
frequencies change), ``LinearScalingRotaryEmbedding`` with one factor (the table is built at
``position / factor``), and the NTK / dynamic-NTK classes (vLLM's tables are static). It
refuses YaRN (unit amplitude only when its ``mscale`` is 1), DeepSeek-YaRN, Phi-3 longrope
(not a ``RotaryEmbedding``: two tables chosen by length), mrope, dual-chunk and Fourier RoPE
(their own forwards), partial and GPT-J-style RoPE. Anything refused raises
:class:`UnsupportedBlendModel` with one reason, so the caller can turn blending off (prefix
reuse keeps working). The scheduler's config-only pre-check is ``check_blending`` in
:mod:`.metadata_builder`; this check has the final word.

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
    "UnsupportedBlendModel",
    "VLLMBlendModel",
    "VLLMModelTracker",
    "blend_model_for",
    "check_rope",
    "check_structure",
    "model_for",
]

logger = logging.getLogger(__name__)

DECODER_MODULES = frozenset({"embed_tokens", "layers", "norm"})
"""The only child modules of ``model.model`` (another one may take part in the forward pass)."""
LAYER_MODULES = frozenset({"input_layernorm", "self_attn", "post_attention_layernorm", "mlp"})
"""A decoder layer's child modules, all required (Gemma-2/3 and OLMo-2 add more norms)."""
ATTENTION_MODULES = frozenset({"qkv_proj", "o_proj", "rotary_emb", "attn", "q_norm", "k_norm"})
"""An attention's allowed child modules (``q_norm``/``k_norm`` optional, together)."""
FORWARD_SCALES = ("embedding_multiplier", "residual_multiplier", "scale_emb", "scale_depth")
"""HF config fields of models whose forward pass scales embeddings or residuals outside any
module (Granite, MiniCPM): the adapter would miss them."""
ROTATION_BASE = "RotaryEmbedding"
"""vLLM's rotary class whose forward (``cos_sin_cache[positions]``, neox or GPT-J pairing)
the adapter's re-rotation inverts; subclasses may change the table, not the forward."""
AMPLITUDE_ULPS = 16
"""Allowed ``|cos^2 + sin^2 - 1|`` of the RoPE table, in units of its dtype's epsilon."""


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


# ----------------------------------------------------------------------------- checks
def _refuse(reason: str) -> UnsupportedBlendModel:
    return UnsupportedBlendModel(f"blending is not supported for this model: {reason}")


def _is_missing(module: Any) -> bool:
    """vLLM puts a ``PPMissingLayer`` where a pipeline-parallel rank holds no weights."""
    return module is None or type(module).__name__ == "PPMissingLayer"


def _children(module: Any) -> set[str]:
    """Names of ``module``'s child modules (none for a non-Module)."""
    named = getattr(module, "named_children", None)
    return {name for name, _ in named()} if callable(named) else set()


def _own(module: Any, kind: str) -> list[str]:
    """Names of ``module``'s own ``kind`` (``named_buffers`` or ``named_parameters``), not
    its children's (none for a non-Module)."""
    named = getattr(module, kind, None)
    return sorted(name for name, _ in named(recurse=False)) if callable(named) else []


def _check_decoder(model: nn.Module) -> tuple[Any, Sequence[Any]]:
    """``model.model`` and its layers: all on this rank, nothing beside embed/layers/norm."""
    arch = type(model).__name__
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
    extra = sorted(_children(decoder) - DECODER_MODULES)
    if extra:
        raise _refuse(f"{arch}'s decoder has modules the blender does not drive: {', '.join(extra)}")
    own = _own(decoder, "named_buffers")
    if own:
        raise _refuse(f"{arch}'s decoder scales its hidden states (buffer {own[0]}, e.g. Gemma's normaliser)")
    config = getattr(model, "config", None)
    for name in FORWARD_SCALES:
        value = getattr(config, name, None)
        if isinstance(value, (int, float)) and not isinstance(value, bool) and float(value) != 1.0:
            raise _refuse(f"{name}={value} (the forward pass scales embeddings or residuals, e.g. Granite, MiniCPM)")
    if not callable(getattr(model, "compute_logits", None)):
        raise _refuse(f"{arch} has no compute_logits")
    return decoder, layers


def _check_layer(layer: Any, index: int) -> None:
    """The four modules of a Llama-layout layer and nothing else; a dense MLP."""
    for name in sorted(LAYER_MODULES):
        if getattr(layer, name, None) is None:
            raise _refuse(f"layer {index} has no {name}")
    extra = sorted(_children(layer) - LAYER_MODULES)
    if extra:
        raise _refuse(f"layer {index} has modules the blender does not drive: {', '.join(extra)}")
    mlp = layer.mlp
    parts = mlp.modules() if isinstance(mlp, nn.Module) else [mlp]
    if getattr(mlp, "experts", None) is not None or any("moe" in type(m).__name__.lower() for m in parts):
        raise _refuse(f"layer {index}'s MLP is a mixture of experts ({type(mlp).__name__})")
    _check_attention(layer.self_attn, index)


def _check_qk_norm(attn: Any, index: int) -> bool:
    """True when the attention normalises q and k per head before RoPE (Qwen3's form:
    ``q_norm``/``k_norm`` with a ``[head_dim]`` weight); False when it has neither."""
    q_norm, k_norm = getattr(attn, "q_norm", None), getattr(attn, "k_norm", None)
    if q_norm is None and k_norm is None:
        if getattr(attn, "qk_norm", False) is True:
            raise _refuse(f"layer {index}'s attention sets qk_norm but has no q_norm/k_norm")
        return False
    if q_norm is None or k_norm is None:
        raise _refuse(f"layer {index}'s attention has only one of q_norm/k_norm")
    for name, norm in (("q_norm", q_norm), ("k_norm", k_norm)):
        weight = getattr(norm, "weight", None)
        if not callable(norm) or not isinstance(weight, torch.Tensor) or tuple(weight.shape) != (attn.head_dim,):
            shape = tuple(weight.shape) if isinstance(weight, torch.Tensor) else None
            raise _refuse(
                f"layer {index}'s {name} is not a per-head norm (weight {shape}, head_dim {attn.head_dim}; "
                "only Qwen3's form, a norm over head_dim before RoPE)"
            )
    return True


def _check_attention(attn: Any, index: int) -> None:
    if attn is None or getattr(attn, "qkv_proj", None) is None:
        raise _refuse(f"layer {index}'s attention has no fused qkv_proj (e.g. MLA)")
    for name in ("q_size", "kv_size", "num_heads", "num_kv_heads", "head_dim", "scaling", "o_proj"):
        if getattr(attn, name, None) is None:
            raise _refuse(f"layer {index}'s attention has no {name}")
    extra = sorted(_children(attn) - ATTENTION_MODULES)
    if extra:
        raise _refuse(f"layer {index}'s attention has modules the blender does not drive: {', '.join(extra)}")
    own = _own(attn, "named_parameters")
    if own:
        raise _refuse(f"layer {index}'s attention has its own parameter {own[0]} (e.g. attention sinks)")
    _check_qk_norm(attn, index)
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
    check_rope(getattr(attn, "rotary_emb", None), attn.head_dim)


def _own_rotation(rope: Any) -> str | None:
    """Why ``rope``'s forward is not vLLM's ``RotaryEmbedding`` forward, or None when it is
    (the class is ``RotaryEmbedding`` or a subclass that defines no ``forward*`` method)."""
    mro = type(rope).__mro__
    names = [cls.__name__ for cls in mro]
    if ROTATION_BASE not in names:
        return "is not vLLM's RotaryEmbedding nor a subclass of it"
    for cls in mro[: names.index(ROTATION_BASE)]:
        own = sorted(name for name in vars(cls) if name.startswith("forward"))
        if own:
            return f"replaces the standard rotation ({cls.__name__}.{own[0]})"
    return None


def check_rope(rope: Any, head_dim: int) -> None:
    """``rope`` applies, by vLLM's own forward, a full-width neox rotation read from one
    ``[max_positions, head_dim]`` table row per integer position; raises
    :class:`UnsupportedBlendModel` otherwise. The table's amplitude is checked by
    :class:`VLLMBlendModel` (it needs the float32 table)."""
    if rope is None:
        raise _refuse("the attention has no rotary_emb")
    kind = type(rope).__name__
    why = _own_rotation(rope)
    if why is not None:
        raise _refuse(f"rotary embedding {kind} {why}: its keys cannot be re-rotated by the cos/sin table")
    if not getattr(rope, "is_neox_style", False):
        raise _refuse(f"non-neox (GPT-J style) RoPE pairing ({kind})")
    if getattr(rope, "rotary_dim", None) != head_dim or getattr(rope, "head_size", head_dim) != head_dim:
        raise _refuse(f"partial rotary embedding (rotary_dim={getattr(rope, 'rotary_dim', None)}, head_dim={head_dim})")
    factors = getattr(rope, "scaling_factors", None)
    if isinstance(factors, (list, tuple)) and len(factors) > 1:
        raise _refuse(f"rotary embedding {kind} with {len(factors)} stacked scaling factors (one table per factor)")
    cache = getattr(rope, "cos_sin_cache", None)
    if not isinstance(cache, torch.Tensor) or cache.dim() != 2 or cache.shape[1] != head_dim:
        raise _refuse(f"rotary embedding {kind} has no [max_positions, head_dim] cos_sin_cache")


def _same_rope(a: Any, b: Any) -> bool:
    if a is b:
        return True
    ta, tb = a.cos_sin_cache, b.cos_sin_cache
    return type(a) is type(b) and ta.shape == tb.shape and torch.equal(ta, tb.to(ta.device, ta.dtype))


def check_structure(model: nn.Module) -> None:
    """Raise :class:`UnsupportedBlendModel` unless the adapter reproduces ``model``'s forward
    pass exactly (module docstring); the RoPE table's amplitude is checked apart."""
    _, layers = _check_decoder(model)
    for i, layer in enumerate(layers):
        _check_layer(layer, i)
    first = layers[0].self_attn
    shapes = {(a.num_heads, a.num_kv_heads, a.head_dim, float(a.scaling)) for a in (x.self_attn for x in layers)}
    if len(shapes) != 1:
        raise _refuse("the layers' attention shapes or scales differ")
    for i, layer in enumerate(layers):
        if not _same_rope(layer.self_attn.rotary_emb, first.rotary_emb):
            raise _refuse(f"layer {i}'s rotary embedding differs from layer 0's (per-layer RoPE)")


def _float32_table(rope: Any) -> tuple[torch.Tensor, torch.dtype]:
    """``rope``'s cos|sin table in float32 on the CPU, and the dtype it was computed in (vLLM
    keeps it in the model dtype; a low-precision one is recomputed by vLLM's own code)."""
    cache = rope.cos_sin_cache
    if cache.dtype != torch.float32:
        compute = getattr(rope, "_compute_cos_sin_cache", None)
        fresh = compute() if callable(compute) else None
        if isinstance(fresh, torch.Tensor) and fresh.shape == cache.shape:
            cache = fresh
    return cache.detach().to("cpu", torch.float32), cache.dtype


def _check_amplitude(rope: Any, table: torch.Tensor, source: torch.dtype) -> None:
    """Refuse a table whose rows are not unit vectors (YaRN's and longrope's ``mscale``):
    moving a key by two such rows would scale it."""
    half = table.shape[1] // 2
    err = float((table[:, :half].double().square() + table[:, half:].double().square() - 1.0).abs().max())
    tolerance = AMPLITUDE_ULPS * torch.finfo(source).eps
    if err > tolerance:
        raise _refuse(
            f"rotary embedding {type(rope).__name__} scales its cos/sin table (|cos^2 + sin^2 - 1| up to "
            f"{err:.3g}, e.g. YaRN's mscale): re-rotation needs a pure rotation"
        )


def _first(output: Any) -> torch.Tensor:
    """vLLM's linear layers return ``(output, bias)``; others return the tensor."""
    return output[0] if isinstance(output, tuple) else output


# ----------------------------------------------------------------------------- adapter
class _Layer:
    """One vLLM decoder layer through :class:`~lmcache.v1.blend.model.BlendLayer`."""

    __slots__ = ("_layer", "_attn", "_qk_norm")

    def __init__(self, layer: Any) -> None:
        self._layer = layer
        self._attn = layer.self_attn
        self._qk_norm = getattr(self._attn, "q_norm", None) is not None

    def input_norm(self, hidden: torch.Tensor) -> torch.Tensor:
        return self._layer.input_layernorm(hidden)  # no residual argument: the plain, unfused form

    def qkv(self, normed: torch.Tensor, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        attn, n = self._attn, normed.shape[0]
        qkv = _first(attn.qkv_proj(normed))
        q, k, v = qkv.split([attn.q_size, attn.kv_size, attn.kv_size], dim=-1)
        if self._qk_norm:  # Qwen3Attention.forward: a norm over each head, before RoPE
            q = attn.q_norm(q.view(n, attn.num_heads, attn.head_dim)).view(n, attn.q_size)
            k = attn.k_norm(k.view(n, attn.num_kv_heads, attn.head_dim)).view(n, attn.kv_size)
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
    """A loaded vLLM model of the Llama layout (Llama, Llama-3.x, Mistral, Qwen2, Qwen3...)
    as a BlendModel.

    Raises :class:`UnsupportedBlendModel` (a ValueError) for anything it cannot reproduce
    exactly (:func:`check_structure`, :func:`check_rope`, a table of non-unit amplitude).
    Holds references to the model's modules; run it under ``torch.inference_mode`` or
    ``no_grad`` (the blender does) on the device the model lives on."""

    def __init__(self, model: nn.Module) -> None:
        check_structure(model)
        decoder = model.model
        first = decoder.layers[0].self_attn
        table, source = _float32_table(first.rotary_emb)
        _check_amplitude(first.rotary_emb, table, source)
        self._model = model
        self._decoder = decoder
        self._layers = [_Layer(layer) for layer in decoder.layers]
        self._rope = first.rotary_emb
        self._num_heads, self._num_kv_heads, self._head_dim = first.num_heads, first.num_kv_heads, first.head_dim
        self._scaling = float(first.scaling)
        self._fp32_table = table
        logger.debug(
            "blend: driving %s (%d layers, rotary %s, q/k norm %s)",
            type(model).__name__, len(self._layers), type(self._rope).__name__, self._layers[0]._qk_norm,
        )  # fmt: skip

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
        """The model's ``[max_position, head_dim]`` cos|sin table in float32 (read at start)."""
        return self._fp32_table

    def rerotate(self, keys: torch.Tensor, old_positions: torch.Tensor, new_positions: torch.Tensor) -> torch.Tensor:
        """Keys ``[n, heads, head_dim]`` rotated for ``old_positions``, moved to
        ``new_positions`` with the model's own cos/sin table (delta rotation formed in float64,
        applied in float32, returned in ``keys``' dtype on ``keys``' device). ``heads`` is a
        multiple of the KV heads (several layers side by side). Raises ValueError for shapes
        that do not match or positions outside the table."""
        if keys.dim() != 3 or keys.shape[1] % self._num_kv_heads or keys.shape[2] != self._head_dim:
            raise ValueError(
                f"keys of shape {tuple(keys.shape)}: expected [n, a multiple of {self._num_kv_heads}, {self._head_dim}]"
            )
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
