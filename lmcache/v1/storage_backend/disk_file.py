"""One disk-tier entry file: naming, durable writes and verified reads.

A file holds ``header || payload`` in the shared entry format
(:mod:`lmcache.v1.storage_backend.entry_format`) with the header padded to 4096 bytes,
so the payload starts page-aligned and the same file can be read with or without
O_DIRECT. Files are named by a fixed-length hash of the key string; the header holds
the full key, so a file under the wrong name is detected.

These functions run on the calling thread and block on I/O. They never keep a
reference to the caller's tensors. Errors surface as ``OSError`` (I/O) or
:class:`CorruptEntryError` (bad bytes); the tier turns both into misses.
"""

from __future__ import annotations

import errno
import mmap
import os
import threading
from collections.abc import Sequence

import torch
import xxhash

from lmcache.v1.memory_management import MemoryObjMetadata
from lmcache.v1.storage_backend.entry_format import (
    CorruptEntryError,
    EntryHeader,
    decode_header,
    encode_header,
    payload_checksum,
    verify_payload,
)

PAGE = 4096
"""Alignment of the header length, of O_DIRECT buffers and of O_DIRECT offsets."""
ENTRY_SUFFIX = ".lmc"
TEMP_SUFFIX = ".tmp"
ENTRY_NAME_LEN = 32 + len(ENTRY_SUFFIX)
_SCRATCH_BYTES = 4 << 20
_MAX_HEADER_BYTES = 1 << 16
_O_NOFOLLOW = getattr(os, "O_NOFOLLOW", 0)
"""Entry files are never opened through a symlink (a planted link could point anywhere)."""
_O_DIRECT = getattr(os, "O_DIRECT", 0)

_local = threading.local()


def entry_file_name(key: str) -> str:
    """The file name of the entry for key string ``key`` (fixed length)."""
    return xxhash.xxh3_128_hexdigest(key.encode()) + ENTRY_SUFFIX


def temp_file_name(final_name: str, owner_token: str, seq: int) -> str:
    """A temp name for a write of ``final_name`` by the owner ``owner_token``."""
    return f"{final_name[: -len(ENTRY_SUFFIX)]}.{owner_token}.{seq}{TEMP_SUFFIX}"


def temp_file_owner(name: str) -> str | None:
    """The owner token in a temp file name, or None if ``name`` is not a temp file."""
    parts = name.split(".")
    if len(parts) != 4 or "." + parts[-1] != TEMP_SUFFIX:
        return None
    return parts[1]


def entry_header(key: str, meta: MemoryObjMetadata, payload: torch.Tensor) -> bytes:
    """The page-padded header for ``payload`` (a flat uint8 CPU tensor) under ``key``."""
    return encode_header(key, meta, payload_checksum(_view(payload)), align=PAGE)


def o_direct_supported(directory: str) -> bool:
    """Whether files in ``directory`` accept an aligned O_DIRECT write (probe file removed)."""
    if not _O_DIRECT:
        return False
    path = os.path.join(directory, f".odirect-probe-{os.getpid()}-{threading.get_ident()}")
    try:
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_CLOEXEC | _O_NOFOLLOW | _O_DIRECT, 0o600)
    except OSError:
        return False
    try:
        os.pwrite(fd, memoryview(_scratch())[:PAGE], 0)
        return True
    except OSError:
        return False
    finally:
        os.close(fd)
        remove_quiet(path)


# ---------------------------------------------------------------------- writes
def write_entry(path: str, header: bytes, payload: torch.Tensor, *, o_direct: bool, sync: bool = True) -> None:
    """Create ``path`` (must not exist; mode 0600) holding ``header || payload``.

    ``payload`` is a flat uint8 CPU tensor. With ``sync`` the data is fdatasync'ed
    before returning. On any error the partial file is removed and the OSError
    propagates (EINVAL from O_DIRECT included: the caller may retry buffered).
    """
    flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC | _O_NOFOLLOW | (_O_DIRECT if o_direct else 0)
    fd = os.open(path, flags, 0o600)
    ok = False
    try:
        if o_direct:
            _write_direct(fd, header, payload)
        else:
            _pwrite_all(fd, [memoryview(header), _view(payload)], 0)
        if sync:
            os.fdatasync(fd)
        ok = True
    finally:
        os.close(fd)
        if not ok:
            remove_quiet(path)


def _write_direct(fd: int, header: bytes, payload: torch.Tensor) -> None:
    hlen = len(header)
    if hlen % PAGE or hlen > _SCRATCH_BYTES:
        raise OSError(errno.EINVAL, f"header of {hlen} bytes cannot be written with O_DIRECT")
    scratch = memoryview(_scratch())
    src = _view(payload)
    n = len(src)
    bulk = n // PAGE * PAGE
    scratch[:hlen] = header
    if bulk and payload.data_ptr() % PAGE == 0:
        _pwrite_all(fd, [scratch[:hlen], src[:bulk]], 0)
    else:  # unaligned source memory: bounce through the aligned scratch buffer
        _pwrite_all(fd, [scratch[:hlen]], 0)
        for off in range(0, bulk, _SCRATCH_BYTES):
            m = min(_SCRATCH_BYTES, bulk - off)
            scratch[:m] = src[off : off + m]
            _pwrite_all(fd, [scratch[:m]], hlen + off)
    tail = n - bulk
    if tail:
        scratch[:tail] = src[bulk:]
        scratch[tail:PAGE] = bytes(PAGE - tail)
        _pwrite_all(fd, [scratch[:PAGE]], hlen + bulk)
        os.ftruncate(fd, hlen + n)


