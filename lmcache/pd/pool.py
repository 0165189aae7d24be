"""The instances of one role (prefillers or decoders): round-robin over the healthy ones.

State per instance is one flag, ``up``. The background health check
(:meth:`InstancePool.check_all`, run every ``health_interval`` seconds by the proxy) sets
it from ``GET <url>/health`` (200: up; anything else, or no answer: down), and nothing
else does: a request that fails on an instance (no connection, timeout, a 5xx answer)
leaves it in rotation. One bad request (or one slow generation) must not take every
instance out until the next check; an instance that is really gone fails its check.

Everything here runs on the proxy's event loop (one thread): no locks.
"""

from __future__ import annotations

import asyncio
import logging
from dataclasses import dataclass
from urllib.parse import urlsplit

import httpx

logger = logging.getLogger(__name__)


def normalize_url(url: str) -> str:
    """``url`` without a trailing slash, checked: http(s), a host, no query or fragment.

    Raises ValueError naming the value and the expectation.
    """
    if not isinstance(url, str):
        raise TypeError(f"expected a URL string, got {type(url).__name__}")
    parts = urlsplit(url.strip())
    if parts.scheme not in ("http", "https") or not parts.hostname:
        raise ValueError(f"{url!r}: expected http://HOST:PORT or https://HOST:PORT (an OpenAI server's base URL)")
    if parts.query or parts.fragment:
        raise ValueError(f"{url!r}: expected a base URL without query or fragment")
    try:
        _ = parts.port  # raises ValueError for a port out of range or not a number
    except ValueError:
        raise ValueError(f"{url!r}: invalid port") from None
    return url.strip().rstrip("/")


@dataclass(slots=True)
class Instance:
    """One vLLM OpenAI server: its base URL and whether it is taken for requests."""

    url: str
    up: bool = False


class InstancePool:
    """Instances of one role; :meth:`pick` rotates over those that are up.

    ``role`` ("prefill" or "decode") names the pool in logs and in ``/health``.
    Instances start down: the proxy runs one health check before it serves.
    """

    def __init__(self, role: str, urls: list[str]) -> None:
        if not urls:
            raise ValueError(f"{role}: expected at least one instance URL")
        seen: set[str] = set()
        self.role = role
        self.instances: list[Instance] = []
        for url in urls:
            norm = normalize_url(url)
            if norm in seen:
                raise ValueError(f"{role}: {url!r} given twice")
            seen.add(norm)
            self.instances.append(Instance(norm))
        self._next = 0

    def pick(self, exclude: Instance | None = None) -> Instance | None:
        """The next instance that is up (round-robin), other than ``exclude``; None if none is."""
        n = len(self.instances)
        for i in range(n):
            inst = self.instances[(self._next + i) % n]
            if inst.up and inst is not exclude:
                self._next = (self._next + i + 1) % n
                return inst
        return None

    def any_up(self) -> bool:
        return any(inst.up for inst in self.instances)

    def down_urls(self) -> list[str]:
        return [inst.url for inst in self.instances if not inst.up]

    async def check_all(self, client: httpx.AsyncClient, timeout: float) -> None:
        """One health check of every instance, concurrently; updates ``up`` and logs changes."""
        await asyncio.gather(*(self._check(client, inst, timeout) for inst in self.instances))

    async def _check(self, client: httpx.AsyncClient, inst: Instance, timeout: float) -> None:
        try:
            resp = await client.get(f"{inst.url}/health", timeout=timeout)
            ok, why = resp.status_code == 200, f"health answered {resp.status_code}"
        except httpx.HTTPError as exc:
            ok, why = False, f"health check failed: {type(exc).__name__}: {exc}"
        if ok and not inst.up:
            logger.info("lmcache proxy: %s instance %s is up", self.role, inst.url)
        elif not ok and inst.up:
            logger.warning("lmcache proxy: %s instance %s is down (%s)", self.role, inst.url, why)
        inst.up = ok
