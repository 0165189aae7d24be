"""Names and paths of one vLLM worker's lmcache parts: its engine's registry name and its
lookup server's socket.

Stateless: pure functions of the vLLM engine id and the worker rank (and the runtime
directory).
"""

from __future__ import annotations

import glob
import hashlib
import os
import re

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


def engine_digest(engine_id: str) -> str:
    """The short digest of a vLLM engine id that names its lookup sockets."""
    return hashlib.sha1(engine_id.encode()).hexdigest()[:16]


def socket_path(socket_dir: str, engine_id: str, rank: int) -> str:
    """Unix socket of worker ``rank``'s lookup server (short: see :data:`MAX_SOCKET_PATH`)."""
    return os.path.join(socket_dir, f"lookup-{engine_digest(engine_id)}-r{rank}.sock")


_SOCK = re.compile(r"^lookup-(?P<digest>[0-9a-f]+)-r(?P<rank>\d+)\.sock$")


def find_lookup_sockets(socket_dir: str) -> dict[str, list[str]]:
    """``{engine digest: [socket path by rank]}`` of the lookup sockets in ``socket_dir``."""
    found: dict[str, dict[int, str]] = {}
    for path in glob.glob(os.path.join(socket_dir, "lookup-*.sock")):
        m = _SOCK.match(os.path.basename(path))
        if m:
            found.setdefault(m["digest"], {})[int(m["rank"])] = path
    return {d: [ranks[r] for r in sorted(ranks)] for d, ranks in sorted(found.items())}


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
