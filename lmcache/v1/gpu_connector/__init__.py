"""Copy connectors between an inference engine's paged KV cache and MemoryObjs.

Layouts are data (:mod:`.layouts`); the copy mechanism (:mod:`.copy_ops`) is shared by
the bulk connector (:mod:`.paged`) and the layerwise connectors (:mod:`.layerwise`).
The contracts live in :mod:`.protocol`: every connector satisfies
:class:`.protocol.KVConnector`, the bulk one :class:`.protocol.GPUConnectorInterface`, the
layerwise ones :class:`.protocol.LayerwiseGPUConnectorInterface`;
:func:`.factory.create_gpu_connector` picks one from a config. The connector classes are exported here, where LMCache 0.5.6 users and vLLM's in-tree
LMCache integration import them.
"""

from lmcache.v1.gpu_connector.layerwise import VLLMBufferLayerwiseGPUConnector, VLLMPagedMemLayerwiseGPUConnector
from lmcache.v1.gpu_connector.paged import VLLMPagedMemGPUConnectorV2
from lmcache.v1.gpu_connector.protocol import GPUConnectorInterface, KVConnector, LayerwiseGPUConnectorInterface

__all__ = [
    "GPUConnectorInterface",
    "KVConnector",
    "LayerwiseGPUConnectorInterface",
    "VLLMBufferLayerwiseGPUConnector",
    "VLLMPagedMemGPUConnectorV2",
    "VLLMPagedMemLayerwiseGPUConnector",
]
