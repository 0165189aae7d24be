"""Real Redis servers for tests: a standalone server and a 3-master Redis Cluster.

The server process itself is :mod:`lmcache.v1.testing_redis` (shared with the
benchmarks); here its :class:`RedisServer` skips the calling test with a reason when
``redis-server`` or ``openssl`` is missing (Debian packages, installed by
``scripts/setup_venv.sh``).

The fixtures are registered for every test module by ``tests/conftest.py``: request
them by name. The classes are imported as ``from tests.redis_fixtures import RedisServer``.

``redis_server`` is a fresh :class:`RedisServer` per test; ``redis_cluster`` is one
:class:`RedisClusterProcs` per module (flushed before each test that uses it).
``redis_server_factory`` starts servers with extra arguments (e.g. a password).
"""

from __future__ import annotations

import subprocess
import time
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Iterator

import pytest

from lmcache.v1 import testing_redis
from lmcache.v1.testing_redis import START_TIMEOUT_S, RedisUnavailable


@contextmanager
def _skip_when_unavailable() -> Iterator[None]:
    try:
        yield
    except RedisUnavailable as exc:
        pytest.skip(str(exc))


def redis_server_binary() -> str:
    """Path of ``redis-server``; skips the calling test if it is not installed."""
    with _skip_when_unavailable():
        return testing_redis.redis_server_binary()


def redis_cli_binary() -> str:
    with _skip_when_unavailable():
        return testing_redis.redis_cli_binary()


class RedisServer(testing_redis.RedisServer):
    """:class:`lmcache.v1.testing_redis.RedisServer` that skips the test when a program is missing."""

    def start(self) -> RedisServer:
        with _skip_when_unavailable():
            return super().start()

    def restart(self) -> RedisServer:
        with _skip_when_unavailable():
            return super().restart()


@dataclass
class RedisClusterProcs:
    """A Redis Cluster of ``masters`` primaries (no replicas) on loopback."""

    masters: int = 3
    servers: list[RedisServer] = field(default_factory=list)

    @property
    def url(self) -> str:
        return "redis-cluster://" + ",".join(f"127.0.0.1:{s.port}" for s in self.servers)

    @property
    def ports(self) -> list[int]:
        return [s.port for s in self.servers]

    def start(self) -> RedisClusterProcs:
        cli = redis_cli_binary()
        args = ("--cluster-enabled", "yes", "--cluster-config-file", "nodes.conf", "--cluster-node-timeout", "5000")
        try:
            for _ in range(self.masters):
                self.servers.append(RedisServer(extra_args=args).start())
            nodes = [f"127.0.0.1:{p}" for p in self.ports]
            res = subprocess.run(
                [cli, "--cluster", "create", *nodes, "--cluster-replicas", "0", "--cluster-yes"],
                capture_output=True, text=True, timeout=60,
            )
            if res.returncode != 0:
                raise RuntimeError(f"redis-cli --cluster create failed: {res.stdout[-2000:]} {res.stderr[-2000:]}")
            self._wait_ok()
        except BaseException:
            self.cleanup()
            raise
        return self

    def _wait_ok(self) -> None:
        """Poll every node until it reports cluster_state:ok and knows all slots."""
        deadline = time.monotonic() + START_TIMEOUT_S
        pending = list(self.servers)
        while pending:
            server = pending[0]
            try:
                info = server.client().execute_command("CLUSTER", "INFO")
            except Exception:  # node still initialising; poll again
                info = b""
            text = info.decode() if isinstance(info, bytes) else str(info)
            if "cluster_state:ok" in text and "cluster_slots_assigned:16384" in text:
                pending.pop(0)
                continue
            if time.monotonic() > deadline:
                raise RuntimeError(f"cluster not ok after {START_TIMEOUT_S}s: {text[:300]!r}")
            time.sleep(0.02)  # polling the cluster's own convergence

    def flushall(self) -> None:
        for server in self.servers:
            server.client().flushall()

    def client(self):
        import redis

        return redis.RedisCluster(host="127.0.0.1", port=self.servers[0].port, socket_timeout=5)

    def cleanup(self) -> None:
        for server in self.servers:
            server.cleanup()


# ---------------------------------------------------------------------- pytest fixtures
@pytest.fixture
def redis_server() -> Iterator[RedisServer]:
    """A fresh standalone server (no password, unix socket enabled) for one test."""
    redis_server_binary()
    server = RedisServer(unixsocket=True).start()
    try:
        yield server
    finally:
        server.cleanup()


@pytest.fixture
def redis_server_factory() -> Iterator:
    """``start(**kwargs) -> RedisServer`` (kwargs of RedisServer); all stopped after the test."""
    redis_server_binary()
    started: list[RedisServer] = []

    def start(**kwargs) -> RedisServer:
        server = RedisServer(**kwargs).start()
        started.append(server)
        return server

    try:
        yield start
    finally:
        for server in started:
            server.cleanup()


@pytest.fixture(scope="module")
def redis_cluster_module() -> Iterator[RedisClusterProcs]:
    redis_server_binary()
    redis_cli_binary()
    cluster = RedisClusterProcs().start()
    try:
        yield cluster
    finally:
        cluster.cleanup()


@pytest.fixture
def redis_cluster(redis_cluster_module: RedisClusterProcs) -> RedisClusterProcs:
    """The module's 3-master cluster, emptied before the test."""
    redis_cluster_module.flushall()
    return redis_cluster_module
