"""Which attention layouts the connector can serve: vLLM's KV cache groups, read once.

vLLM groups a model's layers by the kind of KV they keep (``kv_cache_config.
kv_cache_groups``, one ``KVCacheGroupSpec`` per group). lmcache stores one chunk
format for every layer, so it serves models whose layers end up in **one** group of a
kind it understands:

* ``FullAttentionSpec``: every token's KV stays in its blocks until the request ends.
* ``SlidingWindowSpec``: an all-sliding-window model (every layer windowed). vLLM frees
  the blocks that fall out of the window (``remove_skipped_blocks``, run when the next
  step is scheduled), and a request admitted with cached tokens gets *null* blocks for
  the part of its prefix already out of the window. Those blocks hold nothing (or
  another request's KV): the planner never reads or writes through them
  (:class:`WindowRule`).
* ``MLAAttentionSpec``: the latent KV of MLA models (one tensor per layer).

Models whose sliding-window layers are mixed with full-attention ones (Gemma 3,
gpt-oss) arrive here as one full-attention group: a connector without vLLM's hybrid
allocator interface makes vLLM keep full KV for every layer. Everything else (Mamba /
linear-attention state, cross-attention, chunked-local or sink attention, several
groups) is refused at start-up with one line naming the model's layer kinds, instead of
a cache that would serve wrong KV.

Only the adapter reads vLLM objects; this module uses attribute access and class
names (duck typing), so unit tests pass small fakes.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

SUPPORTED_KINDS = ("FullAttentionSpec", "SlidingWindowSpec", "MLAAttentionSpec")
SUPPORTED_TEXT = "full attention, all-sliding-window attention, MLA, or sliding + full attention mixed (one group)"


class UnsupportedModelError(ValueError):
    """The model's KV layout is one lmcache cannot cache correctly (raised at start-up)."""


@dataclass(frozen=True, slots=True)
class WindowRule:
    """Which of a request's blocks are live in an all-sliding-window group.

    vLLM's rule (``SlidingWindowManager.get_num_skipped_tokens``): once ``n`` tokens of a
    request are computed, the ``n - window + 1`` oldest tokens are outside every future
    query's window and their whole blocks are freed (or, for tokens a request is admitted
    with, never allocated: null blocks).
    """

    window: int
    block_size: int

    def __post_init__(self) -> None:
        if self.window < 1 or self.block_size < 1:
            raise ValueError(f"window={self.window}, block_size={self.block_size}: expected positive integers")

    def live_start(self, num_computed: int) -> int:
        """First token whose block is still allocated once ``num_computed`` tokens are computed."""
        skipped = max(0, num_computed - self.window + 1)
        return skipped - skipped % self.block_size

    @property
    def max_admitted(self) -> int:
        """The most computed tokens (vLLM's own plus loaded) a request may be admitted with
        and still get a real block for every one of them (no null blocks): beyond it, a
        failed load could not be recomputed (vLLM would recompute from a block whose
        window lies in null blocks)."""
        return self.window + self.block_size - 2


@dataclass(frozen=True, slots=True)
class KVGroups:
    """What the connector knows of vLLM's KV cache groups."""

    kind: str
    """Class name of the single group's spec (one of :data:`SUPPORTED_KINDS`)."""
    sliding_window: int | None = None
    """Tokens in the window when the group is ``SlidingWindowSpec``, else None."""

    def describe(self) -> str:
        if self.sliding_window is None:
            return self.kind
        return f"{self.kind}(window={self.sliding_window})"

    def window_rule(self, block_size: int) -> WindowRule | None:
        return None if self.sliding_window is None else WindowRule(self.sliding_window, block_size)


def _spec_kinds(spec: Any) -> list[tuple[str, Any]]:
    """(class name, spec) of a group spec, unpacking vLLM's per-layer uniform wrapper."""
    inner = getattr(spec, "kv_cache_specs", None)
    if type(spec).__name__ == "UniformTypeKVCacheSpecs" and isinstance(inner, dict) and inner:
        return [(type(s).__name__, s) for s in inner.values()]
    return [(type(spec).__name__, spec)]


def _layer_kinds(groups: Iterable[Any]) -> str:
    """``"28 x FullAttentionSpec, 4 x MambaSpec"``: layers per kind, for messages."""
    seen: dict[str, int] = {}
    for group in groups:
        kinds = _spec_kinds(group.kv_cache_spec)
        per_kind = 1 if len(kinds) > 1 else max(1, len(getattr(group, "layer_names", None) or ()))
        for kind, _ in kinds:
            seen[kind] = seen.get(kind, 0) + per_kind
    return ", ".join(f"{n} x {k}" for k, n in seen.items())


def read_kv_groups(kv_cache_config: Any, model: str = "the model") -> KVGroups:
    """Classify ``kv_cache_config.kv_cache_groups``; raises :class:`UnsupportedModelError`.

    A config without groups (older vLLM, unit fakes) counts as full attention.
    """
    groups = list(getattr(kv_cache_config, "kv_cache_groups", None) or ())
    if not groups:
        return KVGroups("FullAttentionSpec")
    if len(groups) > 1:
        raise UnsupportedModelError(
            f"{model}: vLLM keeps its KV in {len(groups)} cache groups ({_layer_kinds(groups)}); lmcache supports "
            f"one group: {SUPPORTED_TEXT}. Serve this model without the lmcache connector."
        )
    kinds = _spec_kinds(groups[0].kv_cache_spec)
    names = {k for k, _ in kinds}
    bad = sorted(names - set(SUPPORTED_KINDS))
    if bad or len(names) > 1:
        raise UnsupportedModelError(
            f"{model}: KV cache layers of kind {_layer_kinds(groups)}; lmcache supports {SUPPORTED_TEXT} "
            "(not Mamba/linear-attention state, cross-attention, chunked-local or sink attention). "
            "Serve this model without the lmcache connector."
        )
    kind, spec = kinds[0]
    if kind != "SlidingWindowSpec":
        return KVGroups(kind)
    windows = {int(s.sliding_window) for _, s in kinds}
    if len(windows) > 1:
        raise UnsupportedModelError(f"{model}: sliding windows of different sizes {sorted(windows)} in one group")
    return KVGroups(kind, windows.pop())


def refuse_unsupported_model(vllm_config: Any) -> None:
    """Early check from the model config alone (before vLLM builds its cache groups).

    vLLM rejects a hybrid model (Mamba / linear attention + attention) for a connector
    without its hybrid-allocator interface with an error that does not say why; this
    names the reason first. Raises :class:`UnsupportedModelError`.
    """
    model = getattr(vllm_config, "model_config", None)
    if model is None:
        return
    name = getattr(model, "model", "the model")
    if bool(getattr(model, "is_attention_free", False)) or bool(getattr(model, "is_hybrid", False)):
        layer_types = getattr(getattr(model, "hf_config", None), "layer_types", None)
        kinds = sorted(set(layer_types)) if isinstance(layer_types, (list, tuple)) else "attention-free or hybrid"
        raise UnsupportedModelError(
            f"{name}: layer types {kinds} keep recurrent (Mamba / linear-attention) state that lmcache does not "
            f"cache; lmcache supports {SUPPORTED_TEXT}. Serve this model without the lmcache connector."
        )
