"""Bulk connector: all layers of a batch of chunks per call, MemoryFormat KV_2LTD / KV_MLA_FMT."""

from __future__ import annotations

import contextlib
from abc import ABC, abstractmethod
from typing import Any, Sequence

import torch

from lmcache.v1.gpu_connector import copy_ops
from lmcache.v1.gpu_connector.layouts import KVLayout, PagedGeometry, detect_layout, get_layout
from lmcache.v1.memory_management import MemoryFormat, MemoryObj


class GPUConnectorInterface(ABC):
    """Moves KV between the engine's paged cache and MemoryObjs.

    Called from the worker thread that runs the forward pass. Calls return when the
    copy is complete (on CUDA the side stream is synchronised before returning), so
    the caller may release or publish the objects right after. The connector never
    takes or drops references.
    """

    fmt: MemoryFormat

    @abstractmethod
    def get_shape(self, num_tokens: int) -> torch.Size:
        """Shape of the MemoryObj holding ``num_tokens`` tokens."""

    @abstractmethod
    def batched_from_gpu(self, objs: Sequence[MemoryObj], starts: Sequence[int], ends: Sequence[int], **kwargs: Any) -> None:
        """Paged KV -> objs (store). kwargs: ``kvcaches``, ``slot_mapping``."""

    @abstractmethod
    def batched_to_gpu(self, objs: Sequence[MemoryObj], starts: Sequence[int], ends: Sequence[int], **kwargs: Any) -> None:
        """objs -> paged KV (retrieve). kwargs: ``kvcaches``, ``slot_mapping``."""

    def from_gpu(self, obj: MemoryObj, start: int, end: int, **kwargs: Any) -> None:
        self.batched_from_gpu([obj], [start], [end], **kwargs)

    def to_gpu(self, obj: MemoryObj, start: int, end: int, **kwargs: Any) -> None:
        self.batched_to_gpu([obj], [start], [end], **kwargs)


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
        self._geom_cache: tuple[tuple[int, ...], tuple[int, ...], PagedGeometry] | None = None
        self.kvcaches: list[torch.Tensor] | None = None
        cuda = self.device.type == "cuda" and torch.cuda.is_available()
        self.load_stream = torch.cuda.Stream(device=self.device) if cuda else None
        self.store_stream = torch.cuda.Stream(device=self.device) if cuda else None

    def register_kv_caches(self, kvcaches: Sequence[torch.Tensor]) -> None:
        """Remember the engine's per-layer KV tensors (used when kwargs carry none)."""
        self.kvcaches = list(kvcaches)

    def _kv_and_slots(self, kwargs: dict[str, Any]) -> tuple[list[torch.Tensor], torch.Tensor, PagedGeometry]:
        kvcaches = kwargs.get("kvcaches", self.kvcaches)
        if kvcaches is None:
            raise ValueError("kvcaches: missing (pass kvcaches= or call register_kv_caches first)")
        kvcaches = list(kvcaches)
        if len(kvcaches) != self.num_layers:
            raise ValueError(f"kvcaches: expected {self.num_layers} layer tensors, got {len(kvcaches)}")
        slot_mapping = kwargs.get("slot_mapping")
        if not isinstance(slot_mapping, torch.Tensor):
            raise ValueError("slot_mapping: expected a 1-D integer tensor")
        first = kvcaches[0]
        if self.dtype is None:
            self.dtype = first.dtype  # adopted from the first KV seen (dtype=None at construction)
        if first.dtype != self.dtype:
            raise ValueError(f"kvcaches: dtype {first.dtype} does not match the connector dtype {self.dtype}")
        cached = self._geom_cache
        if cached is not None and cached[0] == tuple(first.shape) and cached[1] == tuple(first.stride()):
            geom = cached[2]
        else:
            layout = self._layout or detect_layout(first, use_mla=self.use_mla)
            geom = layout.geometry(first)
            if geom.hidden != self.hidden_dim_size or len(geom.components) != self.num_kv:
                raise ValueError(
                    f"kvcaches: layer shape {tuple(first.shape)} gives hidden={geom.hidden} and "
                    f"{len(geom.components)} component(s); expected hidden={self.hidden_dim_size}, {self.num_kv}"
                )
            self._geom_cache = (tuple(first.shape), tuple(first.stride()), geom)
        if slot_mapping.device != first.device:
            slot_mapping = slot_mapping.to(first.device)
        return kvcaches, slot_mapping, geom

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
        for obj, start, end in zip(objs, starts, ends):
            t = obj.tensor
            assert t is not None, "MemoryObj used after it was freed"
            if tuple(t.shape) != tuple(self.get_shape(end - start)):
                raise ValueError(f"MemoryObj shape {tuple(t.shape)} does not hold tokens [{start}, {end})")
            views.append(t)
        return views

    def batched_from_gpu(self, objs, starts, ends, **kwargs) -> None:
        kvcaches, slots, geom = self._kv_and_slots(kwargs)
        dsts = self._views(objs, starts, ends)
        with self._on_stream(self.store_stream, kvcaches[0].device):
            copy_ops.paged_gather(kvcaches, geom, slots, starts, dsts)

    def batched_to_gpu(self, objs, starts, ends, **kwargs) -> None:
        kvcaches, slots, geom = self._kv_and_slots(kwargs)
        srcs = self._views(objs, starts, ends)
        with self._on_stream(self.load_stream, kvcaches[0].device):
            copy_ops.paged_scatter(kvcaches, geom, slots, starts, srcs)
