"""The admin API's access rules: where it may listen and the bearer token it checks.

Bound to a loopback address it may run without a token (only local users reach it);
anywhere else a token is required (:func:`check_bind`). Tokens are compared with
:func:`hmac.compare_digest` (constant time).
"""

from __future__ import annotations

import hmac
import ipaddress
import os
import stat

TOKEN_ENV = "LMCACHE_ADMIN_TOKEN"
MIN_TOKEN_CHARS = 16


def is_loopback(host: str) -> bool:
    """Whether ``host`` (an address or ``localhost``) only accepts local connections."""
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False


def load_token(token_file: str | None, env: dict[str, str] | None = None) -> str | None:
    """The token from ``token_file`` (first line; the file must not be readable by group or
    others) or else ``$LMCACHE_ADMIN_TOKEN``; None when neither is set. Raises ValueError
    naming the source for an unsafe file or a token shorter than :data:`MIN_TOKEN_CHARS`."""
    environ = os.environ if env is None else env
    if token_file is not None:
        try:
            mode = os.stat(token_file).st_mode
            with open(token_file, encoding="utf-8") as f:
                token = f.readline().strip()
        except OSError as exc:
            raise ValueError(f"--token-file {token_file!r}: cannot read it ({exc.strerror})") from None
        if mode & (stat.S_IRWXG | stat.S_IRWXO):
            raise ValueError(f"--token-file {token_file!r}: readable by group or others (mode "
                             f"{stat.S_IMODE(mode):o}); expected 600 (chmod 600 {token_file})")
        source = f"--token-file {token_file!r}"
    else:
        token = environ.get(TOKEN_ENV, "").strip()
        if not token:
            return None
        source = f"${TOKEN_ENV}"
    if len(token) < MIN_TOKEN_CHARS:
        raise ValueError(f"{source}: the token has {len(token)} characters; expected at least {MIN_TOKEN_CHARS} "
                         "(e.g. python -c 'import secrets; print(secrets.token_urlsafe(32))')")
    return token


def check_bind(host: str, token: str | None) -> None:
    """ValueError unless ``host`` is a loopback address or a token is set."""
    if token is None and not is_loopback(host):
        raise ValueError(
            f"--host {host}: the admin API can clear and pin caches; listening on a non-loopback address needs "
            f"a bearer token (--token-file FILE or ${TOKEN_ENV}); refusing to start"
        )


def token_matches(expected: str, authorization: str | None) -> bool:
    """Whether an ``Authorization`` header carries ``Bearer <expected>`` (constant-time compare)."""
    if not authorization:
        return False
    scheme, _, given = authorization.partition(" ")
    if scheme.lower() != "bearer":
        return False
    return hmac.compare_digest(given.strip().encode(), expected.encode())
