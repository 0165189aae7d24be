"""Byte-level client for one Redis (or Valkey) deployment: standalone or Redis Cluster.

:class:`RedisConnector` knows keys as strings and values as buffers; it knows nothing
about MemoryObjs or entries. It routes each key to a connection pool (the single
server, or the cluster node owning the key's slot), runs large SET/GET through the
zero-copy helpers of :mod:`.resp` one value at a time, and batches EXISTS per node.

Threads: every method may be called from any thread and blocks the caller for at
most about ``timeout`` seconds (connect timeout plus one operation deadline); each
call uses its own pooled connection, so several threads run transfers in parallel.

Errors: redis-py exceptions never escape. Connection loss, timeouts and a cluster
that is down raise :class:`RemoteUnavailable`; rejected credentials (or missing ACL
permissions) raise :class:`RemoteAuthError`; other server replies raise
:class:`RemoteError`. A ``MOVED``/``ASK`` redirect refreshes the cluster's slot map
and retries the call once.
"""

from __future__ import annotations

import logging
import threading
import time
from dataclasses import dataclass
from typing import Any, Callable, Iterator, Sequence, TypeVar

import redis
from redis.backoff import NoBackoff
from redis.retry import Retry

from lmcache.v1.storage_backend.connector.errors import RemoteAuthError, RemoteError, RemoteUnavailable, RemoteWrongType
from lmcache.v1.storage_backend.connector.resp import SCRATCH_BYTES, Buffer, ReadPlan, ReplyError, get_into, send_set
from lmcache.v1.storage_backend.connector.url import RemoteAddress

logger = logging.getLogger(__name__)

T = TypeVar("T")
HEAD_BYTES = 8 * 1024  # value bytes handed to a read plan before it picks the destination
_UNAVAILABLE_REPLIES = ("CLUSTERDOWN", "TRYAGAIN", "MASTERDOWN", "LOADING")


@dataclass(frozen=True, slots=True)
class TLSOptions:
    """TLS settings for ``rediss://`` (paths to PEM files; ``cert_reqs``: required/optional/none)."""

    ca_certs: str | None = None
    certfile: str | None = None
    keyfile: str | None = None
    cert_reqs: str = "required"
    check_hostname: bool = False

    def kwargs(self) -> dict[str, Any]:
        return {
            "ssl_ca_certs": self.ca_certs,
            "ssl_certfile": self.certfile,
            "ssl_keyfile": self.keyfile,
            "ssl_cert_reqs": self.cert_reqs,
            "ssl_check_hostname": self.check_hostname,
        }


