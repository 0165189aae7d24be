"""Recurrent-state entries (hybrid models) and the scheduler's question "up to which boundary
does every rank hold the state?": :mod:`lmcache.v1.state_entries` on a real engine, the
``state`` op of the lookup sockets, and ``LookupDispatcher.state_boundary`` in process and
over real unix sockets (ranks that hold different sets, a missing rank, a timeout, hostile
requests)."""

from __future__ import annotations

import dataclasses
import socket
import threading
from types import SimpleNamespace

import numpy as np
import pytest
import torch

from lmcache.integration.vllm.lookup_service import (
    MAX_STATE_BOUNDARIES,
    LookupClient,
    LookupServer,
    common_state_boundary,
    recv_frame,
    send_frame,
)
from lmcache.integration.vllm.naming import instance_id, socket_path
from lmcache.integration.vllm.scheduler_side import LookupDispatcher
from lmcache.v1 import state_entries
from lmcache.v1.cache_engine import LMCacheEngineBuilder
from lmcache.v1.config import LMCacheEngineConfig
from lmcache.v1.metadata import LMCacheEngineMetadata
from lmcache.v1.request import KEY_EXTRA_NAMES
from lmcache.v1.testing import KVSpec, make_connector, make_engine

CHUNK = 16
ROWS = (3, 40)  # three recurrent layers, 40 bytes of state each
TOKENS = list(range(1000, 1000 + 4 * CHUNK + 5))  # boundaries 16, 32, 48, 64
ALL = [16, 32, 48, 64]


def config() -> LMCacheEngineConfig:
    return LMCacheEngineConfig.from_dict({"chunk_size": CHUNK, "max_local_cpu_size": 0.25})


def rows(seed: int) -> torch.Tensor:
    return torch.randint(0, 256, ROWS, dtype=torch.uint8, generator=torch.Generator().manual_seed(seed))


def put(engine, boundaries, tokens=TOKENS, extras=None) -> None:
    for b in boundaries:
        key = state_entries.boundary_key(engine, tokens, b, extras or {})
        assert state_entries.put_state(engine, key, rows(b))


# ------------------------------------------------------------------ state_entries itself
@pytest.fixture
def sock_dir():
    """A short directory for unix sockets (pytest's tmp_path can pass the 107-byte AF_UNIX limit)."""
    import shutil
    import tempfile
    from pathlib import Path

    path = Path(tempfile.mkdtemp(prefix="lmc-st-", dir="/tmp"))
    yield path
    shutil.rmtree(path, ignore_errors=True)


@pytest.fixture
def engine():
    eng = make_engine(KVSpec(), config())
    yield eng
    eng.close()


def test_put_get_round_trip_on_the_cpu_tier(engine):
    key = state_entries.boundary_key(engine, TOKENS, 32, {})
    assert state_entries.get_state(engine, key, ROWS) is None  # not stored yet
    data = rows(7)
    assert state_entries.put_state(engine, key, data)
    assert engine.storage_manager.is_resident(key)
    got = state_entries.get_state(engine, key, ROWS)
    assert got is not None and torch.equal(got, data)
    got[0, 0] ^= 1  # the caller owns the copy: the stored entry is unchanged
    assert torch.equal(state_entries.get_state(engine, key, ROWS), data)
    assert state_entries.put_state(engine, key, rows(8))  # already stored: kept as it was
    assert torch.equal(state_entries.get_state(engine, key, ROWS), data)
    assert state_entries.get_state(engine, key, (2, 40)) is None  # another size: a miss
    with pytest.raises(ValueError, match="uint8"):
        state_entries.put_state(engine, key, torch.zeros(ROWS, dtype=torch.float32))
    with pytest.raises(ValueError, match="uint8"):
        state_entries.put_state(engine, key, torch.zeros(40, dtype=torch.uint8))
    assert engine.lookup(TOKENS) == 0  # a state entry is no KV chunk


def test_state_key_differs_from_the_chunk_key_and_is_stable(engine):
    chunk_key = engine.prefix_keys(TOKENS[:32]).keys[1]
    key = state_entries.state_key(chunk_key)
    assert key != chunk_key and state_entries.STATE_CONFIG in key.request_configs
    assert state_entries.state_key(chunk_key) == key
    assert state_entries.state_key(key) == key  # idempotent
    assert state_entries.state_key(engine.prefix_keys(TOKENS[:48]).keys[1]) == key  # same prefix, same key
    assert state_entries.boundary_key(engine, TOKENS, 32, {}) == key
    assert dataclasses.replace(key, request_configs=chunk_key.request_configs) == chunk_key
    assert state_entries.boundary_key(engine, TOKENS, 32, {"cache_salt": "s"}) != key  # another tenant
    assert state_entries.boundary_key(engine, TOKENS, 16, {}) != key
    other = list(TOKENS)
    other[3] += 1
    assert state_entries.boundary_key(engine, other, 32, {}) != key  # another prefix
    for bad in (0, -16, 17, 80):
        with pytest.raises(ValueError, match="boundary"):
            state_entries.boundary_key(engine, TOKENS, bad, {})


