"""Bulk connector: all layers of a batch of chunks per call, MemoryFormat KV_2LTD / KV_MLA_FMT.

* :class:`PagedKVBase` - what the paged connectors share: constructor, argument checks
  (:meth:`~PagedKVBase.bind`), the layer groups and the CUDA side streams.
* :class:`VLLMPagedMemGPUConnectorV2` - copies between vLLM's paged KV (any layout of
  :mod:`.layouts`) and objects of shape ``[num_kv, num_layers, tokens, hidden]``.

Layer groups (vLLM's hybrid KV cache manager): :meth:`PagedKVBase.set_layer_groups`
tells the connector which KV cache group each layer belongs to and which group is the
primary one. A call may then pass a 2-D slot mapping, one row per group; each layer is
copied with its group's row. A group's layers are copied as a few strided runs (e.g.
layers 0, 2, 4 as one run ``0:5:2``): one kernel call per run with the run's layer
tensors and the matching strided view ``obj[:, start:stop:step]`` of every object, so
each token lands at the same place in the object whatever its group. A store refuses
(ValueError) a chunk where some group has no slot (negative) for one of its tokens; a
load leaves such tokens of that group untouched. A 1-D slot mapping takes the
single-group path (one kernel call for every layer), as without groups.
"""

from __future__ import annotations

import contextlib
import dataclasses
from typing import Any, Sequence

import numpy as np
import torch

from lmcache.v1.gpu_connector import copy_ops, native
from lmcache.v1.gpu_connector.layouts import KVLayout, get_layout
from lmcache.v1.gpu_connector.paged_kv import (
    GeometryCache,
    LayerRun,
    PagedKV,
    PagedKVSpec,
    check_group_slot_mapping,
    check_kv_layers,
    check_layer_groups,
    check_slot_mapping,
    kv_geometry,
    layer_runs,
)
from lmcache.v1.gpu_connector.protocol import GPUConnectorInterface
from lmcache.v1.memory_management import MemoryFormat, MemoryObj
from lmcache.v1.request import reject_unknown