class RedisConnector:
    """SET/GET/EXISTS/DEL/PING against the deployment named by ``address``.

    Construction does no I/O; :meth:`ping` connects (and, for a cluster, discovers
    the slot map). ``username``/``password`` override credentials in the URL.
    """

    def __init__(
        self,
        address: RemoteAddress,
        *,
        timeout: float,
        username: str | None = None,
        password: str | None = None,
        tls: TLSOptions | None = None,
    ) -> None:
        if timeout <= 0:
            raise ValueError(f"timeout={timeout!r}: expected seconds > 0")
        self.address = address
        self.timeout = timeout
        kwargs: dict[str, Any] = {
            "username": username if username is not None else address.username,
            "password": password if password is not None else address.password,
            "socket_timeout": timeout,
            "socket_connect_timeout": timeout,
            "retry": Retry(NoBackoff(), 0),  # the backend's breaker decides about retries
            "health_check_interval": 0,
            "client_name": "lmcache",
            "protocol": 2,  # the zero-copy paths in .resp parse RESP2 replies
        }
        if address.tls:
            kwargs.update((tls or TLSOptions()).kwargs())
        self._topology: _Topology = _Cluster(address, kwargs) if address.cluster else _Standalone(address, kwargs)
        self._local = threading.local()

    # ------------------------------------------------------------------ operations
    def ping(self) -> None:
        """Connect if needed and PING every primary; raises on failure.

        For a cluster, every primary must also report ``cluster_state:ok`` in ``CLUSTER
        INFO``: a node answers PING while it refuses data commands with CLUSTERDOWN, and
        health must follow what data commands would get (one outage, one recovery).
        """
        if not self._topology.connect():
            self._topology.refresh()  # reconnecting: the slot map may have changed
        cluster = isinstance(self._topology, _Cluster)
        for pool in self._topology.all_pools():
            self._on_pool(pool, lambda c: _command(c, "PING"))
            if cluster:
                try:
                    info = self._on_pool(pool, lambda c: _command(c, "CLUSTER", "INFO"))
                except RemoteAuthError:  # an ACL without +cluster|info: PING's answer must do
                    continue
                text = info.decode(errors="replace") if isinstance(info, bytes) else str(info)
                if "cluster_state:ok" not in text:
                    raise RemoteUnavailable(f"cluster node {pool.connection_kwargs.get('port')}: cluster_state is not ok")

    def set(self, key: str, parts: Sequence[Buffer]) -> None:
        """Store the concatenation of ``parts`` under ``key`` (buffers are not joined)."""
        kb = key.encode()
        self._routed(kb, lambda c: send_set(c, kb, parts, time.monotonic() + self.timeout))

    def get_into(self, key: str, plan: ReadPlan) -> bool:
        """Read ``key``'s value into the buffer ``plan`` picks (see resp.ReadPlan); False if absent."""
        kb = key.encode()
        scratch = self._scratch()
        return self._routed(kb, lambda c: get_into(c, kb, plan, HEAD_BYTES, time.monotonic() + self.timeout, scratch))

    def get(self, key: str) -> bytes | None:
        """The whole value as bytes (small values, tests, tools), or None."""
        out: list[bytearray] = []

        def plan(head: memoryview, size: int) -> tuple[int, memoryview]:
            out.append(bytearray(size))
            return 0, memoryview(out[0])

        return bytes(out[0]) if self.get_into(key, plan) else None

    def exists(self, keys: Sequence[str]) -> list[bool]:
        """Whether each key exists: one pipelined round trip per node, nodes in parallel."""
        if not keys:
            return []
        try:
            return self._exists_once(keys)
        except _Redirected:
            self._topology.refresh()
            try:
                return self._exists_once(keys)
            except _Redirected as exc:
                raise RemoteUnavailable(f"cluster keeps redirecting: {exc}") from None

    def delete(self, key: str) -> bool:
        kb = key.encode()
        return bool(self._routed(kb, lambda c: _command(c, "DEL", kb)))

    def command(self, key: str, *args: Any) -> Any:
        """Run one small command (``args``, e.g. ``"ZADD", key, 1, "m"``) on the node owning
        ``key`` and return its reply (records and indexes, not cache entries)."""
        return self._routed(key.encode(), lambda c: _command(c, *args))

    def delete_many(self, keys: Sequence[bytes]) -> int:
        """Delete ``keys`` (one DEL per key, pipelined per node); the number that existed."""
        groups: dict[int, tuple[redis.ConnectionPool, list[bytes]]] = {}
        for kb in keys:
            pool = self._topology.pool_for(kb)
            groups.setdefault(id(pool), (pool, []))[1].append(kb)
        removed = 0
        for pool, group in groups.values():
            cmds = [("DEL", kb) for kb in group]

            def run(c: Any, cmds: list[tuple[Any, ...]] = cmds) -> int:
                c.send_packed_command(c.pack_commands(cmds), check_health=False)
                return sum(int(c.read_response()) for _ in cmds)

            removed += self._on_pool(pool, run)
        return removed

    def scan_keys(self, pattern: str, batch: int = 1000) -> Iterator[list[bytes]]:
        """The keys matching ``pattern`` on every primary, in lists of at most ``batch``
        (SCAN; for tools, not the cache path). Raises RemoteError on failure."""
        for _client, keys in self._scan_batches(pattern, batch):
            yield keys

    def _scan_batches(self, pattern: str, batch: int) -> Iterator[tuple[redis.Redis, list[bytes]]]:
        """``(client of the primary, keys)`` for every batch of at most ``batch`` keys matching
        ``pattern``, primary by primary (SCAN). Raises RemoteError on failure."""
        self.ping()  # connected, cluster slot map known
        for pool in self._topology.all_pools():
            client = redis.Redis(connection_pool=pool)
            try:
                keys: list[bytes] = []
                for key in client.scan_iter(match=pattern, count=batch):
                    keys.append(key)
                    if len(keys) >= batch:
                        yield client, keys
                        keys = []
                if keys:
                    yield client, keys
            except redis.RedisError as exc:
                raise _translate(exc, None) from None

    def close(self) -> None:
        """Drop all connections. Idempotent; later calls reconnect."""
        self._topology.close()

    def scan_sizes(self, pattern: str, batch: int = 1000) -> Iterator[tuple[bytes, int]]:
        """``(key, value bytes)`` of every key matching ``pattern`` on every primary
        (SCAN + pipelined STRLEN; for tools such as ``lmcache remote ping``, not the
        cache path). Blocks on I/O; raises RemoteError on failure."""
        for client, keys in self._scan_batches(pattern, batch):
            try:
                yield from self._strlen(client, keys)
            except redis.RedisError as exc:
                raise _translate(exc, None) from None

    @staticmethod
    def _strlen(client: redis.Redis, keys: list[bytes]) -> list[tuple[bytes, int]]:
        pipe = client.pipeline(transaction=False)
        for key in keys:
            pipe.strlen(key)
        return list(zip(keys, (int(n) for n in pipe.execute())))

    # ------------------------------------------------------------------ plumbing
    def _scratch(self) -> bytearray:
        buf = getattr(self._local, "scratch", None)
        if buf is None:
            buf = self._local.scratch = bytearray(max(SCRATCH_BYTES, HEAD_BYTES + 64))
        return buf

    def _routed(self, key: bytes, fn: Callable[[Any], T]) -> T:
        try:
            return self._on_pool(self._topology.pool_for(key), fn)
        except _Redirected:
            self._topology.refresh()
            try:
                return self._on_pool(self._topology.pool_for(key), fn)
            except _Redirected as exc:
                raise RemoteUnavailable(f"cluster keeps redirecting: {exc}") from None

    def _on_pool(self, pool: redis.ConnectionPool, fn: Callable[[Any], T]) -> T:
        conn = None
        try:
            conn = pool.get_connection()
            return fn(conn)
        except BaseException as exc:
            raise _translate(exc, conn) from None
        finally:
            if conn is not None:
                pool.release(conn)

    def _exists_once(self, keys: Sequence[str]) -> list[bool]:
        groups: dict[int, tuple[redis.ConnectionPool, list[int]]] = {}
        encoded = [k.encode() for k in keys]
        for i, kb in enumerate(encoded):
            pool = self._topology.pool_for(kb)
            groups.setdefault(id(pool), (pool, []))[1].append(i)
        out = [False] * len(keys)
        taken: list[tuple[redis.ConnectionPool, Any, list[int]]] = []
        redirect: str | None = None
        try:
            for pool, idxs in groups.values():
                conn = pool.get_connection()
                taken.append((pool, conn, idxs))
                conn.send_packed_command(conn.pack_commands([("EXISTS", encoded[i]) for i in idxs]), check_health=False)
            for _, conn, idxs in taken:
                for i in idxs:
                    try:
                        out[i] = bool(conn.read_response())
                    except redis.ResponseError as exc:  # reply consumed; the connection stays usable
                        if not isinstance(exc, (redis.exceptions.MovedError, redis.exceptions.AskError)):
                            raise
                        redirect = str(exc)
        except BaseException as exc:
            for _, conn, _ in taken:
                conn.disconnect()
            raise _translate(exc, None) from None
        finally:
            for pool, conn, _ in taken:
                pool.release(conn)
        if redirect is not None:
            raise _Redirected(redirect)
        return out


