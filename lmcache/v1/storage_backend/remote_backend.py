"""L3: the remote tier, one cache shared by many engines (Redis / Valkey, standalone or cluster).

Values are self-describing entries (:mod:`.entry_format`: header with the full remote
key, shape, dtype and an xxh3 checksum of the payload); a reader verifies all of it,
so a corrupt value, a value written under another namespace or another format version
is a miss, never wrong KV. Nothing read from the server is ever unpickled or executed.

Remote keys are ``<prefix>:v<entry version>:<namespace>:<CacheEngineKey.to_string()>``
(a key string over 512 characters is replaced by ``#sha256:<hex digest>``);
the key string already names model, world size, worker, chunk hash and KV dtype, the
namespace separates the KV cache from other caches (``"kv"``, ``"ec"``, ...), and the
prefix (``extra_config.remote_key_prefix``, default ``lmcache``) separates tenants.

Tuning knobs live in ``extra_config`` (see :class:`RemoteOptions` and docs/remote.md).
"""

from __future__ import annotations

import dataclasses
import hashlib
import logging
import threading
import time
from collections.abc import Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any, Sequence

from lmcache.log_once import LogOnce
from lmcache.v1.keys import CacheEngineKey
from lmcache.v1.config import ConfigError, LMCacheEngineConfig
from lmcache.v1.memory_management import MemoryObj
from lmcache.v1.options import option, parse_options
from lmcache.v1.stats import TierStats
from lmcache.v1.storage_backend.abstract_backend import StorageBackend, TierMemory, resolved
from lmcache.v1.storage_backend.connector import (
    RedisConnector,
    RemoteAuthError,
    RemoteError,
    RemoteUnavailable,
    RemoteWrongType,
    TLSOptions,
    create_connector,
    mask_url,
)
from lmcache.v1.storage_backend.connector.breaker import CircuitBreaker, ExponentialBackoff
from lmcache.v1.storage_backend.entry_format import (
    VERSION as ENTRY_VERSION,
)
from lmcache.v1.storage_backend.entry_format import (
    CorruptEntryError,
    decode_header,
    encode_header,
    payload_checksum,
    verify_payload,
)
from lmcache.v1.tiers import Tier

logger = logging.getLogger(__name__)

MiB = 1 << 20
MAX_PLAIN_KEY = 512
"""Key strings up to this many characters are used as they are; longer ones are hashed."""
DEFAULT_INFLIGHT_CAP = 512 * MiB


@dataclass(slots=True)
class RemoteStats(TierStats):
    """Counters of one remote tier: the shared :class:`~lmcache.v1.stats.TierStats` and the
    remote tier's own (read with :meth:`snapshot`)."""

    errors: int = 0
    """Failed remote calls of any kind (connection loss, timeouts, error replies)."""
    breaker_open: int = 0
    """Times the circuit breaker opened (one per outage)."""
    breaker_rejects: int = 0
    """Reads and lookups answered "miss" at once because the breaker was open."""
    reconnects: int = 0
    auth_failures: int = 0
    lookups: int = 0
    lookup_hit_keys: int = 0
    puts_skipped_unavailable: int = 0
    """Writes not attempted: tier unavailable, disabled or closing."""
    puts_dropped_inflight_full: int = 0
    """Writes dropped because the in-flight budget was full."""
    put_waits: int = 0
    """Writes that waited for room in the budget (inside ``waiting_writes``: disaggregated prefill)."""


