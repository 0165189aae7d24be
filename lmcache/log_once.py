"""Log each kind of failure once: a cache failure degrades to a miss and must not flood
the host's log, but the operator must see it once.

This module imports nothing from lmcache, so every layer may import it.
"""

from __future__ import annotations

import logging
import threading


class LogOnce:
    """Logs each *kind* of message at most once (until :meth:`reset`).

    ``kind`` is a short string naming the failure ("alloc", "corrupt", ...); the first
    call with a kind logs, later calls with the same kind return False without logging.
    Thread-safe; one instance per owner (a tier, an engine), so two owners each log
    their own first failure.
    """

    __slots__ = ("_logger", "_seen", "_lock")

    def __init__(self, logger: logging.Logger) -> None:
        self._logger = logger
        self._seen: set[str] = set()
        self._lock = threading.Lock()

    def __call__(self, level: int, kind: str, msg: str, *args: object, exc_info: bool = False) -> bool:
        """Log ``msg % args`` at ``level`` if ``kind`` was not logged yet; True if it logged."""
        with self._lock:
            if kind in self._seen:
                return False
            self._seen.add(kind)
        self._logger.log(level, msg, *args, exc_info=exc_info)
        return True

    def seen(self, kind: str) -> bool:
        """Whether ``kind`` has been logged (and not reset) already."""
        with self._lock:
            return kind in self._seen

    def reset(self, kind: str | None = None) -> None:
        """Forget ``kind`` (every kind when None): its next occurrence logs again.

        Used when a failure has cleared (a tier reachable again), so that a later
        outage is reported too.
        """
        with self._lock:
            if kind is None:
                self._seen.clear()
            else:
                self._seen.discard(kind)
