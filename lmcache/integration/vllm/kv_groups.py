"""Which attention layouts the connector can serve: vLLM's KV cache groups, read once.

vLLM groups a model's layers by the kind of KV they keep (``kv_cache_config.
kv_cache_groups``, one ``KVCacheGroupSpec`` per group, each with its own block table).
lmcache stores one chunk entry holding every layer's KV, and serves:

* one group of ``FullAttentionSpec``: every token's KV stays in its blocks until the
  request ends;
* one group of ``SlidingWindowSpec``: an all-sliding-window model (every layer windowed).
  vLLM frees the blocks that fall out of the window (``remove_skipped_blocks``, run when
  the next step is scheduled), and a request admitted with cached tokens gets *null*
  blocks for the part of its prefix already out of the window. Those blocks hold nothing
  (or another request's KV): the planner never reads or writes through them
  (:class:`WindowRule`);
* one group of ``MLAAttentionSpec``: the latent KV of MLA models (one tensor per layer);
* **several groups** (vLLM's hybrid KV cache manager, HMA, kept on because the connector
  implements ``SupportsHMA``): sliding-window layers mixed with full-attention ones
  (Gemma 2/3, gpt-oss, Cohere 2...). Each group's layers use their group's block table
  (the slot mapping has one row per group, :func:`group_slot_mapping`); a sliding group
  follows its own :class:`WindowRule`, full-attention groups keep everything. At least
  one group must be full attention (its row is the *primary* one: it says which tokens a
  copy covers), every group the same block size.

With vLLM's built-in connector name (its wrapper does not declare ``SupportsHMA``) vLLM
turns HMA off and a mixed model arrives as one full-attention group, as before.
Everything else (Mamba / linear-attention state, cross-attention, chunked-local or sink
attention, MLA mixed with others) is refused at start-up with one line naming the
model's layer kinds, instead of a cache that would serve wrong KV.

Only the adapter reads vLLM objects; this module uses attribute access and class
names (duck typing), so unit tests pass small fakes.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

SUPPORTED_KINDS = ("FullAttentionSpec", "SlidingWindowSpec", "MLAAttentionSpec")
HYBRID_KINDS = ("FullAttentionSpec", "SlidingWindowSpec", "MambaSpec")
"""Kinds of the groups of a hybrid (several-group) layout."""
STATE_KIND = "MambaSpec"
"""vLLM's group kind of recurrent state (Mamba2, gated delta net), one block per state."""
SUPPORTED_TEXT = (
    "full attention, all-sliding-window attention, MLA, or sliding-window + full attention mixed "
    "(several KV cache groups, one of them full attention)"
)
"""What single- and attention-group layouts lmcache serves (refusal messages)."""


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
class KVGroup:
    """One of vLLM's KV cache groups (hybrid layouts): its kind, window and layers."""

    kind: str
    """``FullAttentionSpec``, ``SlidingWindowSpec`` or ``MambaSpec`` (recurrent state)."""
    sliding_window: int | None
    layer_names: tuple[str, ...]
    block_size: int = 0
    """Tokens per block (a ``MambaSpec`` group: tokens between two cached states)."""

    @property
    def is_state(self) -> bool:
        return self.kind == STATE_KIND

    def window_rule(self, block_size: int) -> WindowRule | None:
        return None if self.sliding_window is None else WindowRule(self.sliding_window, block_size)


@dataclass(frozen=True, slots=True)
class KVGroups:
    """What the connector knows of vLLM's KV cache groups."""

    kind: str
    """Class name of the single group's spec (one of :data:`SUPPORTED_KINDS`); ``"hybrid"``
    with several groups."""
    sliding_window: int | None = None
    """Tokens in the window when the single group is ``SlidingWindowSpec``, else None."""
    groups: tuple[KVGroup, ...] = ()
    """Several groups (vLLM's hybrid KV cache manager), in vLLM's order; empty for one group."""
    block_size: int | None = None
    """The groups' common block size (hybrid layouts; vLLM may pick it apart from the cache config's)."""

    @property
    def hybrid(self) -> bool:
        return len(self.groups) > 1

    @property
    def state_group(self) -> int | None:
        """The index of the recurrent-state (``MambaSpec``) group, or None."""
        return next((i for i, g in enumerate(self.groups) if g.is_state), None)

    @property
    def attention_groups(self) -> tuple[int, ...]:
        """Indices of the attention groups (the slot-mapping rows, in this order)."""
        return tuple(i for i, g in enumerate(self.groups) if not g.is_state)

    @property
    def primary(self) -> int:
        """The slot row (among :attr:`attention_groups`) that says which tokens a copy
        covers: the first full-attention group's."""
        rows = [self.groups[i] for i in self.attention_groups]
        return next((r for r, g in enumerate(rows) if g.sliding_window is None), 0)

    @property
    def num_attention_layers(self) -> int:
        return sum(len(self.groups[i].layer_names) for i in self.attention_groups)

    def describe(self) -> str:
        if self.hybrid:
            parts = [
                f"{len(g.layer_names)} x {g.kind}" + (f"(window={g.sliding_window})" if g.sliding_window else "")
                for g in self.groups
            ]
            return f"hybrid KV cache groups [{', '.join(parts)}]"
        if self.sliding_window is None:
            return self.kind
        return f"{self.kind}(window={self.sliding_window})"

    def window_rule(self, block_size: int) -> WindowRule | None:
        """The block-freeing rule of a single all-sliding-window group (None otherwise)."""
        return None if self.sliding_window is None else WindowRule(self.sliding_window, block_size)

    def group_windows(self, block_size: int) -> tuple[WindowRule | None, ...]:
        """Each group's rule (hybrid layouts; None for a full-attention or state group)."""
        return tuple(g.window_rule(block_size) for g in self.groups)

    def state_layers(self) -> tuple[str, ...]:
        """The recurrent layers' names (empty without a state group)."""
        g = self.state_group
        return () if g is None else self.groups[g].layer_names

    def layer_groups(self, layer_names: Iterable[str]) -> tuple[int, ...]:
        """The slot row (index among :attr:`attention_groups`) of each attention layer of
        ``layer_names`` (hybrid layouts); ValueError for a layer no attention group names."""
        rows = self.attention_groups
        where = {name: r for r, i in enumerate(rows) for name in self.groups[i].layer_names}
        out = []
        for name in layer_names:
            if name not in where:
                raise ValueError(f"KV layer {name!r} is in none of vLLM's KV cache groups ({self.describe()})")
            out.append(where[name])
        return tuple(out)


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
        return _read_hybrid(groups, model)
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


