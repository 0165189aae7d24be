"""The connector that matches a config (bulk or layerwise, plain or buffered)."""

from __future__ import annotations

import torch

from lmcache.v1.config import LMCacheEngineConfig
from lmcache.v1.gpu_connector.layerwise import VLLMBufferLayerwiseGPUConnector, VLLMPagedMemLayerwiseGPUConnector
from lmcache.v1.gpu_connector.options import ConnectorOptions
from lmcache.v1.gpu_connector.paged import VLLMPagedMemGPUConnectorV2
from lmcache.v1.gpu_connector.protocol import KVConnector


def create_gpu_connector(
    config: LMCacheEngineConfig,
    hidden_dim_size: int,
    num_layers: int,
    *,
    dtype: torch.dtype,
    device: torch.device | str,
    use_mla: bool = False,
    layout: str | None = None,
) -> KVConnector:
    """The connector that matches ``config``.

    ``use_layerwise: false`` -> :class:`VLLMPagedMemGPUConnectorV2` (bulk);
    ``use_layerwise: true`` -> :class:`VLLMPagedMemLayerwiseGPUConnector`, or
    :class:`VLLMBufferLayerwiseGPUConnector` when ``enable_blending`` is on (the top-level
    key) or ``extra_config`` sets ``use_gpu`` or ``enable_blending`` true
    (:class:`~.options.ConnectorOptions`; a value that is not a boolean raises ConfigError).
    The caller owns the returned connector.
    """
    args = (hidden_dim_size, num_layers)
    kw = dict(chunk_size=config.chunk_size, dtype=dtype, device=device, use_mla=use_mla, layout=layout)
    if not config.use_layerwise:
        return VLLMPagedMemGPUConnectorV2(*args, **kw)
    if ConnectorOptions.from_config(config).buffered or config.enable_blending:  # typed: "false" is False, a bad value a ConfigError
        return VLLMBufferLayerwiseGPUConnector(*args, **kw)
    return VLLMPagedMemLayerwiseGPUConnector(*args, **kw)