class PagedKVBase:
    """Shared parts of the paged connectors: argument checks, layout and stream handling.

    Constructor: LMCache 0.5.6's ``(hidden_dim_size, num_layers, use_gpu=False, **kw)``
    form works. ``use_gpu`` is accepted and has no effect (copies go straight between
    the paged cache and the objects; no intermediate GPU buffer is needed). ``dtype``
    None takes the dtype of the first KV tensors the connector sees (later calls must
    match it); ``device`` None is the current CUDA device, or the CPU without CUDA.

    Layer groups (:meth:`set_layer_groups`) are set once, before the copies start (the
    connector does not lock them); each :class:`PagedKV` keeps the groups it was bound with.
    """

    def __init__(
        self,
        hidden_dim_size: int,
        num_layers: int,
        use_gpu: bool = False,
        *,
        chunk_size: int = 256,
        dtype: torch.dtype | None = None,
        device: torch.device | str | None = None,
        use_mla: bool = False,
        layout: str | None = None,
    ) -> None:
        if dtype is not None and not isinstance(dtype, torch.dtype):
            raise TypeError(f"dtype={dtype!r}: expected a torch.dtype or None")
        if device is None:
            device = torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else "cpu"
        if hidden_dim_size <= 0 or num_layers <= 0 or chunk_size <= 0:
            raise ValueError(
                f"hidden_dim_size={hidden_dim_size}, num_layers={num_layers}, chunk_size={chunk_size}: expected > 0"
            )
        self.hidden_dim_size = hidden_dim_size
        self.num_layers = num_layers
        self.chunk_size = chunk_size
        self.use_gpu = bool(use_gpu)
        self.dtype: torch.dtype | None = dtype
        self.device = torch.device(device)
        self.use_mla = use_mla
        self.num_kv = 1 if use_mla else 2
        self._layout: KVLayout | None = get_layout(layout) if layout is not None else None
        self._geom_cache = GeometryCache()
        self._spec = PagedKVSpec(num_layers, hidden_dim_size, self.num_kv, dtype, use_mla, self._layout)
        self.kvcaches: list[torch.Tensor] | None = None
        self._num_groups: int | None = None  # None: set_layer_groups never called (or reset)
        self._layer_groups: tuple[int, ...] | None = None  # None: one group
        self._primary = 0
        cuda = self.device.type == "cuda" and torch.cuda.is_available()
        self.load_stream = torch.cuda.Stream(device=self.device) if cuda else None
        self.store_stream = torch.cuda.Stream(device=self.device) if cuda else None

    def register_kv_caches(self, kvcaches: Sequence[torch.Tensor]) -> None:
        """Remember the engine's per-layer KV tensors (used when a call passes none). Validated here."""
        layers = check_kv_layers(kvcaches, self._spec)
        if self.dtype is None:
            self.dtype = layers[0].dtype
            self._spec = dataclasses.replace(self._spec, dtype=self.dtype)
        kv_geometry(layers[0], self._spec, self._geom_cache)
        self.kvcaches = list(layers)

    @property
    def kv_spec(self) -> PagedKVSpec:
        """What every layer tensor must look like."""
        return self._spec

    def set_layer_groups(self, groups: Sequence[int] | None, primary: int = 0) -> None:
        """Assign each layer to a KV cache group (vLLM's hybrid KV cache manager).

        ``groups[l]`` is the group of layer ``l``: ``num_layers`` ints, every index in
        ``0..G-1`` used at least once. ``primary`` is the group whose slot row says which
        tokens a call covers (a full-attention group). Afterwards :meth:`bind` also
        accepts a 2-D slot mapping ``[G, >= num_tokens]``, row ``g`` for the layers of
        group ``g``. ``None`` (or a single group) restores one slot row for every layer.
        Raises TypeError/ValueError naming the bad argument.
        """
        if groups is None:
            check_layer_groups((0,) * self.num_layers, primary, self.num_layers)
            self._num_groups, self._layer_groups, self._primary = None, None, 0
            return
        checked, num_groups = check_layer_groups(groups, primary, self.num_layers)
        self._num_groups = num_groups
        self._layer_groups = checked if num_groups > 1 else None
        self._primary = int(primary)

    @property
    def layer_groups(self) -> tuple[int, ...] | None:
        """The KV cache group of each layer, or None when every layer shares one slot row."""
        return self._layer_groups

    @property
    def primary_group(self) -> int:
        """The group whose slot row says which tokens a call covers (0 without groups)."""
        return self._primary

    @property
    def group_runs(self) -> tuple[tuple[LayerRun, ...], ...]:
        """Each group's layers as strided runs ``(start, stop, step)`` (``()`` without groups)."""
        return () if self._layer_groups is None else layer_runs(self._layer_groups)

    def bind(
        self,
        num_tokens: int,
        *,
        kvcaches: Sequence[torch.Tensor] | None = None,
        slot_mapping: torch.Tensor | None = None,
        sync: bool = True,
    ) -> PagedKV:
        """Validate one call's paged KV tensors and slot mapping (for ``num_tokens`` tokens).

        ``kvcaches`` defaults to the tensors given to :meth:`register_kv_caches`. Every
        layer is checked (rank, shape, strides, dtype, device) against the layout and
        layer 0; every slot among the first ``num_tokens`` must be int32/int64 and
        inside the paged cache. With layer groups set (:meth:`set_layer_groups`),
        ``slot_mapping`` may be 2-D ``[G, >= num_tokens]`` (one row per group, each
        checked like a 1-D mapping); a 1-D one is shared by every group. Raises
        TypeError/ValueError.
        """
        if kvcaches is None:
            kvcaches = self.kvcaches
            if kvcaches is None:
                raise ValueError("kvcaches: missing (pass kvcaches= or call register_kv_caches first)")
        if not isinstance(sync, bool):
            raise TypeError(f"sync={sync!r}: expected a bool")
        layers = check_kv_layers(kvcaches, self._spec)
        if self.dtype is None:  # adopted from the first KV seen (dtype=None at construction)
            self.dtype = layers[0].dtype
            self._spec = dataclasses.replace(self._spec, dtype=self.dtype)
        spec = self._spec
        geom = kv_geometry(layers[0], spec, self._geom_cache)
        capacity = geom.num_blocks * geom.block_size
        if isinstance(slot_mapping, torch.Tensor) and slot_mapping.dim() == 2:
            num_groups = self._num_groups
            if num_groups is None:
                raise ValueError(
                    f"slot_mapping: shape {tuple(slot_mapping.shape)} is 2-D (one row per KV cache group) but no "
                    f"layer groups are set (set_layer_groups); expected a 1-D tensor of >= {num_tokens} slots"
                )
            slots, firsts = check_group_slot_mapping(slot_mapping, num_groups, num_tokens, capacity, layers[0].device)
            groups = self._layer_groups
            if groups is None:  # a single group: its only row is the 1-D mapping
                return PagedKV(layers, slots[0], geom, firsts[0], sync)
            primary = self._primary
            return PagedKV(layers, slots, geom, firsts[primary], sync, groups, primary, firsts)
        slots, first_neg = check_slot_mapping(slot_mapping, num_tokens, capacity, layers[0].device)
        return PagedKV(layers, slots, geom, first_neg, sync)

    def _bound(self, kv: PagedKV | None, ends: Sequence[int], kwargs: dict[str, Any]) -> PagedKV:
        """``kv`` when the engine built it, else one built from a direct call's keyword arguments."""
        if kv is not None:
            if kwargs:
                raise TypeError(f"unexpected keyword arguments {sorted(kwargs)} together with a bound PagedKV")
            return kv
        reject_unknown(kwargs, ("kvcaches", "slot_mapping", "sync"), type(self).__name__ + ".copy")
        return self.bind(max(ends, default=0), **kwargs)

    @contextlib.contextmanager
    def _on_stream(self, stream: torch.cuda.Stream | None, kv_device: torch.device):
        """Run the body on a side stream ordered after the current stream, then wait for it."""
        if stream is None or kv_device.type != "cuda":
            yield
            return
        stream.wait_stream(torch.cuda.current_stream(kv_device))
        with torch.cuda.stream(stream):
            yield
        stream.synchronize()


