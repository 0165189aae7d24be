"""The admin API against callers it must refuse: other local users (no token readable by
them), other Host names (DNS rebinding), big or slow bodies (the event loop stays free),
over a real uvicorn server where it matters. No vLLM, no Redis: an empty service."""

from __future__ import annotations

import json
import os
import shutil
import socket
import stat
import subprocess
import tempfile
import threading
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

pytest.importorskip("fastapi")
pytest.importorskip("uvicorn")

from fastapi.testclient import TestClient  # noqa: E402

from lmcache.admin import server as server_mod  # noqa: E402
from lmcache.admin.auth import allowed_hosts, host_name  # noqa: E402
from lmcache.admin.directory import InstanceDirectory, record_problem  # noqa: E402
from lmcache.admin.server import MAX_BODY_BYTES, bind_unix_socket, build_server, create_app  # noqa: E402
from lmcache.admin.service import AdminService  # noqa: E402
from lmcache.admin.token_file import TOKEN_FILE_NAME, ensure_token, token_path  # noqa: E402
from lmcache.cli import main  # noqa: E402
from lmcache.cli.admin_cmd import resolve_token  # noqa: E402
from lmcache.integration.vllm.registration import InstanceRecord  # noqa: E402
from lmcache.v1.private_files import UnsafePathError  # noqa: E402

TOKEN = "t0ken-for-the-admin-security-tests"


def empty_service(tmp: Path) -> AdminService:
    (tmp / "sockets").mkdir(exist_ok=True)
    return AdminService(InstanceDirectory(None, str(tmp / "sockets")))


# ----------------------------------------------------------------------------- the generated token
def test_a_token_is_generated_once_in_a_private_file(tmp_path: Path) -> None:
    runtime = tmp_path / "rt"
    first = ensure_token(str(runtime))
    assert first.created and first.path == token_path(str(runtime)) == str(runtime / TOKEN_FILE_NAME)
    assert len(first.token) >= 40 and first.token not in repr(first)
    assert stat.S_IMODE(os.stat(runtime).st_mode) == 0o700
    st = os.stat(first.path)
    assert stat.S_IMODE(st.st_mode) == 0o600 and st.st_uid == os.geteuid()
    assert Path(first.path).read_text().strip() == first.token
    assert os.listdir(runtime) == [TOKEN_FILE_NAME]  # no temporary file left behind
    again = ensure_token(str(runtime))
    assert (again.token, again.created) == (first.token, False)


def test_an_unsafe_token_file_is_refused_not_used(tmp_path: Path) -> None:
    runtime = tmp_path / "rt"
    path = Path(ensure_token(str(runtime)).path)
    path.chmod(0o644)
    with pytest.raises(UnsafePathError, match="readable only by us"):
        ensure_token(str(runtime))
    path.unlink()
    (tmp_path / "planted").write_text("p" * 40 + "\n")
    (tmp_path / "planted").chmod(0o600)
    path.symlink_to(tmp_path / "planted")
    with pytest.raises(UnsafePathError, match="symlink"):
        ensure_token(str(runtime))
    path.unlink()
    path.write_text("short\n")
    path.chmod(0o600)
    with pytest.raises(ValueError, match="at least 16"):
        ensure_token(str(runtime))
    runtime.chmod(0o777)
    with pytest.raises(UnsafePathError, match="writable by group or others"):
        ensure_token(str(runtime))


def test_serve_prints_the_token_path_never_the_token(tmp_path: Path, monkeypatch, capsys) -> None:
    monkeypatch.delenv("LMCACHE_ADMIN_TOKEN", raising=False)
    monkeypatch.setenv("XDG_RUNTIME_DIR", str(tmp_path))
    served: list[dict[str, Any]] = []
    monkeypatch.setattr(server_mod, "serve", lambda service, **kw: served.append(kw))
    assert main(["admin", "serve", "--socket-dir", str(tmp_path / "s"), "--allowed-host", "admin.internal"]) == 0
    path = tmp_path / "lmcache" / TOKEN_FILE_NAME
    token = path.read_text().strip()
    err = capsys.readouterr().err
    assert str(path) in err and "generated" in err and f"$(cat {path})" in err and token not in err
    assert served[0]["token"] == token
    assert served[0]["allowed_hosts"] == {"localhost", "127.0.0.1", "[::1]", "admin.internal"}
    assert main(["admin", "serve", "--host", "0.0.0.0"]) == 0  # any address: a token is always required
    assert served[1]["token"] == token and "reused" in capsys.readouterr().err
    monkeypatch.setenv("LMCACHE_ADMIN_TOKEN", TOKEN)
    assert main(["admin", "serve"]) == 0 and served[2]["token"] == TOKEN
    assert TOKEN not in capsys.readouterr().err
    assert main(["admin", "serve", "--allowed-host", "http://x/"]) == 2
    assert "--allowed-host 'http://x/'" in capsys.readouterr().err


