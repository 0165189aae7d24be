"""Layerwise connectors: one layer of a batch of chunks per ``next()``/``send()``.

The layerwise pipeline (:mod:`lmcache.v1.layerwise`) moves KV between the paged cache
and per-layer :class:`~lmcache.v1.memory_management.MemoryObj` s while the forward pass
runs. A per-layer object is ``KV_2LTD`` with one layer, ``[2, 1, tokens, hidden]`` (K and
V of one layer of one chunk; ``KV_MLA_FMT`` ``[1, 1, tokens, hidden]`` for MLA): each
component's tokens are contiguous, the same order as the bulk format, so a layer copies
as fast as the bulk path (a token-major ``KV_T2D`` object interleaves K and V rows and
scatters about 1.5x slower into flash-attn pages). Two variants share one base,
:class:`LayerwiseGPUConnector`:

* :class:`VLLMPagedMemLayerwiseGPUConnector` copies straight between the paged layer
  and the objects;
* :class:`VLLMBufferLayerwiseGPUConnector` stages each layer through a contiguous
  temporary buffer on the KV device (the spec's ``use_gpu`` load/store buffers), so the
  host <-> device transfer is one contiguous copy per object and the paged
  gather/scatter runs device-local. Blending builds on this variant.

Streams and synchronisation (CUDA only; on CPU every copy is complete when the call
returns and stream handling is a no-op):

* loads run on ``load_stream``, stores on ``store_stream``, both distinct from the
  forward pass's current stream;
* store, ``sync=True`` (the *first* request of a batch): before each layer's copy the
  store stream waits for the current stream, so the copy sees the layer's KV just
  written by the forward pass. Later requests of the batch enqueue on the same store
  stream after that wait and need none of their own;
* load, ``sync=True`` (the *last* request of a batch): when layer ``i+1`` is sent (and at
  the final ``next()``), the current stream first waits for the event recorded after
  this request's layer ``i`` copy. Since every request's layer ``i`` copy was enqueued
  on the load stream before it, the forward pass's layer ``i`` then sees the KV of the
  whole batch, while layer ``i+1``'s copies still overlap with layer ``i``'s compute.

Each copied layer yields a :class:`LayerCopy`; its memory objects must stay referenced
until ``LayerCopy.done()`` (or after ``wait()``). The connector never takes or drops
references.
"""

from __future__ import annotations

from abc import abstractmethod
from typing import Any, Callable, Sequence

import torch

from lmcache.v1.gpu_connector import copy_ops, native
from lmcache.v1.gpu_connector.layouts import PagedGeometry
from lmcache.v1.gpu_connector.paged import PagedKVBase, object_tensor, pool_addresses
from lmcache.v1.gpu_connector.paged_kv import PagedKV, check_layer_groups
from lmcache.v1.gpu_connector.protocol import LayerCopy, LayerwiseGPUConnectorInterface, LoadGenerator, StoreGenerator
from lmcache.v1.memory_management import MemoryFormat, MemoryObj


LayerCopier = Callable[[int, Sequence[MemoryObj]], None]


def _check_spans(starts: Sequence[int], ends: Sequence[int]) -> None:
    if len(starts) != len(ends):
        raise ValueError(f"starts/ends: lengths differ ({len(starts)}, {len(ends)})")
    for s, e in zip(starts, ends):
        if not 0 <= s < e:
            raise ValueError(f"starts/ends: span [{s}, {e}) is empty or negative")


_GROUPED_REFUSED = (
    "slot_mapping: per-group slot rows (hybrid KV cache groups) are not supported by the layerwise "
    "connector; use the bulk connector (use_layerwise: false)"
)


def _refuse_grouped(kv: PagedKV) -> None:
    """ValueError for a PagedKV with per-group slot rows (a 2-D slot mapping)."""
    if kv.layer_groups is not None or kv.slot_mapping.dim() != 1:
        raise ValueError(f"{_GROUPED_REFUSED} (got shape {tuple(kv.slot_mapping.shape)})")


