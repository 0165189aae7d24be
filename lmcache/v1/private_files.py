"""Private runtime directories and sockets, safe against other local users.

Rules (docs/security.md):

* A directory we keep sockets or cache entries in must be a real directory (not a
  symlink), owned by our effective uid, and writable by nobody else (no group/other
  write bit). We create missing ones with mode 0700; one we own with other
  permission bits (e.g. 0755) is tightened to 0700; anything else is refused with
  :class:`UnsafePathError` naming the path, what is wrong and what to do.
* Checks run on an ``O_NOFOLLOW`` directory file descriptor (``fstat``), so a swap
  between the check and the use cannot redirect us.
* Unix sockets: the peer's uid is read with ``SO_PEERCRED`` on every connection, both
  by the server (who may ask) and by the client (who answers).

Functions block on filesystem calls only. Thread-safe.
"""

from __future__ import annotations

import errno
import os
import socket
import stat
import struct
import tempfile

from lmcache.errors import LMCacheError

_NOFOLLOW_DIR = os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC | getattr(os, "O_NOFOLLOW", 0)


class UnsafePathError(LMCacheError, PermissionError):
    """A runtime directory or socket fails the ownership/symlink/mode rules (also a ``PermissionError``)."""


def _describe(st: os.stat_result) -> str:
    return f"owner uid {st.st_uid}, mode {stat.S_IMODE(st.st_mode):04o}"


def open_private_dir(path: str, *, create: bool = True, what: str = "directory") -> int:
    """Create (0700) or verify ``path``; returns an ``O_NOFOLLOW`` fd of it (caller closes).

    Raises :class:`UnsafePathError` when ``path`` is a symlink, not a directory, owned
    by another user, or writable by group/others; OSError for other failures (e.g.
    the parent does not exist and ``create`` is False).
    """
    uid = os.geteuid()
    if create:
        try:
            os.mkdir(path, 0o700)
        except FileExistsError:
            pass
    try:
        fd = os.open(path, _NOFOLLOW_DIR)
    except OSError as exc:
        if exc.errno in (errno.ELOOP, errno.ENOTDIR):
            kind = "a symlink" if os.path.islink(path) else "not a directory"
            raise UnsafePathError(
                f"{what} {path} is {kind}; refusing to use it (remove it or choose another path)"
            ) from None
        raise
    try:
        st = os.fstat(fd)
        if st.st_uid != uid:
            raise UnsafePathError(
                f"{what} {path} is owned by another user ({_describe(st)}, we are uid {uid}); refusing to use it "
                "(another local user may have created it: remove it or choose another path)"
            )
        mode = stat.S_IMODE(st.st_mode)
        if mode & 0o022:
            raise UnsafePathError(
                f"{what} {path} is writable by group or others ({_describe(st)}); refusing to use it "
                "(entries planted there could be served: chmod 700 it after checking its contents, or choose another path)"
            )
        if mode != 0o700:
            os.fchmod(fd, 0o700)
    except BaseException:
        os.close(fd)
        raise
    return fd


def check_parent_dir(path: str, *, what: str = "parent directory") -> None:
    """``path`` (symlinks followed: the operator named it) must not let another user swap
    what is inside it: owned by us or root, and not writable by others unless sticky
    (like ``/tmp``). Raises :class:`UnsafePathError`; OSError if it cannot be stat-ed."""
    st = os.stat(path)
    uid = os.geteuid()
    if st.st_uid not in (uid, 0):
        raise UnsafePathError(
            f"{what} {path} is owned by another user ({_describe(st)}, we are uid {uid}); that user could replace "
            "our directory inside it: choose a path owned by this user"
        )
    if st.st_mode & stat.S_IWOTH and not st.st_mode & stat.S_ISVTX:
        raise UnsafePathError(
            f"{what} {path} is writable by everybody without the sticky bit ({_describe(st)}); anybody could "
            "replace our directory inside it: choose another path or chmod o-w / +t it"
        )


def ensure_private_dir(path: str, *, create: bool = True, what: str = "directory") -> None:
    """:func:`open_private_dir` without keeping the descriptor."""
    os.close(open_private_dir(path, create=create, what=what))


def default_runtime_dir() -> str:
    """Per-user directory for sockets: ``$XDG_RUNTIME_DIR/lmcache``, else ``<tmp>/lmcache-<uid>``.

    Only names the path; :func:`ensure_private_dir` creates and verifies it.
    """
    xdg = os.environ.get("XDG_RUNTIME_DIR")
    if xdg and os.path.isabs(xdg) and os.path.isdir(xdg):
        return os.path.join(xdg, "lmcache")
    return os.path.join(tempfile.gettempdir(), f"lmcache-{os.geteuid()}")


def peer_uid(sock: socket.socket) -> int | None:
    """The uid of a connected unix socket's peer (SO_PEERCRED), or None where unsupported."""
    opt = getattr(socket, "SO_PEERCRED", None)
    if opt is None:
        return None
    creds = sock.getsockopt(socket.SOL_SOCKET, opt, struct.calcsize("3i"))
    _pid, uid, _gid = struct.unpack("3i", creds)
    return uid


def peer_is_us(sock: socket.socket) -> bool:
    """Whether the peer runs as our effective uid (root peers are not trusted either)."""
    uid = peer_uid(sock)
    return uid is None or uid == os.geteuid()


def remove_stale_socket(path: str) -> bool:
    """Remove ``path`` if it is a socket of ours nobody listens on; True if removed/absent.

    Returns False (and leaves it) when a live server answers on it. Raises
    :class:`UnsafePathError` when it is not a socket or not ours.
    """
    try:
        st = os.lstat(path)
    except FileNotFoundError:
        return True
    if not stat.S_ISSOCK(st.st_mode) or st.st_uid != os.geteuid():
        raise UnsafePathError(f"{path} exists and is not a socket of ours ({_describe(st)}); refusing to replace it")
    probe = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    probe.settimeout(0.5)
    try:
        probe.connect(path)
    except (ConnectionRefusedError, FileNotFoundError):
        pass  # dead: nobody listens
    except OSError:
        return False  # busy or timing out: leave it alone
    else:
        return False
    finally:
        probe.close()
    try:
        os.unlink(path)
    except FileNotFoundError:
        pass
    return True


def sweep_stale_sockets(directory: str, prefix: str) -> int:
    """Remove the dead sockets of ours named ``prefix*`` in ``directory``; returns how many."""
    removed = 0
    try:
        names = os.listdir(directory)
    except OSError:
        return 0
    for name in names:
        if not (name.startswith(prefix) and name.endswith(".sock")):
            continue
        path = os.path.join(directory, name)
        try:
            st = os.lstat(path)
            if stat.S_ISSOCK(st.st_mode) and st.st_uid == os.geteuid() and remove_stale_socket(path):
                removed += 1
        except (OSError, UnsafePathError):
            continue
    return removed
