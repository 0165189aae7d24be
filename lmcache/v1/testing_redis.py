"""A throw-away ``redis-server`` on loopback, for tests, benchmarks and ``lmcache bench remote``.

Not used by the engine itself. The server runs from the ``redis-server`` binary on a
loopback port chosen at run time, in its own temporary directory with persistence off, and
is stopped by pid; readiness is polled with a deadline, never assumed after a sleep. A
missing program raises :class:`RedisUnavailable` (the test fixtures in
``tests/redis_fixtures.py`` turn it into a skip). The caller owns a started server and
must call :meth:`RedisServer.cleanup` (stop it and delete its directory).
"""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

START_TIMEOUT_S = 20.0
STOP_TIMEOUT_S = 10.0


class RedisUnavailable(RuntimeError):
    """A program this module needs (``redis-server``, ``redis-cli``, ``openssl``) is not installed."""


def redis_server_binary() -> str:
    """Path of ``redis-server``; :class:`RedisUnavailable` if it is not installed."""
    path = shutil.which("redis-server")
    if path is None:
        raise RedisUnavailable("redis-server is not installed (e.g. apt-get install redis-server)")
    return path


def redis_cli_binary() -> str:
    """Path of ``redis-cli``; :class:`RedisUnavailable` if it is not installed."""
    path = shutil.which("redis-cli")
    if path is None:
        raise RedisUnavailable("redis-cli is not installed (it comes with the redis-server package)")
    return path


def make_tls_certs(directory: Path) -> None:
    """A throw-away CA (``ca.crt``) and a server certificate for 127.0.0.1 (``server.crt/.key``)."""
    openssl = shutil.which("openssl")
    if openssl is None:
        raise RedisUnavailable("openssl is not installed: cannot make TLS certificates")
    d = str(directory)

    def run(*args: str) -> None:
        subprocess.run([openssl, *args], cwd=d, check=True, capture_output=True, timeout=60)

    run("req", "-x509", "-newkey", "rsa:2048", "-nodes", "-keyout", "ca.key", "-out", "ca.crt",
        "-days", "1", "-subj", "/CN=lmcache-test-ca")
    run("req", "-newkey", "rsa:2048", "-nodes", "-keyout", "server.key", "-out", "server.csr", "-subj", "/CN=127.0.0.1")
    (directory / "ext.cnf").write_text("subjectAltName=IP:127.0.0.1,DNS:localhost\n")
    run("x509", "-req", "-in", "server.csr", "-CA", "ca.crt", "-CAkey", "ca.key", "-CAcreateserial",
        "-out", "server.crt", "-days", "1", "-extfile", "ext.cnf")


def _port_free(port: int) -> bool:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        try:
            s.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True


def free_port(*, with_bus: bool = False) -> int:
    """A loopback port free right now (and ``port + 10000`` too, for a cluster bus)."""
    for _ in range(200):
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        if with_bus and (port > 55535 or not _port_free(port + 10000)):
            continue
        return port
    raise RuntimeError("no free loopback port found")


def _ping(port: int, unixsocket: str | None = None) -> bool:
    """True once the server answers PING (or NOAUTH, which also proves it is up)."""
    try:
        if unixsocket is not None:
            sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            sock.settimeout(1.0)
            sock.connect(unixsocket)
        else:
            sock = socket.create_connection(("127.0.0.1", port), timeout=1.0)
    except OSError:
        return False
    with sock:
        try:
            sock.sendall(b"PING\r\n")
            reply = sock.recv(64)
        except OSError:
            return False
    return reply.startswith((b"+PONG", b"-NOAUTH"))