def _read_hybrid(groups: list[Any], model: str) -> KVGroups:
    """Several groups (vLLM's hybrid KV cache manager): sliding-window and full attention only."""
    out = []
    block_sizes = set()
    for group in groups:
        kinds = _spec_kinds(group.kv_cache_spec)
        names = {k for k, _ in kinds}
        if len(names) != 1 or not names <= set(HYBRID_KINDS):
            raise UnsupportedModelError(
                f"{model}: vLLM keeps its KV in {len(groups)} cache groups ({_layer_kinds(groups)}); with several "
                f"groups lmcache supports sliding-window and full attention, and one group of recurrent state "
                "(MambaSpec) beside full attention (not MLA, cross-attention, chunked-local or sink attention). "
                "Serve this model without the lmcache connector."
            )
        kind = names.pop()
        if kind == STATE_KIND:
            out.append(_state_group(group, kinds, model))
            continue
        window = None
        if kind == "SlidingWindowSpec":
            windows = {int(s.sliding_window) for _, s in kinds}
            if len(windows) > 1:
                raise UnsupportedModelError(f"{model}: sliding windows of different sizes {sorted(windows)} in one group")
            window = windows.pop()
        own = {int(getattr(s, "block_size", 0)) for _, s in kinds}
        block_sizes |= own
        out.append(KVGroup(kind, window, tuple(getattr(group, "layer_names", None) or ()), max(own)))
    if sum(g.is_state for g in out) > 1:
        raise UnsupportedModelError(f"{model}: {sum(g.is_state for g in out)} recurrent-state groups; lmcache "
                                    "supports one")  # fmt: skip
    if all(g.sliding_window is not None or g.is_state for g in out):
        raise UnsupportedModelError(
            f"{model}: {len(out)} sliding-window KV cache groups and no full-attention one ({_layer_kinds(groups)}); "
            f"lmcache supports {SUPPORTED_TEXT}. Serve this model without the lmcache connector."
        )
    if len(block_sizes) > 1:
        raise UnsupportedModelError(
            f"{model}: KV cache groups with different block sizes {sorted(block_sizes)}; lmcache needs one block size"
        )
    return KVGroups("hybrid", None, tuple(out), block_sizes.pop() or None)


def _state_group(group: Any, kinds: list[tuple[str, Any]], model: str) -> KVGroup:
    """A recurrent-state group: cached only with vLLM's state-per-block mode (``align``)."""
    spec = kinds[0][1]
    mode = getattr(spec, "mamba_cache_mode", "align")
    if mode != "align":
        raise UnsupportedModelError(
            f"{model}: vLLM keeps this model's recurrent state in mamba_cache_mode={mode!r} (one state per "
            "request); lmcache needs 'align' (a state per block, so a cached prefix can resume): start vLLM with "
            "prefix caching on (--enable-prefix-caching), or --mamba-cache-mode align"
        )
    block = int(getattr(spec, "block_size", 0) or 0)
    if block <= 0:
        raise UnsupportedModelError(f"{model}: the recurrent-state group has block_size={block}; expected > 0")
    return KVGroup(STATE_KIND, None, tuple(getattr(group, "layer_names", None) or ()), block)


def refuse_unsupported_model(vllm_config: Any, *, hma: bool = False) -> None:
    """Early check from the model config alone (before vLLM builds its cache groups).

    A model with recurrent layers (Mamba / linear attention) needs vLLM's hybrid KV cache
    manager, which vLLM keeps on only for a connector that declares ``SupportsHMA``
    (``hma``: ``LMCacheConnectorV1Dynamic``); without it, or for an attention-free model,
    refused here naming the layer types. Raises :class:`UnsupportedModelError`.
    """
    model = getattr(vllm_config, "model_config", None)
    if model is None:
        return
    name = getattr(model, "model", "the model")
    free = bool(getattr(model, "is_attention_free", False))
    if free or (bool(getattr(model, "is_hybrid", False)) and not hma):
        layer_types = getattr(getattr(model, "hf_config", None), "layer_types", None)
        kinds = sorted(set(layer_types)) if isinstance(layer_types, (list, tuple)) else "attention-free or hybrid"
        how = (
            "an attention-free model has no KV to cache"
            if free
            else "vLLM's built-in LMCacheConnectorV1 turns vLLM's hybrid KV cache manager off, which this model "
            "needs: use LMCacheConnectorV1Dynamic (kv_connector_module_path: lmcache.integration.vllm."
            "lmcache_connector_v1)"
        )
        raise UnsupportedModelError(
            f"{name}: layer types {kinds} keep recurrent (Mamba / linear-attention) state; {how}. lmcache supports "
            f"{SUPPORTED_TEXT}, and recurrent state beside full attention with LMCacheConnectorV1Dynamic."
        )