def _contiguous_run(starts: Sequence[int], ends: Sequence[int]) -> bool:
    """Whether the spans are back to back (one copy can cover them all)."""
    return all(ends[i] == starts[i + 1] for i in range(len(starts) - 1))


class LayerwiseGPUConnector(PagedKVBase, LayerwiseGPUConnectorInterface):
    """What the layerwise connectors share (see the module docstring); the contract is
    :class:`~lmcache.v1.gpu_connector.protocol.LayerwiseGPUConnectorInterface`.

    Called from the worker thread that runs the forward pass. Constructor arguments are
    those of :class:`~lmcache.v1.gpu_connector.paged.VLLMPagedMemGPUConnectorV2`.

    Copy keyword arguments: ``kvcaches`` (list of per-layer tensors, or the ones given
    to :meth:`register_kv_caches`), ``slot_mapping`` (one slot per token, negative =
    skip) and ``sync`` (default True; see the module docstring for its meaning in each
    direction).
    """

    @property
    def fmt(self) -> MemoryFormat:
        return MemoryFormat.KV_MLA_FMT if self.use_mla else MemoryFormat.KV_2LTD

    def get_shape(self, num_tokens: int) -> torch.Size:
        """``[num_kv, 1, num_tokens, hidden]``: one layer of one chunk (num_kv is 1 for MLA)."""
        return torch.Size([self.num_kv, 1, num_tokens, self.hidden_dim_size])

    def set_layer_groups(self, groups: Sequence[int] | None, primary: int = 0) -> None:
        """Only one group (or None): the layerwise connector copies every layer with one slot row."""
        if groups is not None:
            checked, num_groups = check_layer_groups(groups, primary, self.num_layers)
            if num_groups > 1:
                raise ValueError(f"groups={checked}: {num_groups} KV cache groups; {_GROUPED_REFUSED}")
        super().set_layer_groups(groups, primary)

    def bind(
        self,
        num_tokens: int,
        *,
        kvcaches: Sequence[torch.Tensor] | None = None,
        slot_mapping: torch.Tensor | None = None,
        sync: bool = True,
    ) -> PagedKV:
        """:meth:`PagedKVBase.bind`, refusing a 2-D (per-group) slot mapping."""
        if isinstance(slot_mapping, torch.Tensor) and slot_mapping.dim() == 2:
            raise ValueError(f"{_GROUPED_REFUSED} (got shape {tuple(slot_mapping.shape)})")
        kv = super().bind(num_tokens, kvcaches=kvcaches, slot_mapping=slot_mapping, sync=sync)
        _refuse_grouped(kv)
        return kv

    # ------------------------------------------------------------------ helpers
    def _kernel_view(self, obj: MemoryObj, start: int, end: int) -> torch.Tensor:
        """The object's ``[num_kv, 1, T, hidden]`` tensor (what copy_ops expects), shape-checked."""
        t = object_tensor(obj, "objs")
        if tuple(t.shape) != tuple(self.get_shape(end - start)):
            raise ValueError(f"MemoryObj shape {tuple(t.shape)} does not hold one layer of tokens [{start}, {end})")
        return t

    def _stream_of(self, stream: torch.cuda.Stream | None, kv: torch.Tensor) -> torch.cuda.Stream | None:
        """The side stream to use for ``kv``, or None when copies are synchronous (CPU)."""
        return stream if stream is not None and kv.device.type == "cuda" else None

    def _run_layer(self, stream: torch.cuda.Stream | None, layer: int, body) -> LayerCopy:
        if stream is None:
            body()
            return LayerCopy(layer)
        with torch.cuda.stream(stream):
            body()
        event = torch.cuda.Event()
        event.record(stream)
        return LayerCopy(layer, event)

    def _layer_copier(
        self,
        direction: int,
        kvcaches: Sequence[torch.Tensor],
        geom: PagedGeometry,
        slots: torch.Tensor,
        starts: Sequence[int],
        ends: Sequence[int],
    ) -> LayerCopier:
        """The per-layer copy of one request: ``copier(layer, objs)`` copies ``layer`` for
        the first ``len(objs)`` chunks. Built once per generator; subclasses may prepare
        the per-request work here (see :class:`VLLMPagedMemLayerwiseGPUConnector`)."""
        body = self._gather_layer if direction == native.GATHER else self._scatter_layer

        def copy(layer: int, objs: Sequence[MemoryObj]) -> None:
            k = len(objs)
            body(kvcaches[layer], geom, slots, starts[:k], ends[:k], objs)

        return copy

    @abstractmethod
    def _gather_layer(
        self,
        layer_kv: torch.Tensor,
        geom: PagedGeometry,
        slots: torch.Tensor,
        starts: Sequence[int],
        ends: Sequence[int],
        objs: Sequence[MemoryObj],
    ) -> None:
        """Paged layer -> objs (runs on the store stream when on CUDA)."""

    @abstractmethod
    def _scatter_layer(
        self,
        layer_kv: torch.Tensor,
        geom: PagedGeometry,
        slots: torch.Tensor,
        starts: Sequence[int],
        ends: Sequence[int],
        objs: Sequence[MemoryObj],
    ) -> None:
        """objs -> paged layer (runs on the load stream when on CUDA)."""

    # ------------------------------------------------------------------ generators
    def batched_from_gpu(
        self,
        objs_per_layer: Sequence[Sequence[MemoryObj]],
        starts: Sequence[int],
        ends: Sequence[int],
        kv: PagedKV | None = None,
        **kwargs: Any,
    ) -> StoreGenerator:
        """Store generator: the ``i``-th ``next()`` copies layer ``i`` into ``objs_per_layer[i]``.

        Exactly ``num_layers`` ``next()`` calls; each returns the layer's
        :class:`LayerCopy`. ``objs_per_layer[i][j]`` receives chunk ``j`` (tokens
        ``[starts[j], ends[j])``) of layer ``i``; the caller owns every object before and
        after. Arguments are checked when the generator is created.
        """
        _check_spans(starts, ends)
        if len(objs_per_layer) != self.num_layers:
            raise ValueError(f"objs_per_layer: expected {self.num_layers} layers, got {len(objs_per_layer)}")
        n = len(starts)
        for layer, objs in enumerate(objs_per_layer):
            if len(objs) != n:
                raise ValueError(f"objs_per_layer[{layer}]: expected {n} objects, got {len(objs)}")
        kv = self._bound(kv, ends, kwargs)
        _refuse_grouped(kv)
        return self._from_gpu_steps(
            list(kv.kvcaches), kv.slot_mapping, kv.geometry, objs_per_layer, list(starts), list(ends), kv.sync
        )

    def _from_gpu_steps(self, kvcaches, slots, geom, objs_per_layer, starts, ends, sync) -> StoreGenerator:
        stream = self._stream_of(self.store_stream, kvcaches[0])
        if stream is not None and slots.is_cuda:
            slots.record_stream(stream)  # read by copies still queued when the generator ends
        copy = self._layer_copier(native.GATHER, kvcaches, geom, slots, starts, ends)
        for layer in range(self.num_layers):
            if stream is not None and sync:
                stream.wait_stream(torch.cuda.current_stream(kvcaches[layer].device))
            objs = objs_per_layer[layer]
            yield self._run_layer(stream, layer, lambda: copy(layer, objs))

    def batched_to_gpu(
        self, starts: Sequence[int], ends: Sequence[int], kv: PagedKV | None = None, **kwargs: Any
    ) -> LoadGenerator:
        """Load generator, ``num_layers + 2`` steps, objects handed in per layer.

        Protocol::

            gen = connector.batched_to_gpu(starts, ends, kvcaches=..., slot_mapping=...)
            next(gen)                        # setup; returns None
            for layer in range(num_layers):
                handle = gen.send(objs)      # copy layer `layer`; returns its LayerCopy
            next(gen)                        # final ordering; returns None

        ``objs`` holds the layer's objects for a prefix of the chunks (fewer than
        ``len(starts)`` when storage returned fewer; an empty list copies nothing). Only
        those chunks are written. The caller owns the objects and keeps them referenced
        until the layer's handle is done.
        """
        _check_spans(starts, ends)
        kv = self._bound(kv, ends, kwargs)
        _refuse_grouped(kv)
        return self._to_gpu_steps(list(kv.kvcaches), kv.slot_mapping, kv.geometry, list(starts), list(ends), kv.sync)

    def _to_gpu_steps(self, kvcaches, slots, geom, starts, ends, sync) -> LoadGenerator:
        stream = self._stream_of(self.load_stream, kvcaches[0])
        device = kvcaches[0].device
        if stream is not None:
            # Blocks being filled may have been read by work still queued on the current stream.
            stream.wait_stream(torch.cuda.current_stream(device))
            if slots.is_cuda:
                slots.record_stream(stream)  # read by copies still queued when the generator ends
        previous: LayerCopy | None = None
        copy = self._layer_copier(native.SCATTER, kvcaches, geom, slots, starts, ends)
        objs = yield None
        for layer in range(self.num_layers):
            if objs is None:
                raise ValueError(f"batched_to_gpu: layer {layer} needs its MemoryObjs via send(), got None")
            if len(objs) > len(starts):
                raise ValueError(f"batched_to_gpu: layer {layer} got {len(objs)} objects for {len(starts)} chunks")
            if sync and previous is not None and previous.event is not None:
                torch.cuda.current_stream(device).wait_event(previous.event)
            layer_objs = list(objs)
            previous = self._run_layer(stream, layer, lambda: copy(layer, layer_objs))
            objs = yield previous
        if sync and previous is not None and previous.event is not None:
            torch.cuda.current_stream(device).wait_event(previous.event)
        yield None


