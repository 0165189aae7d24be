"""Zero-copy SET and GET of large values over a redis-py connection.

redis-py packs a ``SET`` value into one buffer and hands a ``GET`` reply over as a
fresh ``bytes`` object; for MiB-sized KV chunks both are extra copies into freshly
faulted memory, which is several times slower than copying into reused memory
(docs/performance.md). These two helpers speak RESP on the connection's
socket directly instead:

* :func:`send_set` sends ``SET key <value>`` where the value is the concatenation of
  several buffers (entry header, pool memory) without joining them;
* :func:`get_into` reads a ``GET`` reply's first bytes, lets a *read plan* choose the
  destination (e.g. freshly allocated pool memory) from them, and ``recv_into``\\s the
  rest of the value straight there.

Both run on the calling thread, block for at most the connection's socket timeout
per socket call and the given deadline overall, and leave the connection either
clean (whole reply consumed) or disconnected. They are only used one command at a
time per connection (no pipelining), so nothing but this reply can be on the wire.
"""

from __future__ import annotations

import socket
import time
from typing import Callable, Sequence

from lmcache.v1.storage_backend.connector.errors import RemoteError, RemoteUnavailable

try:  # the value's bytes read in one call with the GIL released (csrc/sockread.c)
    from lmcache import _sockread
except ImportError:  # not built: the recv_into loop below
    _sockread = None

Buffer = bytes | bytearray | memoryview
ReadPlan = Callable[[memoryview, int], tuple[int, memoryview]]
"""``plan(head, value_len) -> (offset, dest)``: ``head`` holds the value's first bytes
(all of them if the value is short); the plan returns where the value's bytes from
``offset`` on go (``dest``, exactly ``value_len - offset`` writable bytes, with
``offset <= len(head)``). Raising aborts the read (the connection is dropped)."""

_COALESCE = 64 * 1024  # buffers below this are joined into one send; larger ones go as they are
SCRATCH_BYTES = 16 * 1024


class ReplyError(RemoteError):
    """The server answered with an error line (``-ERR ...``, ``-MOVED ...``)."""

    def __init__(self, message: str) -> None:
        super().__init__(message)
        self.message = message

    @property
    def is_redirect(self) -> bool:
        return self.message.startswith(("MOVED ", "ASK "))


def send_set(conn, key: bytes, parts: Sequence[Buffer], deadline: float) -> None:
    """``SET key b''.join(parts)`` without joining; waits for ``+OK``.

    Raises ReplyError for an error reply, RemoteUnavailable on socket trouble.
    """
    views = [memoryview(p).cast("B") for p in parts]
    total = sum(v.nbytes for v in views)
    chunks: list[Buffer] = []
    pending = bytearray(b"*3\r\n$3\r\nSET\r\n$%d\r\n%s\r\n$%d\r\n" % (len(key), key, total))
    for v in views:
        if v.nbytes < _COALESCE:
            pending += v
        else:
            if pending:
                chunks.append(pending)
                pending = bytearray()
            chunks.append(v)
    pending += b"\r\n"
    chunks.append(pending)
    sock = _socket(conn)
    try:
        for chunk in chunks:
            _settimeout(sock, deadline)
            sock.sendall(chunk)
        line = _read_line(conn, sock, bytearray(256), deadline)
    except (OSError, EOFError) as exc:  # socket.timeout is an OSError
        conn.disconnect()
        raise RemoteUnavailable(f"SET failed: {exc!r}") from None
    finally:
        _restore_timeout(conn, sock)
    if line.startswith(b"-"):
        raise ReplyError(line[1:].decode(errors="replace"))
    if line != b"+OK":
        conn.disconnect()
        raise RemoteError(f"unexpected reply to SET: {line[:80]!r}")


