"""The admin API (``lmcache admin serve``, docs/admin.md) end to end without vLLM: a real
redis-server, a real engine (CPU, disk and remote tiers) serving its lookup socket with a
WorkerAdmin and registered like a vLLM worker, and the FastAPI app through TestClient."""

from __future__ import annotations

import dataclasses
import logging
import os
import shutil
import sys
import tempfile
import threading
from dataclasses import dataclass
from pathlib import Path
from types import SimpleNamespace
from typing import Any, Iterator

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
import torch

pytest.importorskip("fastapi")
pytest.importorskip("httpx")

from fastapi.testclient import TestClient  # noqa: E402

from lmcache.admin.auth import load_token  # noqa: E402
from lmcache.admin.directory import InstanceDirectory  # noqa: E402
from lmcache.admin.remote import RemoteStore  # noqa: E402
from lmcache.admin.server import MAX_BODY_BYTES, create_app  # noqa: E402
from lmcache.admin.service import MAX_TOKENIZERS, AdminService, BadRequest, Tokenizers  # noqa: E402
from lmcache.http_server import ServerLimits  # noqa: E402
from lmcache.integration.vllm.lookup_service import LookupServer  # noqa: E402
from lmcache.integration.vllm.naming import engine_digest, socket_path  # noqa: E402
from lmcache.integration.vllm.registration import Registration, instances_prefix, make_record  # noqa: E402
from lmcache.integration.vllm.worker_admin import MAX_ACTIVE_PINS, MAX_PIN_TTL_S, WorkerAdmin  # noqa: E402
from lmcache.v1.config import LMCacheEngineConfig  # noqa: E402
from lmcache.v1.testing import KVSpec, make_engine, random_kv_caches  # noqa: E402

CHUNK = 16
ENGINE_ID = "admin-test-engine"
MODEL_DIR = Path(__file__).resolve().parents[2] / "models" / "smollm2-135m"
TOKEN = "t0ken-for-the-admin-api-tests"
AUTH = {"Authorization": f"Bearer {TOKEN}"}
BASE_URL = "http://127.0.0.1:8100"


def admin_client(service: AdminService, **kwargs: Any) -> TestClient:
    """TestClient of the whole admin app (guard, body limit, routes), sending the token."""
    return TestClient(create_app(service, TOKEN, **kwargs), base_url=BASE_URL, headers=AUTH)


@dataclass
class World:
    engine: Any
    admin: WorkerAdmin
    server: LookupServer
    registration: Registration
    service: AdminService
    client: TestClient
    redis: Any
    kv: list[torch.Tensor]
    unpinned: list[str]
    unpin_event: threading.Event

    def store(self, tokens: list[int]) -> None:
        slots = torch.arange(len(tokens), dtype=torch.int64)
        self.engine.store(tokens, kvcaches=self.kv, slot_mapping=slots)
        assert self.engine.storage_manager.flush(10)

    def lookup(self, **body: Any) -> dict[str, Any]:
        res = self.client.post("/lookup", json=body)
        assert res.status_code == 200, res.text
        (inst,) = [i for i in res.json()["instances"] if i["instance"] == ENGINE_ID]
        return inst


@pytest.fixture
def world(redis_server, tmp_path) -> Iterator[World]:
    spec = KVSpec(num_blocks=64, block_size=16)
    config = LMCacheEngineConfig.from_dict({
        "chunk_size": CHUNK, "max_local_cpu_size": 0.05, "local_disk": str(tmp_path / "disk"),
        "max_local_disk_size": 0.05, "remote_url": redis_server.url, "model_namespace": "admin-model",
    })
    engine = make_engine(spec, config, model_name="admin-model")
    base = tempfile.mkdtemp(prefix="lmca")  # unix socket paths must stay short
    sock_dir = os.path.join(base, "s")
    unpinned: list[str] = []
    event = threading.Event()

    def on_unpin(pin_id: str) -> None:
        unpinned.append(pin_id)
        event.set()

    admin = WorkerAdmin(engine, on_unpin=on_unpin)
    server = LookupServer(socket_path(sock_dir, ENGINE_ID, 0), lambda t, e: engine.lookup(t), lambda: {}, admin=admin)
    record = make_record(engine, engine_id=ENGINE_ID, model=str(MODEL_DIR), tokenizer=str(MODEL_DIR), world_size=1,
                         socket_dir=sock_dir, sockets=[server.path])
    assert record is not None
    registration = Registration(config, record)
    assert registration.written.wait(10)
    remote = RemoteStore(redis_server.url)
    service = AdminService(InstanceDirectory(remote, sock_dir))
    w = World(engine, admin, server, registration, service, admin_client(service), redis_server.client(),
              random_kv_caches(spec, seed=3), unpinned, event)
    try:
        yield w
    finally:
        registration.close()
        server.close()
        admin.close()
        remote.close()
        engine.close()
        shutil.rmtree(base, ignore_errors=True)


