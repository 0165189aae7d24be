"""Circuit breaker with exponential backoff for a remote tier.

Policy only, no I/O: the owner reports failures and successes and asks whether calls
may go through. While the breaker is open every call is refused at once (the tier
answers "miss"), and the owner's background prober tries to reconnect after
:meth:`CircuitBreaker.next_delay` seconds, doubling the delay after each failed
probe up to a cap. Thread-safe; nothing here blocks except :meth:`wait_closed`.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class ExponentialBackoff:
    """Delay before probe ``n`` (0-based): ``min(maximum, initial * factor**n)``."""

    initial: float = 0.1
    maximum: float = 10.0
    factor: float = 2.0

    def __post_init__(self) -> None:
        if self.initial <= 0 or self.maximum < self.initial or self.factor < 1:
            raise ValueError(
                f"ExponentialBackoff(initial={self.initial!r}, maximum={self.maximum!r}, factor={self.factor!r}): "
                "expected 0 < initial <= maximum and factor >= 1"
            )

    def delay(self, attempt: int) -> float:
        return min(self.maximum, self.initial * self.factor ** min(attempt, 64))


class CircuitBreaker:
    """Closed (calls go through) or open (calls refused until a probe succeeds)."""

    def __init__(self, backoff: ExponentialBackoff | None = None) -> None:
        self.backoff = backoff or ExponentialBackoff()
        self._closed = threading.Event()
        self._closed.set()
        self._lock = threading.Lock()
        self._failed_probes = 0

    @property
    def is_open(self) -> bool:
        return not self._closed.is_set()

    def allow(self) -> bool:
        """True if calls may go to the server now."""
        return self._closed.is_set()

    def trip(self) -> bool:
        """Open the breaker after a connection failure; True if this call opened it."""
        with self._lock:
            if not self._closed.is_set():
                return False
            self._closed.clear()
            self._failed_probes = 0
            return True

    def probe_failed(self) -> None:
        with self._lock:
            self._failed_probes += 1

    def next_delay(self) -> float:
        """Seconds the prober waits before its next attempt."""
        with self._lock:
            return self.backoff.delay(self._failed_probes)

    def reset(self) -> bool:
        """Close the breaker after a successful probe; True if it was open."""
        with self._lock:
            was_open = not self._closed.is_set()
            self._failed_probes = 0
            self._closed.set()
            return was_open

    def wait_closed(self, timeout: float | None = None) -> bool:
        """Block until the breaker is closed (or ``timeout`` passes); True if closed."""
        return self._closed.wait(timeout)