def pool_addresses(objs: Sequence[MemoryObj], shapes: Sequence[tuple[int, ...]], dtype: torch.dtype) -> list[int] | None:
    """The payload address of each object for the native CPU kernels, checked from its
    metadata only (no tensor op): each must be valid, in CPU memory, of ``shapes[k]``
    and ``dtype``. None when one is not (the caller takes the tensor path, whose checks
    raise the precise error)."""
    ptrs = []
    for obj, shape in zip(objs, shapes):
        if not isinstance(obj, MemoryObj):
            return None  # a duck-typed object with a .tensor: the tensor path handles (or rejects) it
        meta = obj.meta
        ptr = obj.host_address()
        if ptr is None or meta.shape != shape or meta.dtype != dtype:
            return None
        ptrs.append(ptr)
    return ptrs


def object_tensor(obj: object, where: str) -> torch.Tensor:
    """The tensor of a copy's memory object: a live :class:`MemoryObj`, or any object with a
    ``.tensor`` (LMCache's connector API is duck-typed). ValueError for a freed MemoryObj,
    TypeError for anything else; ``where`` names the argument in the message."""
    t = getattr(obj, "tensor", None)
    if isinstance(t, torch.Tensor):
        return t
    if isinstance(obj, MemoryObj):
        raise ValueError(f"{where}: MemoryObj used after it was freed")
    raise TypeError(f"{where}: expected a MemoryObj (or an object with a .tensor), got {type(obj).__name__}")


def _check_spans(objs: Sequence[MemoryObj], starts: Sequence[int], ends: Sequence[int]) -> None:
    if not len(objs) == len(starts) == len(ends):
        raise ValueError(f"objs/starts/ends: lengths differ ({len(objs)}, {len(starts)}, {len(ends)})")


def check_groups_hold(kv: PagedKV, starts: Sequence[int], ends: Sequence[int]) -> None:
    """ValueError unless every group's row of ``kv``'s 2-D slot mapping has a slot (>= 0)
    for every token of every span ``[starts[i], ends[i])``: a store must not cache KV a
    group does not hold. No-op for a 1-D mapping. One device -> host transfer at most
    (none when no row has a negative slot before the last span end)."""
    if kv.layer_groups is None or not ends:
        return
    hi = max(ends)
    if min(kv.group_first_unmapped, default=hi) >= hi:
        return
    neg = kv.slot_mapping[:, :hi] < 0
    bad = neg.any(dim=0).cpu().numpy()
    width = bad.shape[0]
    cum = np.concatenate(([0], np.cumsum(bad)))
    for start, end in zip(starts, ends):
        lo, up = min(max(start, 0), width), min(max(end, 0), width)
        if up > lo and cum[up] > cum[lo]:
            t = lo + int(np.argmax(bad[lo:up]))
            rows = neg[:, t].nonzero().flatten().tolist()
            raise ValueError(
                f"slot_mapping: token {t} has a negative slot in row(s) {rows} (KV cache group(s) {rows} do not "
                f"hold it) inside the chunk [{start}, {end}) being stored; a store needs a slot in every group "
                f"for every token it copies"
            )