def tokens_of(n: int, start: int = 1000) -> list[int]:
    return list(range(start, start + n))


# ----------------------------------------------------------------------------- lookup
def test_lookup_reports_each_tier(world: World) -> None:
    tokens = tokens_of(4 * CHUNK)
    world.store(tokens)
    got = world.lookup(tokens=tokens + [7] * CHUNK)
    assert got["tiers"] == {"cpu": 64, "disk": 64, "remote": 64}
    assert got["cached_tokens"] == 64 and got["num_tokens"] == 80 and "error" not in got
    # drop chunk 2 from the CPU tier only: the tiers now answer differently
    key = world.engine.keys(tokens)[2]
    assert world.engine.storage_manager.local_cpu.remove(key)
    assert world.lookup(tokens=tokens)["tiers"] == {"cpu": 32, "disk": 64, "remote": 64}
    assert world.lookup(tokens=tokens_of(64, start=5000))["tiers"] == {"cpu": 0, "disk": 0, "remote": 0}


def test_lookup_tokenizes_a_prompt_with_the_instance_tokenizer(world: World) -> None:
    transformers = pytest.importorskip("transformers")
    if not MODEL_DIR.is_dir():
        pytest.skip(f"{MODEL_DIR} missing")
    prompt = "The admin API tokenizes this prompt like the serving instance does. " * 6
    ids = transformers.AutoTokenizer.from_pretrained(str(MODEL_DIR), local_files_only=True)(prompt)["input_ids"]
    world.store(ids)
    got = world.lookup(prompt=prompt, model=str(MODEL_DIR))
    whole = len(ids) // CHUNK * CHUNK
    assert got["num_tokens"] == len(ids)
    assert got["tiers"] == {"cpu": whole, "disk": whole, "remote": whole}
    # another model's filter selects nothing
    res = world.client.post("/lookup", json={"prompt": prompt, "model": "other/model"})
    assert res.status_code == 200 and res.json()["instances"] == []


# ----------------------------------------------------------------------------- clear
def test_clear_local_then_remote(world: World) -> None:
    tokens = tokens_of(3 * CHUNK)
    world.store(tokens)
    res = world.client.post("/clear", json={"instance": ENGINE_ID})
    assert res.status_code == 200, res.text
    (cleared,) = res.json()["instances"]
    assert cleared["ranks"] == [{"pinned_kept": 0, "cpu_removed": 3, "disk_removed": 3}]
    assert world.lookup(tokens=tokens)["tiers"] == {"cpu": 0, "disk": 0, "remote": 48}
    res = world.client.post("/clear", json={"instance": ENGINE_ID, "local": False, "remote": True})
    assert res.status_code == 200 and res.json()["remote_deleted"] == 3
    assert world.lookup(tokens=tokens)["tiers"] == {"cpu": 0, "disk": 0, "remote": 0}
    # the registration is not an entry: it survives a remote clear
    assert world.redis.exists(instances_prefix("lmcache") + ENGINE_ID)


def test_clear_all_remote_keeps_other_prefixes(world: World) -> None:
    world.store(tokens_of(2 * CHUNK))
    world.redis.set("unrelated:key", b"x")
    res = world.client.post("/clear", json={"local": False, "remote": True})
    assert res.status_code == 200 and res.json()["remote_deleted"] == 2
    assert world.redis.get("unrelated:key") == b"x"


