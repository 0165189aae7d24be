"""Which vLLM instances the admin API sees: those registered in the remote store
(:mod:`lmcache.integration.vllm.registration`) and those with lookup sockets in the
local socket directory (same user; ``lmcache stats`` finds the same ones).

An instance's id is its vLLM engine id when it is registered, else ``local-<digest>``
(the digest in its socket names). A registered instance on this host is reached over
its sockets for its local tiers; one on another host only through the remote store.
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
from lmcache.v1.storage_backend.connector import RemoteError

logger = logging.getLogger(__name__)


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


class InstanceDirectory:
    """Lists instances from ``remote`` (None: no remote store) and ``socket_dir``.

    Asked anew on every call (registrations expire, sockets come and go); ``errors``
    of the last call say what could not be read."""

    def __init__(self, remote: RemoteStore | None, socket_dir: str | None) -> None:
        self.remote = remote
        self.socket_dir = socket_dir
        self.errors: list[str] = []

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
            digest = engine_digest(r.engine_id)
            found = local.pop(digest, [])
            if not found and r.host == host:  # registered with another socket directory
                found = [p for p in r.sockets if os.path.exists(p)]
            out.append(Instance(r.engine_id, r, found))
        out.extend(Instance(f"local-{digest}", None, paths) for digest, paths in local.items())
        self.errors = errors
        return out

    def get(self, instance_id: str) -> Instance | None:
        return next((i for i in self.instances() if i.id == instance_id), None)