def test_latest_state_picks_the_longest_stored_boundary(engine):
    assert state_entries.latest_state(engine, TOKENS, ALL, {}) == 0
    put(engine, [16, 48])
    assert state_entries.latest_state(engine, TOKENS, ALL, {}) == 48
    assert state_entries.latest_state(engine, TOKENS, [16, 32], {}) == 16
    assert state_entries.latest_state(engine, TOKENS, [32, 64], {}) == 0
    assert state_entries.latest_state(engine, TOKENS, [47, 49, 50], {}) == 0  # non-multiples are ignored
    assert state_entries.latest_state(engine, TOKENS, [16, 47, 49], {}) == 16
    assert state_entries.latest_state(engine, TOKENS, [48, 0, -16, 96], {}) == 48  # out of range: ignored
    assert state_entries.latest_state(engine, TOKENS[:40], ALL, {}) == 16  # 48 is beyond these tokens
    assert state_entries.latest_state(engine, np.array(TOKENS, dtype=np.int32), ALL, {}) == 48
    assert state_entries.latest_state(engine, TOKENS, ALL, {"cache_salt": "s"}) == 0  # another tenant
    assert state_entries.latest_state(engine, TOKENS, [], {}) == 0


# ------------------------------------------------------------- the narrowing, by itself
def test_common_state_boundary_narrows_to_a_boundary_every_rank_holds():
    def asker(held: list[set[int]], log: list[list[int]]):
        def ask(cands: list[int]) -> list[int]:
            log.append(cands)
            return [max((c for c in cands if c in h), default=0) for h in held]

        return ask

    log: list[list[int]] = []
    assert common_state_boundary(asker([{16, 48}, {16, 32}], log), ALL, 69) == 16
    assert log == [[16, 32, 48, 64], [16, 32], [16]]
    assert common_state_boundary(asker([{32, 48}, {32, 48}], []), ALL, 69) == 48
    assert common_state_boundary(asker([{32, 48}, set()], []), ALL, 69) == 0
    assert common_state_boundary(asker([{64}], []), ALL, 60) == 0  # 64 is beyond the tokens
    assert common_state_boundary(asker([{16}], []), [], 69) == 0
    log = []  # more candidates than one request carries: windows, longest first
    many = [CHUNK * i for i in range(1, 101)]
    assert common_state_boundary(asker([{16, 32}, {16}], log), many, 1600) == 16
    assert all(len(c) <= MAX_STATE_BOUNDARIES for c in log) and log[0][-1] == 1600
    assert common_state_boundary(lambda c: None, ALL, 69) is None
    assert common_state_boundary(lambda c: [17], ALL, 69) is None  # not a candidate: no answer
    assert common_state_boundary(lambda c: [], ALL, 69) is None


# ------------------------------------------------------------ two ranks, real engines
ENGINE_ID = "state-lookup-test"


@pytest.fixture
def ranks(sock_dir):
    """Two registered engines (tensor-parallel ranks 0 and 1) and a lookup server for each."""
    spec = KVSpec()
    engines = []
    for r in range(2):
        md = LMCacheEngineMetadata("test-model", 2, r, "vllm", spec.dtype, (spec.num_layers, 2, CHUNK, spec.num_heads,
                                   spec.head_size))  # fmt: skip
        engines.append(LMCacheEngineBuilder.get_or_create(instance_id(ENGINE_ID, r), config(), md,
                                                          make_connector(spec, CHUNK)))  # fmt: skip
    socket_dir = str(sock_dir / "socks")

    def state_fn(engine):
        def state(tokens, extras, boundaries):
            allowed = {k: v for k, v in extras.items() if k in KEY_EXTRA_NAMES}
            return state_entries.latest_state(engine, tokens, boundaries, allowed)

        return state

    servers = [
        LookupServer(socket_path(socket_dir, ENGINE_ID, r), lambda t, e: 0, dict, state=state_fn(engines[r]))
        for r in range(2)
    ]
    settings = SimpleNamespace(engine_id=ENGINE_ID, world_size=2, socket_dir=socket_dir, lookup_timeout=2.0)
    try:
        yield SimpleNamespace(engines=engines, servers=servers, settings=settings)
    finally:
        for s in servers:
            s.close()
        for r in range(2):
            LMCacheEngineBuilder.destroy(instance_id(ENGINE_ID, r))