# ----------------------------------------------------------------------------- pin
def test_pin_holds_chunks_until_the_ttl(world: World) -> None:
    tokens = tokens_of(4 * CHUNK)
    world.store(tokens)
    keys = world.engine.keys(tokens)
    cpu = world.engine.storage_manager.local_cpu
    res = world.client.post("/pin", json={"instance": ENGINE_ID, "tokens": tokens, "ttl": 0.3})
    assert res.status_code == 200, res.text
    body = res.json()
    assert body["pinned_tokens"] == 64 and len(body["pin_ids"]) == 1
    assert [cpu.pin_count(k) for k in keys] == [1, 1, 1, 1]
    # a local clear keeps pinned entries
    cleared = world.client.post("/clear", json={"instance": ENGINE_ID}).json()["instances"][0]["ranks"][0]
    assert cleared["pinned_kept"] == 4 and cleared["cpu_removed"] == 0
    assert world.unpin_event.wait(10)
    assert world.unpinned == body["pin_ids"]
    assert [cpu.pin_count(k) for k in keys] == [0, 0, 0, 0]


def test_pin_unknown_instance_is_404(world: World) -> None:
    res = world.client.post("/pin", json={"instance": "nope", "tokens": [1], "ttl": 1})
    assert res.status_code == 404 and "instance" in res.json()["error"]


# ----------------------------------------------------------------------------- validation
@pytest.mark.parametrize(
    "route, body, field",
    [
        ("/lookup", {"tokens": "abc"}, "tokens"),
        ("/lookup", {"tokens": [1, -1]}, "tokens.1"),
        ("/lookup", {"tokens": [1, 2**31]}, "tokens.1"),
        ("/lookup", {"tokens": [1.5]}, "tokens.0"),
        ("/lookup", {"tokens": [1], "prompt": "x"}, "prompt, tokens"),
        ("/lookup", {}, "prompt, tokens"),
        ("/lookup", {"prompt": 3}, "prompt"),
        ("/lookup", {"tokens": [1], "bogus": 1}, "bogus"),
        ("/lookup", {"tokens": [1], "model": ""}, "model"),
        ("/clear", {"remote": "yes"}, "remote"),
        ("/clear", {"local": False}, "local, remote"),
        ("/pin", {"instance": ENGINE_ID, "tokens": [1], "ttl": -1}, "ttl"),
        ("/pin", {"instance": ENGINE_ID, "tokens": [1], "ttl": 10**9}, "ttl"),
        ("/pin", {"tokens": [1], "ttl": 1}, "instance"),
        ("/pin", {"instance": ENGINE_ID, "tokens": [1], "ttl": "5"}, "ttl"),
    ],
)
def test_bad_fields_are_422_naming_the_field(world: World, route: str, body: dict, field: str) -> None:
    res = world.client.post(route, json=body)
    assert res.status_code == 422, res.text
    assert field in res.json()["error"]


def test_too_many_tokens_and_bad_json(world: World) -> None:
    res = world.client.post("/lookup", json={"tokens": [0] * 1_000_001})
    assert res.status_code == 422 and "tokens" in res.json()["error"]
    res = world.client.post("/lookup", content=b"{not json", headers={"content-type": "application/json"})
    assert res.status_code == 422


def test_prompt_for_an_unregistered_instance_is_an_error_not_a_guess(world: World) -> None:
    world.registration.close()
    got = world.client.post("/lookup", json={"prompt": "hello"}).json()["instances"]
    (local,) = got
    assert local["instance"] == f"local-{engine_digest(ENGINE_ID)}" and "send tokens" in local["error"]


# ----------------------------------------------------------------------------- auth
def test_token_is_required_on_every_route_but_health(world: World) -> None:
    client = TestClient(create_app(world.service, TOKEN), base_url=BASE_URL)
    health = client.get("/health")
    assert health.status_code == 200 and health.json() == {"status": "ok"}  # nothing else: no version, no paths
    for headers in ({}, {"Authorization": "Bearer wrong-token-of-some-length"}, {"Authorization": TOKEN}):
        res = client.get("/instances", headers=headers)
        assert res.status_code == 401 and res.headers["www-authenticate"] == "Bearer"
        assert client.post("/lookup", json={"tokens": [1]}, headers=headers).status_code == 401
        assert client.post("/clear", content=b"{bad", headers=headers).status_code == 401
        assert client.post("/unpin", json={"instance": ENGINE_ID}, headers=headers).status_code == 401
    assert client.get("/instances", headers=AUTH).status_code == 200


def test_token_file_and_env_are_checked(tmp_path: Path) -> None:
    token_file = tmp_path / "token"
    token_file.write_text(TOKEN + "\n")
    token_file.chmod(0o644)
    with pytest.raises(ValueError, match="readable by group or others"):
        load_token(str(token_file))
    token_file.chmod(0o600)
    assert load_token(str(token_file)) == TOKEN
    with pytest.raises(ValueError, match="at least"):
        load_token(None, {"LMCACHE_ADMIN_TOKEN": "short"})


