"""The connectors' paged-KV checks: one call's KV tensors and slot mapping, validated once.

* :class:`PagedKVSpec` - what a connector expects of every layer tensor (layer count,
  hidden size, K/V or MLA, dtype, layout).
* :func:`check_kv_layers` / :func:`kv_geometry` - per-layer tensors checked against the
  spec and against each other; the layer geometry from :mod:`.layouts` (cached per
  connector in a :class:`GeometryCache`).
* :func:`check_slot_mapping` - a slot mapping (int32/int64, inside the paged cache's
  capacity) and the index of its first unmapped (negative) slot.
* :func:`check_layer_groups` / :func:`layer_runs` - a layer -> KV cache group assignment
  (vLLM's hybrid KV cache manager) and each group's layers as strided runs.
* :class:`PagedKV` - the result: the validated tensors, slots and geometry of one call,
  built by a connector's ``bind`` and carried by the engine's ``TransferRequest``.

Layer groups: with vLLM's hybrid KV cache manager the layers fall into KV cache groups
(e.g. sliding-window layers and full-attention layers). Every layer tensor has the same
shape and strides, but each group has its own block table, so a token's slot depends on
the group of the layer being copied. The slot mapping is then 2-D, one row per group
(``slot_mapping[g, t]``: the slot of token ``t`` in the layers of group ``g``). One row is
the *primary* one: it says which tokens a call covers (``PagedKV.token_slots``,
``PagedKV.first_unmapped``). A negative slot in another row means that group does not
hold the token (e.g. a sliding-window group whose blocks vLLM freed): loads skip it, and
a store refuses any chunk containing one (it would cache KV that is not there). A 1-D
mapping means every group shares one row (the single-group path, unchanged).

Bad input raises ``TypeError`` (wrong type) or ``ValueError`` (wrong value). The copy
paths trust a :class:`PagedKV` (the native kernels still bound-check their run ends).

Thread-safety: :class:`PagedKVSpec` and :class:`PagedKV` are immutable; a
:class:`GeometryCache` belongs to one connector. Memory: a :class:`PagedKV` references
the caller's tensors for the duration of the call only.
"""

from __future__ import annotations

import functools
import operator
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch

from lmcache.v1.gpu_connector.layouts import KVLayout, PagedGeometry, detect_layout
from lmcache.v1.request import native_int_stats

_SLOT_DTYPES = (torch.int32, torch.int64)


@dataclass(frozen=True, slots=True)
class PagedKVSpec:
    """What a connector expects of every layer tensor."""

    num_layers: int
    hidden: int
    num_kv: int
    dtype: torch.dtype | None  # None: any (the connector adopts the first one it sees)
    use_mla: bool
    layout: KVLayout | None  # None: detected from the rank


LayerRun = tuple[int, int, int]
"""``(start, stop, step)``: the layers ``range(start, stop, step)``, as a slice of the layer list."""


@dataclass(frozen=True, slots=True)
class PagedKV:
    """Validated paged KV tensors and slot mapping of one call.

    Every layer has the same shape, strides, dtype and device (checked), so
    ``geometry`` describes each of them; ``capacity`` (blocks x block size) bounds every
    slot. ``slot_mapping`` is the caller's tensor moved to the KV device (int32 or
    int64): 1-D (one slot per token, every layer), or 2-D ``[G, >= tokens]`` with one row
    per KV cache group, in which case ``layer_groups[l]`` is the group (row) of layer
    ``l`` and ``primary`` the row that says which tokens the call covers (see the module
    docstring). ``layer_groups`` is set exactly when ``slot_mapping`` is 2-D.
    ``first_unmapped`` is the index of the first negative slot of :attr:`token_slots`
    (or the token count); ``group_first_unmapped`` the same per row (2-D only, else ``()``).
    """

    kvcaches: tuple[torch.Tensor, ...]
    slot_mapping: torch.Tensor
    geometry: PagedGeometry
    first_unmapped: int
    sync: bool = True
    layer_groups: tuple[int, ...] | None = None
    primary: int = 0
    group_first_unmapped: tuple[int, ...] = ()

    @property
    def capacity(self) -> int:
        return self.geometry.num_blocks * self.geometry.block_size

    @property
    def grouped(self) -> bool:
        """Whether the layers use per-group slot rows (a 2-D ``slot_mapping``)."""
        return self.layer_groups is not None

    @property
    def token_slots(self) -> torch.Tensor:
        """The 1-D slot of each token: the primary row of a 2-D mapping, else the mapping itself."""
        if self.layer_groups is None:
            return self.slot_mapping
        return self.slot_mapping[self.primary]


class GeometryCache:
    """Last (shape, strides) -> geometry, per connector (one layer shape per engine)."""

    __slots__ = ("key", "geometry")

    def __init__(self) -> None:
        self.key: tuple[tuple[int, ...], tuple[int, ...]] | None = None
        self.geometry: PagedGeometry | None = None


