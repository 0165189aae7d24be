"""Instance registration: a vLLM instance with a remote tier announces itself there.

Rank 0's worker writes ``<remote_key_prefix>:instances:<engine_id>`` (JSON, see
:class:`InstanceRecord`) with a TTL of :data:`TTL_S` seconds, adds its engine id to the
sorted set ``<remote_key_prefix>:instances`` (the index readers list, so that nobody
SCANs the cache's keyspace), and refreshes both every :data:`REFRESH_S` seconds from a
daemon thread; :meth:`Registration.close` deletes them. An instance that died without
closing disappears when the TTL runs out (readers drop its index entry then). The admin API
(:mod:`lmcache.admin`) lists instances from these records and, with :class:`KeySpace`,
computes the remote keys of a prompt's chunks without asking the instance.

The record holds no secret (the remote URL is not in it) and no KV. Failures to
write or delete are logged once and never reach vLLM.
"""

from __future__ import annotations

import json
import logging
import os
import socket
import threading
import time
from dataclasses import asdict, dataclass, field
from typing import TYPE_CHECKING, Any

from lmcache.log_once import LogOnce
from lmcache.v1.cache_engine import LMCacheEngine
from lmcache.v1.config import LMCacheEngineConfig
from lmcache.v1.keys import key_dtype
from lmcache.v1.metadata import LMCacheEngineMetadata
from lmcache.v1.storage_backend.connector import RemoteError, create_connector
from lmcache.v1.storage_backend.remote_backend import RemoteOptions
from lmcache.v1.tiers import Tier
from lmcache.v1.token_database import ChunkedTokenDatabase

if TYPE_CHECKING:
    from lmcache.integration.vllm.metadata_builder import AdapterSettings

logger = logging.getLogger(__name__)

TTL_S = 30
REFRESH_S = 10.0
RECORD_VERSION = 1


def instances_prefix(key_prefix: str) -> str:
    """Where the records live: ``<remote_key_prefix>:instances:``."""
    return f"{key_prefix}:instances:"


def index_key(key_prefix: str) -> str:
    """The sorted set of registered engine ids (score: start time)."""
    return f"{key_prefix}:instances"


@dataclass(frozen=True, slots=True)
class KeySpace:
    """Everything chunk keys depend on, for one instance: with it a tool rebuilds the keys
    of a token sequence (:meth:`databases`) exactly as the instance's workers do."""

    model_name: str
    world_size: int
    """The world size in the keys (1 when only rank 0 stores: ``save_only_first_rank``)."""
    fmt: str
    kv_dtype: str
    kv_shape: tuple[int, int, int, int, int]
    use_mla: bool
    chunk_size: int
    save_unfull_chunk: bool

    @staticmethod
    def of(engine: LMCacheEngine) -> KeySpace:
        md = engine.metadata
        return KeySpace(
            md.model_name, md.world_size, md.fmt, md.dtype_name, tuple(md.kv_shape), md.use_mla,  # type: ignore[arg-type]
            engine.config.chunk_size, engine.config.save_unfull_chunk,
        )

    @staticmethod
    def from_dict(data: dict[str, Any]) -> KeySpace:
        """Raises ValueError/TypeError/KeyError for a malformed record."""
        shape = tuple(int(d) for d in data["kv_shape"])
        if len(shape) != 5:
            raise ValueError(f"kv_shape={data['kv_shape']!r}: expected 5 ints")
        return KeySpace(
            str(data["model_name"]), int(data["world_size"]), str(data["fmt"]), str(data["kv_dtype"]),
            shape, bool(data["use_mla"]), int(data["chunk_size"]), bool(data["save_unfull_chunk"]),  # type: ignore[arg-type]
        )

    def databases(self) -> list[ChunkedTokenDatabase]:
        """One token database per worker id (rank) whose keys the instance writes."""
        config = LMCacheEngineConfig.from_dict(
            {"chunk_size": self.chunk_size, "save_unfull_chunk": self.save_unfull_chunk}, source="instance record"
        )
        dtype = key_dtype(self.kv_dtype)
        return [
            ChunkedTokenDatabase(
                config,
                LMCacheEngineMetadata(self.model_name, self.world_size, rank, self.fmt, dtype, self.kv_shape, self.use_mla),
            )
            for rank in range(self.world_size)
        ]


