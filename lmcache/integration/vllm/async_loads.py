"""Asynchronous loads on the worker (``enable_async_loading``): a request's hit is read into
the CPU tier in the background while vLLM runs other requests, then copied into the
request's blocks (by the prefetch thread itself with CPU KV, else at the ends of steps).

The scheduler side offers a hit asynchronously only when some of its chunks are outside the
CPU tier (disk, remote) and the Dynamic connector is in use (vLLM's built-in route always
loads synchronously). vLLM then keeps the request waiting for its KV
(``WAITING_FOR_REMOTE_KVS``) and schedules the others; the load's metadata reaches the
worker in the step that allocated the request's blocks.

Threads and ownership: :meth:`AsyncLoads.start` and :meth:`AsyncLoads.ready` run on vLLM's
worker thread. A prefetch runs on this module's own thread pool: it reads the chunks (and a
hybrid model's recurrent-state entry at the load's end, last) with the
storage manager's ``batched_get`` (the CPU tier's hits inline, the lower tiers' chunks on
their reader threads, promoted into the CPU tier) and holds one reference to each object
until :meth:`PendingLoad.release` (worker thread, after the copy), so the CPU pool's memory
for in-flight prefetches is bounded by the pool itself. The copy into vLLM's blocks reads
only what the CPU tier holds then, so a remote tier that froze mid-prefetch never blocks
it; what is missing is reported as failed blocks (vLLM recomputes them). With a *copier*
(:meth:`AsyncLoads.start`; CPU KV, ``async_copy_in_background``) the prefetch thread copies
the load into the blocks itself, each batch of chunks as soon as its reads land (so the copy
overlaps the reads still in flight), and keeps the :class:`CopyResult` for the worker
thread, which only records it; without one the worker (``WorkerConnector``) copies at step ends.

Deadline: a load whose prefetch is not done ``async_load_timeout`` seconds after it started
is ``timed_out``: a background copy is stopped (:meth:`PendingLoad.stop_copy` waits for the
batch being copied, a memory copy of chunks the prefetch holds, never I/O) and what it
copied is kept (``progress``); otherwise the load is copied as far as the CPU tier holds it.
The prefetch thread's late results only warm the CPU tier. Exactly one side copies:
whichever claims the load first (:meth:`PendingLoad.claim`).

Blends (:meth:`AsyncLoads.start_blend`) run whole on one blend thread (one at a time), in
``torch.inference_mode``, writing into the request's blocks (no other request uses them
while it waits); a blend is reported when it returns (no deadline: it is compute, not I/O).
"""

from __future__ import annotations

import logging
import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any, Callable

import torch

from lmcache.integration.vllm.connector_metadata import LoadSpec, ReqMeta
from lmcache.log_once import LogOnce
from lmcache.v1.state_entries import state_key
from lmcache.v1.tiers import Tier

logger = logging.getLogger(__name__)

__all__ = ["AsyncLoads", "CopyResult", "PendingLoad"]

Copier = Callable[[ReqMeta, int, int], torch.Tensor]
"""Copies tokens ``[start, stop)`` of a request's load from the CPU tier into its blocks
(prefetch thread); returns ``CacheEngine.retrieve``'s mask of the tokens written."""

BACKGROUND_COPY_TOKENS = 1024
"""Least tokens a background copy writes at once while reads are still landing (each copy
call costs ~1.5 ms besides the bytes: 16 calls of one 256-token chunk take 2.7x one call of
4096 tokens, 4 calls of 1024 take 1.08x); the last part may be shorter."""

PREFETCH_THREADS = 2
"""Prefetches run at once (each waits on the tiers' own reader threads)."""


@dataclass(slots=True)
class CopyResult:
    """What a background copy wrote into a request's blocks (the prefetch thread's report to
    the worker thread)."""

    load: LoadSpec | None
    """The load copied (``load_len`` cut to what the CPU tier held); None: nothing of
    the hit was in the CPU tier after the prefetch."""
    written: torch.Tensor | None = None
    """``CacheEngine.retrieve``'s mask of the tokens written."""
    error: Exception | None = None
    """The copy raised: none of the hit can be trusted."""


