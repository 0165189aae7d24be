"""LMCache 0.5.6's module path for the connector classes (re-exports only)."""

from lmcache.v1.gpu_connector.layerwise import VLLMBufferLayerwiseGPUConnector, VLLMPagedMemLayerwiseGPUConnector
from lmcache.v1.gpu_connector.paged import VLLMPagedMemGPUConnectorV2
from lmcache.v1.gpu_connector.protocol import GPUConnectorInterface

__all__ = [
    "GPUConnectorInterface",
    "VLLMBufferLayerwiseGPUConnector",
    "VLLMPagedMemGPUConnectorV2",
    "VLLMPagedMemLayerwiseGPUConnector",
]
