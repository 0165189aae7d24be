"""A remote-tier value read from its socket: the native reader (``lmcache._sockread``, the GIL
released for the whole value) and the Python ``recv_into`` loop give the same bytes and the
same errors (a peer that stops sending is a timeout, one that closes is an EOF)."""

from __future__ import annotations

import socket
import threading
import time

import numpy as np
import pytest
import redis

from lmcache.v1.storage_backend.connector import resp

try:
    from lmcache import _sockread
except ImportError:  # the extension is optional: its tests are skipped, the fallback's run
    _sockread = None

READERS = [
    pytest.param(
        "native", marks=pytest.mark.skipif(_sockread is None, reason="lmcache._sockread is not built"), id="native"
    ),
    pytest.param("python", id="python"),
]


@pytest.fixture(params=READERS)
def reader(request, monkeypatch):
    if request.param == "python":
        monkeypatch.setattr(resp, "_sockread", None)
    else:
        monkeypatch.setattr(resp, "_sockread", _sockread)
    return request.param


def test_values_read_through_get_into_are_the_bytes_stored(reader, redis_server):
    client = redis.Redis.from_url(redis_server.url)
    rng = np.random.default_rng(3)
    values = {f"k{n}": rng.bytes(n) for n in (1, 100, 65_536, 3_000_001)}
    for key, value in values.items():
        client.set(key, value)
    conn = client.connection_pool.get_connection()
    scratch = bytearray(4096)
    try:
        for key, value in values.items():
            dest = bytearray(len(value))
            found = resp.get_into(conn, key.encode(), lambda head, n, d=dest: (0, memoryview(d)), 16,
                                  time.monotonic() + 10, scratch)  # fmt: skip
            assert found and bytes(dest) == value
        assert not resp.get_into(conn, b"missing", lambda head, n: (0, memoryview(bytearray(n))), 16,
                                 time.monotonic() + 10, scratch)  # fmt: skip
    finally:
        client.connection_pool.release(conn)


def _pair() -> tuple[socket.socket, socket.socket]:
    a, b = socket.socketpair()
    a.settimeout(5.0)  # as redis-py leaves its sockets: a timeout, so non-blocking underneath
    return a, b


def test_a_peer_that_sends_in_pieces_fills_the_buffer(reader):
    a, b = _pair()
    data = bytes(range(256)) * 4096  # 1 MiB

    def send() -> None:
        for i in range(0, len(data), 100_000):
            b.sendall(data[i : i + 100_000])
            time.sleep(0.001)

    t = threading.Thread(target=send)
    t.start()
    buf = bytearray(len(data))
    resp._recv_exact(a, memoryview(buf), time.monotonic() + 10)
    t.join()
    assert buf == data
    a.close()
    b.close()


def test_a_peer_that_stops_sending_times_out_at_the_deadline(reader):
    a, b = _pair()
    b.sendall(b"x" * 100)
    t0 = time.monotonic()
    with pytest.raises(TimeoutError):
        resp._recv_exact(a, memoryview(bytearray(200)), time.monotonic() + 0.3)
    assert 0.25 <= time.monotonic() - t0 < 3.0
    a.close()
    b.close()


def test_a_peer_that_closes_early_is_an_eof(reader):
    a, b = _pair()
    b.sendall(b"x" * 100)
    b.close()
    with pytest.raises(EOFError):
        resp._recv_exact(a, memoryview(bytearray(200)), time.monotonic() + 5)
    a.close()


def test_a_read_only_or_empty_destination():
    """A read-only buffer takes the Python loop (which refuses it); an empty one reads nothing."""
    a, b = _pair()
    resp._recv_exact(a, memoryview(bytearray()), time.monotonic() + 1)
    b.sendall(b"y" * 10)
    with pytest.raises(TypeError):
        resp._recv_exact(a, memoryview(b"z" * 10), time.monotonic() + 1)
    a.close()
    b.close()


@pytest.mark.skipif(_sockread is None, reason="lmcache._sockread is not built")
def test_the_native_reader_refuses_bad_arguments():
    a, b = _pair()
    with pytest.raises(ValueError, match="timeout"):
        _sockread.recv_exact(a.fileno(), bytearray(4), 0.0)
    with pytest.raises(TypeError):
        _sockread.recv_exact(a.fileno(), b"read-only", 1.0)
    with pytest.raises(OSError):
        _sockread.recv_exact(-1, bytearray(4), 1.0)
    a.close()
    b.close()


_ASAN_DRIVER = """
import importlib.util, random, socket, sys, threading
spec = importlib.util.spec_from_file_location("_sockread", sys.argv[1])
sr = importlib.util.module_from_spec(spec)
spec.loader.exec_module(sr)
rnd = random.Random(int(sys.argv[2]))
for _ in range(int(sys.argv[3])):
    a, b = socket.socketpair()
    a.settimeout(5.0)
    size = rnd.choice([0, 1, 7, 4096, 65_537, rnd.randrange(1, 3_000_000)])
    send = rnd.randrange(0, size + 1) if rnd.random() < 0.3 else size  # sometimes closed early
    data = rnd.randbytes(send)
    after = rnd.randbytes(64) if send == size else b""  # the reply's next bytes: not the reader's
    backing = bytearray(size + 32)  # the destination is a slice: nothing outside it may change
    view = memoryview(backing)[16 : 16 + size]
    def writer():
        for i in range(0, len(data), 200_003):
            b.sendall(data[i : i + 200_003])
        b.sendall(after)
        b.close()
    t = threading.Thread(target=writer)
    t.start()
    got = sr.recv_exact(a.fileno(), view, 5.0)
    t.join()
    assert got == send, (got, send, size)
    assert bytes(backing[16 : 16 + send]) == data
    assert backing[:16] == bytearray(16) and backing[16 + size :] == bytearray(16)
    rest = b""
    while len(rest) < len(after):
        rest += a.recv(4096)
    assert rest == after
    a.close()
try:
    sr.recv_exact(-1, bytearray(4), 1.0)
except OSError:
    pass
print("ok")
"""


@pytest.mark.slow
def test_asan_ubsan_build_of_the_native_reader(tmp_path):
    """csrc/sockread.c built with AddressSanitizer and UBSan, driven over socket pairs with
    random sizes, early closes and a slice of a larger buffer: the bytes read are the bytes
    sent, nothing outside the destination is written, and the bytes after it stay in the socket."""
    from tests.native_build import run_sanitized_extension

    run_sanitized_extension(tmp_path, "sockread.c", "_sockread", _ASAN_DRIVER, "11", "60")
