"""Loader for the optional native copy kernels built from ``csrc/`` (``lmcache._c_ops``).

The extension is optional: if it was not built (no compiler at install time) or fails
to import, :func:`load` returns None once with one log line, and callers use the
torch fallback in :mod:`lmcache.v1.gpu_connector.copy_ops`.
"""

from __future__ import annotations

import functools
import logging
from types import ModuleType

import torch

logger = logging.getLogger(__name__)


@functools.cache
def load() -> ModuleType | None:
    """The native module, or None (logged once) when it is unavailable."""
    try:
        from lmcache import _c_ops  # type: ignore[attr-defined]
    except ImportError as exc:
        logger.info("lmcache native copy kernels unavailable (%s); using the torch fallback", exc)
        return None
    return _c_ops


def supports(mod: ModuleType, kv: torch.Tensor, mem: torch.Tensor) -> bool:
    """Whether ``mod`` has kernels for this pair of devices."""
    if kv.device.type == "cpu" and mem.device.type == "cpu":
        return True
    if kv.device.type == "cuda":
        return bool(getattr(mod, "has_cuda", False))
    return False
