"""The connectors' paged-KV checks: one call's KV tensors and slot mapping, validated once.

* :class:`PagedKVSpec` - what a connector expects of every layer tensor (layer count,
  hidden size, K/V or MLA, dtype, layout).
* :func:`check_kv_layers` / :func:`kv_geometry` - per-layer tensors checked against the
  spec and against each other; the layer geometry from :mod:`.layouts` (cached per
  connector in a :class:`GeometryCache`).
* :func:`check_slot_mapping` - a slot mapping (int32/int64, inside the paged cache's
  capacity) and the index of its first unmapped (negative) slot.
* :class:`PagedKV` - the result: the validated tensors, slots and geometry of one call,
  built by a connector's ``bind`` and carried by the engine's ``TransferRequest``.

Bad input raises ``TypeError`` (wrong type) or ``ValueError`` (wrong value). The copy
paths trust a :class:`PagedKV` (the native kernels still bound-check their run ends).

Thread-safety: :class:`PagedKVSpec` and :class:`PagedKV` are immutable; a
:class:`GeometryCache` belongs to one connector. Memory: a :class:`PagedKV` references
the caller's tensors for the duration of the call only.
"""

from __future__ import annotations

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


@dataclass(frozen=True, slots=True)
class PagedKV:
    """Validated paged KV tensors and slot mapping of one call.

    Every layer has the same shape, strides, dtype and device (checked), so
    ``geometry`` describes each of them; ``capacity`` (blocks x block size) bounds every
    slot. ``slot_mapping`` is the caller's tensor moved to the KV device (int32 or
    int64). ``first_unmapped`` is the index of the first negative slot (or its length).
    """

    kvcaches: tuple[torch.Tensor, ...]
    slot_mapping: torch.Tensor
    geometry: PagedGeometry
    first_unmapped: int
    sync: bool = True

    @property
    def capacity(self) -> int:
        return self.geometry.num_blocks * self.geometry.block_size


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
