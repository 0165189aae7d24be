"""Removing ``kv_transfer_params`` from what the decoder answers, before the client sees it.

Non-streaming answers are one JSON object (:func:`strip_json_body`); streaming answers are
Server-Sent Events, ``data: <json>`` lines (:class:`SSEFilter`). Bytes without the key
pass through unchanged; an object that had it is re-serialized compactly, as vLLM
writes it.
"""

from __future__ import annotations

import json
from typing import Any

KEY = "kv_transfer_params"
_KEY_BYTES = KEY.encode()


def _dumps(obj: Any) -> bytes:
    return json.dumps(obj, separators=(",", ":"), ensure_ascii=False).encode()


def strip_json_body(body: bytes) -> bytes:
    """``body`` without a top-level ``kv_transfer_params`` (unchanged if it has none or is not JSON)."""
    if _KEY_BYTES not in body:
        return body
    try:
        obj = json.loads(body)
    except ValueError:
        return body
    if not isinstance(obj, dict) or KEY not in obj:
        return body
    del obj[KEY]
    return _dumps(obj)


class SSEFilter:
    """Rewrites an SSE byte stream line by line: :meth:`feed` a chunk as it arrives and send
    what it returns (every complete line so far, each ``data:`` line without
    ``kv_transfer_params``); :meth:`flush` returns the unterminated tail at the end.

    Nothing is held back longer than the rest of its line, so the client gets each
    event as soon as the decoder's ``\\n`` for it arrives.
    """

    __slots__ = ("_pending",)

    def __init__(self) -> None:
        self._pending = b""

    def feed(self, chunk: bytes) -> bytes:
        data = self._pending + chunk
        cut = data.rfind(b"\n") + 1
        self._pending = data[cut:]
        if not cut:
            return b""
        done = data[:cut]
        if _KEY_BYTES not in done:
            return done
        return b"".join(_strip_line(line) for line in done.splitlines(keepends=True))

    def flush(self) -> bytes:
        tail, self._pending = self._pending, b""
        return _strip_line(tail) if _KEY_BYTES in tail else tail


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
