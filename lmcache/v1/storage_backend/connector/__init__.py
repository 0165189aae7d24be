"""Connectors from the remote tier to a key-value store (Redis/Valkey, standalone or cluster).

:func:`create_connector` picks the connector for a ``remote_url``; the remote backend
talks to it in keys (strings) and buffers only.
"""

from __future__ import annotations

from lmcache.v1.storage_backend.connector.errors import RemoteAuthError, RemoteError, RemoteUnavailable, RemoteWrongType
from lmcache.v1.storage_backend.connector.redis_connector import RedisConnector, TLSOptions
from lmcache.v1.storage_backend.connector.url import RemoteAddress, mask_url, parse_remote_url

__all__ = [
    "RedisConnector",
    "RemoteAddress",
    "RemoteAuthError",
    "RemoteError",
    "RemoteUnavailable",
    "RemoteWrongType",
    "TLSOptions",
    "create_connector",
    "mask_url",
    "parse_remote_url",
]


def create_connector(
    url: str,
    *,
    timeout: float,
    username: str | None = None,
    password: str | None = None,
    tls: TLSOptions | None = None,
) -> RedisConnector:
    """The connector for ``url`` (no I/O yet). Raises ValueError for a malformed URL."""
    return RedisConnector(parse_remote_url(url), timeout=timeout, username=username, password=password, tls=tls)
