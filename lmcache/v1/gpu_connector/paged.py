"""Bulk connector: all layers of a batch of chunks per call, MemoryFormat KV_2LTD / KV_MLA_FMT."""

from __future__ import annotations

import contextlib
import dataclasses
from typing import Any, Sequence

import torch

from lmcache.v1.gpu_connector import copy_ops, native
from lmcache.v1.gpu_connector.layouts import KVLayout, get_layout
from lmcache.v1.gpu_connector.paged_kv import (
    GeometryCache,
    PagedKV,
    PagedKVSpec,
    check_kv_layers,
    check_slot_mapping,
    kv_geometry,
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
        inside the paged cache. Raises TypeError/ValueError.
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
        slots, first_neg = check_slot_mapping(slot_mapping, num_tokens, geom.num_blocks * geom.block_size, layers[0].device)
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
        if self._copy_at(native.GATHER, kv, objs, starts, ends):
            return
        dsts = self._views(objs, starts, ends)
        with self._on_stream(self.store_stream, kv.kvcaches[0].device):
            copy_ops.paged_gather(kv.kvcaches, kv.geometry, kv.slot_mapping, starts, dsts)

    def batched_to_gpu(self, objs, starts, ends, kv=None, **kwargs) -> None:
        kv = self._bound(kv, ends, kwargs)
        if self._copy_at(native.SCATTER, kv, objs, starts, ends):
            return
        srcs = self._views(objs, starts, ends)
        with self._on_stream(self.load_stream, kv.kvcaches[0].device):
            copy_ops.paged_scatter(kv.kvcaches, kv.geometry, kv.slot_mapping, starts, srcs)

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