class VLLMPagedMemLayerwiseGPUConnector(LayerwiseGPUConnector):
    """Layerwise copies straight between the paged layer and the per-layer objects.

    On the CPU with the native kernels, each request's copies share one
    :class:`~lmcache.v1.gpu_connector.native.LayerCopyPlan` (spans, slots and layer
    checks done once); a layer then costs one native call plus a metadata check per
    object. Elsewhere (CUDA, torch fallback) every layer goes through
    :mod:`~lmcache.v1.gpu_connector.copy_ops`.
    """

    def _layer_copier(self, direction, kvcaches, geom, slots, starts, ends) -> LayerCopier:
        mod = native.load() if copy_ops.native_enabled() else None
        if mod is None or not starts or kvcaches[0].device.type != "cpu":
            return super()._layer_copier(direction, kvcaches, geom, slots, starts, ends)
        counts = [e - s for s, e in zip(starts, ends)]
        plan = mod.layer_plan(direction, kvcaches, geom, slots, starts, counts)
        dtype = kvcaches[0].dtype
        shapes = {n: tuple(self.get_shape(n)) for n in set(counts)}
        want = [shapes[n] for n in counts]
        run = plan.run

        def copy(layer: int, objs: Sequence[MemoryObj]) -> None:
            ptrs = pool_addresses(objs, want, dtype)  # pool objects: no tensor op
            if ptrs is None:
                j = next(j for j, obj in enumerate(objs) if pool_addresses([obj], [want[j]], dtype) is None)
                if not isinstance(objs[j], MemoryObj):
                    raise TypeError(f"objs[{j}]: expected a MemoryObj, got {type(objs[j]).__name__}")
                self._kernel_view(objs[j], starts[j], ends[j])  # raises the precise error for a wrong shape
                raise ValueError(f"MemoryObj {objs[j]!r}: dtype {objs[j].meta.dtype} or device does not match the KV ({dtype}, cpu)")
            run(layer, ptrs)

        return copy

    def _gather_layer(self, layer_kv, geom, slots, starts, ends, objs) -> None:
        if objs:
            dsts = [self._kernel_view(o, s, e) for o, s, e in zip(objs, starts, ends)]
            copy_ops.paged_gather([layer_kv], geom, slots, starts, dsts)

    def _scatter_layer(self, layer_kv, geom, slots, starts, ends, objs) -> None:
        if objs:
            srcs = [self._kernel_view(o, s, e) for o, s, e in zip(objs, starts, ends)]
            copy_ops.paged_scatter([layer_kv], geom, slots, starts, srcs)