# ---------------------------------------------------------------------- error mapping
class _Redirected(Exception):
    """Internal: the cluster answered MOVED/ASK; refresh the slot map and retry once."""


def _translate(exc: BaseException, conn) -> BaseException:
    """Map any exception from a redis call to the connector's own (or pass it through)."""
    if isinstance(exc, (RemoteAuthError, RemoteUnavailable, _Redirected)):
        return exc
    if isinstance(exc, ReplyError):
        if exc.is_redirect:
            return _Redirected(exc.message)
        if exc.message.startswith(("NOAUTH", "WRONGPASS", "NOPERM")):
            return RemoteAuthError(exc.message)
        if exc.message.startswith(_UNAVAILABLE_REPLIES):
            return RemoteUnavailable(exc.message)
        if exc.message.startswith("WRONGTYPE"):
            return RemoteWrongType(exc.message)
        return exc
    if isinstance(exc, RemoteError):
        return exc
    if isinstance(exc, (redis.AuthenticationError, redis.exceptions.NoPermissionError)):
        return RemoteAuthError(str(exc))
    if isinstance(exc, redis.ResponseError) and "AUTH" in str(exc) and "password" in str(exc):
        return RemoteAuthError(str(exc))  # e.g. AUTH sent to a server without a password
    if isinstance(exc, (redis.exceptions.MovedError, redis.exceptions.AskError)):
        return _Redirected(str(exc))
    if isinstance(exc, (redis.exceptions.ClusterDownError, redis.exceptions.TryAgainError, redis.exceptions.MasterDownError)):
        return RemoteUnavailable(str(exc))
    if isinstance(exc, (redis.ConnectionError, redis.TimeoutError, redis.exceptions.RedisClusterException, OSError)):
        if conn is not None:
            conn.disconnect()
        cause = _auth_cause(exc)
        return RemoteAuthError(str(cause)) if cause is not None else RemoteUnavailable(str(exc) or repr(exc))
    if isinstance(exc, redis.ResponseError) and str(exc).startswith("WRONGTYPE"):
        return RemoteWrongType(str(exc))
    if isinstance(exc, redis.RedisError):
        return RemoteError(str(exc))
    return exc