@dataclass
class RedisServer:
    """One ``redis-server`` process on 127.0.0.1 (persistence off, logs in its directory)."""

    port: int = 0
    password: str | None = None
    extra_args: tuple[str, ...] = ()
    unixsocket: bool = False
    tls: bool = False
    """Also listen with TLS on :attr:`tls_port` (certificates made by :func:`make_tls_certs`)."""
    tls_port: int = 0
    workdir: Path = field(default_factory=lambda: Path(tempfile.mkdtemp(prefix="lmcache-redis-")))
    proc: subprocess.Popen | None = None

    @property
    def pid(self) -> int:
        assert self.proc is not None, "server not started"
        return self.proc.pid

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}"

    @property
    def tls_url(self) -> str:
        return f"rediss://127.0.0.1:{self.tls_port}"

    @property
    def ca_cert(self) -> str:
        return str(self.workdir / "ca.crt")

    @property
    def socket_path(self) -> str:
        return str(self.workdir / "redis.sock")

    @property
    def unix_url(self) -> str:
        return f"unix://{self.socket_path}"

    def args(self) -> list[str]:
        out = [
            redis_server_binary(),
            "--port", str(self.port),
            "--bind", "127.0.0.1",
            "--save", "",
            "--appendonly", "no",
            "--dir", str(self.workdir),
            "--logfile", str(self.workdir / "redis.log"),
            "--daemonize", "no",
        ]
        if self.password is not None:
            out += ["--requirepass", self.password]
        if self.unixsocket:
            out += ["--unixsocket", self.socket_path, "--unixsocketperm", "700"]
        if self.tls:
            out += [
                "--tls-port", str(self.tls_port),
                "--tls-cert-file", str(self.workdir / "server.crt"),
                "--tls-key-file", str(self.workdir / "server.key"),
                "--tls-ca-cert-file", self.ca_cert,
                "--tls-auth-clients", "no",
            ]
        return out + list(self.extra_args)

    def start(self) -> RedisServer:
        """Start (on a new free port unless one is set) and wait until it answers PING."""
        if self.tls and not (self.workdir / "server.crt").exists():
            make_tls_certs(self.workdir)
        for attempt in range(5):
            if not self.port or attempt:
                self.port = free_port(with_bus="--cluster-enabled" in self.extra_args)
            if self.tls and (not self.tls_port or attempt):
                self.tls_port = free_port()
            self.proc = subprocess.Popen(
                self.args(), stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True
            )
            if self._wait_ready():
                return self
            self._reap()
        raise RuntimeError(f"redis-server did not start; see {self.workdir / 'redis.log'}")

    def restart(self) -> RedisServer:
        """Start again on the same port (after :meth:`kill` or :meth:`stop`)."""
        if self.proc is not None and self.proc.poll() is None:
            raise RuntimeError("restart() of a running server")
        self.proc = subprocess.Popen(
            self.args(), stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True
        )
        if not self._wait_ready():
            self._reap()
            raise RuntimeError(f"redis-server did not restart on port {self.port}; see {self.workdir / 'redis.log'}")
        return self

    def _wait_ready(self) -> bool:
        deadline = time.monotonic() + START_TIMEOUT_S
        while time.monotonic() < deadline:
            if self.proc is None or self.proc.poll() is not None:
                return False  # exited (e.g. port taken)
            if _ping(self.port, self.socket_path if self.unixsocket else None):
                return True
            time.sleep(0.01)  # polling a server's readiness, not waiting for our own work
        return False

    def _reap(self) -> None:
        if self.proc is None:
            return
        if self.proc.poll() is None:
            os.kill(self.proc.pid, signal.SIGKILL)
        self.proc.wait(STOP_TIMEOUT_S)

    def kill(self) -> None:
        """SIGKILL by pid and wait for the process to exit (a crash, no clean shutdown)."""
        if self.proc is not None and self.proc.poll() is None:
            os.kill(self.proc.pid, signal.SIGCONT)  # a stopped process must run to die cleanly
            os.kill(self.proc.pid, signal.SIGKILL)
            self.proc.wait(STOP_TIMEOUT_S)

    def pause(self) -> None:
        """SIGSTOP: the server keeps its sockets but answers nothing (a very slow server)."""
        assert self.proc is not None
        os.kill(self.proc.pid, signal.SIGSTOP)

    def resume(self) -> None:
        assert self.proc is not None
        os.kill(self.proc.pid, signal.SIGCONT)

    def stop(self) -> None:
        """SIGTERM by pid, SIGKILL if it does not exit in time."""
        if self.proc is None or self.proc.poll() is not None:
            return
        os.kill(self.proc.pid, signal.SIGCONT)
        os.kill(self.proc.pid, signal.SIGTERM)
        try:
            self.proc.wait(STOP_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            os.kill(self.proc.pid, signal.SIGKILL)
            self.proc.wait(STOP_TIMEOUT_S)

    def cleanup(self) -> None:
        self.stop()
        shutil.rmtree(self.workdir, ignore_errors=True)

    def client(self, **kwargs):
        """A plain redis-py client to this server (for tampering and inspection in tests)."""
        import redis

        return redis.Redis(host="127.0.0.1", port=self.port, password=self.password, socket_timeout=5, **kwargs)
