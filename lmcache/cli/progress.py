"""A plain-text progress bar on stderr for long CLI work (no dependencies).

Shown when stderr is a terminal, or when ``LMCACHE_PROGRESS=1``; otherwise silent, so
scripts and logs get only the results on stdout.
"""

from __future__ import annotations

import os
import sys
import time
from typing import TextIO


class Progress:
    """``[#####.....]  52/100 label``, redrawn at most 10 times a second; call :meth:`done` at the end."""

    WIDTH = 30

    def __init__(
        self, total: int, label: str = "", *, stream: TextIO | None = None, enabled: bool | None = None
    ) -> None:
        self.total = max(0, int(total))
        self.label = label
        self.stream = stream or sys.stderr
        if enabled is None:
            enabled = os.environ.get("LMCACHE_PROGRESS") == "1" or bool(getattr(self.stream, "isatty", lambda: False)())
        self.enabled = enabled and self.total > 0
        self.n = 0
        self._last = 0.0

    def advance(self, n: int = 1) -> None:
        self.n += n
        now = time.monotonic()
        if self.enabled and (now - self._last >= 0.1 or self.n >= self.total):
            self._last = now
            self._draw()

    def _draw(self) -> None:
        filled = self.WIDTH * min(self.n, self.total) // self.total
        bar = "#" * filled + "." * (self.WIDTH - filled)
        self.stream.write(f"\r[{bar}] {self.n}/{self.total} {self.label}")
        self.stream.flush()

    def done(self) -> None:
        if self.enabled:
            self._draw()
            self.stream.write("\n")
            self.stream.flush()