def check_kv_layers(kvcaches: object, spec: PagedKVSpec) -> tuple[torch.Tensor, ...]:
    """Validate per-layer KV tensors against ``spec`` and each other; returns them as a tuple."""
    if isinstance(kvcaches, torch.Tensor) or not isinstance(kvcaches, Sequence):
        raise TypeError(f"kvcaches: expected a list of per-layer tensors, got {type(kvcaches).__name__}")
    layers = tuple(kvcaches)
    if len(layers) != spec.num_layers:
        raise ValueError(f"kvcaches: expected {spec.num_layers} layer tensors, got {len(layers)}")
    first = layers[0]
    if not isinstance(first, torch.Tensor):
        raise TypeError(f"kvcaches[0]: expected a torch.Tensor, got {type(first).__name__}")
    shape, strides, dtype, device = first.shape, first.stride(), first.dtype, first.device
    if spec.dtype is not None and dtype != spec.dtype:
        raise ValueError(f"kvcaches[0]: dtype {dtype} does not match the connector dtype {spec.dtype}")
    for i in range(1, len(layers)):
        t = layers[i]
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"kvcaches[{i}]: expected a torch.Tensor, got {type(t).__name__}")
        if t.shape != shape or t.dtype != dtype or t.device != device or t.stride() != strides:
            raise ValueError(
                f"kvcaches[{i}]: shape/strides/dtype/device {tuple(t.shape)}/{t.stride()}/{t.dtype}/{t.device} differ "
                f"from layer 0 ({tuple(shape)}/{strides}/{dtype}/{device}); every layer must have the same layout"
            )
    return layers


def kv_geometry(first: torch.Tensor, spec: PagedKVSpec, cache: GeometryCache | None = None) -> PagedGeometry:
    """The geometry of a (validated) layer tensor under ``spec``'s layout, cached."""
    key = (tuple(first.shape), first.stride())
    if cache is not None and cache.key == key:
        assert cache.geometry is not None
        return cache.geometry
    if any(st == 0 and n > 1 for n, st in zip(first.shape, first.stride())):
        raise ValueError(f"kvcaches: layer strides {first.stride()} overlap (a zero stride); expected distinct elements")
    if first.numel() == 0:
        raise ValueError(f"kvcaches: layer shape {tuple(first.shape)} is empty")
    layout = spec.layout or detect_layout(first, use_mla=spec.use_mla)
    geom = layout.geometry(first)
    if geom.hidden != spec.hidden or len(geom.components) != spec.num_kv:
        raise ValueError(
            f"kvcaches: layer shape {tuple(first.shape)} gives hidden={geom.hidden} and "
            f"{len(geom.components)} component(s); expected hidden={spec.hidden}, {spec.num_kv}"
        )
    if cache is not None:
        cache.key, cache.geometry = key, geom
    return geom


def check_slot_mapping(slot_mapping: object, n: int, capacity: int, device: torch.device) -> tuple[torch.Tensor, int]:
    """Validate a slot mapping for ``n`` tokens; returns (slots on ``device``, first negative index).

    Must be a 1-D int32/int64 tensor with at least ``n`` entries; every one of the first
    ``n`` slots must be < ``capacity`` (negative = the token has no slot: skipped).
    """
    if slot_mapping is None:
        raise ValueError("slot_mapping: missing; expected a 1-D int32/int64 tensor with one slot per token")
    if not isinstance(slot_mapping, torch.Tensor):
        raise TypeError(f"slot_mapping: expected a 1-D int32/int64 torch.Tensor, got {type(slot_mapping).__name__}")
    dtype = slot_mapping.dtype
    if dtype not in _SLOT_DTYPES:
        raise TypeError(f"slot_mapping: dtype {dtype}; expected torch.int32 or torch.int64")
    if slot_mapping.dim() != 1:
        raise ValueError(f"slot_mapping: expected a 1-D tensor, got shape {tuple(slot_mapping.shape)}")
    if slot_mapping.shape[0] < n:
        raise ValueError(f"slot_mapping: has {slot_mapping.shape[0]} entries; expected at least {n} (one per token)")
    if n == 0:
        return slot_mapping, 0
    stats = native_int_stats(slot_mapping, n, dtype)  # one C pass over the first n slots
    if stats is not None:
        top, first_neg = stats
    elif slot_mapping.device.type == "cpu":
        arr = slot_mapping.numpy()[:n]
        lo, top = int(arr.min()), int(arr.max())
        first_neg = n if lo >= 0 else int(np.argmax(arr < 0))  # no temporary array when nothing is negative
    else:
        head = slot_mapping[:n]
        negs = head < 0
        both = torch.stack([head.max().to(torch.int64), torch.where(negs.any(), negs.int().argmax(), n).to(torch.int64)])
        top, first_neg = both.tolist()
    if top >= capacity:
        raise ValueError(f"slot_mapping: slot {top} is outside the paged cache (capacity {capacity} slots)")
    if slot_mapping.device != device:
        slot_mapping = slot_mapping.to(device)
    return slot_mapping, first_neg