@dataclass(frozen=True, slots=True)
class RemoteOptions:
    """Remote-tier tuning, from ``extra_config`` (names prefixed ``remote_``; the field
    metadata is the docs' source). Bad values raise ConfigError."""

    workers: int = option(2, "remote_workers", "writer threads, each with its own connection", ge=1)
    read_workers: int = option(2, "remote_read_workers", "threads serving non-blocking reads (layerwise path)", ge=1)
    max_inflight_mb: int | None = option(
        None,
        "remote_max_inflight_mb",
        "MiB of pool memory held by queued writes; beyond it writes are dropped (counted)",
        ge=1,
        default_doc="min(512, pool/4)",
    )
    backoff_initial: float = option(0.1, "remote_backoff_initial", "seconds before the first reconnect attempt", gt=0)
    backoff_max: float = option(10.0, "remote_backoff_max", "cap of the doubling reconnect delay (seconds)", gt=0)
    key_prefix: str | None = option("lmcache", "remote_key_prefix", "first component of every remote key (tenants)")
    tls_ca_certs: str | None = option(None, "remote_tls_ca_certs", "CA bundle (PEM) for `rediss://`")
    tls_certfile: str | None = option(None, "remote_tls_certfile", "client certificate (PEM) for `rediss://`")
    tls_keyfile: str | None = option(None, "remote_tls_keyfile", "client key (PEM) for `rediss://`")
    tls_cert_reqs: str | None = option(
        "required", "remote_tls_cert_reqs", "server certificate check", choices=("required", "optional", "none")
    )
    max_inflight_bytes: int = DEFAULT_INFLIGHT_CAP
    """The in-flight budget in bytes (``remote_max_inflight_mb``, or its pool-based default)."""

    def __post_init__(self) -> None:
        if not self.key_prefix:
            object.__setattr__(self, "key_prefix", "lmcache")
        if not self.tls_cert_reqs:
            object.__setattr__(self, "tls_cert_reqs", "required")
        if any(c.isspace() for c in self.key_prefix or ""):
            raise ConfigError(f"extra_config.remote_key_prefix={self.key_prefix!r}: expected no whitespace")
        if self.backoff_max < self.backoff_initial:
            raise ConfigError(
                f"extra_config.remote_backoff_max={self.backoff_max!r}: "
                f"expected >= remote_backoff_initial={self.backoff_initial!r}"
            )

    @property
    def tls(self) -> TLSOptions:
        """The TLS settings for ``rediss://``."""
        return TLSOptions(
            ca_certs=self.tls_ca_certs,
            certfile=self.tls_certfile,
            keyfile=self.tls_keyfile,
            cert_reqs=self.tls_cert_reqs or "required",
        )

    @classmethod
    def from_config(cls, config: LMCacheEngineConfig, pool_bytes: int) -> RemoteOptions:
        opts = parse_options(cls, config.extra_config)
        mb = opts.max_inflight_mb
        if mb is None:
            mb = max(MiB, min(DEFAULT_INFLIGHT_CAP, pool_bytes // 4)) // MiB
        return dataclasses.replace(opts, max_inflight_bytes=mb * MiB)


def entry_key_prefix(key_prefix: str, namespace: str) -> str:
    """``<key_prefix>:v<entry version>:<namespace>:``: the start of every entry key of a namespace."""
    return f"{key_prefix}:v{ENTRY_VERSION}:{namespace}:"


def entry_key(prefix: str, key: CacheEngineKey) -> str:
    """The remote key of ``key``'s entry under ``prefix`` (from :func:`entry_key_prefix`);
    see :meth:`RemoteBackend.remote_key`. Pure: tools compute the keys of a running
    engine's entries with it."""
    text = key.to_string()
    if len(text) > MAX_PLAIN_KEY:
        text = "#sha256:" + hashlib.sha256(text.encode("utf-8", "surrogatepass")).hexdigest()
    return prefix + text


class _NoRoom(Exception):
    """Internal: the CPU pool cannot take a remote hit."""


def _payload_view(obj: MemoryObj) -> memoryview:
    """The object's payload bytes as a (writable) memoryview over pool memory, no copy."""
    return memoryview(obj.byte_array.numpy())


class RemoteBackend(StorageBackend):
    """The remote tier over a :class:`RedisConnector`.

    Calling threads: any engine thread. ``contains``/``batched_contains`` (one
    pipelined round trip), ``remove`` and ``get_blocking`` block the caller for at
    most about ``remote_timeout`` seconds; ``submit_put`` and ``get_non_blocking``
    never wait on the network (writer/reader threads do).

    Ownership: ``submit_put`` takes its own reference on the object until its write
    has finished (the pool memory is sent without a copy) and never consumes the
    caller's. ``get_blocking`` allocates the result from ``memory`` (the CPU pool; the caller
    owns its one reference; the StorageManager promotes it into L1) and reads the
    value straight into it.

    Failures are misses: on connection loss or a timeout the circuit breaker opens,
    one warning is logged, reads/lookups answer "miss" and writes are skipped at once,
    and a background prober reconnects with exponential backoff (one info line when
    back). Rejected credentials disable the tier with one error line. Counters are in
    :attr:`stats`. Construction PINGs the server once (blocking for at most about
    ``remote_timeout``) so that bad credentials are reported at start; an unreachable
    server only opens the breaker.
    """

    tier = Tier.REMOTE

    name = "RemoteBackend"

    def __init__(
        self,
        config: LMCacheEngineConfig,
        memory: TierMemory,
        namespace: str = "kv",
        *,
        connector: RedisConnector | None = None,
    ) -> None:
        if config.remote_url is None:
            raise ValueError("remote_url=None: the remote tier needs a URL such as redis://host:6379")
        if not namespace or ":" in namespace:
            raise ValueError(f"namespace={namespace!r}: expected a non-empty name without ':'")
        self.url = mask_url(config.remote_url)
        self.namespace = namespace
        self.memory = memory
        self.options = RemoteOptions.from_config(config, memory.capacity)  # ConfigError
        try:
            self.connector = connector or create_connector(
                config.remote_url,
                timeout=config.remote_timeout,
                username=config.remote_username,
                password=config.remote_password,
                tls=self.options.tls,
            )
        except ValueError as exc:  # a malformed URL: a clear error at start
            raise ConfigError(str(exc)) from None
        self.stats = RemoteStats()
        self.breaker = CircuitBreaker(ExponentialBackoff(self.options.backoff_initial, self.options.backoff_max))
        self._key_prefix = entry_key_prefix(self.options.key_prefix or "lmcache", namespace)
        self._writer = ThreadPoolExecutor(self.options.workers, thread_name_prefix="lmcache-remote-put")
        self._reader = ThreadPoolExecutor(self.options.read_workers, thread_name_prefix="lmcache-remote-get")
        self._cv = threading.Condition()
        self._inflight_bytes = 0
        self._inflight_keys: set[str] = set()
        self._tls = threading.local()
        """``wait``: (deadline, budget) while the thread is inside :meth:`waiting_writes`."""
        self._lock = threading.Lock()
        self._disabled: str | None = None
        self._closed = False
        self._stop = threading.Event()
        self._prober: threading.Thread | None = None
        self._log_once = LogOnce(logger)
        self._connect_at_start()

    # ------------------------------------------------------------------ state
    @property
    def disabled_reason(self) -> str | None:
        """Why the tier is off for good (rejected credentials), or None."""
        return self._disabled

    @property
    def available(self) -> bool:
        """True while calls go to the server (not disabled, closed or breaker-open)."""
        return self._disabled is None and not self._closed and self.breaker.allow()

    def wait_available(self, timeout: float | None = None) -> bool:
        """Block until the tier is reachable again (or ``timeout``); for tests and tools."""
        if self._disabled is not None or self._closed:
            return False
        return self.breaker.wait_closed(timeout) and self.available

    def remote_key(self, key: CacheEngineKey) -> str:
        """The namespaced key under which ``key``'s entry is stored.

        Key strings longer than :data:`MAX_PLAIN_KEY` bytes (e.g. many request configs)
        are replaced by ``#sha256:<hex>`` of the string: fixed length, so the entry
        header (which repeats the remote key) always fits the first read, and still
        collision-resistant.
        """
        return entry_key(self._key_prefix, key)

    @property
    def key_prefix(self) -> str:
        """What every entry key of this tier starts with (:func:`entry_key_prefix`)."""
        return self._key_prefix

    # ------------------------------------------------------------------ contract
    def contains(self, key: CacheEngineKey, pin: bool = False) -> bool:
        """Whether the server holds ``key`` (``pin`` is ignored: remote entries cannot be pinned)."""
        return self.batched_contains([key]) == 1

    def batched_contains(self, keys: Sequence[CacheEngineKey], pin: bool = False) -> int:
        """Number of leading keys present, asked in one pipelined round trip (per node)."""
        if not keys:
            return 0
        if not self._usable():
            return 0
        try:
            present = self.connector.exists([self.remote_key(k) for k in keys])
        except RemoteError as exc:
            self._failed(exc, "lookup")
            return 0
        n = 0
        for hit in present:
            if not hit:
                break
            n += 1
        self.stats.add(lookups=1, lookup_hit_keys=n)
        return n

    def submit_put(self, key: CacheEngineKey, obj: MemoryObj) -> None:
        """Queue an asynchronous write; never blocks. Skipped while the tier is unavailable,
        dropped (and counted) when the in-flight budget is full."""
        if not self._usable(count=False):
            self.stats.add(puts_skipped_unavailable=1)
            return
        rkey = self.remote_key(key)
        size = obj.get_size()
        with self._cv:
            if rkey in self._inflight_keys:
                return
            if not self._room_for(size):
                self.stats.add(puts_dropped_inflight_full=1)
                self._warn_once("budget", "remote tier %s: write budget of %d MiB full, dropping writes (logged once)",
                                self.url, self.options.max_inflight_bytes // MiB)
                return
            self._inflight_bytes += size
            self._inflight_keys.add(rkey)
        obj.ref_count_up()
        try:
            self._writer.submit(self._write, rkey, obj, size, key)
        except RuntimeError:  # executor shut down by a concurrent close()
            self._write_done(rkey, obj, size)
            self.stats.add(puts_skipped_unavailable=1)

    def _room_for(self, size: int) -> bool:
        """Whether a write of ``size`` bytes fits the in-flight budget (under ``self._cv``);
        inside :meth:`waiting_writes`, waits for room until that block's deadline."""
        wait = getattr(self._tls, "wait", None)
        cap = wait[1] if wait is not None else self.options.max_inflight_bytes

        def fits() -> bool:
            return not self._inflight_bytes or self._inflight_bytes + size <= cap

        if wait is None or fits():
            return fits()
        self.stats.add(put_waits=1)
        return self._cv.wait_for(fits, max(0.0, wait[0] - time.monotonic()))

    @contextmanager
    def waiting_writes(self, timeout: float, budget: int | None = None) -> Iterator[None]:
        """Inside the block, writes this thread submits wait (until ``timeout`` seconds after
        entering) for room in the in-flight budget (``budget`` bytes, default the tier's)
        instead of being dropped: back-pressure for disaggregated prefill, where a dropped
        write is a decoder's recompute. Only the calling thread waits."""
        self._tls.wait = (time.monotonic() + timeout, budget or self.options.max_inflight_bytes)
        try:
            yield
        finally:
            self._tls.wait = None

    def get_blocking(self, key: CacheEngineKey) -> MemoryObj | None:
        """Read and verify ``key``'s entry into a new pool object (caller owns it) or None."""
        if not self._usable():
            self.stats.add(misses=1)
            return None
        rkey = self.remote_key(key)
        got: list[tuple[Any, MemoryObj]] = []

        def plan(head: memoryview, value_len: int) -> tuple[int, memoryview]:
            hdr = decode_header(head, expected_key=rkey)
            if hdr.header_len + hdr.payload_len != value_len:
                raise CorruptEntryError(
                    f"value has {value_len} bytes, header says {hdr.header_len} + {hdr.payload_len}"
                )
            obj = self.memory.allocate(hdr.meta.shape, hdr.meta.dtype, hdr.meta.fmt)
            if obj is None:
                raise _NoRoom()
            got.append((hdr, obj))
            return hdr.header_len, _payload_view(obj)

        try:
            found = self.connector.get_into(rkey, plan)
            if found:
                hdr, obj = got[0]
                verify_payload(hdr, _payload_view(obj))
        except CorruptEntryError as exc:
            self._release(got)
            self._corrupt(rkey, exc)
            return None
        except _NoRoom:
            self.stats.add(alloc_failures=1, misses=1)
            return None
        except RemoteWrongType as exc:  # a list/hash/... under our key: never one of our entries
            self._release(got)
            self._corrupt(rkey, CorruptEntryError(f"value of another Redis type ({exc})"))
            return None
        except RemoteError as exc:
            self._release(got)
            self._failed(exc, "read")
            self.stats.add(misses=1)
            return None
        if not found:
            self.stats.add(misses=1)
            return None
        hdr, obj = got[0]
        self.stats.add(hits=1, bytes_read=hdr.header_len + hdr.payload_len)
        return obj

    def get_non_blocking(self, key: CacheEngineKey) -> Future[MemoryObj | None]:
        """:meth:`get_blocking` on a reader thread; resolves to None at once when unavailable."""
        if not self._usable():
            self.stats.add(misses=1)
            return resolved(None)
        try:
            return self._reader.submit(self.get_blocking, key)
        except RuntimeError:  # closed concurrently
            return resolved(None)

    def remove(self, key: CacheEngineKey) -> bool:
        if not self._usable():
            return False
        try:
            return self.connector.delete(self.remote_key(key))
        except RemoteError as exc:
            self._failed(exc, "remove")
            return False

    def flush(self, timeout: float | None = None) -> bool:
        """Wait until every queued write finished (stored, skipped or failed); True if so."""
        with self._cv:
            return self._cv.wait_for(lambda: not self._inflight_keys, timeout)

    def close(self) -> None:
        """Finish queued writes (each bounded by the timeout), stop threads, disconnect. Idempotent."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
        self._writer.shutdown(wait=True)
        self._reader.shutdown(wait=True)
        self._stop.set()
        prober = self._prober
        if prober is not None:
            prober.join()
        self.connector.close()

    # ------------------------------------------------------------------ writes
    def _write(self, rkey: str, obj: MemoryObj, size: int, key: CacheEngineKey | None = None) -> None:
        try:
            if self._disabled is not None or not self.breaker.allow():
                self.stats.add(puts_skipped_unavailable=1)
                return
            payload = _payload_view(obj)
            header = encode_header(rkey, obj.meta, payload_checksum(payload), align=8)
            self.connector.set(rkey, [header, payload])
            self.stats.add(writes_completed=1, bytes_written=len(header) + size)
            if key is not None:
                self._notify("stored", [key])
        except RemoteError as exc:
            self.stats.add(write_errors=1)
            self._failed(exc, "write")
        except ValueError as exc:  # e.g. a dtype the entry format cannot describe
            self.stats.add(write_errors=1)
            self._warn_once("encode", "remote tier %s: cannot encode an entry (%s); such writes are skipped (logged once)",
                            self.url, exc)
        except Exception:  # last resort on a background thread: never lose the error silently
            self.stats.add(write_errors=1, errors=1)
            self._log_once(logging.ERROR, "unexpected-write", "remote tier %s: unexpected error in a write (logged once)",
                           self.url, exc_info=True)
        finally:
            self._write_done(rkey, obj, size)

    def _write_done(self, rkey: str, obj: MemoryObj, size: int) -> None:
        obj.ref_count_down()
        with self._cv:
            self._inflight_bytes -= size
            self._inflight_keys.discard(rkey)
            self._cv.notify_all()  # flush() and writers waiting for room (waiting_writes)

    # ------------------------------------------------------------------ failures
    def _usable(self, count: bool = True) -> bool:
        if self._disabled is not None or self._closed:
            return False
        if self.breaker.allow():
            return True
        if count:
            self.stats.add(breaker_rejects=1)
        return False

    def _failed(self, exc: RemoteError, what: str) -> None:
        self.stats.add(errors=1)
        if isinstance(exc, RemoteAuthError):
            self._disable(str(exc))
        elif isinstance(exc, RemoteUnavailable):
            self._trip(exc)
        else:
            self._warn_once(f"error-{what}", "remote tier %s: %s failed (%s); treated as a miss (logged once)",
                            self.url, what, exc)

    def _corrupt(self, rkey: str, exc: CorruptEntryError) -> None:
        self.stats.add(corrupt_entries=1, misses=1)
        self._warn_once("corrupt", "remote tier %s: dropping an invalid entry %r (%s) (logged once)", self.url, rkey, exc)
        try:
            self.connector.delete(rkey)
        except RemoteError as del_exc:
            self._failed(del_exc, "delete")

    def suspect(self, reason: str) -> None:
        """A caller saw this tier hang (e.g. an asynchronous load past its deadline): open the
        breaker as a timed-out call would, so lookups and reads answer "miss" at once until the
        background PING gets an answer. Any thread; never blocks."""
        self._trip(RemoteUnavailable(reason))

    def _trip(self, exc: RemoteError) -> None:
        if not self.breaker.trip():
            return
        self.stats.add(breaker_open=1)
        logger.warning(
            "remote tier %s unavailable (%s): answering misses and skipping writes; reconnecting in the background",
            self.url, exc,
        )
        with self._lock:
            if self._closed:
                return
            self._prober = threading.Thread(target=self._probe_loop, name="lmcache-remote-probe", daemon=True)
            self._prober.start()

    def _probe_loop(self) -> None:
        """Background: PING with exponential backoff until the server answers."""
        while not self._stop.wait(self.breaker.next_delay()):
            try:
                self.connector.ping()
            except RemoteAuthError as exc:
                self._disable(str(exc))
                return
            except RemoteError:
                self.breaker.probe_failed()
                continue
            if self.breaker.reset():
                self.stats.add(reconnects=1)
                logger.info("remote tier %s reachable again", self.url)
            return

    def _disable(self, reason: str) -> None:
        with self._lock:
            if self._disabled is not None:
                return
            self._disabled = reason
        self.stats.add(auth_failures=1)
        logger.error(
            "remote tier %s disabled: the server rejected the credentials (%s); check remote_username and "
            "remote_password / LMCACHE_REMOTE_PASSWORD. The engine continues without this tier.",
            self.url, reason,
        )

    def _connect_at_start(self) -> None:
        try:
            self.connector.ping()
        except RemoteAuthError as exc:
            self._disable(str(exc))
        except RemoteError as exc:
            self.stats.add(errors=1)
            self._trip(exc if isinstance(exc, RemoteUnavailable) else RemoteUnavailable(str(exc)))
        else:
            logger.info("remote tier connected: %s (namespace %r)", self.url, self.namespace)

    def _warn_once(self, tag: str, msg: str, *args: object) -> None:
        if not self._log_once(logging.WARNING, tag, msg, *args):
            logger.debug(msg, *args)

    @staticmethod
    def _release(got: list[tuple[Any, MemoryObj]]) -> None:
        for _, obj in got:
            obj.ref_count_down()
        got.clear()
