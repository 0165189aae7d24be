"""Private directories and sockets (lmcache.v1.private_files): the disk tier's directories and
the lookup service's sockets refuse paths another user could read, plant or replace.

The two-user tests need root (CI runs as root): directories and sockets are created as
another uid with ``os.chown`` / a child process that drops to that uid.
"""

from __future__ import annotations

import os
import socket
import stat
import subprocess
import sys
import textwrap

import pytest

from lmcache.integration.vllm.lookup_service import LookupClient, LookupServer
from lmcache.v1.config import ConfigError, LMCacheEngineConfig
from lmcache.v1.private_files import UnsafePathError, default_runtime_dir, ensure_private_dir, remove_stale_socket
from lmcache.v1.memory_management import PoolAllocator
from lmcache.v1.storage_backend.cache_policy import make_policy
from lmcache.v1.storage_backend.local_cpu_backend import LocalCPUBackend
from lmcache.v1.storage_backend.local_disk_backend import LocalDiskBackend

OTHER_UID = 54321
root_only = pytest.mark.skipif(os.geteuid() != 0, reason="two-user tests need root (os.chown to another uid)")


def _disk(root) -> LocalDiskBackend:
    cfg = LMCacheEngineConfig.from_dict({"chunk_size": 16, "max_local_cpu_size": 0.05, "local_disk": str(root), "max_local_disk_size": 0.01})
    return LocalDiskBackend(cfg, LocalCPUBackend(PoolAllocator(1 << 20), make_policy("LRU")))


# ----------------------------------------------------------------------------- directories
def test_created_private_dir_is_0700(tmp_path):
    d = tmp_path / "mine"
    ensure_private_dir(str(d))
    assert stat.S_IMODE(os.stat(d).st_mode) == 0o700


def test_symlinked_dir_is_refused(tmp_path):
    target = tmp_path / "elsewhere"
    target.mkdir(mode=0o755)
    (tmp_path / "link").symlink_to(target)
    with pytest.raises(UnsafePathError, match="symlink"):
        ensure_private_dir(str(tmp_path / "link"))
    assert stat.S_IMODE(os.stat(target).st_mode) == 0o755, "the symlink target must not be chmod-ed"


def test_group_writable_dir_is_refused_and_0755_tightened(tmp_path):
    d = tmp_path / "open"
    d.mkdir()
    os.chmod(d, 0o777)
    with pytest.raises(UnsafePathError, match="writable by group or others"):
        ensure_private_dir(str(d))
    os.chmod(d, 0o755)
    ensure_private_dir(str(d))
    assert stat.S_IMODE(os.stat(d).st_mode) == 0o700


def test_disk_tier_refuses_a_planted_kv_symlink(tmp_path):
    root = tmp_path / "cache"
    root.mkdir()
    attacker = tmp_path / "attacker"
    attacker.mkdir(mode=0o755)
    (root / "kv").symlink_to(attacker)
    with pytest.raises(ConfigError, match="symlink"):
        _disk(root)
    assert stat.S_IMODE(os.stat(attacker).st_mode) == 0o755


@root_only
def test_disk_tier_refuses_a_kv_dir_of_another_user(tmp_path):
    root = tmp_path / "cache"
    root.mkdir()
    (root / "kv").mkdir(mode=0o700)
    os.chown(root / "kv", OTHER_UID, OTHER_UID)
    with pytest.raises(ConfigError, match="owned by another user"):
        _disk(root)


@root_only
def test_disk_tier_refuses_a_root_dir_of_another_user(tmp_path):
    root = tmp_path / "theirs"
    root.mkdir(mode=0o755)
    os.chown(root, OTHER_UID, OTHER_UID)  # they could rename our kv/ and put theirs in place
    with pytest.raises(ConfigError, match="owned by another user"):
        _disk(root)


def test_disk_tier_refuses_a_world_writable_root_without_sticky_bit(tmp_path):
    root = tmp_path / "open"
    root.mkdir()
    os.chmod(root, 0o777)
    with pytest.raises(ConfigError, match="sticky"):
        _disk(root)
    os.chmod(root, 0o1777)  # like /tmp: others cannot rename our directory
    _disk(root).close()


@root_only
def test_lookup_socket_dir_of_another_user_is_refused(tmp_path):
    d = tmp_path / "lmcache-sock"
    d.mkdir(mode=0o700)
    os.chown(d, OTHER_UID, OTHER_UID)
    with pytest.raises(UnsafePathError, match="owned by another user"):
        LookupServer(str(d / "lookup-x-r0.sock"), lambda t, e: 0, dict)
    client = LookupClient([str(d / "lookup-x-r0.sock")], timeout=1.0)
    assert client.lookup([1, 2, 3]) is None and "owned by another user" in (client.last_error or "")
    client.close()