@dataclass(frozen=True, slots=True)
class InstanceRecord:
    """What an instance registers (JSON; fields may be added, never renamed)."""

    engine_id: str
    host: str
    pid: int
    model: str
    """The model vLLM serves (name or path, as given to vLLM)."""
    tokenizer: str
    namespace: str
    """The model namespace in the keys (``model_namespace``, default the model)."""
    world_size: int
    kv_dtype: str
    chunk_size: int
    socket_dir: str
    sockets: list[str]
    tiers: list[str]
    started_at: float
    remote_entry_prefix: str
    """What the instance's remote entry keys start with (``<prefix>:v<n>:kv:``)."""
    keys: dict[str, Any] = field(default_factory=dict)
    """The :class:`KeySpace` as a dict."""
    version: int = RECORD_VERSION

    def to_json(self) -> bytes:
        return json.dumps(asdict(self), separators=(",", ":"), sort_keys=True).encode()

    @staticmethod
    def from_json(raw: bytes | str) -> InstanceRecord:
        """Raises ValueError (or TypeError) for a value that is not a record."""
        data = json.loads(raw)
        if not isinstance(data, dict):
            raise ValueError("instance record: expected a JSON object")
        names = InstanceRecord.__dataclass_fields__
        return InstanceRecord(**{k: v for k, v in data.items() if k in names})

    @property
    def key_space(self) -> KeySpace:
        return KeySpace.from_dict(self.keys)


def make_record(engine: LMCacheEngine, *, engine_id: str, model: str, tokenizer: str, world_size: int,
                socket_dir: str, sockets: list[str]) -> InstanceRecord | None:
    """The record of the instance whose rank-0 engine is ``engine``; None without a remote tier."""
    remote = next((b for b in engine.storage_manager.backends if b.tier == Tier.REMOTE), None)
    if remote is None:
        return None
    return InstanceRecord(
        engine_id=engine_id,
        host=socket.gethostname(),
        pid=os.getpid(),
        model=model,
        tokenizer=tokenizer,
        namespace=engine.metadata.model_name,
        world_size=world_size,
        kv_dtype=engine.metadata.dtype_name,
        chunk_size=engine.config.chunk_size,
        socket_dir=socket_dir,
        sockets=sockets,
        tiers=[str(b.tier) for b in engine.storage_manager.backends],
        started_at=time.time(),
        remote_entry_prefix=remote.key_prefix,
        keys=asdict(KeySpace.of(engine)),
    )


class Registration:
    """Keeps ``record`` registered in the remote store of ``config`` (see the module docstring).

    Starts a daemon thread that writes at once and then every ``refresh_s`` seconds;
    :meth:`close` stops it and deletes the record. Never raises after construction."""

    def __init__(self, config: LMCacheEngineConfig, record: InstanceRecord, *, ttl_s: int = TTL_S,
                 refresh_s: float = REFRESH_S) -> None:
        assert config.remote_url is not None
        options = RemoteOptions.from_config(config, 1 << 30)
        self.key = instances_prefix(options.key_prefix or "lmcache") + record.engine_id
        self.index = index_key(options.key_prefix or "lmcache")
        self.record = record
        self.ttl_s = ttl_s
        self.refresh_s = refresh_s
        self._conn = create_connector(
            config.remote_url, timeout=config.remote_timeout, username=config.remote_username,
            password=config.remote_password, tls=options.tls,
        )
        self._log_once = LogOnce(logger)
        self._stop = threading.Event()
        self.written = threading.Event()
        """Set after each successful write (tests and tools wait on it)."""
        self._thread = threading.Thread(target=self._run, name="lmcache-registration", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        value, engine_id = self.record.to_json(), self.record.engine_id
        while True:
            try:
                self._conn.command(self.key, "SET", self.key, value, "EX", self.ttl_s)
                self._conn.command(self.index, "ZADD", self.index, self.record.started_at, engine_id)
                self.written.set()
            except RemoteError as exc:
                self._log_once(logging.WARNING, "write", "lmcache: cannot register instance %s in the remote store "
                               "(%s); retrying quietly (logged once)", self.record.engine_id, exc)
            if self._stop.wait(self.refresh_s):
                return

    def close(self) -> None:
        """Stop refreshing and delete the record. Idempotent."""
        if self._stop.is_set():
            return
        self._stop.set()
        self._thread.join()
        try:
            self._conn.delete(self.key)
            self._conn.command(self.index, "ZREM", self.index, self.record.engine_id)
        except RemoteError as exc:
            self._log_once(logging.WARNING, "delete", "lmcache: cannot unregister instance %s (%s); it expires in %ds",
                           self.record.engine_id, exc, self.ttl_s)
        self._conn.close()


def start_registration(settings: AdapterSettings, engine: LMCacheEngine, vllm_config: Any, rank: int,
                       sockets: list[str]) -> Registration | None:
    """Rank 0 with a remote tier: register the instance; otherwise (or on a failure,
    logged) None."""
    if rank != 0 or settings.config.remote_url is None:
        return None
    try:
        model_cfg = vllm_config.model_config
        record = make_record(
            engine, engine_id=settings.engine_id, model=str(model_cfg.model),
            tokenizer=str(getattr(model_cfg, "tokenizer", None) or model_cfg.model), world_size=settings.world_size,
            socket_dir=settings.socket_dir, sockets=sockets,
        )
        if record is None:
            return None
        return Registration(settings.config, record)
    except Exception as exc:  # noqa: BLE001 - registration never stops vLLM
        logger.warning("lmcache: instance registration unavailable (%s: %s)", type(exc).__name__, exc)
        return None
