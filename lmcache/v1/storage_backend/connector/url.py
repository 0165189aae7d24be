"""Parsing and masking of ``remote_url`` values.

Accepted forms::

    redis://[user[:password]@]host[:port][/db]
    rediss://[user[:password]@]host[:port][/db]          (TLS)
    unix://[user[:password]@]/path/to/redis.sock[?db=N]
    redis-cluster://[user[:password]@]host:port,host:port,...
    rediss-cluster://[user[:password]@]host:port,...     (TLS)

Credentials in the URL are accepted but the config keys ``remote_username`` /
``remote_password`` (or ``LMCACHE_REMOTE_PASSWORD``) win over them and keep the
secret out of the URL. :func:`mask_url` is what every log line shows.
"""

from __future__ import annotations

from dataclasses import dataclass
from urllib.parse import parse_qs, unquote

from lmcache.v1.secrets import mask_url

__all__ = ["DEFAULT_PORT", "SCHEMES", "RemoteAddress", "mask_url", "parse_remote_url"]

DEFAULT_PORT = 6379
SCHEMES = ("redis", "rediss", "unix", "redis-cluster", "rediss-cluster")


@dataclass(frozen=True, slots=True)
class RemoteAddress:
    """A parsed ``remote_url``: where to connect and how (never holds a secret in repr)."""

    scheme: str
    nodes: tuple[tuple[str, int], ...] = ()
    """(host, port) pairs; one for standalone, the startup nodes for a cluster."""
    path: str | None = None
    """Socket path for ``unix://``."""
    db: int = 0
    username: str | None = None
    password: str | None = None

    @property
    def cluster(self) -> bool:
        return self.scheme.endswith("-cluster")

    @property
    def tls(self) -> bool:
        return self.scheme.startswith("rediss")

    def __repr__(self) -> str:
        where = self.path if self.path is not None else ",".join(f"{h}:{p}" for h, p in self.nodes)
        pw = ", password=***" if self.password else ""
        return f"RemoteAddress({self.scheme}://{where}, db={self.db}, username={self.username!r}{pw})"


def _bad(url: str, why: str) -> ValueError:
    return ValueError(f"remote_url={mask_url(url)!r}: {why}")


def _host_port(url: str, item: str) -> tuple[str, int]:
    if item.startswith("["):  # [ipv6]:port
        host, sep, rest = item[1:].partition("]")
        if not sep:
            raise _bad(url, f"unterminated IPv6 address in {item!r}")
        port_text = rest[1:] if rest.startswith(":") else ""
    else:
        host, _, port_text = item.rpartition(":") if ":" in item else (item, "", "")
    if not host:
        raise _bad(url, f"missing host in {item!r}; expected host:port")
    try:
        port = int(port_text) if port_text else DEFAULT_PORT
    except ValueError:
        raise _bad(url, f"port {port_text!r} is not an integer") from None
    if not 0 < port < 65536:
        raise _bad(url, f"port {port} out of range 1..65535")
    return host, port


def parse_remote_url(url: str) -> RemoteAddress:
    """Parse ``url``; raises ValueError (naming the masked URL) if it is malformed."""
    scheme, sep, rest = url.partition("://")
    scheme = scheme.lower()
    if not sep or scheme not in SCHEMES:
        raise _bad(url, f"unsupported scheme {scheme!r}; expected one of {', '.join(s + '://' for s in SCHEMES)}")
    username = password = None
    if "@" in rest:  # the userinfo ends at the last '@' (mask_url splits there too)
        userinfo, _, rest = rest.rpartition("@")
        user, has_pw, pw = userinfo.partition(":")
        username = unquote(user) or None
        password = unquote(pw) if has_pw and pw else None
    rest, _, query_text = rest.partition("?")
    query = {k: v[-1] for k, v in parse_qs(query_text).items()}
    db_text = query.get("db", "")
    if scheme == "unix":
        if not rest.startswith("/"):
            raise _bad(url, "expected an absolute socket path, e.g. unix:///run/redis/redis.sock")
        return RemoteAddress(scheme, (), unquote(rest), _db(url, db_text), username, password)
    netloc, _, path = rest.partition("/")
    if path:
        if scheme.endswith("-cluster"):
            raise _bad(url, "Redis Cluster has only database 0; remove the /db path")
        db_text = path
    items = [s for s in netloc.split(",") if s]
    if not items:
        raise _bad(url, "no host given")
    if len(items) > 1 and not scheme.endswith("-cluster"):
        raise _bad(url, f"several hosts need the cluster scheme ({scheme}-cluster://)")
    nodes = tuple(_host_port(url, item) for item in items)
    return RemoteAddress(scheme, nodes, None, _db(url, db_text), username, password)


def _db(url: str, text: str) -> int:
    if not text:
        return 0
    if not text.isdigit():
        raise _bad(url, f"database {text!r} is not a non-negative integer")
    return int(text)
