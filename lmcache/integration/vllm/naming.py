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


MAX_SOCKET_PATH = 107
"""Longest Unix socket path Linux accepts, in bytes (``sun_path`` holds 108 with the NUL)."""


def socket_path(socket_dir: str, engine_id: str, rank: int) -> str:
    """Unix socket of worker ``rank``'s lookup server (short: see :data:`MAX_SOCKET_PATH`)."""
    digest = hashlib.sha1(engine_id.encode()).hexdigest()[:16]
    return os.path.join(socket_dir, f"lookup-{digest}-r{rank}.sock")


def socket_dir_problem(socket_dir: str, engine_id: str, world_size: int) -> str | None:
    """Why ``socket_dir`` cannot hold the lookup sockets of ``world_size`` ranks, or None.

    A path over :data:`MAX_SOCKET_PATH` bytes cannot be bound or connected to, which
    would turn every scheduler lookup into a miss; callers refuse it at start-up."""
    longest = socket_path(socket_dir, engine_id, max(world_size - 1, 0))
    size = len(os.fsencode(longest))
    if size <= MAX_SOCKET_PATH:
        return None
    room = MAX_SOCKET_PATH - (size - len(os.fsencode(socket_dir)))
    return (
        f"{socket_dir!r} gives lookup socket paths of {size} bytes; Unix sockets allow {MAX_SOCKET_PATH} "
        f"(expected a directory path of at most {room} bytes)"
    )
