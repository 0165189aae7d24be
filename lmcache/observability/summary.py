"""The periodic INFO summary: one line every ``log_summary_interval`` seconds while there is traffic.

Example::

    [lmcache] INFO ... lmcache summary (10.0 s, worker rank 0): 4 lookups, token hit rate 62.5%
    (1024 loaded of 1638 looked up), loaded cpu 768 / disk 256 / remote 0 tokens, stored 614 tokens,
    pool cpu 0.01/5 GiB, disk 0.02/10 GiB, remote ok, load errors 0

A daemon thread sleeps on an event for the interval (no busy loop), reads the
engine's snapshot and logs only if lookups, loads or stores happened since the last
line. :meth:`SummaryLogger.close` wakes it, logs a last line if there was unreported
traffic, and joins it.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Mapping

from lmcache.observability.snapshot import loaded_tokens
from lmcache.v1.tiers import TIERS

logger = logging.getLogger("lmcache.summary")

_GIB = float(1 << 30)
_TRAFFIC = ("lookup_requests", "retrieve_requests", "store_requests")


def _gib(n: float) -> str:
    return f"{n / _GIB:.3g}"


def format_summary(now: Mapping[str, float], before: Mapping[str, float], seconds: float, who: str) -> str:
    """The summary line for the traffic between two snapshots."""

    def d(key: str) -> int:
        return int(now.get(key, 0) - before.get(key, 0))

    looked, loaded = d("lookup_tokens"), loaded_tokens(now) - loaded_tokens(before)
    rate = f"{100.0 * loaded / looked:.1f}%" if looked else "n/a"
    parts = [
        f"{d('lookup_requests')} lookups",
        f"token hit rate {rate} ({loaded} loaded of {looked} looked up)",
        "loaded " + " / ".join(f"{t} {d(f'hit_tokens_{t}')}" for t in TIERS) + " tokens",
        f"stored {d('stored_tokens')} tokens",
    ]
    if d("blend_requests"):
        parts.append(
            f"blended {d('blend_requests')} prompts ({d('blend_reused_tokens')} tokens reused, "
            f"{d('blend_recomputed_tokens')} recomputed)"
        )
    pools = [f"cpu {_gib(now.get('pool_used_bytes_cpu', 0))}/{_gib(now.get('pool_capacity_bytes_cpu', 0))} GiB"]
    if "pool_capacity_bytes_disk" in now:
        pools.append(f"disk {_gib(now['pool_used_bytes_disk'])}/{_gib(now['pool_capacity_bytes_disk'])} GiB")
    parts.append("pool " + ", ".join(pools))
    if "remote_available" in now:
        parts.append("remote " + ("ok" if now["remote_available"] else "UNAVAILABLE"))
    parts.append(f"load errors {d('load_errors')}")
    return f"lmcache summary ({seconds:.1f} s, {who}): " + ", ".join(parts)


class SummaryLogger:
    """Logs :func:`format_summary` every ``interval`` seconds while there is traffic.

    ``snapshot_fn`` is called on the summary thread and must be thread-safe
    (:func:`~.snapshot.engine_snapshot` is). ``interval`` <= 0 disables it.
    """

    def __init__(self, snapshot_fn: Callable[[], Mapping[str, float]], interval: float, who: str) -> None:
        self._snapshot_fn = snapshot_fn
        self.interval = float(interval)
        self.who = who
        self._stop = threading.Event()
        self._last = dict(snapshot_fn())
        self._thread: threading.Thread | None = None
        if self.interval > 0:
            self._thread = threading.Thread(target=self._run, name="lmcache-summary", daemon=True)
            self._thread.start()

    def _run(self) -> None:
        while not self._stop.wait(self.interval):
            self.log_if_traffic(self.interval)

    def log_if_traffic(self, seconds: float) -> bool:
        """Log one line if there was traffic since the last one; True if it logged."""
        try:
            now = dict(self._snapshot_fn())
        except Exception as exc:  # noqa: BLE001 - a closed engine; monitoring never raises
            logger.debug("lmcache summary: no snapshot (%s: %s)", type(exc).__name__, exc)
            return False
        before, self._last = self._last, now
        if not any(now.get(k, 0) != before.get(k, 0) for k in _TRAFFIC):
            return False
        logger.info("%s", format_summary(now, before, seconds, self.who))
        return True

    def close(self) -> None:
        """Stop the thread and log a last line if there was unreported traffic (idempotent).
        Call before closing the engine."""
        if self._stop.is_set():
            return
        self._stop.set()
        if self.interval > 0:
            self.log_if_traffic(self.interval)
        if self._thread is not None and self._thread is not threading.current_thread():
            self._thread.join(timeout=5)
        self._thread = None