CASES = [  # (states of rank 0, states of rank 1, the longest boundary both hold)
    ([], [], 0),
    ([16, 32, 48], [], 0),
    ([16, 48], [16, 48], 48),
    ([16, 48], [16, 32], 16),  # rank 0 says 48, rank 1 says 32: narrowed twice
    ([32, 48, 64], [16, 32, 64], 64),
    ([32, 48], [16, 32, 64], 32),
    ([48], [16, 32, 64], 0),
]


@pytest.mark.parametrize("held0,held1,expected", CASES)
@pytest.mark.parametrize("over_socket", [False, True])
def test_state_boundary_is_the_longest_boundary_every_rank_holds(ranks, monkeypatch, held0, held1, expected,
                                                                 over_socket):  # fmt: skip
    put(ranks.engines[0], held0)
    put(ranks.engines[1], held1)
    if over_socket:  # "another process": the scheduler sees no engine
        monkeypatch.setattr("lmcache.integration.vllm.scheduler_side.engine_for", lambda *_: None)
    dispatcher = LookupDispatcher(ranks.settings)
    try:
        assert dispatcher.state_boundary(TOKENS, {}, ALL) == expected
        assert dispatcher.state_boundary(TOKENS, {}, [16]) == (16 if 16 in held0 and 16 in held1 else 0)
        assert dispatcher.state_boundary(TOKENS, {"cache_salt": "other"}, ALL) == 0
        assert dispatcher.state_boundary(TOKENS, {}, []) == 0
        assert dispatcher.used_socket == over_socket
    finally:
        dispatcher.close()


@pytest.mark.parametrize("over_socket", [False, True])
def test_state_boundary_with_salts_many_candidates_and_odd_candidates(ranks, monkeypatch, over_socket):
    tokens = list(range(5000, 5000 + 100 * CHUNK))
    for engine in ranks.engines:
        put(engine, [16, 320, 1600], tokens=tokens, extras={"cache_salt": "t"})
    put(ranks.engines[0], [800], tokens=tokens, extras={"cache_salt": "t"})
    if over_socket:
        monkeypatch.setattr("lmcache.integration.vllm.scheduler_side.engine_for", lambda *_: None)
    dispatcher = LookupDispatcher(ranks.settings)
    many = [CHUNK * i for i in range(1, 100)]  # 99 candidates, 1600 not among them: two windows
    try:
        assert dispatcher.state_boundary(tokens, {"cache_salt": "t"}, many) == 320
        assert dispatcher.state_boundary(tokens, {"cache_salt": "t"}, many + [1600]) == 1600
        assert dispatcher.state_boundary(tokens, {"cache_salt": "t"}, [16, 800]) == 16  # only rank 0 holds 800
        assert dispatcher.state_boundary(tokens, {}, many) == 0  # stored under another salt
        # out of range and duplicated candidates are dropped, non-multiples never match
        assert dispatcher.state_boundary(tokens, {"cache_salt": "t"}, [-16, 0, 16, 16, 17, 321, 99999]) == 16
        assert dispatcher.state_boundary(tokens[:300], {"cache_salt": "t"}, [16, 320, 1600]) == 16
    finally:
        dispatcher.close()


def test_a_missing_rank_or_a_timeout_is_no_answer(ranks, sock_dir):
    for engine in ranks.engines:
        put(engine, [32])
    three = SimpleNamespace(**{**vars(ranks.settings), "world_size": 3})  # rank 2 serves nothing
    dispatcher = LookupDispatcher(three)
    try:
        assert dispatcher.state_boundary(TOKENS, {}, ALL) is None
        assert "r2.sock" in (dispatcher.last_error or "")
    finally:
        dispatcher.close()

    ranks.servers[1].close()  # a rank that went away
    client = LookupClient([s.path for s in ranks.servers], timeout=1.0)
    try:
        assert client.state(TOKENS, {}, ALL) is None
    finally:
        client.close()

    gate = threading.Event()
    slow = LookupServer(str(sock_dir / "slow" / "r0.sock"), lambda t, e: 0, dict,
                        state=lambda t, e, b: gate.wait(5) and 0)  # fmt: skip
    client = LookupClient([ranks.servers[0].path, slow.path], timeout=0.3)
    try:
        assert client.state(TOKENS, {}, ALL) is None
        assert "timed out" in (client.last_error or "")
    finally:
        gate.set()
        client.close()
        slow.close()

    old = LookupServer(str(sock_dir / "old" / "r0.sock"), lambda t, e: 0, dict)  # a worker without the op
    client = LookupClient([old.path], timeout=1.0)
    try:
        assert client.state(TOKENS, {}, ALL) is None and "unknown op" in (client.last_error or "")
    finally:
        client.close()
        old.close()


