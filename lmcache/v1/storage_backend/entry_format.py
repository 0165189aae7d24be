"""The self-describing entry format shared by the disk and remote tiers.

An entry is ``header || payload``. The header (little-endian) is::

    magic "LMCE" | version u16 | header_len u32 | fmt u8 | dtype u8 | ndim u8 | pad u8
    | payload_len u64 | payload xxh3_64 u64 | key_len u32 | shape ndim x u64
    | key utf-8 | zero padding to header_len | header xxh3_64 u64 (last 8 bytes)

``header_len`` is padded to a multiple of ``align`` (4096 for O_DIRECT files, 8 for
remote values) so the payload can start at an aligned offset. A reader checks magic,
version, the header checksum, the full key, the payload length and the payload
checksum; any mismatch raises :class:`CorruptEntryError`, which tiers turn into a miss.
Decoding never executes code from the data (no pickle).
"""

from __future__ import annotations

from lmcache.errors import LMCacheError

import struct
from dataclasses import dataclass

import torch
import xxhash

from lmcache.v1.memory_management import MemoryFormat, MemoryObjMetadata

MAGIC = b"LMCE"
VERSION = 1
_FIXED = struct.Struct("<4sHIBBBBQQI")  # up to and including key_len
HEADER_PREFIX_SIZE = _FIXED.size
_TAIL = struct.Struct("<Q")

_DTYPES: dict[int, torch.dtype] = {
    1: torch.float32,
    2: torch.float16,
    3: torch.bfloat16,
    4: torch.float8_e4m3fn,
    5: torch.float8_e5m2,
    6: torch.uint8,
    7: torch.int8,
    8: torch.int16,
    9: torch.int32,
    10: torch.int64,
    11: torch.float64,
}
_DTYPE_CODES = {v: k for k, v in _DTYPES.items()}


class CorruptEntryError(LMCacheError, ValueError):
    """The bytes are not a valid entry for the expected key (treat as a miss)."""


@dataclass(frozen=True, slots=True)
class EntryHeader:
    key: str
    meta: MemoryObjMetadata
    payload_len: int
    checksum: int
    header_len: int


def payload_checksum(payload) -> int:
    """xxh3_64 of a bytes-like object (bytes, memoryview, numpy array)."""
    return xxhash.xxh3_64_intdigest(payload)


def header_size(key: str, ndim: int, align: int = 8) -> int:
    raw = _FIXED.size + 8 * ndim + len(key.encode()) + _TAIL.size
    return (raw + align - 1) // align * align


def encode_header(key: str, meta: MemoryObjMetadata, checksum: int, *, align: int = 8) -> bytes:
    """The header bytes for an entry whose payload has ``checksum`` (see payload_checksum)."""
    if meta.dtype not in _DTYPE_CODES:
        raise ValueError(f"dtype {meta.dtype} cannot be stored in an entry")
    kb = key.encode()
    hlen = header_size(key, len(meta.shape), align)
    body = (
        _FIXED.pack(MAGIC, VERSION, hlen, meta.fmt.value, _DTYPE_CODES[meta.dtype], len(meta.shape), 0, meta.nbytes, checksum, len(kb))
        + struct.pack(f"<{len(meta.shape)}Q", *meta.shape)
        + kb
    )
    body += b"\0" * (hlen - _TAIL.size - len(body))
    return body + _TAIL.pack(xxhash.xxh3_64_intdigest(body))


def decode_header(buf, expected_key: str | None = None) -> EntryHeader:
    """Parse and verify a header from the start of ``buf`` (bytes-like, may hold more).

    Raises CorruptEntryError on any inconsistency, or if ``expected_key`` differs.
    """
    mv = memoryview(buf).cast("B")
    if len(mv) < _FIXED.size:
        raise CorruptEntryError("entry truncated inside the header")
    magic, version, hlen, fmt, dcode, ndim, _, plen, csum, klen = _FIXED.unpack_from(mv, 0)
    if magic != MAGIC:
        raise CorruptEntryError("bad magic")
    if version != VERSION:
        raise CorruptEntryError(f"unsupported entry version {version}")
    if hlen > len(mv) or hlen < _FIXED.size + 8 * ndim + klen + _TAIL.size:
        raise CorruptEntryError("entry truncated or header length inconsistent")
    (hsum,) = _TAIL.unpack_from(mv, hlen - _TAIL.size)
    if xxhash.xxh3_64_intdigest(mv[: hlen - _TAIL.size]) != hsum:
        raise CorruptEntryError("header checksum mismatch")
    try:
        shape = struct.unpack_from(f"<{ndim}Q", mv, _FIXED.size)
        key = bytes(mv[_FIXED.size + 8 * ndim : _FIXED.size + 8 * ndim + klen]).decode()
        meta = MemoryObjMetadata(tuple(shape), _DTYPES[dcode], MemoryFormat(fmt))
    except (KeyError, ValueError, UnicodeDecodeError, struct.error) as exc:
        raise CorruptEntryError(f"bad header field: {exc}") from None
    if meta.nbytes != plen:
        raise CorruptEntryError("payload length does not match shape and dtype")
    if expected_key is not None and key != expected_key:
        raise CorruptEntryError(f"entry holds key {key!r}, expected {expected_key!r}")
    return EntryHeader(key, meta, plen, csum, hlen)


def verify_payload(header: EntryHeader, payload) -> None:
    """Raise CorruptEntryError unless ``payload`` has the header's length and checksum."""
    mv = memoryview(payload).cast("B")
    if len(mv) != header.payload_len:
        raise CorruptEntryError(f"payload has {len(mv)} bytes, header says {header.payload_len}")
    if payload_checksum(mv) != header.checksum:
        raise CorruptEntryError("payload checksum mismatch")