class VLLMBufferLayerwiseGPUConnector(LayerwiseGPUConnector):
    """Layerwise copies staged through one contiguous buffer per direction on the KV device.

    Store: paged layer -> buffer (device-local gather) -> one contiguous copy per object.
    Load: one contiguous copy per object -> buffer -> paged layer (device-local scatter).
    The buffers are ``[num_kv, 1, tokens, hidden]`` like the objects (an object's slice is
    one contiguous run per component), grow to the largest request seen and are reused;
    each is used only on its own stream, so consecutive layers and requests are ordered
    on it.
    """

    def __init__(self, *args: Any, use_double_buffer: bool = True, **kwargs: Any) -> None:
        """Arguments of :class:`~lmcache.v1.gpu_connector.paged.PagedKVBase`;
        ``use_double_buffer`` (LMCache's) is accepted and has no effect: each direction
        has its own buffer and stream."""
        super().__init__(*args, **kwargs)
        self.use_double_buffer = bool(use_double_buffer)
        self._buffers: dict[str, torch.Tensor] = {}

    def _buffer(self, name: str, num_tokens: int, like: torch.Tensor) -> torch.Tensor:
        buf = self._buffers.get(name)
        if buf is None or buf.shape[2] < num_tokens or buf.device != like.device or buf.dtype != like.dtype:
            size = max(num_tokens, self.chunk_size)
            buf = torch.empty((self.num_kv, 1, size, self.hidden_dim_size), dtype=like.dtype, device=like.device)
            self._buffers[name] = buf
        return buf

    @staticmethod
    def _offsets(starts: Sequence[int], ends: Sequence[int]) -> list[int]:
        offs, total = [], 0
        for s, e in zip(starts, ends):
            offs.append(total)
            total += e - s
        offs.append(total)
        return offs

    def _staged_views(self, buf: torch.Tensor, starts, ends, offs) -> tuple[list[int], list[torch.Tensor]]:
        """Kernel starts and ``[num_kv, 1, T, hidden]`` buffer views covering the spans."""
        if _contiguous_run(starts, ends):
            return [starts[0]], [buf[:, :, : offs[-1]]]
        return list(starts), [buf[:, :, offs[j] : offs[j + 1]] for j in range(len(starts))]

    def _gather_layer(self, layer_kv, geom, slots, starts, ends, objs) -> None:
        if not objs:
            return
        for o, s, e in zip(objs, starts, ends):
            self._kernel_view(o, s, e)  # validates shapes
        offs = self._offsets(starts, ends)
        buf = self._buffer("store", offs[-1], layer_kv)
        kstarts, views = self._staged_views(buf, starts, ends, offs)
        copy_ops.paged_gather([layer_kv], geom, slots, kstarts, views)
        non_blocking = layer_kv.device.type == "cuda"
        for j, obj in enumerate(objs):
            obj.tensor.copy_(buf[:, :, offs[j] : offs[j + 1]], non_blocking=non_blocking)

    def _scatter_layer(self, layer_kv, geom, slots, starts, ends, objs) -> None:
        if not objs:
            return
        for o, s, e in zip(objs, starts, ends):
            self._kernel_view(o, s, e)  # validates shapes
        offs = self._offsets(starts, ends)
        buf = self._buffer("load", offs[-1], layer_kv)
        non_blocking = layer_kv.device.type == "cuda"
        for j, obj in enumerate(objs):
            buf[:, :, offs[j] : offs[j + 1]].copy_(obj.tensor, non_blocking=non_blocking)
        kstarts, views = self._staged_views(buf, starts, ends, offs)
        copy_ops.paged_scatter([layer_kv], geom, slots, kstarts, views)
