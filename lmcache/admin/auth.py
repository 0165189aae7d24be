"""The admin API's access rules: the bearer token it always requires and the Host names it answers.

* Token: from ``--token-file``, else ``$LMCACHE_ADMIN_TOKEN`` (:func:`load_token`), else
  one generated at first start and kept in the private runtime directory
  (:mod:`lmcache.admin.token_file`). Compared with :func:`hmac.compare_digest` (constant
  time). A local user of another uid cannot read it, so cannot use the API.
* Host: a request whose ``Host`` header is not an allowed name (by default ``localhost``,
  ``127.0.0.1``, ``[::1]`` and the listening address, with any port) is refused, so a web
  page served under another name (DNS rebinding) never reaches a route.

Pure functions; thread-safe.
"""

from __future__ import annotations

import hmac
import ipaddress
import os
import stat
from collections.abc import Iterable

TOKEN_ENV = "LMCACHE_ADMIN_TOKEN"
MIN_TOKEN_CHARS = 16
DEFAULT_HOSTS = ("localhost", "127.0.0.1", "[::1]")
"""Host names every admin API answers (with any port)."""


def load_token(token_file: str | None, env: dict[str, str] | None = None) -> str | None:
    """The token from ``token_file`` (first line; the file must not be readable by group or
    others) or else ``$LMCACHE_ADMIN_TOKEN``; None when neither is set. Raises ValueError
    naming the source for an unsafe file or a token shorter than :data:`MIN_TOKEN_CHARS`."""
    environ = os.environ if env is None else env
    if token_file is not None:
        try:
            mode = os.stat(token_file).st_mode
            with open(token_file, encoding="utf-8") as f:
                token = f.readline(4096).strip()
        except (OSError, UnicodeDecodeError) as exc:
            why = exc.strerror if isinstance(exc, OSError) else "not UTF-8 text"
            raise ValueError(f"--token-file {token_file!r}: cannot read it ({why})") from None
        if mode & (stat.S_IRWXG | stat.S_IRWXO):
            raise ValueError(f"--token-file {token_file!r}: readable by group or others (mode "
                             f"{stat.S_IMODE(mode):o}); expected 600 (chmod 600 {token_file})")
        source = f"--token-file {token_file!r}"
    else:
        token = environ.get(TOKEN_ENV, "").strip()
        if not token:
            return None
        source = f"${TOKEN_ENV}"
    check_token(token, source)
    return token


def check_token(token: str, source: str) -> None:
    """ValueError naming ``source`` unless ``token`` has at least :data:`MIN_TOKEN_CHARS`
    characters, all printable ASCII without spaces (they travel in an HTTP header)."""
    if len(token) < MIN_TOKEN_CHARS:
        raise ValueError(f"{source}: the token has {len(token)} characters; expected at least {MIN_TOKEN_CHARS} "
                         "(e.g. python -c 'import secrets; print(secrets.token_urlsafe(32))')")
    if not all("!" <= c <= "~" for c in token):
        raise ValueError(f"{source}: the token has spaces or non-ASCII characters; expected printable ASCII "
                         "(e.g. python -c 'import secrets; print(secrets.token_urlsafe(32))')")


def token_matches(expected: str, authorization: str | None) -> bool:
    """Whether an ``Authorization`` header carries ``Bearer <expected>`` (constant-time compare)."""
    if not authorization:
        return False
    scheme, _, given = authorization.partition(" ")
    if scheme.lower() != "bearer":
        return False
    return hmac.compare_digest(given.strip().encode(errors="replace"), expected.encode())


def host_name(value: str) -> str:
    """A ``Host`` header's or ``--host``'s name without the port, lower case, IPv6
    literals in brackets (``::1`` and ``[::1]:8100`` both give ``[::1]``); ValueError for
    something that is not a host name."""
    text = value.strip().lower().rstrip(".")
    if text.startswith("["):
        end = text.find("]")
        if end < 0 or (text[end + 1:] and not (text[end + 1] == ":" and text[end + 2:].isdigit())):
            raise ValueError(f"host {value!r}: expected [IPv6] with an optional :port")
        name = text[1:end]
        ipaddress.IPv6Address(name)  # ValueError
        return f"[{name}]"
    if text.count(":") > 1:  # a bare IPv6 address (--host ::1)
        return f"[{ipaddress.IPv6Address(text)}]"
    name, sep, port = text.partition(":")
    if not name or (sep and not port.isdigit()) or not all(c.isalnum() or c in "-._" for c in name):
        raise ValueError(f"host {value!r}: expected a host name or address with an optional :port")
    return name


def allowed_hosts(listen_host: str | None, extra: Iterable[str] = ()) -> frozenset[str]:
    """The Host names to answer: :data:`DEFAULT_HOSTS`, ``listen_host`` (the address the
    service listens on, if any) and ``extra`` (``--allowed-host``; ValueError naming a bad one)."""
    names = set(DEFAULT_HOSTS)
    if listen_host:
        names.add(host_name(listen_host))
    for item in extra:
        try:
            names.add(host_name(item))
        except ValueError:
            raise ValueError(f"--allowed-host {item!r}: expected a host name or address (without a scheme "
                             "or path)") from None
    return frozenset(names)


def host_allowed(header: str | None, allowed: frozenset[str]) -> bool:
    """Whether a request's ``Host`` header names one of ``allowed`` (any port)."""
    if not header:
        return False
    try:
        return host_name(header) in allowed
    except ValueError:
        return False