def test_a_rank_answering_something_else_is_no_answer(sock_dir):
    answers = iter([17, True, "16", None, 16])
    server = LookupServer(str(sock_dir / "s" / "r0.sock"), lambda t, e: 0, dict, state=lambda t, e, b: 0)
    server._server._dispatch_state = lambda header, payload: {"state": next(answers)}  # a forged rank
    client = LookupClient([server.path], timeout=1.0)
    try:
        for _ in range(4):
            assert client.state_ranks(TOKENS, {}, ALL) is None
            assert "malformed state reply" in (client.last_error or "")
        assert client.state_ranks(TOKENS, {}, ALL) == [16]
    finally:
        client.close()
        server.close()


def test_hostile_state_requests_get_the_error_answer_and_the_server_keeps_serving(ranks):
    put(ranks.engines[0], [16, 32])
    payload = np.array(TOKENS, dtype="<i4").tobytes()
    n = len(TOKENS)
    bad_headers = [
        {"op": "state", "boundaries": [16] * (MAX_STATE_BOUNDARIES + 1)},  # too many
        {"op": "state", "boundaries": list(range(1, 10_000))},
        {"op": "state", "boundaries": [-16]},
        {"op": "state", "boundaries": [0]},
        {"op": "state", "boundaries": [16, n + 1]},  # beyond the tokens
        {"op": "state", "boundaries": [2**70]},
        {"op": "state", "boundaries": [True]},
        {"op": "state", "boundaries": ["16"]},
        {"op": "state", "boundaries": [16.0]},
        {"op": "state", "boundaries": [None]},
        {"op": "state", "boundaries": [[16]]},
        {"op": "state", "boundaries": {"16": 1}},
        {"op": "state", "boundaries": "16"},
        {"op": "state", "boundaries": 16},
        {"op": "state"},  # no boundaries at all
        {"op": "state", "boundaries": [16], "extras": [["cache_salt", "s"]]},
        {"op": "state", "boundaries": [16], "extras": "s"},
    ]
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    sock.settimeout(5.0)
    sock.connect(ranks.servers[0].path)
    try:
        for header in bad_headers:
            send_frame(sock, header, payload)
            reply, _ = recv_frame(sock)
            assert set(reply) == {"error"}, (header, reply)
        for body in (b"\x01\x02\x03\x04\x05", b""):  # not int32 values; no tokens
            send_frame(sock, {"op": "state", "boundaries": [1]}, body)
            reply, _ = recv_frame(sock)
            assert set(reply) == {"error"}, (body, reply)
        send_frame(sock, {"op": "state", "boundaries": [16, 32, 48], "extras": {"unknown": 1}}, payload)
        assert recv_frame(sock)[0] == {"state": 32}  # same connection, still served
        send_frame(sock, {"op": "state", "boundaries": []}, payload)
        assert recv_frame(sock)[0] == {"state": 0}
    finally:
        sock.close()
    client = LookupClient([ranks.servers[0].path], timeout=1.0)  # a new connection too
    try:
        assert client.state(TOKENS, {}, ALL) == 32
        assert client.state_ranks(TOKENS, {}, [16] * (MAX_STATE_BOUNDARIES + 1)) is None  # refused by the rank
        assert "at most 64" in (client.last_error or "")
        assert client.state(TOKENS, {}, ALL) == 32
    finally:
        client.close()


# ------------------------------------------------------------------ every tier
def test_a_state_survives_in_the_disk_and_redis_tiers(tmp_path, redis_server):
    """A state entry is an ordinary entry: written through to disk and Redis, found and read
    from there by an engine whose CPU tier never held it (another process, a restart)."""
    cfg = {"chunk_size": CHUNK, "max_local_cpu_size": 0.25, "local_disk": str(tmp_path / "disk"),
           "max_local_disk_size": 0.1, "remote_url": redis_server.url}  # fmt: skip
    writer = make_engine(KVSpec(), LMCacheEngineConfig.from_dict(cfg))
    try:
        put(writer, [32])
        assert writer.storage_manager.flush(10)
    finally:
        writer.close()
    for tiers in ({"local_disk": cfg["local_disk"], "max_local_disk_size": 0.1}, {"remote_url": redis_server.url}):
        reader = make_engine(KVSpec(), LMCacheEngineConfig.from_dict({"chunk_size": CHUNK, "max_local_cpu_size": 0.25,
                                                                      **tiers}))  # fmt: skip
        try:
            assert state_entries.latest_state(reader, TOKENS, ALL, {}) == 32
            got = state_entries.get_state(reader, state_entries.boundary_key(reader, TOKENS, 32, {}), ROWS)
            assert got is not None and torch.equal(got, rows(32))
        finally:
            reader.close()