def _auth_cause(exc: BaseException) -> BaseException | None:
    seen = 0
    cur: BaseException | None = exc
    while cur is not None and seen < 8:
        if isinstance(cur, redis.AuthenticationError):
            return cur
        cur = cur.__cause__ or cur.__context__
        seen += 1
    return None


def _command(conn, *args: Any) -> Any:
    conn.send_command(*args, check_health=False)
    return conn.read_response()


# ---------------------------------------------------------------------- topologies
class _Topology:
    """Where a key lives. ``pool_for`` never does I/O; ``connect``/``refresh`` may."""

    def connect(self) -> bool:
        """Make routing possible; True if this call set it up (False: it already was)."""
        return False

    def refresh(self) -> None: ...

    def pool_for(self, key: bytes) -> redis.ConnectionPool:
        raise NotImplementedError

    def all_pools(self) -> list[redis.ConnectionPool]:
        raise NotImplementedError

    def close(self) -> None: ...


class _Standalone(_Topology):
    def __init__(self, address: RemoteAddress, kwargs: dict[str, Any]) -> None:
        kw = dict(kwargs, db=address.db)
        if address.path is not None:
            kw.update(connection_class=redis.UnixDomainSocketConnection, path=address.path)
        else:
            (host, port), = address.nodes
            kw.update(host=host, port=port)
            if address.tls:
                kw["connection_class"] = redis.SSLConnection
        self._pool = redis.ConnectionPool(**kw)

    def pool_for(self, key: bytes) -> redis.ConnectionPool:
        return self._pool

    def all_pools(self) -> list[redis.ConnectionPool]:
        return [self._pool]

    def close(self) -> None:
        self._pool.disconnect()


class _Cluster(_Topology):
    """Slot routing through redis-py's RedisCluster (created on the first connect)."""

    def __init__(self, address: RemoteAddress, kwargs: dict[str, Any]) -> None:
        self._address = address
        self._kwargs = dict(kwargs)
        if address.tls:
            self._kwargs["ssl"] = True
        self._rc: redis.RedisCluster | None = None
        self._lock = threading.Lock()

    def connect(self) -> bool:
        with self._lock:
            if self._rc is not None:
                return False
            nodes = [redis.cluster.ClusterNode(h, p) for h, p in self._address.nodes]
            try:
                self._rc = redis.RedisCluster(startup_nodes=nodes, **self._kwargs)
            except BaseException as exc:
                raise _translate(exc, None) from None
            return True

    def refresh(self) -> None:
        rc = self._client()
        try:
            rc.nodes_manager.initialize()
        except BaseException as exc:
            raise _translate(exc, None) from None

    def _client(self) -> redis.RedisCluster:
        rc = self._rc
        if rc is None:
            raise RemoteUnavailable("cluster not connected yet")
        return rc

    def pool_for(self, key: bytes) -> redis.ConnectionPool:
        rc = self._client()
        try:
            node = rc.get_node_from_key(key)
            return rc.get_redis_connection(node).connection_pool
        except redis.exceptions.RedisClusterException as exc:  # slot not covered
            raise RemoteUnavailable(str(exc)) from None

    def all_pools(self) -> list[redis.ConnectionPool]:
        rc = self._client()
        return [rc.get_redis_connection(node).connection_pool for node in rc.get_primaries()]

    def close(self) -> None:
        with self._lock:
            rc, self._rc = self._rc, None
        if rc is not None:
            rc.close()