# ---------------------------------------------------------------------- reads
def read_entry(path: str, key: str, header_len: int, out: torch.Tensor, *, o_direct: bool) -> EntryHeader:
    """Read and verify the entry at ``path`` into ``out`` (flat uint8 CPU tensor of payload size).

    Checks the file size, the header (magic, version, checksum, full key) and the
    payload checksum. Raises CorruptEntryError on a mismatch or truncation and OSError
    on an I/O error; ``out`` then holds garbage and must not be used.
    """
    flags = os.O_RDONLY | os.O_CLOEXEC | _O_NOFOLLOW | (_O_DIRECT if o_direct else 0)
    fd = os.open(path, flags)
    try:
        size = os.fstat(fd).st_size
        expected = header_len + out.numel()
        if size != expected:
            raise CorruptEntryError(f"file has {size} bytes, expected {expected}")
        if o_direct:
            head = _read_direct(fd, header_len, out)
        else:
            head = bytearray(header_len)
            if _pread_all(fd, [memoryview(head), _view(out)], 0) != expected:
                raise CorruptEntryError("entry truncated while reading")
    finally:
        os.close(fd)
    header = decode_header(head, key)
    if header.header_len != header_len:
        raise CorruptEntryError(f"header length {header.header_len}, index says {header_len}")
    verify_payload(header, _view(out))
    return header


def _read_direct(fd: int, header_len: int, out: torch.Tensor) -> bytes:
    if header_len % PAGE or header_len > _SCRATCH_BYTES:
        raise CorruptEntryError(f"header length {header_len} is not a multiple of {PAGE}")
    scratch = memoryview(_scratch())
    dst = _view(out)
    n = len(dst)
    bulk = n // PAGE * PAGE
    if bulk and out.data_ptr() % PAGE == 0:
        got = _pread_all(fd, [scratch[:header_len], dst[:bulk]], 0)
        head = bytes(scratch[:header_len])
    else:  # unaligned destination: bounce through the aligned scratch buffer
        got = _pread_all(fd, [scratch[:header_len]], 0)
        head = bytes(scratch[:header_len])
        for off in range(0, bulk, _SCRATCH_BYTES):
            m = min(_SCRATCH_BYTES, bulk - off)
            got += _pread_all(fd, [scratch[:m]], header_len + off)
            dst[off : off + m] = scratch[:m]
    tail = n - bulk
    if tail:
        # one call: at end of file O_DIRECT returns the short remainder, and a retry
        # from the unaligned offset would fail with EINVAL
        got += min(tail, os.preadv(fd, [scratch[:PAGE]], header_len + bulk))
        dst[bulk:] = scratch[:tail]
    if got != header_len + n:
        raise CorruptEntryError("entry truncated while reading")
    return head


def read_header(path: str) -> tuple[EntryHeader, os.stat_result]:
    """Header and stat of the entry at ``path``, reading no payload.

    Raises CorruptEntryError if the header is bad or the file size disagrees with it.
    """
    fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC | _O_NOFOLLOW)
    try:
        st = os.fstat(fd)
        buf = os.pread(fd, PAGE, 0)
        try:
            header = decode_header(buf)
        except CorruptEntryError:
            if len(buf) < PAGE:
                raise
            header = decode_header(os.pread(fd, _MAX_HEADER_BYTES, 0))  # a very long key
    finally:
        os.close(fd)
    if st.st_size != header.header_len + header.payload_len:
        raise CorruptEntryError(f"file has {st.st_size} bytes, header says {header.header_len + header.payload_len}")
    return header, st


def drop_page_cache(path: str) -> None:
    """Ask the kernel to drop the cached pages of ``path`` (clean pages only)."""
    fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC | _O_NOFOLLOW)
    try:
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(fd)


# ---------------------------------------------------------------------- helpers
def _view(t: torch.Tensor) -> memoryview:
    """A byte memoryview sharing memory with a contiguous CPU uint8 tensor."""
    return memoryview(t.numpy()).cast("B")


def _scratch() -> mmap.mmap:
    """This thread's page-aligned bounce buffer (anonymous mmap, created on first use)."""
    buf = getattr(_local, "scratch", None)
    if buf is None:
        buf = _local.scratch = mmap.mmap(-1, _SCRATCH_BYTES)
    return buf


def _pwrite_all(fd: int, views: Sequence[memoryview], offset: int) -> None:
    pending = [v for v in views if len(v)]
    while pending:
        n = os.pwritev(fd, pending, offset)
        if n <= 0:
            raise OSError(errno.EIO, "write made no progress")
        offset += n
        while pending and n >= len(pending[0]):
            n -= len(pending.pop(0))
        if n:
            pending[0] = pending[0][n:]


def _pread_all(fd: int, views: Sequence[memoryview], offset: int) -> int:
    """Fill ``views`` from ``offset``; returns the bytes read (less only at end of file)."""
    pending = [v for v in views if len(v)]
    total = 0
    while pending:
        n = os.preadv(fd, pending, offset)
        if n <= 0:
            break
        total += n
        offset += n
        while pending and n >= len(pending[0]):
            n -= len(pending.pop(0))
        if n:
            pending[0] = pending[0][n:]
    return total


def remove_quiet(path: str) -> bool:
    """Unlink ``path``; True if it was removed, False on any error (missing included)."""
    try:
        os.unlink(path)
        return True
    except OSError:
        return False