def test_default_socket_dir_prefers_xdg_runtime_dir(tmp_path, monkeypatch):
    monkeypatch.setenv("XDG_RUNTIME_DIR", str(tmp_path))
    assert default_runtime_dir() == str(tmp_path / "lmcache")
    monkeypatch.delenv("XDG_RUNTIME_DIR")
    assert default_runtime_dir().endswith(f"lmcache-{os.geteuid()}")


# ----------------------------------------------------------------------------- sockets
def test_stale_socket_of_ours_is_removed_live_one_kept(tmp_path):
    d = tmp_path / "s"
    ensure_private_dir(str(d))
    stale = d / "lookup-dead-r0.sock"
    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    s.bind(str(stale))
    s.close()  # bound, never listening, process "gone": a dead socket file remains
    assert stale.exists()
    server = LookupServer(str(d / "lookup-live-r0.sock"), lambda t, e: len(t), dict)
    try:
        assert not stale.exists(), "a dead socket of ours is swept at start"
        assert not remove_stale_socket(server.path), "a live server's socket is kept"
        with pytest.raises(OSError, match="already listens"):
            LookupServer(server.path, lambda t, e: 0, dict)
        client = LookupClient([server.path])
        assert client.lookup([1, 2, 3]) == 3
        client.close()
    finally:
        server.close()


_FOREIGN_CLIENT = textwrap.dedent(
    """
    import os, socket, struct, sys, json
    os.setuid(int(sys.argv[2]))  # started as root (to load Python), connects as the other user
    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    s.settimeout(5)
    s.connect(sys.argv[1])
    head = json.dumps({"op": "lookup", "extras": {}}).encode()
    payload = struct.pack("<3i", 1, 2, 3)
    try:
        s.sendall(struct.pack("!II", len(head), len(payload)) + head + payload)
        data = s.recv(100)
    except ConnectionError:
        data = b""
    print("answered" if data else "refused")
    """
)


@root_only
def test_lookup_server_refuses_a_peer_of_another_uid():
    import pathlib
    import shutil
    import tempfile

    top = pathlib.Path(tempfile.mkdtemp(prefix="lmcache-two-user-"))  # pytest's tmp dirs are 0700 all the way
    d = top / "s"
    ensure_private_dir(str(d))
    asked = []
    server = LookupServer(str(d / "lookup-a-r0.sock"), lambda t, e: asked.append(t) or 0, dict)
    try:
        os.chmod(top, 0o711)
        os.chmod(d, 0o711)  # test only: let the other uid reach the socket file
        os.chmod(server.path, 0o666)
        out = subprocess.run(
            [sys.executable, "-c", _FOREIGN_CLIENT, server.path, str(OTHER_UID)], capture_output=True, text=True, timeout=30
        )
        assert out.stdout.strip() == "refused", out.stderr
        assert not asked, "the foreign peer's tokens must never reach lookup()"
    finally:
        server.close()
        shutil.rmtree(top)


_FOREIGN_SERVER = textwrap.dedent(
    """
    import os, socket, struct, sys, json
    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    s.bind(sys.argv[1])
    os.chmod(sys.argv[1], 0o666)
    os.setuid(int(sys.argv[2]))  # SO_PEERCRED of a listener = credentials at listen()
    s.listen(1)
    print("ready", flush=True)
    c, _ = s.accept()
    c.settimeout(5)
    try:
        c.recv(1 << 16)
        head = json.dumps({"hit": 999999}).encode()
        c.sendall(struct.pack("!II", len(head), 0) + head)
    except OSError:
        pass
    """
)


@root_only
def test_lookup_client_refuses_a_server_of_another_uid(tmp_path):
    d = tmp_path / "s"
    ensure_private_dir(str(d))
    path = str(d / "lookup-b-r0.sock")
    proc = subprocess.Popen(
        [sys.executable, "-c", _FOREIGN_SERVER, path, str(OTHER_UID)], stdout=subprocess.PIPE, text=True
    )
    try:
        assert proc.stdout.readline().strip() == "ready"
        client = LookupClient([path], timeout=2.0)
        assert client.lookup([1, 2, 3]) is None
        assert "not ours" in (client.last_error or "")
        client.close()
    finally:
        proc.kill()
        proc.wait()