# ----------------------------------------------------------------------------- Host allow-list
@pytest.mark.parametrize("host, ok", [
    ("127.0.0.1:8100", True), ("localhost", True), ("LOCALHOST:1", True), ("[::1]:8100", True), ("[::1]", True),
    ("admin.internal:443", True), ("10.0.0.5:8100", True), ("attacker.example", False),
    ("attacker.example:8100", False), ("127.0.0.1.attacker.example", False), ("localhost:abc", False),
    ("[::2]", False), ("", False), ("a b", False),
])  # fmt: skip
def test_host_header_allow_list(tmp_path: Path, host: str, ok: bool) -> None:
    hosts = allowed_hosts("10.0.0.5", ["admin.internal"])
    client = TestClient(create_app(empty_service(tmp_path), TOKEN, allowed_hosts=hosts))
    # refused before authentication and before the body is read
    res = client.post("/lookup", content=b"{not json", headers={"host": host})
    if ok:
        assert res.status_code == 401, res.text
        res = client.get("/instances", headers={"host": host, "authorization": f"Bearer {TOKEN}"})
        assert res.status_code == 200
    else:
        assert res.status_code == 421 and res.json()["error"].startswith("host: ")
        assert "--allowed-host" in res.json()["error"]
        assert client.get("/health", headers={"host": host}).status_code == 421
        res = client.get("/instances", headers={"host": host, "authorization": f"Bearer {TOKEN}"})
        assert res.status_code == 421


def test_host_names() -> None:
    assert host_name("::1") == "[::1]" and host_name("[::1]:80") == "[::1]" and host_name("Example.COM.") == "example.com"
    assert allowed_hosts("::") == {"localhost", "127.0.0.1", "[::1]", "[::]"}
    for bad in ("[::1", "[nope]", "a/b", "x:y"):
        with pytest.raises(ValueError):
            host_name(bad)


# ----------------------------------------------------------------------------- records
GOOD_RECORD = {
    "engine_id": "e1", "host": "this-host", "pid": 1, "model": "/m", "tokenizer": "/m", "namespace": "/m",
    "world_size": 1, "kv_dtype": "float32", "chunk_size": 16, "socket_dir": "/run/x",
    "sockets": ["/run/x/lookup-0123456789abcdef-r0.sock"], "tiers": ["cpu", "remote"], "started_at": 1.0,
    "remote_entry_prefix": "lmcache:v1:kv:",
    "keys": {"model_name": "/m", "world_size": 1, "fmt": "vllm", "kv_dtype": "float32", "kv_shape": [2, 2, 16, 2, 8],
             "use_mla": False, "chunk_size": 16, "save_unfull_chunk": True},
}  # fmt: skip


def problem(**changes: Any) -> str | None:
    record = InstanceRecord.from_json(json.dumps({**GOOD_RECORD, **changes}))
    return record_problem(record, key_prefix="lmcache", socket_dir="/run/x/", host="this-host")


def test_which_records_are_trusted() -> None:
    assert problem() is None
    assert problem(host="other-host", sockets=["/anywhere/s.sock"]) is None  # another host: sockets never used
    assert "remote entries" in problem(remote_entry_prefix="tenant2:v1:kv:")
    assert "remote entries" in problem(remote_entry_prefix="lmcache:v1:ec:")
    assert "remote entries" in problem(remote_entry_prefix="lmcache:tenant2:v1:kv:")
    assert "outside" in problem(sockets=["/tmp/elsewhere/lookup-x-r0.sock"])
    assert "outside" in problem(sockets=["/run/x/../y/lookup-x-r0.sock"])
    assert "outside" in problem(sockets="/run/x/lookup-x-r0.sock")
    assert "engine_id" in problem(engine_id=5)
    assert "tokenizer" in problem(tokenizer=None)
    assert "tiers" in problem(tiers="cpu")
    assert "out of bounds" in problem(keys={**GOOD_RECORD["keys"], "world_size": 10**9})
    assert "malformed" in problem(keys={**GOOD_RECORD["keys"], "world_size": 1e400})
    assert "malformed" in problem(keys=[])


_ANY_JSON = st.recursive(st.none() | st.booleans() | st.integers() | st.floats() | st.text(max_size=10),
                         lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=5), inner,
                                                                                     max_size=3), max_leaves=8)


@settings(max_examples=200, deadline=None)
@given(field=st.sampled_from(sorted(GOOD_RECORD)), value=_ANY_JSON,
       key=st.sampled_from(sorted(GOOD_RECORD["keys"])))  # fmt: skip
def test_fuzz_records_are_judged_never_raise(field: str, value: Any, key: str) -> None:
    changes = {"keys": {**GOOD_RECORD["keys"], key: value}} if field == "keys" else {field: value}
    result = problem(**changes)
    assert result is None or isinstance(result, str)


