"""Gather/scatter between paged KV layers and cache memory.

Two implementations with one signature:

* native kernels from ``csrc/`` (loaded by :mod:`.native`), used when built and the
  tensors are on a device they were built for;
* a pure-torch fallback (this module), always available.

``LMCACHE_USE_NATIVE=0`` at import forces the fallback (tests switch ``USE_NATIVE``).

Both take a whole batch of chunks and all layers in one call:

``paged_gather(kv_layers, geom, slot_mapping, starts, dsts)``
    For chunk ``i``, token ``t`` and layer ``l``: copy the vectors of the token at
    ``slot_mapping[starts[i] + t]`` from ``kv_layers[l]`` into ``dsts[i][c, l, t]`` for each
    component ``c``. ``dsts[i]`` is a 4-D view ``[C, L, T_i, hidden]`` (any strides, last
    dim contiguous). Tokens with a negative slot are skipped (their rows untouched).
``paged_scatter(kv_layers, geom, slot_mapping, starts, srcs)``
    The reverse: write ``srcs[i][c, l, t]`` to the token's slot; negative slots skipped.

The caller owns every tensor before and after the call.
"""

from __future__ import annotations

import logging
import os
from typing import Sequence

import torch

from lmcache.v1.gpu_connector import native
from lmcache.v1.gpu_connector.layouts import PagedGeometry

logger = logging.getLogger(__name__)

_INT_OF_SIZE = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


USE_NATIVE = os.environ.get("LMCACHE_USE_NATIVE", "1") not in ("0", "false", "False")
"""False when ``LMCACHE_USE_NATIVE=0`` was set at import (tests and benchmarks switch this
attribute; reading ``os.environ`` per request cost ~30 us with cold caches)."""


def native_enabled() -> bool:
    """True when native kernels are importable and not disabled by LMCACHE_USE_NATIVE=0."""
    return USE_NATIVE and native.load() is not None


def _as_int(t: torch.Tensor) -> torch.Tensor:
    """Bit-identical integer view (torch lacks index kernels for some float types, e.g. fp8)."""
    return t.view(_INT_OF_SIZE[t.element_size()])


def _component_views(layer: torch.Tensor, geom: PagedGeometry) -> list[tuple[bool, torch.Tensor]]:
    """Per component: (flat, view). Flat views are [blocks*block_size, H, D]; others [B, N, H, D]."""
    nb, bs, h, d = geom.num_blocks, geom.block_size, geom.num_heads, geom.head_size
    out = []
    for comp in geom.components:
        base = layer.storage_offset() + comp.offset
        if comp.block_stride == bs * comp.token_stride:
            out.append((True, torch.as_strided(layer, (nb * bs, h, d), (comp.token_stride, comp.head_stride, comp.dim_stride), base)))
        else:
            out.append(
                (False, torch.as_strided(layer, (nb, bs, h, d), (comp.block_stride, comp.token_stride, comp.head_stride, comp.dim_stride), base))
            )
    return out


def _chunk_slots(slot_mapping: torch.Tensor, start: int, num: int) -> tuple[torch.Tensor, torch.Tensor | None]:
    """(valid slots, row indices of valid tokens or None when all are valid)."""
    slots = slot_mapping[start : start + num]
    if slots.shape[0] != num:
        raise ValueError(f"slot_mapping: has {slot_mapping.shape[0]} entries, chunk needs [{start}, {start + num})")
    valid = slots >= 0
    if bool(valid.all()):
        return slots, None
    rows = valid.nonzero().squeeze(1)
    return slots[rows], rows


def _check_capacity(kv_layers, geom: PagedGeometry, slot_mapping: torch.Tensor, starts, mems) -> None:
    """Fallback's run-end check: every used slot inside every layer's blocks (one reduction)."""
    blocks = min(native.layer_block_counts(kv_layers, geom))
    top = -1
    for start, mem in zip(starts, mems):
        part = slot_mapping[start : start + mem.shape[2]]
        if part.numel():
            top = max(top, int(part.max()))
    if top >= blocks * geom.block_size:
        raise IndexError(
            f"slot_mapping: slot {top} is outside the paged cache (smallest layer: {blocks} blocks x "
            f"{geom.block_size} slots)"
        )


def _gather_torch(kv_layers, geom, slot_mapping, starts, dsts) -> None:
    _check_capacity(kv_layers, geom, slot_mapping, starts, dsts)
    h, d = geom.num_heads, geom.head_size
    views = [_component_views(_as_int(layer), geom) for layer in kv_layers]
    for start, dst in zip(starts, dsts):
        dst_i = _as_int(dst)
        slots, rows = _chunk_slots(slot_mapping, start, dst.shape[2])
        blk, off = (slots // geom.block_size, slots % geom.block_size)
        for layer_idx, comps in enumerate(views):
            for c, (flat, view) in enumerate(comps):
                got = view.index_select(0, slots) if flat else view[blk, off]
                target = dst_i[c, layer_idx]
                got = got.reshape(got.shape[0], h * d)
                if rows is None:
                    # device -> pinned host copies stay asynchronous; the connector
                    # synchronises its stream before the objects are used
                    target.copy_(got, non_blocking=True)
                else:
                    target[rows.to(target.device)] = got.to(target.device)


def _scatter_torch(kv_layers, geom, slot_mapping, starts, srcs) -> None:
    _check_capacity(kv_layers, geom, slot_mapping, starts, srcs)
    h, d = geom.num_heads, geom.head_size
    views = [_component_views(_as_int(layer), geom) for layer in kv_layers]
    device = kv_layers[0].device
    for start, src in zip(starts, srcs):
        src_i = _as_int(src)
        slots, rows = _chunk_slots(slot_mapping, start, src.shape[2])
        blk, off = (slots // geom.block_size, slots % geom.block_size)
        for layer_idx, comps in enumerate(views):
            for c, (flat, view) in enumerate(comps):
                values = src_i[c, layer_idx]
                if rows is not None:
                    values = values[rows.to(values.device)]
                values = values.to(device, non_blocking=True).reshape(-1, h, d)
                if flat:
                    view.index_copy_(0, slots, values)
                else:
                    view[blk, off] = values


def paged_gather(
    kv_layers: Sequence[torch.Tensor],
    geom: PagedGeometry,
    slot_mapping: torch.Tensor,
    starts: Sequence[int],
    dsts: Sequence[torch.Tensor],
    *,
    use_native: bool | None = None,
) -> None:
    """Paged KV -> cache memory for a batch of chunks (see module docstring)."""
    if not dsts:
        return
    mod = native.load() if (native_enabled() if use_native is None else use_native) else None
    if mod is not None and native.supports(mod, kv_layers[0], dsts):
        mod.paged_gather(kv_layers, geom, slot_mapping, starts, dsts)
        return
    _gather_torch(kv_layers, geom, slot_mapping.to(torch.int64), starts, dsts)


def paged_scatter(
    kv_layers: Sequence[torch.Tensor],
    geom: PagedGeometry,
    slot_mapping: torch.Tensor,
    starts: Sequence[int],
    srcs: Sequence[torch.Tensor],
    *,
    use_native: bool | None = None,
) -> None:
    """Cache memory -> paged KV for a batch of chunks (see module docstring)."""
    if not srcs:
        return
    mod = native.load() if (native_enabled() if use_native is None else use_native) else None
    if mod is not None and native.supports(mod, kv_layers[0], srcs):
        mod.paged_scatter(kv_layers, geom, slot_mapping, starts, srcs)
        return
    _scatter_torch(kv_layers, geom, slot_mapping.to(torch.int64), starts, srcs)
