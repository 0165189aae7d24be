"""Copy connectors between an inference engine's paged KV cache and MemoryObjs.

Layouts are data (:mod:`.layouts`); the copy mechanism (:mod:`.copy_ops`) is shared by
the bulk connector (:mod:`.paged`) and the layerwise connectors (:mod:`.layerwise`).
"""

from lmcache.v1.gpu_connector.paged import GPUConnectorInterface, VLLMPagedMemGPUConnectorV2

__all__ = ["GPUConnectorInterface", "VLLMPagedMemGPUConnectorV2"]