# ----------------------------------------------------------------------------- registration
def test_registration_appears_and_disappears(world: World) -> None:
    key = instances_prefix("lmcache") + ENGINE_ID
    assert 0 < world.redis.ttl(key) <= 30
    (inst,) = world.client.get("/instances").json()["instances"]
    assert inst["id"] == ENGINE_ID and inst["registered"] and inst["local"]
    assert inst["namespace"] == "admin-model" and inst["chunk_size"] == CHUNK
    assert inst["tiers"] == ["cpu", "disk", "remote"] and inst["sockets"] == [world.server.path]
    assert "remote_url" not in str(inst) and "redis://" not in str(inst)
    assert world.redis.zrange("lmcache:instances", 0, -1) == [ENGINE_ID.encode()]
    world.registration.close()
    assert not world.redis.exists(key) and not world.redis.exists("lmcache:instances")
    (inst,) = world.client.get("/instances").json()["instances"]
    assert inst["id"] == f"local-{engine_digest(ENGINE_ID)}" and not inst["registered"]


def test_vllm_worker_registers_serves_the_admin_ops_and_unregisters(redis_server) -> None:
    """The adapter's worker side (driven like vLLM drives it) registers rank 0 and serves
    the admin ops on its lookup socket; closing it deletes the registration."""
    from tests.vllm_adapter.test_vllm_connector_unit import CHUNK as UNIT_CHUNK
    from tests.vllm_adapter.test_vllm_connector_unit import FakeRequest, MiniVLLM, fake_vllm_config, prompt

    base = tempfile.mkdtemp(prefix="lmca")
    remote = RemoteStore(redis_server.url)
    mini = MiniVLLM(fake_vllm_config(tmp=os.path.join(base, "s"), extra={"lmcache.remote_url": redis_server.url}))
    try:
        registration = mini.worker._registration
        assert registration is not None and registration.written.wait(10)
        engine_id = mini.worker.settings.engine_id
        tokens = prompt(3 * UNIT_CHUNK + 5, seed=7)
        mini.serve(FakeRequest("r1", tokens))
        assert mini.engine.storage_manager.flush(10)
        client = admin_client(AdminService(InstanceDirectory(remote, os.path.join(base, "s"))))
        (inst,) = client.post("/lookup", json={"tokens": tokens}).json()["instances"]
        assert inst["instance"] == engine_id
        assert inst["tiers"] == {"cpu": 3 * UNIT_CHUNK, "remote": 3 * UNIT_CHUNK}
        res = client.post("/pin", json={"instance": engine_id, "tokens": tokens, "ttl": 60}).json()
        assert res["pinned_tokens"] == 3 * UNIT_CHUNK
    finally:
        mini.close()  # also releases the pins still held
        remote.close()
        shutil.rmtree(base, ignore_errors=True)
    assert not redis_server.client().exists(instances_prefix("lmcache") + engine_id)


def test_body_size_is_bounded_also_when_chunked(world: World) -> None:
    client = admin_client(world.service, limits=ServerLimits(max_body_bytes=32))
    res = client.post("/lookup", json={"tokens": list(range(100))})
    assert res.status_code == 413 and "body" in res.json()["error"]
    res = client.post("/lookup", content=iter([b'{"tokens": [', b"1, " * 40, b"1]}"]))  # no Content-Length
    assert res.status_code == 413 and "body" in res.json()["error"]
    assert client.post("/lookup", json={"tokens": [1]}).status_code == 200


# ----------------------------------------------------------------------------- pin limits, unpin
def pin(world: World, tokens: list[int], ttl: float = 600) -> dict[str, Any]:
    res = world.client.post("/pin", json={"instance": ENGINE_ID, "tokens": tokens, "ttl": ttl})
    assert res.status_code == 200, res.text
    return res.json()