def check_layer_groups(groups: object, primary: object, num_layers: int) -> tuple[tuple[int, ...], int]:
    """Validate a layer -> group assignment; returns ``(groups as a tuple, number of groups)``.

    ``groups[l]`` is the group index of layer ``l``: ``num_layers`` ints, every index in
    ``0..G-1`` used at least once; ``primary`` must be one of them. Raises TypeError /
    ValueError naming the argument, the value and what was expected.
    """
    if isinstance(groups, (str, bytes, torch.Tensor, np.ndarray)) or not isinstance(groups, Sequence):
        raise TypeError(f"groups={groups!r}: expected a sequence of ints (the KV cache group of each layer)")
    out = []
    for i, g in enumerate(groups):
        if isinstance(g, bool) or not isinstance(g, (int, np.integer)):
            raise TypeError(f"groups[{i}]={g!r}: expected an int (a KV cache group index)")
        out.append(operator.index(g))
    if len(out) != num_layers:
        raise ValueError(f"groups: {len(out)} entries {tuple(out)}; expected one per layer ({num_layers})")
    if any(g < 0 for g in out):
        raise ValueError(f"groups={tuple(out)}: negative group index; expected indices 0..G-1")
    num_groups = max(out) + 1
    unused = sorted(set(range(num_groups)) - set(out))
    if unused:
        raise ValueError(
            f"groups={tuple(out)}: group(s) {unused} have no layer; expected every index in 0..{num_groups - 1} used"
        )
    if isinstance(primary, bool) or not isinstance(primary, (int, np.integer)):
        raise TypeError(f"primary={primary!r}: expected an int (a KV cache group index)")
    if not 0 <= primary < num_groups:
        raise ValueError(f"primary={primary}: expected a group index in 0..{num_groups - 1} (groups={tuple(out)})")
    return tuple(out), num_groups


@functools.lru_cache(maxsize=64)
def layer_runs(groups: tuple[int, ...]) -> tuple[tuple[LayerRun, ...], ...]:
    """For each group ``g`` (0..G-1) its layers as maximal arithmetic runs ``(start, stop, step)``,
    taken greedily in layer order: ``[0, 2, 4]`` -> ``((0, 5, 2),)``, ``[0, 1, 3]`` ->
    ``((0, 2, 1), (3, 4, 1))``. ``kvcaches[start:stop:step]`` and ``mem[:, start:stop:step]``
    select exactly a run's layers. ``groups`` must be valid (:func:`check_layer_groups`)."""
    num_groups = max(groups) + 1 if groups else 0
    out = []
    for g in range(num_groups):
        layers = [layer for layer, lg in enumerate(groups) if lg == g]
        runs: list[LayerRun] = []
        i = 0
        while i < len(layers):
            start = layers[i]
            if i + 1 == len(layers):
                runs.append((start, start + 1, 1))
                break
            step = layers[i + 1] - start
            j = i + 1
            while j + 1 < len(layers) and layers[j + 1] - layers[j] == step:
                j += 1
            runs.append((start, layers[j] + 1, step))
            i = j + 1
        out.append(tuple(runs))
    return tuple(out)


def check_group_slot_mapping(
    slot_mapping: torch.Tensor, num_groups: int, n: int, capacity: int, device: torch.device
) -> tuple[torch.Tensor, tuple[int, ...]]:
    """Validate a 2-D per-group slot mapping ``[num_groups, >= n]`` (int32/int64); returns
    (slots on ``device``, first negative index of each row). Each row is checked as
    :func:`check_slot_mapping` checks a 1-D mapping."""
    if slot_mapping.dtype not in _SLOT_DTYPES:
        raise TypeError(f"slot_mapping: dtype {slot_mapping.dtype}; expected torch.int32 or torch.int64")
    shape = tuple(slot_mapping.shape)
    if slot_mapping.dim() != 2 or shape[0] != num_groups or shape[1] < n:
        raise ValueError(
            f"slot_mapping: shape {shape}; expected [{num_groups}, >= {n}] (one row per KV cache group, "
            f"one slot per token) or a 1-D tensor shared by every group"
        )
    firsts = []
    for g in range(num_groups):
        try:
            _, first_neg = check_slot_mapping(slot_mapping[g], n, capacity, slot_mapping.device)
        except ValueError as exc:
            detail = str(exc).removeprefix("slot_mapping: ")
            raise ValueError(f"slot_mapping row {g} (KV cache group {g}): {detail}") from None
        firsts.append(first_neg)
    if slot_mapping.device != device:
        slot_mapping = slot_mapping.to(device)
    return slot_mapping, tuple(firsts)
