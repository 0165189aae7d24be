"""The GPU connectors' ``extra_config`` options (typed; see :mod:`lmcache.v1.options`)."""

from __future__ import annotations

from dataclasses import dataclass

from lmcache.v1.config import LMCacheEngineConfig
from lmcache.v1.options import option, parse_options


@dataclass(frozen=True, slots=True)
class ConnectorOptions:
    """Which layerwise connector the engine builds (bad values raise ConfigError)."""

    use_gpu: bool = option(
        False, "use_gpu", "with `use_layerwise`: use `VLLMBufferLayerwiseGPUConnector` (LMCache's GPU-buffer variant)"
    )
    enable_blending: bool = option(
        False, "enable_blending", "with `use_layerwise`: same choice as `use_gpu` (the top-level `enable_blending` makes it too)"
    )

    @property
    def buffered(self) -> bool:
        """Whether the layerwise engine uses the buffer connector."""
        return self.use_gpu or self.enable_blending

    @classmethod
    def from_config(cls, config: LMCacheEngineConfig) -> ConnectorOptions:
        return parse_options(cls, config.extra_config)
