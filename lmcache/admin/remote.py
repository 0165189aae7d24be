"""The remote store as the admin API sees it: instance records, and the KV entries of a
prompt probed by their deterministic keys (EXISTS only: values are never read).

Threads: one :class:`RemoteStore` serves every request thread (the connector is
thread-safe). Calls block for at most about ``timeout`` seconds per round trip and
raise :class:`~lmcache.v1.storage_backend.connector.RemoteError` on failure.
"""

from __future__ import annotations

import logging
import re
from collections.abc import Sequence
from urllib.parse import quote

from lmcache.integration.vllm.registration import InstanceRecord, index_key, instances_prefix
from lmcache.log_once import LogOnce
from lmcache.v1.request import KeyExtras
from lmcache.v1.storage_backend.connector import RedisConnector, create_connector, mask_url
from lmcache.v1.storage_backend.remote_backend import entry_key, entry_key_prefix

logger = logging.getLogger(__name__)

DELETE_BATCH = 500
MAX_RECORDS = 1024
"""Registrations read per listing (the oldest first): a flooded index cannot make every request slow."""
_GLOB_SPECIAL = re.compile(r"([*?\[\]\\])")


def glob_escape(text: str) -> str:
    """``text`` as a literal in a Redis SCAN MATCH pattern."""
    return _GLOB_SPECIAL.sub(r"\\\1", text)


class RemoteStore:
    """Instance records and KV-entry probes on the server at ``url`` (no I/O until used).

    ``key_prefix`` is the instances' ``remote_key_prefix``. ``username``/``password``
    override credentials in the URL."""

    def __init__(self, url: str, *, key_prefix: str = "lmcache", timeout: float = 5.0,
                 username: str | None = None, password: str | None = None) -> None:
        self.url = mask_url(url)
        self.key_prefix = key_prefix
        self.conn: RedisConnector = create_connector(url, timeout=timeout, username=username, password=password)
        self._log_once = LogOnce(logger)

    def records(self) -> list[InstanceRecord]:
        """Every live instance record, from the registration index (no keyspace SCAN).
        Index entries whose record expired are dropped; malformed records are skipped
        (logged once); at most :data:`MAX_RECORDS` are read."""
        out = []
        index = index_key(self.key_prefix)
        for member in self.conn.command(index, "ZRANGE", index, 0, MAX_RECORDS - 1):
            engine_id = member.decode() if isinstance(member, bytes) else str(member)
            raw = self.conn.get(instances_prefix(self.key_prefix) + engine_id)
            if raw is None:  # the instance died without closing: its record expired
                self.conn.command(index, "ZREM", index, member)
                continue
            try:
                out.append(InstanceRecord.from_json(raw))
            except (ValueError, TypeError) as exc:
                self._log_once(logging.WARNING, "record", "lmcache admin: skipping a malformed instance record "
                               "%r (%s) (logged once)", engine_id, exc)
        return sorted(out, key=lambda r: r.engine_id)

    def cached_tokens(self, record: InstanceRecord, tokens: Sequence[int]) -> int:
        """Leading tokens of ``tokens`` whose chunks are in the remote store for every rank
        of ``record``'s instance (whole chunks, and a partial last chunk when the instance
        stores those)."""
        best: int | None = None
        for db in record.key_space.databases():
            pk = db.prefix_keys(list(tokens), KeyExtras.build())
            present = self.conn.exists([entry_key(record.remote_entry_prefix, k) for k in pk.keys])
            found = next((i for i, hit in enumerate(present) if not hit), len(present))
            hit = pk.end(found)
            best = hit if best is None else min(best, hit)
        return best or 0

    def namespace_pattern(self, record: InstanceRecord | None) -> str:
        """SCAN pattern of the KV entries of ``record``'s namespace (model and world size,
        every rank and dtype), or with None of every KV entry under the key prefix.
        Entries whose key string was too long and stored hashed (``#sha256:``) are not
        matched by a namespace pattern."""
        if record is None:
            return glob_escape(entry_key_prefix(self.key_prefix, "kv")) + "*"
        ks = record.key_space
        head = f"{quote(ks.model_name, safe='')}@{ks.world_size}@"
        return glob_escape(record.remote_entry_prefix + head) + "*"

    def delete_matching(self, pattern: str) -> int:
        """Delete every key matching ``pattern`` (SCAN, then DEL in batches of
        :data:`DELETE_BATCH`); the number deleted."""
        deleted = 0
        for batch in self.conn.scan_keys(pattern, batch=DELETE_BATCH):
            deleted += self.conn.delete_many(batch)
        logger.info("lmcache admin: deleted %d remote keys matching %r on %s", deleted, pattern, self.url)
        return deleted

    def close(self) -> None:
        self.conn.close()