def get_into(conn, key: bytes, plan: ReadPlan, head_len: int, deadline: float, scratch: bytearray) -> bool:
    """``GET key`` into the buffer the plan chooses; False if the key does not exist.

    ``scratch`` must hold at least ``head_len + 64`` bytes. Raises ReplyError for an
    error reply, RemoteUnavailable on socket trouble, and whatever the plan raises.
    """
    if len(scratch) < head_len + 64:
        raise ValueError(f"scratch has {len(scratch)} bytes, expected >= head_len + 64 = {head_len + 64}")
    sock = _socket(conn)
    mv = memoryview(scratch)
    try:
        _settimeout(sock, deadline)
        sock.sendall(b"*2\r\n$3\r\nGET\r\n$%d\r\n%s\r\n" % (len(key), key))
        # 1. the reply's first line: "$<len>", "$-1" or "-<error>"
        n = 0
        while True:
            nl = scratch.find(b"\r\n", 0, n)
            if nl >= 0:
                break
            if n == len(scratch):
                raise RemoteError("reply line too long")
            n += _recv_into(sock, mv[n:], deadline)
        kind = scratch[0]
        line = bytes(scratch[1:nl])
        if kind == ord("_") and nl == 1:  # RESP3 null
            return False
        if kind == ord("-"):
            if n != nl + 2:
                conn.disconnect()
            raise ReplyError(line.decode(errors="replace"))
        if kind != ord("$") or not (line.isdigit() or line == b"-1"):
            raise RemoteError(f"unexpected reply to GET: {bytes(scratch[:nl])[:80]!r}")
        vlen = int(line)
        if vlen < 0:
            return False
        start = nl + 2
        end = start + vlen + 2  # reply end, trailing CRLF included
        # 2. the value's head, for the plan
        want = start + min(vlen, head_len)
        while n < want:
            n += _recv_into(sock, mv[n : min(len(scratch), end)], deadline)
        have = min(n - start, vlen)
        try:
            offset, dest = plan(mv[start : start + have], vlen)
        except BaseException:
            conn.disconnect()
            raise
        if offset > have or dest.nbytes != vlen - offset:
            conn.disconnect()
            raise RemoteError(f"read plan returned offset {offset} and {dest.nbytes} bytes for a {vlen}-byte value")
        # 3. the rest of the value, straight into dest
        got = have - offset
        dest[:got] = mv[start + offset : start + have]
        _recv_exact(sock, dest[got:], deadline)
        # 4. the trailing CRLF
        tail = n - (start + have)
        while tail < 2:
            tail += _recv_into(sock, mv[tail:2], deadline)
        return True
    except (OSError, EOFError) as exc:
        conn.disconnect()
        raise RemoteUnavailable(f"GET failed: {exc!r}") from None
    except RemoteError as exc:
        if not isinstance(exc, ReplyError):
            conn.disconnect()
        raise
    finally:
        _restore_timeout(conn, sock)


# ---------------------------------------------------------------------- socket helpers
def _socket(conn) -> socket.socket:
    sock = getattr(conn, "_sock", None)
    if sock is None:
        conn.connect()
        sock = conn._sock
    return sock


def _settimeout(sock: socket.socket, deadline: float) -> None:
    left = deadline - time.monotonic()
    if left <= 0:
        raise TimeoutError("remote call deadline passed")
    sock.settimeout(left)


def _restore_timeout(conn, sock: socket.socket) -> None:
    if getattr(conn, "_sock", None) is sock:
        try:
            sock.settimeout(conn.socket_timeout)
        except OSError:
            conn.disconnect()


def _recv_into(sock: socket.socket, buf: memoryview, deadline: float) -> int:
    _settimeout(sock, deadline)
    k = sock.recv_into(buf)
    if k == 0:
        raise EOFError("server closed the connection")
    return k


def _recv_exact(sock: socket.socket, buf: memoryview, deadline: float) -> None:
    """Fill ``buf`` from ``sock`` by ``deadline``: one call into ``lmcache._sockread`` when it
    is built (the GIL released for the whole value: another thread holding it, such as
    vLLM's step loop beside a prefetch, delays the reply's few Python steps, not each of its
    ~60 socket reads), else a ``recv_into`` loop."""
    if not buf.nbytes:
        return
    # a plain socket only: a TLS socket's descriptor carries ciphertext
    if _sockread is not None and type(sock) is socket.socket and not buf.readonly and buf.contiguous:
        left = deadline - time.monotonic()
        if left <= 0:
            raise TimeoutError("remote call deadline passed")
        if _sockread.recv_exact(sock.fileno(), buf, left) < buf.nbytes:
            raise EOFError("server closed the connection")
        return
    got = 0
    while got < buf.nbytes:
        got += _recv_into(sock, buf[got:], deadline)


def _read_line(conn, sock: socket.socket, buf: bytearray, deadline: float) -> bytes:
    """A short single-line reply (``+OK``, ``-ERR ...``) without its CRLF."""
    mv = memoryview(buf)
    n = 0
    while True:
        nl = buf.find(b"\r\n", 0, n)
        if nl >= 0:
            if n != nl + 2:
                conn.disconnect()  # more on the wire than one line: do not reuse
            return bytes(buf[:nl])
        if n == len(buf):
            conn.disconnect()
            raise RemoteError("reply line too long")
        n += _recv_into(sock, mv[n:], deadline)
