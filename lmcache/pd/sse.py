"""The decoder's answers on their way to the client: ``kv_transfer_params`` removed, the end
of a stream checked.

Non-streaming answers are one JSON object (:func:`strip_json_body`); streaming answers are
Server-Sent Events, ``data: <json>`` lines (:class:`SSEFilter`). Bytes without the key
pass through unchanged; an object that had it is re-serialized compactly, as vLLM
writes it. A complete OpenAI stream ends with ``data: [DONE]`` (:attr:`SSEFilter.done`);
one that broke off gets a last event of its own (:meth:`SSEFilter.error_event`).
"""

from __future__ import annotations

import json
from typing import Any

KEY = "kv_transfer_params"
_KEY_BYTES = KEY.encode()
_DONE = b"[DONE]"


def _dumps(obj: Any) -> bytes:
    return json.dumps(obj, separators=(",", ":"), ensure_ascii=False).encode()


def strip_json_body(body: bytes) -> bytes:
    """``body`` without a top-level ``kv_transfer_params`` (unchanged if it has none or is not JSON)."""
    if _KEY_BYTES not in body:
        return body
    try:
        obj = json.loads(body)
    except (ValueError, RecursionError):
        return body
    if not isinstance(obj, dict) or KEY not in obj:
        return body
    del obj[KEY]
    try:
        return _dumps(obj)
    except (ValueError, UnicodeEncodeError):  # lone surrogates: keep the decoder's own bytes
        return body


def error_event(message: str, code: int, kind: str = "upstream_error") -> bytes:
    """One SSE event carrying an OpenAI-style error object."""
    return b"data: " + _dumps({"error": {"message": message, "type": kind, "code": code}}) + b"\n\n"


class SSEFilter:
    """Rewrites an SSE byte stream line by line: :meth:`feed` a chunk as it arrives and send
    what it returns (every complete line so far, each ``data:`` line without
    ``kv_transfer_params``); :meth:`flush` returns the unterminated tail at the end.

    Nothing is held back longer than the rest of its line, so the client gets each
    event as soon as the decoder's ``\\n`` for it arrives. :attr:`done`: a complete
    ``data: [DONE]`` line went through.
    """

    __slots__ = ("_pending", "_open_event", "done")

    def __init__(self) -> None:
        self._pending = b""
        self._open_event = False  # the lines sent so far end inside an event (no blank line yet)
        self.done = False

    def feed(self, chunk: bytes) -> bytes:
        data = self._pending + chunk
        cut = data.rfind(b"\n") + 1
        self._pending = data[cut:]
        if not cut:
            return b""
        done = data[:cut]
        last = done[done.rfind(b"\n", 0, len(done) - 1) + 1:]
        self._open_event = last.strip(b"\r\n") != b""
        if _DONE in done and not self.done:
            self.done = any(_is_done(line) for line in done.splitlines())
        if _KEY_BYTES not in done:
            return done
        return b"".join(_strip_line(line) for line in done.splitlines(keepends=True))

    def flush(self) -> bytes:
        tail, self._pending = self._pending, b""
        if tail and not self.done:
            self.done = _is_done(tail)
        return _strip_line(tail) if _KEY_BYTES in tail else tail

    def error_event(self, message: str, code: int) -> bytes:
        """The last bytes of a stream that broke off: the unterminated tail dropped, the event
        in progress (if any) ended, then an error event (:func:`error_event`)."""
        self._pending = b""
        out = (b"\n" if self._open_event else b"") + error_event(message, code)
        self._open_event = False
        return out


def _is_done(line: bytes) -> bool:
    line = line.rstrip(b"\r\n")
    if not line.startswith(b"data:"):
        return False
    payload = line[len(b"data:"):]
    return (payload[1:] if payload.startswith(b" ") else payload) == _DONE


def _strip_line(line: bytes) -> bytes:
    """One SSE line (with its line ending, if any) with ``kv_transfer_params`` removed from its data."""
    if not line.startswith(b"data:") or _KEY_BYTES not in line:
        return line
    body = line.rstrip(b"\r\n")
    ending = line[len(body):]
    payload = body[len(b"data:"):]
    space = b" " if payload.startswith(b" ") else b""
    stripped = strip_json_body(payload[len(space):])
    return b"data:" + space + stripped + ending