def test_pins_are_bounded_in_time_and_count(world: World) -> None:
    assert (MAX_PIN_TTL_S, MAX_ACTIVE_PINS) == (3600.0, 256)
    res = world.client.post("/pin", json={"instance": ENGINE_ID, "tokens": [1], "ttl": MAX_PIN_TTL_S + 1})
    assert res.status_code == 422 and "ttl" in res.json()["error"]
    tokens = tokens_of(2 * CHUNK)
    world.store(tokens)
    ids = [pin(world, tokens)["pin_ids"][0] for _ in range(MAX_ACTIVE_PINS)]
    assert world.admin.active_pins == MAX_ACTIVE_PINS
    res = world.client.post("/pin", json={"instance": ENGINE_ID, "tokens": tokens, "ttl": 5})
    assert res.status_code == 429 and "pins already held" in res.json()["error"], res.text
    assert world.admin.active_pins == MAX_ACTIVE_PINS  # the refused pin holds nothing
    res = world.client.post("/unpin", json={"instance": ENGINE_ID, "pin_ids": ids[:1]})
    assert res.status_code == 200 and res.json()["unpinned"] == ids[:1]
    pin(world, tokens)  # room again
    res = world.client.post("/unpin", json={"instance": ENGINE_ID})
    assert len(res.json()["unpinned"]) == MAX_ACTIVE_PINS and world.admin.active_pins == 0
    assert [world.engine.storage_manager.local_cpu.pin_count(k) for k in world.engine.keys(tokens)] == [0, 0]


def test_unpin_by_id_and_all(world: World) -> None:
    tokens = tokens_of(4 * CHUNK)
    world.store(tokens)
    cpu = world.engine.storage_manager.local_cpu
    keys = world.engine.keys(tokens)
    first, second = pin(world, tokens), pin(world, tokens[: 2 * CHUNK])
    assert [cpu.pin_count(k) for k in keys] == [2, 2, 1, 1]
    res = world.client.post("/unpin", json={"instance": ENGINE_ID, "pin_ids": first["pin_ids"]})
    assert res.status_code == 200, res.text
    assert res.json() == {"instance": ENGINE_ID, "unpinned": first["pin_ids"], "unknown": []}
    assert [cpu.pin_count(k) for k in keys] == [1, 1, 0, 0]
    res = world.client.post("/unpin", json={"instance": ENGINE_ID, "pin_ids": first["pin_ids"]})  # idempotent
    assert res.json() == {"instance": ENGINE_ID, "unpinned": [], "unknown": first["pin_ids"]}
    res = world.client.post("/unpin", json={"instance": ENGINE_ID})
    assert res.json()["unpinned"] == second["pin_ids"] and world.admin.active_pins == 0
    assert [cpu.pin_count(k) for k in keys] == [0, 0, 0, 0]
    assert world.unpinned == []  # released early: the expiry thread has nothing left to do for them
    for bad in ("admin-pin-xyz", f"x{first['pin_ids'][0]}", f"{first['pin_ids'][0]}\n"):
        res = world.client.post("/unpin", json={"instance": ENGINE_ID, "pin_ids": [bad]})
        assert res.status_code == 422 and "pin_ids.0" in res.json()["error"], bad
    res = world.client.post("/unpin", json={"instance": "nope"})
    assert res.status_code == 404 and "instance" in res.json()["error"]


def test_clear_can_drop_admin_pins(world: World) -> None:
    tokens = tokens_of(4 * CHUNK)
    world.store(tokens)
    pin(world, tokens)
    (kept,) = world.client.post("/clear", json={"instance": ENGINE_ID}).json()["instances"][0]["ranks"]
    assert kept["pinned_kept"] == 4 and kept["cpu_removed"] == 0 and "unpinned" not in kept
    res = world.client.post("/clear", json={"instance": ENGINE_ID, "unpin": True})
    assert res.status_code == 200, res.text
    (cleared,) = res.json()["instances"][0]["ranks"]
    assert cleared["unpinned"] == 1 and cleared["pinned_kept"] == 0 and cleared["cpu_removed"] == 4
    assert world.admin.active_pins == 0 and world.lookup(tokens=tokens)["tiers"]["cpu"] == 0
    res = world.client.post("/clear", json={"local": False, "remote": True, "unpin": True})
    assert res.status_code == 422 and "unpin" in res.json()["error"]


# ----------------------------------------------------------------------------- forged records
def forge(world: World, engine_id: str, **changes: Any) -> None:
    """Write a registration like an instance would, with ``changes`` (what a forger controls)."""
    record = dataclasses.replace(world.registration.record, engine_id=engine_id, **changes)
    world.redis.set(instances_prefix("lmcache") + engine_id, record.to_json())
    world.redis.zadd("lmcache:instances", {engine_id: 1.0})


