"""Which vLLM instances the admin API sees: those registered in the remote store
(:mod:`lmcache.integration.vllm.registration`) and those with lookup sockets in the
local socket directory (same user; ``lmcache stats`` finds the same ones).

An instance's id is its vLLM engine id when it is registered, else ``local-<digest>``
(the digest in its socket names). A registered instance on this host is reached over
its sockets for its local tiers; one on another host only through the remote store.

Records are written by anyone who may write under the key prefix, so they are only
trusted as far as they cannot redirect this service (:func:`record_problem`): a record
whose entries are not under this service's own key prefix, whose sockets on this host
are outside its socket directory, or whose key space is out of bounds is skipped
(logged once, and listed in ``errors``). Sockets are only ever taken from the socket
directory (found by the engine id's digest), never from a record.
"""

from __future__ import annotations

import logging
import os
import socket
from dataclasses import dataclass, field
from typing import Any

from lmcache.admin.remote import RemoteStore
from lmcache.integration.vllm.naming import engine_digest, find_lookup_sockets
from lmcache.integration.vllm.registration import InstanceRecord
from lmcache.log_once import LogOnce
from lmcache.v1.storage_backend.connector import RemoteError
from lmcache.v1.storage_backend.remote_backend import entry_key_prefix

logger = logging.getLogger(__name__)

MAX_WORLD_SIZE = 1024
"""Largest world size a record may name (the remote probe rebuilds one key set per rank)."""


@dataclass(frozen=True, slots=True)
class Instance:
    """One vLLM instance: its registration (if any) and the lookup sockets of its ranks
    reachable from here (empty when it runs elsewhere)."""

    id: str
    record: InstanceRecord | None = None
    sockets: list[str] = field(default_factory=list)

    def describe(self) -> dict[str, Any]:
        """What ``GET /instances`` shows (no secrets: records hold none)."""
        out: dict[str, Any] = {"id": self.id, "registered": self.record is not None, "local": bool(self.sockets),
                               "sockets": list(self.sockets)}
        if self.record is not None:
            r = self.record
            out.update(host=r.host, pid=r.pid, model=r.model, namespace=r.namespace, world_size=r.world_size,
                       kv_dtype=r.kv_dtype, chunk_size=r.chunk_size, tiers=r.tiers, started_at=r.started_at)
        return out

    def serves(self, model: str) -> bool:
        r = self.record
        return r is not None and model in (r.model, r.namespace, r.tokenizer)


def _inside(path: object, directory: str) -> bool:
    return isinstance(path, str) and os.path.dirname(os.path.normpath(path)) == directory


def record_problem(record: InstanceRecord, *, key_prefix: str, socket_dir: str | None, host: str) -> str | None:
    """Why ``record`` must not be used by a service with ``key_prefix`` and ``socket_dir``
    on ``host``, or None when it may. Pure."""
    for name in ("engine_id", "host", "model", "tokenizer", "namespace"):
        value = getattr(record, name)
        if not isinstance(value, str) or not value or len(value) > 4096:
            return f"{name} is not a non-empty string"
    if not isinstance(record.tiers, list) or not all(isinstance(t, str) for t in record.tiers):
        return "tiers is not a list of tier names"
    expected = entry_key_prefix(key_prefix, "kv")
    if record.remote_entry_prefix != expected:
        return (f"its remote entries are under {str(record.remote_entry_prefix)[:120]!r}, not this service's "
                f"{expected!r} (--key-prefix {key_prefix})")
    if record.host == host:
        own = os.path.normpath(socket_dir) if socket_dir else None
        if not isinstance(record.sockets, list) or own is None or not all(_inside(p, own) for p in record.sockets):
            return (f"its lookup sockets are outside this service's socket directory {socket_dir!r} "
                    "(start it with the instances' --socket-dir)")
    try:
        ks = record.key_space
    except (KeyError, ValueError, TypeError, OverflowError) as exc:
        return f"its key space is malformed ({type(exc).__name__}: {exc})"
    if not 1 <= ks.world_size <= MAX_WORLD_SIZE or not 1 <= ks.chunk_size <= 1 << 20:
        return f"world_size {ks.world_size} / chunk_size {ks.chunk_size} out of bounds"
    return None


class InstanceDirectory:
    """Lists instances from ``remote`` (None: no remote store) and ``socket_dir``.

    Asked anew on every call (registrations expire, sockets come and go); ``errors``
    of the last call say what could not be read or was not trusted. Called on request
    threads; blocks on the remote store (bounded by its timeout)."""

    def __init__(self, remote: RemoteStore | None, socket_dir: str | None) -> None:
        self.remote = remote
        self.socket_dir = socket_dir
        self.errors: list[str] = []
        self._log_once = LogOnce(logger)

    def instances(self) -> list[Instance]:
        errors: list[str] = []
        records: list[InstanceRecord] = []
        if self.remote is not None:
            try:
                records = self.remote.records()
            except RemoteError as exc:
                errors.append(f"remote store {self.remote.url}: {type(exc).__name__}: {exc}")
        local = find_lookup_sockets(self.socket_dir) if self.socket_dir and os.path.isdir(self.socket_dir) else {}
        host = socket.gethostname()
        out = []
        for r in records:
            assert self.remote is not None
            problem = record_problem(r, key_prefix=self.remote.key_prefix, socket_dir=self.socket_dir, host=host)
            if problem is not None:
                errors.append(f"instance record {str(r.engine_id)[:120]!r}: skipped: {problem}")
                self._log_once(logging.WARNING, "untrusted", "lmcache admin: skipping instance record %r: %s "
                               "(logged once; GET /instances lists every skipped record)", r.engine_id, problem)
                continue
            out.append(Instance(r.engine_id, r, local.pop(engine_digest(r.engine_id), [])))
        out.extend(Instance(f"local-{digest}", None, paths) for digest, paths in local.items())
        self.errors = errors
        return out

    def get(self, instance_id: str) -> Instance | None:
        return next((i for i in self.instances() if i.id == instance_id), None)
