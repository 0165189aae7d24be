"""CacheBlend core: reuse separately cached documents' KV anywhere in a prompt.

Pure torch, no inference-engine import (the vLLM side is in
``lmcache/integration/vllm/blend_*.py``; see docs/blending.md):

* :mod:`.rope`      standard RoPE: apply it, re-rotate cached keys to new positions
* :mod:`.segments`  split a prompt on a separator's token ids; position-free segment keys
* :mod:`.reused`    cached segments' KV placed (and re-rotated) into a new prompt
* :mod:`.model`     the layer-by-layer model interface and exact causal attention
* :mod:`.blender`   the selective recompute (check layer, top-ratio deviation)
* :mod:`.segment_store` segments' KV in the engine's tiers, under position-free keys
* :mod:`.hf_llama`  adapter for Hugging Face Llama-family models
"""

from __future__ import annotations

from lmcache.v1.blend.blender import BlendConfig, BlendResult, blend, deviation, full_prefill
from lmcache.v1.blend.reused import CachedSegmentKV, ReusedKV, assemble, rerotate_layers
from lmcache.v1.blend.rope import RopeSpec, UnsupportedRope
from lmcache.v1.blend.segments import DEFAULT_SEPARATOR, Segment, SegmentKeys, split_segments

__all__ = [
    "DEFAULT_SEPARATOR",
    "BlendConfig",
    "BlendResult",
    "CachedSegmentKV",
    "ReusedKV",
    "RopeSpec",
    "Segment",
    "SegmentKeys",
    "UnsupportedRope",
    "assemble",
    "blend",
    "deviation",
    "full_prefill",
    "rerotate_layers",
    "split_segments",
]