def test_a_record_with_another_entry_prefix_cannot_redirect_a_remote_clear(world: World, caplog) -> None:
    tokens = tokens_of(3 * CHUNK)
    world.store(tokens)
    theirs = [k.replace(b"lmcache:", b"tenant2:", 1) for k in world.redis.scan_iter("lmcache:v1:kv:*")]
    assert len(theirs) == 3
    for key in theirs:
        world.redis.set(key, b"another tenant's entry")
    forge(world, "forged-prefix", remote_entry_prefix="tenant2:v1:kv:")
    forge(world, "forged-prefix-2", remote_entry_prefix="tenant2:v1:kv:")
    with caplog.at_level(logging.WARNING, logger="lmcache.admin.directory"):
        listed = world.client.get("/instances").json()
        world.client.get("/instances")
    assert [i["id"] for i in listed["instances"]] == [ENGINE_ID]
    assert [e.split(":")[0] for e in listed["errors"]] == ["instance record 'forged-prefix'",
                                                           "instance record 'forged-prefix-2'"]
    assert all("tenant2:v1:kv:" in e and "--key-prefix lmcache" in e for e in listed["errors"])
    assert len([r for r in caplog.records if "skipping instance record" in r.getMessage()]) == 1  # logged once
    res = world.client.post("/clear", json={"instance": "forged-prefix", "local": False, "remote": True})
    assert res.status_code == 404, res.text
    assert all(world.redis.get(k) == b"another tenant's entry" for k in theirs)
    assert world.lookup(tokens=tokens)["tiers"]["remote"] == 3 * CHUNK  # the real instance is still served


def test_a_record_with_sockets_outside_the_socket_dir_is_skipped(world: World) -> None:
    """A record naming live sockets of ours elsewhere must not make the service talk to them."""
    other = tempfile.mkdtemp(prefix="lmco")
    elsewhere = LookupServer(socket_path(os.path.join(other, "s"), "forged-sockets", 0),
                             lambda t, e: world.engine.lookup(t), lambda: {}, admin=world.admin)
    try:
        forge(world, "forged-sockets", sockets=[elsewhere.path])
        listed = world.client.get("/instances").json()
        assert [i["id"] for i in listed["instances"]] == [ENGINE_ID]
        assert any("forged-sockets" in e and "outside this service's socket directory" in e for e in listed["errors"])
        res = world.client.post("/pin", json={"instance": "forged-sockets", "tokens": [1], "ttl": 5})
        assert res.status_code == 404 and world.admin.active_pins == 0
    finally:
        elsewhere.close()
        shutil.rmtree(other, ignore_errors=True)


def test_tokenizers_are_local_directories_only_and_bounded(tmp_path: Path, monkeypatch) -> None:
    loaded: list[str] = []

    class FakeAutoTokenizer:
        @staticmethod
        def from_pretrained(path: str, **kwargs: Any) -> Any:
            assert kwargs.get("local_files_only") is True
            loaded.append(path)
            return lambda text: {"input_ids": [len(text)]}

    monkeypatch.setitem(sys.modules, "transformers", SimpleNamespace(AutoTokenizer=FakeAutoTokenizer))
    toks = Tokenizers()
    for name in ("gpt2", "org/model", "relative/dir", str(tmp_path / "missing")):
        with pytest.raises(BadRequest, match="not a local directory"):
            toks.encode(name, "hello")
    assert loaded == []
    dirs = []
    for i in range(MAX_TOKENIZERS + 12):
        (tmp_path / f"m{i}").mkdir()
        dirs.append(str(tmp_path / f"m{i}"))
        assert toks.encode(dirs[-1], "hello") == [5]
        assert len(toks) <= MAX_TOKENIZERS
    assert len(loaded) == MAX_TOKENIZERS + 12
    toks.encode(dirs[-1], "again")  # the most recent ones stay loaded
    assert len(loaded) == MAX_TOKENIZERS + 12


def test_remote_clear_and_registrations_on_a_cluster(redis_cluster) -> None:
    """SCAN every primary, DEL each key on its own node, records read across nodes."""
    client = redis_cluster.client()
    for i in range(40):
        client.set(f"lmcache:v1:kv:m@1@0@{i:032x}@float32", b"x")
    client.set("lmcache:instances:e1", b'{"engine_id": "e1"}')
    client.zadd("lmcache:instances", {"e1": 1.0, "gone": 2.0})
    client.set("other:key", b"y")
    store = RemoteStore(redis_cluster.url)
    try:
        assert store.delete_matching("lmcache:v1:kv:*") == 40
        left = sorted(k.decode() for b in store.conn.scan_keys("*") for k in b)
        assert left == ["lmcache:instances", "lmcache:instances:e1", "other:key"]
        assert store.records() == []  # a record missing its fields is skipped (logged), not half-read
        assert client.zrange("lmcache:instances", 0, -1) == [b"e1"]  # "gone" has no record: dropped
    finally:
        store.close()