@dataclass(slots=True)
class PendingLoad:
    """One request's asynchronous load."""

    req: ReqMeta
    started: float
    deadline: float
    future: Future[Any] | None = None
    timed_out: bool = False
    blend: bool = False
    """A blend computed on the blend thread (``future`` resolves to its outcome; no deadline:
    it writes into the request's blocks until it returns, so it is reported only then)."""
    released: bool = False
    copied: int = 0
    """Tokens copied into the request's blocks so far (the copy runs over several steps)."""
    copy: CopyResult | None = None
    """Set by the prefetch thread when it copied the load itself (before its future resolves)."""
    progress: CopyResult | None = None
    """What a background copy has written so far (its load cut to the tokens copied)."""
    on_release: Callable[[], None] | None = field(default=None, repr=False)
    """Called once, by the first :meth:`release` (the load is settled: not in flight any more)."""
    _claimed: bool = False
    _stopped: bool = False
    _claim_lock: threading.Lock = field(default_factory=threading.Lock, repr=False)
    _copy_lock: threading.Lock = field(default_factory=threading.Lock, repr=False)

    def claim(self) -> bool:
        """Take the copy into the blocks: True for the first caller only (the prefetch
        thread when its reads end, or the worker thread at the deadline)."""
        with self._claim_lock:
            if self._claimed:
                return False
            self._claimed = True
            return True

    def copy_part(self, copy: Callable[[], None]) -> bool:
        """Prefetch thread: run ``copy`` (one batch into the blocks) unless the copy was
        stopped; False when it was."""
        with self._copy_lock:
            if self._stopped:
                return False
            copy()
            return True

    def copy_done(self, result: CopyResult) -> None:
        """Prefetch thread: the background copy's outcome, kept unless the copy was stopped
        (then the worker takes ``progress``)."""
        with self._copy_lock:
            if not self._stopped:
                self.copy = result

    def stop_copy(self) -> None:
        """Worker thread, at the deadline: no background copy writes after this returns (a
        batch being copied is waited for)."""
        with self._copy_lock:
            self._stopped = True

    def release(self) -> None:
        """Drop the prefetch's references (worker thread, once the copy is done). A prefetch
        still running drops its own when it ends."""
        if self.released:
            return
        self.released = True
        if self.on_release is not None:
            self.on_release()
        if self.blend:
            return
        if self.future is not None and self.future.done() and not self.future.cancelled():
            try:
                objs = self.future.result()
            except Exception:  # noqa: BLE001 - a failed prefetch holds nothing
                objs = []
            _release(objs)
        elif self.future is not None:
            self.future.add_done_callback(_release_when_done)


def _release(objs: list[Any]) -> None:
    for obj in objs:
        if obj is not None:
            obj.ref_count_down()


def _release_when_done(fut: Future[list[Any]]) -> None:
    if fut.cancelled():
        return
    try:
        _release(fut.result())
    except Exception:  # noqa: BLE001 - a failed prefetch holds nothing
        pass


