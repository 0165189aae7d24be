"""Names and paths of one vLLM worker's lmcache parts: its engine's registry name and its
lookup server's socket.

Stateless: pure functions of the vLLM engine id and the worker rank (and the runtime
directory).
"""

from __future__ import annotations

import hashlib
import os

from lmcache.v1.cache_engine import LMCacheEngine, LMCacheEngineBuilder
from lmcache.v1.private_files import default_runtime_dir


def instance_id(engine_id: str, rank: int) -> str:
    """Registry name (:class:`LMCacheEngineBuilder`) of the engine of one vLLM worker."""
    return f"vllm-{engine_id}-r{rank}"


def engine_for(engine_id: str, rank: int) -> LMCacheEngine | None:
    """The engine of worker ``rank`` of the vLLM instance ``engine_id``, if it lives in this process."""
    return LMCacheEngineBuilder.get(instance_id(engine_id, rank))


def default_socket_dir() -> str:
    """Per-user directory (mode 0700) for lookup sockets: ``$XDG_RUNTIME_DIR/lmcache`` or ``<tmp>/lmcache-<uid>``.

    The server creates and verifies it (:mod:`lmcache.v1.private_files`).
    """
    return default_runtime_dir()


def socket_path(socket_dir: str, engine_id: str, rank: int) -> str:
    """Unix socket of worker ``rank``'s lookup server (short: AF_UNIX paths are ~107 bytes)."""
    digest = hashlib.sha1(engine_id.encode()).hexdigest()[:16]
    return os.path.join(socket_dir, f"lookup-{digest}-r{rank}.sock")
