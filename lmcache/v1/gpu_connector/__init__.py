"""Copy connectors between an inference engine's paged KV cache and MemoryObjs.

Layouts are data (:mod:`.layouts`); the copy mechanism (:mod:`.copy_ops`) is shared by
the bulk connector (:mod:`.paged`) and the layerwise connectors (:mod:`.layerwise`).
Every connector satisfies :class:`.protocol.KVConnector`; :func:`.factory.create_gpu_connector`
picks one from a config. The connector classes are exported here, where LMCache 0.5.6 users and vLLM's in-tree
LMCache integration import them.
"""

from lmcache.v1.gpu_connector.layerwise import VLLMBufferLayerwiseGPUConnector, VLLMPagedMemLayerwiseGPUConnector
from lmcache.v1.gpu_connector.paged import GPUConnectorInterface, VLLMPagedMemGPUConnectorV2
from lmcache.v1.gpu_connector.protocol import KVConnector

__all__ = [
    "GPUConnectorInterface",
    "KVConnector",
    "VLLMBufferLayerwiseGPUConnector",
    "VLLMPagedMemGPUConnectorV2",
    "VLLMPagedMemLayerwiseGPUConnector",
]