class AsyncLoads:
    """The worker's asynchronous loads in flight (see the module docstring)."""

    def __init__(self, engine: Any, timeout: float, threads: int = PREFETCH_THREADS) -> None:
        self.engine = engine
        self.timeout = timeout
        self._pending: dict[str, PendingLoad] = {}
        self._pool = ThreadPoolExecutor(max_workers=threads, thread_name_prefix="lmcache-prefetch")
        self._blends = ThreadPoolExecutor(max_workers=1, thread_name_prefix="lmcache-blend")
        """Blends run one at a time (each holds two copies of its prompt's KV)."""
        self._log_once = LogOnce(logger)
        self._closed = threading.Event()
        self._settled = threading.Event()
        """Set when a prefetch or a blend ends (:meth:`wait_settled`)."""

    def __len__(self) -> int:
        return len(self._pending)

    def start(self, req: ReqMeta, copier: Callable[[ReqMeta], CopyResult] | None = None) -> None:
        """Begin prefetching ``req``'s load (its chunks into the CPU tier). ``copier``: run on
        the prefetch thread after the reads, unless the deadline claimed the load first (it
        writes into ``req``'s blocks; an exception it raises becomes a failed load)."""
        assert req.load is not None
        now = time.monotonic()
        pending = PendingLoad(req, now, now + self.timeout, on_release=self._settled_one)
        old = self._pending.pop(req.req_id, None)
        if old is not None:  # vLLM never loads a request twice at once; keep the newest
            old.release()
        self._pending[req.req_id] = pending
        try:
            keys, num_chunks = self._keys(req)
            pending.future = self._pool.submit(self._prefetch, keys, num_chunks, pending, copier)
            pending.future.add_done_callback(self._wake)
        except Exception as exc:  # noqa: BLE001 - no prefetch: the copy takes what the CPU tier has
            self._log_once(logging.WARNING, "prefetch", "lmcache: prefetch of %s not started (%s: %s); loading "
                           "what the CPU tier holds", req.req_id, type(exc).__name__, exc)  # fmt: skip

    def start_blend(self, req: ReqMeta, work: Callable[[], Any]) -> None:
        """Run ``work`` (``req``'s blend, writing into its blocks) on the blend thread."""
        now = time.monotonic()
        pending = PendingLoad(req, now, now, blend=True, on_release=self._settled_one)
        pending.future = self._blends.submit(work)
        pending.future.add_done_callback(self._wake)
        self._pending[req.req_id] = pending

    def _settled_one(self) -> None:
        """A load or blend left flight (``async_loads_in_flight`` = started - settled)."""
        self.engine.stats.add(async_loads_settled=1)

    def _wake(self, _fut: Future[Any]) -> None:
        self._settled.set()

    def wait_settled(self, timeout: float) -> None:
        """Worker thread, in a step that scheduled nothing: block until a pending load's
        prefetch (or blend) ends, or ``timeout`` seconds (at once if one has ended or none is
        pending). A deadline is overrun by at most ``timeout``."""
        self._settled.clear()
        if not self._pending or any(p.future is None or p.future.done() for p in self._pending.values()):
            return
        self._settled.wait(timeout)

    def _keys(self, req: ReqMeta) -> tuple[list[Any], int]:
        """The keys to prefetch: the load's chunks from ``num_local`` on (how many: the second
        value), then a hybrid's recurrent-state entry, if any."""
        spec = req.load
        assert spec is not None
        pk = self.engine.prefix_keys(req.token_ids[: spec.load_len], **req.load_key_extras)
        first = spec.num_local // pk.chunk_size
        keys = list(pk.keys[first:])
        num_chunks = len(keys)
        state = req.state_load
        if state is not None and 0 < state.boundary <= pk.num_tokens:  # a hybrid's recurrent state, last
            keys.append(state_key(pk.keys[state.boundary // pk.chunk_size - 1]))
        return keys, num_chunks

    def _prefetch(
        self, keys: list[Any], num_chunks: int, pending: PendingLoad, copier: Copier | None
    ) -> list[Any]:
        """Prefetch thread: the chunks of ``keys`` into the CPU tier (one reference each, held);
        with a ``copier`` and the load not claimed by the deadline, copied into the blocks as
        they land (:meth:`_copy_as_read`)."""
        if self._closed.is_set():
            return []
        if copier is None or not pending.claim():
            tiers: list[Tier] = []
            objs = [o for o in self.engine.storage_manager.batched_get(keys, sources=tiers) if o is not None]
            self._count_prefetched(pending.req, tiers[:num_chunks])
            return objs
        objs: list[Any] = []
        try:
            self._copy_as_read(keys[:num_chunks], pending, copier, objs)
        except Exception as exc:  # noqa: BLE001 - reported to the worker thread: a recompute
            pending.copy_done(CopyResult(pending.req.load, error=exc))
        if num_chunks < len(keys):  # the recurrent state, read for the worker thread's copy
            objs += [o for o in self.engine.storage_manager.batched_get(keys[num_chunks:]) if o is not None]
        return objs

    def _copy_as_read(self, keys: list[Any], pending: PendingLoad, copier: Copier, objs: list[Any]) -> None:
        """Read the load's chunks (``keys``, from the chunk of ``num_local`` on) and copy each
        batch into the blocks as soon as it lands, unless stopped; ``objs`` receives the objects
        read (one reference each, held). Sets ``pending.copy`` when the copy ran to its end."""
        req = pending.req
        spec = req.load
        assert spec is not None
        c = self.engine.config.chunk_size
        first = spec.num_local // c
        written = torch.zeros(spec.load_len, dtype=torch.bool)
        copied = spec.num_local

        def copy_to(stop: int) -> None:
            nonlocal copied
            ret = copier(req, copied, stop)
            written[: ret.shape[0]] |= ret[: spec.load_len]
            copied = stop
            pending.progress = CopyResult(LoadSpec(spec.num_local, spec.num_external, stop), written)

        tiers: list[Tier] = []
        stream = self.engine.storage_manager.iter_prefix(keys, sources=tiers)
        held = copied
        try:
            for batch in stream:
                objs += batch
                held = min(spec.end, (first + len(objs)) * c)
                if held - copied >= BACKGROUND_COPY_TOKENS and not pending.copy_part(lambda: copy_to(held)):
                    return
            if self._closed.is_set():
                return
            # the rest of what landed; when every whole chunk did, with the load's tail (a
            # block-granular part of another entry, which no key here names)
            stop = spec.end if len(objs) >= spec.load_len // c - first else held
            if stop > copied and not pending.copy_part(lambda: copy_to(stop)):
                return
        finally:
            stream.close()
            self._count_prefetched(req, tiers)
        if copied <= spec.num_local:
            done = CopyResult(None)  # nothing of the hit was read
        elif copied >= spec.end:
            done = CopyResult(spec, written)
        else:
            done = CopyResult(LoadSpec(spec.num_local, spec.num_external, copied), written)
        pending.copy_done(done)

    def _count_prefetched(self, req: ReqMeta, tiers: list[Tier]) -> None:
        """Count the tokens of ``req``'s load the prefetch read from disk or the remote tier
        (``tiers``: the tier of each chunk read, from the chunk of ``num_local`` on)."""
        spec = req.load
        assert spec is not None
        c = self.engine.config.chunk_size
        first = spec.num_local // c
        counts = {Tier.DISK: 0, Tier.REMOTE: 0}
        for i, tier in enumerate(tiers, start=first):
            if tier in counts:
                counts[tier] += min((i + 1) * c, spec.load_len) - i * c
        if any(counts.values()):
            self.engine.stats.add(prefetch_tokens_disk=counts[Tier.DISK], prefetch_tokens_remote=counts[Tier.REMOTE])

    def ready(self, now: float | None = None) -> list[PendingLoad]:
        """Loads to copy now (prefetch done, or past the deadline), removed from the pending set."""
        now = time.monotonic() if now is None else now
        out = []
        for req_id, p in list(self._pending.items()):
            done = p.future is None or p.future.done()
            if done or (now >= p.deadline and not p.blend):
                if not done:  # past the deadline: a background copy stops (after its batch in flight)
                    p.claim()
                    p.stop_copy()
                p.timed_out = not done
                out.append(p)
                del self._pending[req_id]
        return out

    def close(self) -> list[PendingLoad]:
        """Stop: the loads still pending (to report as finished, failed), prefetches not waited for."""
        self._closed.set()
        left = list(self._pending.values())
        self._pending.clear()
        for p in left:
            p.release()
        self._pool.shutdown(wait=False, cancel_futures=True)
        self._blends.shutdown(wait=False, cancel_futures=True)
        return left