class VLLMPagedMemGPUConnectorV2(PagedKVBase, GPUConnectorInterface):
    """vLLM paged KV (any layout in :mod:`.layouts`) <-> KV_2LTD / KV_MLA_FMT objects."""

    @property
    def fmt(self) -> MemoryFormat:  # type: ignore[override]
        return MemoryFormat.KV_MLA_FMT if self.use_mla else MemoryFormat.KV_2LTD

    def get_shape(self, num_tokens: int) -> torch.Size:
        return torch.Size([self.num_kv, self.num_layers, num_tokens, self.hidden_dim_size])

    def _views(self, objs: Sequence[MemoryObj], starts: Sequence[int], ends: Sequence[int]) -> list[torch.Tensor]:
        _check_spans(objs, starts, ends)
        views = []
        for i, (obj, start, end) in enumerate(zip(objs, starts, ends)):
            t = object_tensor(obj, f"objs[{i}]")
            if tuple(t.shape) != tuple(self.get_shape(end - start)):
                raise ValueError(f"MemoryObj shape {tuple(t.shape)} does not hold tokens [{start}, {end})")
            views.append(t)
        return views

    def batched_from_gpu(self, objs, starts, ends, kv=None, **kwargs) -> None:
        kv = self._bound(kv, ends, kwargs)
        if kv.layer_groups is not None:
            self._grouped_copy(native.GATHER, kv, objs, starts, ends)
            return
        if self._copy_at(native.GATHER, kv, objs, starts, ends):
            return
        dsts = self._views(objs, starts, ends)
        with self._on_stream(self.store_stream, kv.kvcaches[0].device):
            copy_ops.paged_gather(kv.kvcaches, kv.geometry, kv.slot_mapping, starts, dsts)

    def batched_to_gpu(self, objs, starts, ends, kv=None, **kwargs) -> None:
        kv = self._bound(kv, ends, kwargs)
        if kv.layer_groups is not None:
            self._grouped_copy(native.SCATTER, kv, objs, starts, ends)
            return
        if self._copy_at(native.SCATTER, kv, objs, starts, ends):
            return
        srcs = self._views(objs, starts, ends)
        with self._on_stream(self.load_stream, kv.kvcaches[0].device):
            copy_ops.paged_scatter(kv.kvcaches, kv.geometry, kv.slot_mapping, starts, srcs)

    def _grouped_copy(self, direction: int, kv: PagedKV, objs, starts, ends) -> None:
        """A copy with per-group slot rows: for each group and each of its layer runs
        ``(a, b, step)``, one gather/scatter of layers ``a:b:step`` with the group's row,
        into/from the views ``obj[:, a:b:step]``. A gather first checks that every group
        holds every token it copies (:func:`check_groups_hold`)."""
        groups = kv.layer_groups
        assert groups is not None
        mems = self._views(objs, starts, ends)
        if not mems:
            return
        gather = direction == native.GATHER
        if gather:
            check_groups_hold(kv, starts, ends)
        slots = kv.slot_mapping
        if slots.dtype != torch.int64 or not slots.is_contiguous():
            slots = slots.to(torch.int64).contiguous()  # once, not once per run
        op = copy_ops.paged_gather if gather else copy_ops.paged_scatter
        layers = kv.kvcaches
        with self._on_stream(self.store_stream if gather else self.load_stream, layers[0].device):
            for g, runs in enumerate(layer_runs(groups)):
                row = slots[g]
                for a, b, step in runs:
                    op(layers[a:b:step], kv.geometry, row, starts, [m[:, a:b:step] for m in mems])

    def _copy_at(self, direction: int, kv: PagedKV, objs, starts, ends) -> bool:
        """CPU KV with native kernels and objects in CPU memory: one kernel call on the
        objects' addresses (no tensor view per chunk). False: take the tensor path."""
        if kv.kvcaches[0].device.type != "cpu" or not copy_ops.native_enabled():
            return False
        _check_spans(objs, starts, ends)
        counts = [e - s for s, e in zip(starts, ends)]
        shapes = {n: tuple(self.get_shape(n)) for n in set(counts)}
        ptrs = pool_addresses(objs, [shapes[n] for n in counts], kv.kvcaches[0].dtype)
        if ptrs is None:
            return False
        mod = native.load()
        assert mod is not None  # native_enabled()
        mod.paged_copy_at(direction, kv.kvcaches, kv.geometry, kv.slot_mapping, starts, counts, ptrs)
        return True
