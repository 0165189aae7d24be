"""The connector contracts: what the engine, the transfer paths and the adapters rely on.

* :class:`KVConnector` - what every connector satisfies whatever its kind: the object
  format and shape per chunk, argument validation (:meth:`KVConnector.bind`) and the
  registered KV tensors.
* :class:`GPUConnectorInterface` - the bulk copies, all layers of a batch of chunks per
  call (``batched_from_gpu``/``batched_to_gpu``); used by the bulk transfer path and
  implemented by :class:`~lmcache.v1.gpu_connector.paged.VLLMPagedMemGPUConnectorV2`.
* :class:`LayerwiseGPUConnectorInterface` - the per-layer copies, generators that copy
  one layer per step and yield a :class:`LayerCopy` handle; used by the layerwise
  transfer path and implemented by the connectors of :mod:`.layerwise`.

The copy calls differ by kind and only the matching transfer path calls them.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Generator, Sequence
from dataclasses import dataclass
from typing import Any, Protocol, runtime_checkable

import torch

from lmcache.v1.gpu_connector.paged_kv import PagedKV, PagedKVSpec
from lmcache.v1.memory_management import MemoryFormat, MemoryObj


@runtime_checkable
class KVConnector(Protocol):
    """Moves KV between an inference engine's paged cache and MemoryObjs (any kind).

    Called from the worker thread that runs the forward pass. A connector never takes
    or drops references of the objects it copies.
    """

    num_layers: int
    chunk_size: int
    hidden_dim_size: int
    use_mla: bool

    @property
    def fmt(self) -> MemoryFormat:
        """Format of the objects the connector fills and reads."""
        ...

    @property
    def kv_spec(self) -> PagedKVSpec:
        """What every layer tensor must look like."""
        ...

    def get_shape(self, num_tokens: int) -> torch.Size:
        """Shape of the MemoryObj holding ``num_tokens`` tokens (of all layers, or of one)."""
        ...

    def register_kv_caches(self, kvcaches: Sequence[torch.Tensor]) -> None:
        """Remember the engine's per-layer KV tensors (used when a call passes none)."""
        ...

    def bind(
        self,
        num_tokens: int,
        *,
        kvcaches: Sequence[torch.Tensor] | None = None,
        slot_mapping: torch.Tensor | None = None,
        sync: bool = True,
    ) -> PagedKV:
        """Validate one call's KV tensors and slot mapping (TypeError/ValueError)."""
        ...


class GPUConnectorInterface(ABC):
    """Moves KV between the engine's paged cache and MemoryObjs, all layers per call.

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
    def batched_from_gpu(
        self, objs: Sequence[MemoryObj], starts: Sequence[int], ends: Sequence[int], kv: PagedKV | None = None, **kwargs: Any
    ) -> None:
        """Paged KV -> objs (store). ``kv`` from :meth:`bind`, or kwargs ``kvcaches``, ``slot_mapping``."""

    @abstractmethod
    def batched_to_gpu(
        self, objs: Sequence[MemoryObj], starts: Sequence[int], ends: Sequence[int], kv: PagedKV | None = None, **kwargs: Any
    ) -> None:
        """objs -> paged KV (retrieve). ``kv`` from :meth:`bind`, or kwargs ``kvcaches``, ``slot_mapping``."""

    def from_gpu(self, obj: MemoryObj, start: int, end: int, kv: PagedKV | None = None, **kwargs: Any) -> None:
        self.batched_from_gpu([obj], [start], [end], kv, **kwargs)

    def to_gpu(self, obj: MemoryObj, start: int, end: int, kv: PagedKV | None = None, **kwargs: Any) -> None:
        self.batched_to_gpu([obj], [start], [end], kv, **kwargs)


@dataclass(frozen=True, slots=True)
class LayerCopy:
    """Completion handle of one layer's copy.

    ``event`` is None when the copy was synchronous (CPU), so it is already complete.
    """

    layer: int
    event: torch.cuda.Event | None = None

    def done(self) -> bool:
        """Non-blocking: whether the copy has finished (its objects may be released)."""
        return self.event is None or bool(self.event.query())

    def wait(self) -> None:
        """Block the calling thread until the copy has finished."""
        if self.event is not None:
            self.event.synchronize()


StoreGenerator = Generator[LayerCopy, None, None]
LoadGenerator = Generator["LayerCopy | None", "Sequence[MemoryObj] | None", None]


class LayerwiseGPUConnectorInterface(ABC):
    """Moves KV between the engine's paged cache and per-layer MemoryObjs, one layer per step.

    Called from the worker thread that runs the forward pass. Each copied layer yields a
    :class:`LayerCopy`; its objects must stay referenced until ``LayerCopy.done()``.
    The connector never takes or drops references.
    """

    fmt: MemoryFormat
    num_layers: int

    @abstractmethod
    def get_shape(self, num_tokens: int) -> torch.Size:
        """Shape of the MemoryObj holding one layer of ``num_tokens`` tokens."""

    @abstractmethod
    def batched_from_gpu(
        self,
        objs_per_layer: Sequence[Sequence[MemoryObj]],
        starts: Sequence[int],
        ends: Sequence[int],
        kv: PagedKV | None = None,
        **kwargs: Any,
    ) -> StoreGenerator:
        """Store generator: the ``i``-th ``next()`` copies layer ``i`` into ``objs_per_layer[i]``."""

    @abstractmethod
    def batched_to_gpu(
        self, starts: Sequence[int], ends: Sequence[int], kv: PagedKV | None = None, **kwargs: Any
    ) -> LoadGenerator:
        """Load generator: setup, one ``send(objs)`` per layer, a final ``next()``."""