_JSON = st.recursive(
    st.none() | st.booleans() | st.integers(-(2**70), 2**70) | st.floats(allow_nan=False, allow_infinity=False)
    | st.text(max_size=8),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8), inner, max_size=4),
    max_leaves=10,
)
_VALUES = {
    "tokens": st.lists(st.integers(0, 2**31 - 1), max_size=3 * CHUNK) | _JSON,
    "prompt": st.text(max_size=40) | _JSON,
    "model": st.sampled_from([str(MODEL_DIR), "admin-model"]) | _JSON,
    "instance": st.sampled_from([ENGINE_ID, "nope"]) | _JSON,
    "ttl": st.floats(0.001, 2 * MAX_PIN_TTL_S, allow_nan=False) | _JSON,
    "local": st.booleans() | _JSON,
    "remote": st.booleans() | _JSON,
    "unpin": st.booleans() | _JSON,
    "pin_ids": st.lists(st.from_regex(r"admin-pin-[0-9a-f]{32}", fullmatch=True), max_size=3) | _JSON,
    "x": _JSON,
}
_BODIES = st.one_of(
    _JSON,
    st.fixed_dictionaries({}, optional=_VALUES),
    st.dictionaries(st.sampled_from(sorted(_VALUES)), _JSON, max_size=4),
)
_ROUTES = ["/lookup", "/pin", "/unpin", "/clear"]


def check_answer(route: str, res: Any) -> None:
    """A 4xx with a JSON error, or a 200 of the route's shape; never a 5xx or the token."""
    assert res.status_code in (200, 400, 404, 413, 422, 429), (res.status_code, res.text)
    assert TOKEN not in res.text
    body = res.json()
    if res.status_code != 200:
        assert isinstance(body["error"], str) and body["error"]
        return
    if route in ("/lookup", "/clear"):
        assert isinstance(body["instances"], list) and isinstance(body["errors"], list)
    elif route == "/pin":
        assert body["instance"] == ENGINE_ID and all(p.startswith("admin-pin-") for p in body["pin_ids"])
    else:
        assert body["instance"] == ENGINE_ID and isinstance(body["unpinned"], list)


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(route=st.sampled_from(_ROUTES), body=_BODIES)
def test_fuzz_json_bodies_get_an_answer_never_a_server_error(world: World, route: str, body: Any) -> None:
    check_answer(route, world.client.post(route, json=body))


@settings(max_examples=100, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(route=st.sampled_from(_ROUTES), raw=st.binary(max_size=512) | st.text(max_size=200).map(str.encode))
def test_fuzz_raw_bytes_get_an_answer_never_a_server_error(world: World, route: str, raw: bytes) -> None:
    check_answer(route, world.client.post(route, content=raw))


@settings(max_examples=8, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(route=st.sampled_from(_ROUTES),
       size=st.sampled_from([MAX_BODY_BYTES - 1, MAX_BODY_BYTES, MAX_BODY_BYTES + 1])
       | st.integers(1 << 20, MAX_BODY_BYTES),
       item=st.sampled_from([b"1", b"-1", b'"a"', b"[]", b"{}"]),
       key=st.sampled_from([b"tokens", b"pin_ids", b"prompt", b"x"]))  # fmt: skip
def test_fuzz_bodies_of_any_size_up_to_the_limit(world: World, route: str, size: int, item: bytes,
                                                 key: bytes) -> None:
    """Big bodies (a million bad token ids, a huge unknown field) are one bounded 4xx, never a 5xx."""
    head, tail = b'{"' + key + b'": [', b"]}"
    count = max(1, (size - len(head) - len(tail)) // (len(item) + 1))
    raw = (head + b",".join([item] * count) + tail).ljust(size)
    res = world.client.post(route, content=raw)
    check_answer(route, res)
    if len(raw) > MAX_BODY_BYTES:
        assert res.status_code == 413
    elif not (route == "/lookup" and key == b"tokens" and item == b"1"):  # up to a million valid ids: answered
        assert res.status_code == 422
    assert len(res.content) < 10_000
