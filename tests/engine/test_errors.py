"""lmcache.errors: the error root and the shared failure helpers."""

from __future__ import annotations

import logging
import threading

from lmcache.errors import LMCacheError
from lmcache.log_once import LogOnce
from lmcache.v1.storage_backend.abstract_backend import resolved


def test_log_once_logs_each_kind_once_until_reset(caplog):
    log = logging.getLogger("lmcache.test_errors")
    once = LogOnce(log)
    with caplog.at_level(logging.WARNING, logger="lmcache.test_errors"):
        assert once(logging.WARNING, "full", "pool full: %d", 1) is True
        assert once(logging.WARNING, "full", "pool full: %d", 2) is False
        assert once(logging.WARNING, "corrupt", "corrupt %s", "x") is True
        assert once.seen("full") and not once.seen("other")
        once.reset("full")
        assert once(logging.WARNING, "full", "pool full: %d", 3) is True
    assert [r.getMessage() for r in caplog.records] == ["pool full: 1", "corrupt x", "pool full: 3"]


def test_log_once_is_once_under_threads(caplog):
    once = LogOnce(logging.getLogger("lmcache.test_errors"))
    results: list[bool] = []
    barrier = threading.Barrier(8)

    def hit() -> None:
        barrier.wait()
        results.append(once(logging.WARNING, "k", "m"))

    threads = [threading.Thread(target=hit) for _ in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert results.count(True) == 1


def test_resolved_future_is_done_with_value():
    fut = resolved([1, 2])
    assert fut.done() and fut.result(timeout=0) == [1, 2]


def test_error_root_is_an_exception():
    assert issubclass(LMCacheError, Exception)