# ----------------------------------------------------------------------------- a real server
@dataclass
class Running:
    addr: tuple[str, int]
    token: str
    service: AdminService

    def request(self, raw: bytes) -> bytes:
        with socket.create_connection(self.addr, timeout=30) as s:
            s.sendall(raw)
            return read_all(s)


def read_all(s: socket.socket) -> bytes:
    out = b""
    while True:
        data = s.recv(65536)
        if not data:
            return out
        out += data


def run_in_thread(server: Any, sock: socket.socket) -> threading.Thread:
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    return thread


def stop(server: Any, thread: threading.Thread, sock: socket.socket) -> None:
    server.should_exit = True
    thread.join(30)
    sock.close()


def get(path: str, token: str | None, host: str = "127.0.0.1") -> bytes:
    auth = f"Authorization: Bearer {token}\r\n" if token else ""
    return f"GET {path} HTTP/1.1\r\nHost: {host}\r\n{auth}Connection: close\r\n\r\n".encode()


@pytest.fixture
def running(tmp_path: Path) -> Iterator[Running]:
    service = empty_service(tmp_path)
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.bind(("127.0.0.1", 0))
    sock.listen(128)  # clients may connect at once: they wait in the backlog until the server accepts
    server = build_server(service, token=TOKEN, host="127.0.0.1", port=0, log_level="warning")
    thread = run_in_thread(server, sock)
    try:
        yield Running(sock.getsockname(), TOKEN, service)
    finally:
        stop(server, thread, sock)


def test_a_20mb_body_is_413_and_health_stays_responsive(running: Running) -> None:
    size = 20 << 20
    assert size > MAX_BODY_BYTES == 16 << 20
    head = (f"POST /lookup HTTP/1.1\r\nHost: 127.0.0.1\r\nAuthorization: Bearer {TOKEN}\r\n"
            f"Content-Type: application/json\r\nContent-Length: {size}\r\nConnection: close\r\n\r\n").encode()
    out = running.request(head)  # declared: refused before a byte of it is read
    assert out.startswith(b"HTTP/1.1 413") and f"expected at most {MAX_BODY_BYTES}".encode() in out
    # unauthenticated: 401 from the headers alone, the body is never buffered
    out = running.request(head.replace(f"Authorization: Bearer {TOKEN}\r\n".encode(), b""))
    assert out.startswith(b"HTTP/1.1 401")
    # a large upload in progress (chunked, under the limit so far) does not hold up other requests
    with socket.create_connection(running.addr, timeout=30) as big:
        big.sendall(head.replace(f"Content-Length: {size}".encode(), b"Transfer-Encoding: chunked")
                    + b'%x\r\n{"tokens": [' % 12 + b"\r\n")
        chunk = b"1," * (1 << 19)
        for _ in range(8):
            big.sendall(b"%x\r\n%s\r\n" % (len(chunk), chunk))
        assert running.request(get("/health", None)).startswith(b"HTTP/1.1 200")
        assert running.request(get("/instances", TOKEN)).startswith(b"HTTP/1.1 200")


def test_bodies_are_parsed_off_the_event_loop(running: Running, monkeypatch) -> None:
    """While a body is being parsed (held here until /health has answered), the server
    still answers: the parse does not run on the event loop."""
    entered, release = threading.Event(), threading.Event()
    real = server_mod.parse_body

    def held_parse(model: type, raw: bytes) -> Any:
        entered.set()
        assert release.wait(30), "/health never answered while a body was parsed"
        return real(model, raw)

    monkeypatch.setattr(server_mod, "parse_body", held_parse)
    body = b'{"tokens": [' + b",".join([b"7"] * 900_000) + b"]}"
    head = (f"POST /lookup HTTP/1.1\r\nHost: localhost\r\nAuthorization: Bearer {TOKEN}\r\n"
            f"Content-Length: {len(body)}\r\nConnection: close\r\n\r\n").encode()
    answers: list[bytes] = []
    poster = threading.Thread(target=lambda: answers.append(running.request(head + body)))
    poster.start()
    try:
        assert entered.wait(30)
        assert running.request(get("/health", None)).startswith(b"HTTP/1.1 200")
    finally:
        release.set()
        poster.join(30)
    assert answers[0].startswith(b"HTTP/1.1 200") and b'"instances":[]' in answers[0]


