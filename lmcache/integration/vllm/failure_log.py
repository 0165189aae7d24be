"""The adapter's failure logging: the first failure of each kind at WARNING, later ones at DEBUG.

Each :func:`failure_logger` call returns a logger with its own memory of the kinds it
has reported; nothing is shared between them.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

from lmcache.log_once import LogOnce


def failure_logger(log: logging.Logger) -> Callable[..., None]:
    """``warn(kind, msg, *args)``: the first failure of each kind at WARNING (one line), later ones at DEBUG.

    A cache failure must not flood vLLM's log; the counters in ``CacheStats`` count
    every occurrence. One per adapter part (scheduler, worker, tracker).
    """
    once = LogOnce(log)

    def warn(kind: str, msg: str, *args: Any) -> None:
        if not once(logging.WARNING, kind, msg + " (further %s failures are logged at debug level)", *args, kind):
            log.debug(msg, *args)

    return warn
