"""The one protocol every GPU connector satisfies (bulk and layerwise).

What the engine and the adapters use of a connector whatever its kind: the object
format and shape per chunk, argument validation (:meth:`KVConnector.bind`) and the
registered KV tensors. The copy calls differ by kind and are used only by the matching
transfer path: the bulk connector's ``batched_from_gpu``/``batched_to_gpu`` copy all
layers at once (:class:`~lmcache.v1.gpu_connector.paged.GPUConnectorInterface`), the
layerwise connectors return per-layer generators
(:class:`~lmcache.v1.gpu_connector.layerwise.LayerwiseGPUConnector`).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol, runtime_checkable

import torch

from lmcache.v1.memory_management import MemoryFormat
from lmcache.v1.gpu_connector.paged_kv import PagedKV, PagedKVSpec


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