def test_serves_on_a_private_unix_socket(tmp_path: Path) -> None:
    base = tempfile.mkdtemp(prefix="lmcx")  # unix socket paths must stay short
    try:
        path = os.path.join(base, "rt", "admin.sock")
        sock = bind_unix_socket(path)
        assert stat.S_IMODE(os.stat(path).st_mode) == 0o600
        assert stat.S_IMODE(os.stat(os.path.dirname(path)).st_mode) == 0o700
        server = build_server(empty_service(tmp_path), token=TOKEN, unix_socket=True, log_level="warning")
        thread = run_in_thread(server, sock)
        try:
            for token, status in ((None, b"401"), (TOKEN, b"200")):
                with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as c:
                    c.settimeout(30)
                    c.connect(path)
                    c.sendall(get("/instances", token, host="localhost"))
                    assert read_all(c).startswith(b"HTTP/1.1 " + status)
            with pytest.raises(OSError, match="live server"):
                bind_unix_socket(path)
        finally:
            stop(server, thread, sock)
    finally:
        shutil.rmtree(base, ignore_errors=True)


# ----------------------------------------------------------------------------- another local user
CHILD = r"""
import json, socket, sys
token_path, port, uds, leaked = sys.argv[1], int(sys.argv[2]), sys.argv[3], sys.argv[4]
out = {}
try:
    open(token_path).read()
    out["read_token"] = "read"
except PermissionError:
    out["read_token"] = "denied"

def status(sock, token):
    auth = "Authorization: Bearer %s\r\n" % token if token else ""
    sock.sendall(("GET /instances HTTP/1.1\r\nHost: 127.0.0.1\r\n%sConnection: close\r\n\r\n" % auth).encode())
    data = b""
    while True:
        part = sock.recv(65536)
        if not part:
            break
        data += part
    return int(data.split()[1]) if data else "closed"

for name, token in (("no_token", None), ("guessed", "x" * 43)):
    with socket.create_connection(("127.0.0.1", port), timeout=30) as s:
        out[name] = status(s, token)
with socket.create_connection(("127.0.0.1", port), timeout=30) as s:
    out["leaked_tcp"] = status(s, leaked)
try:
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:
        s.settimeout(30)
        s.connect(uds)
        out["uds"] = status(s, leaked)
except PermissionError:
    out["uds"] = "denied"
except (ConnectionResetError, BrokenPipeError):
    out["uds"] = "closed"
print(json.dumps(out))
"""


def _as_nobody() -> None:
    os.setgroups([])
    os.setgid(65534)
    os.setuid(65534)


def run_as_nobody(*args: str) -> dict[str, Any]:
    python = shutil.which("python3", path="/usr/bin:/bin")
    if python is None:
        pytest.skip("no system python3 for the child of another uid")
    done = subprocess.run([python, "-I", "-S", "-c", CHILD, *args], preexec_fn=_as_nobody, cwd="/",
                          capture_output=True, text=True, timeout=120, check=False)
    assert done.returncode == 0, done.stderr
    return json.loads(done.stdout)


@pytest.mark.skipif(not hasattr(os, "geteuid") or os.geteuid() != 0, reason="needs root to run a child as uid 65534")
def test_another_uid_cannot_read_the_token_and_gets_401(tmp_path: Path, monkeypatch) -> None:
    monkeypatch.delenv("LMCACHE_ADMIN_TOKEN", raising=False)
    base = tempfile.mkdtemp(prefix="lmcu")
    os.chmod(base, 0o755)  # like /tmp or /run/user: others may traverse it, only our 0700 directory protects
    runtime = os.path.join(base, "lmcache")
    servers = []
    try:
        token, _ = resolve_token(None, runtime)  # what `lmcache admin serve` does without a token
        uds_path = os.path.join(runtime, "admin.sock")
        tcp = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        tcp.bind(("127.0.0.1", 0))
        tcp.listen(16)
        uds = bind_unix_socket(uds_path)
        for sock, kw in ((tcp, {"host": "127.0.0.1", "port": 0}), (uds, {"unix_socket": True})):
            srv = build_server(empty_service(tmp_path), token=token, log_level="warning", **kw)
            servers.append((srv, run_in_thread(srv, sock), sock))
        port = tcp.getsockname()[1]
        out = run_as_nobody(token_path(runtime), str(port), uds_path, token)
        assert out["read_token"] == "denied"
        assert out["no_token"] == 401 and out["guessed"] == 401
        assert out["leaked_tcp"] == 200  # the token is what protects the TCP listener
        assert out["uds"] == "denied"  # the private directory keeps others off the unix socket
        # even with the directory and socket opened up by mistake, SO_PEERCRED refuses the other uid
        os.chmod(runtime, 0o711)
        os.chmod(uds_path, 0o666)
        assert run_as_nobody(token_path(runtime), str(port), uds_path, token)["uds"] == "closed"
        # the owner, with the token, is served
        with socket.create_connection(("127.0.0.1", port), timeout=30) as s:
            s.sendall(get("/instances", token))
            assert read_all(s).startswith(b"HTTP/1.1 200")
    finally:
        for srv, thread, sock in servers:
            stop(srv, thread, sock)
        shutil.rmtree(base, ignore_errors=True)
