"""Lazy store (``lazy_store``): a request's KV, prompt and answer, is stored once after it
finished (vLLM holds its blocks until the worker reports the store), never in the steps
that compute it. Driven like vLLM drives the connector (``MiniVLLM``)."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from lmcache.integration.vllm.connector_metadata import SaveSpec
from lmcache.v1.config import ConfigError, LMCacheEngineConfig
from tests.vllm_adapter.test_vllm_connector_unit import (
    BLOCK,
    CHUNK,
    FakeRequest,
    MiniVLLM,
    _hermetic_env,  # noqa: F401 - autouse fixture
    fake_vllm_config,
    planner,
    prompt,
)


@pytest.fixture(params=[False, True], ids=["bulk", "layerwise"])
def lazy_mini(request, tmp_path):
    extra = {"lmcache.lazy_store": True, "lmcache.use_layerwise": request.param}
    m = MiniVLLM(fake_vllm_config(extra=extra, tmp=str(tmp_path)))
    yield m
    m.close()


def cached(m: MiniVLLM, tokens: list[int]) -> int:
    return m.engine.lookup(np.asarray(tokens, dtype=np.int32))


def test_a_finished_request_is_stored_once_in_the_next_step(lazy_mini):
    m = lazy_mini
    a = FakeRequest("a", prompt(5 * CHUNK + 3, seed=1))
    m.serve(a)
    assert not any(r.save is not None for step in m.step_log for r in step["meta"].requests)
    assert cached(m, a.prompt_token_ids) == 0  # nothing stored while it ran
    assert "a" in m.held  # vLLM keeps its blocks

    m.step_log.clear()
    m.idle_step()
    (store,) = m.step_log[0]["meta"].requests
    unit = BLOCK if not m.layerwise else CHUNK  # block-granular reuse is a bulk-path feature
    end = (5 * CHUNK + 3) // unit * unit
    assert store.finished_store and store.save == SaveSpec(0, end)
    assert "a" not in m.held  # reported: vLLM freed the blocks
    assert cached(m, a.prompt_token_ids) == end

    again = FakeRequest("a2", list(a.prompt_token_ids))
    res = m.serve(again)
    assert res["external"] == end and not res["errors"]
    m.assert_kv_correct(again, res["blocks"])
    snap = m.scheduler.scheduler.snapshot()
    assert snap["scheduler_lazy_stores"] >= 1 and snap["scheduler_planned_saves"] == 0


def test_the_answer_is_stored_too_so_the_next_turn_reuses_it(lazy_mini):
    m = lazy_mini
    turn1 = FakeRequest("t1", prompt(3 * CHUNK, seed=2), output=prompt(CHUNK + 5, seed=3))
    m.serve(turn1)  # the fake forward computes prompt and answer tokens
    m.idle_step()
    turn2 = FakeRequest("t2", turn1.all_token_ids + prompt(20, seed=4))
    res = m.serve(turn2)
    assert res["external"] == 4 * CHUNK  # the answer's whole chunk too, not only the first prompt
    m.assert_kv_correct(turn2, res["blocks"])


def test_a_step_with_a_forward_stores_finished_requests_too(lazy_mini):
    m = lazy_mini
    a = FakeRequest("a", prompt(2 * CHUNK, seed=5))
    m.serve(a)
    m.serve(FakeRequest("b", prompt(CHUNK + 1, seed=6)))  # its first step stores a
    assert "a" not in m.held and "b" in m.held
    assert cached(m, a.prompt_token_ids) == 2 * CHUNK


def test_nothing_planned_without_a_whole_unit_unknown_or_still_loading():
    p = planner(lazy_store=True)
    short = FakeRequest("s", prompt(CHUNK - 1, seed=7), num_computed_tokens=CHUNK - 1)
    p.offer(short, 0, 0)
    p.on_alloc(short, 0)
    assert not p.defer_store(short)  # less than a chunk (no block reuse configured here)
    assert not p.defer_store(FakeRequest("unknown", prompt(40, seed=8), num_computed_tokens=40))
    waiting = FakeRequest("w", prompt(40, seed=9), num_computed_tokens=0)
    p.offer(waiting, 0, 32)
    p.track(waiting).async_waiting = True
    assert not p.defer_store(waiting)
    assert p.build(type("SO", (), {"scheduled_new_reqs": [], "num_scheduled_tokens": {},
                                   "scheduled_cached_reqs": type("C", (), {"req_ids": []})()})()) == []  # fmt: skip


@settings(max_examples=200, deadline=None)
@given(
    prompt_len=st.integers(1, 200),
    output_len=st.integers(0, 60),
    hit_chunks=st.integers(0, 12),
    reuse=st.booleans(),
    unfull=st.booleans(),
)
def test_the_finished_store_covers_computed_tokens_in_whole_units(prompt_len, output_len, hit_chunks, reuse, unfull):
    p = planner(lazy_store=True, reuse_block_size=BLOCK if reuse else None, save_unfull_chunk=unfull)
    req = FakeRequest("r", prompt(prompt_len, seed=prompt_len), output=prompt(output_len, seed=output_len + 1))
    computed = prompt_len + output_len - (1 if output_len else 0)  # the last sampled token has no KV
    req.num_computed_tokens = computed
    p.offer(req, 0, 0)
    tracker = p.track(req)
    tracker.num_hit = min(hit_chunks * CHUNK, prompt_len)
    tracker.block_ids = [list(range(100, 100 + -(-(prompt_len + output_len) // BLOCK)))]
    planned = p.defer_store(req)
    out = p.build(type("SO", (), {"scheduled_new_reqs": [], "num_scheduled_tokens": {},
                                  "scheduled_cached_reqs": type("C", (), {"req_ids": []})()})())  # fmt: skip
    assert len(out) == int(planned)
    if not planned:
        return
    (meta,) = out
    s = meta.save
    unit = 1 if unfull else (BLOCK if reuse else CHUNK)
    assert s.end == computed - computed % unit and s.skip % CHUNK == 0 and s.skip < s.end
    assert s.skip <= tracker.num_hit
    assert meta.token_ids.tolist() == req.all_token_ids[: s.end]
    assert meta.slot_mapping.tolist() == [100 * BLOCK + i for i in range(s.end)]


@pytest.mark.parametrize("other", ["enable_pd", "enable_blending"])
def test_lazy_store_refuses_pd_and_blending(other):
    kw = {"remote_url": "redis://127.0.0.1:1", "pd_secret": "x" * 40} if other == "enable_pd" else {}
    with pytest.raises(ConfigError, match=f"lazy_store=True with {other}=True"):
        LMCacheEngineConfig(lazy_store=True, **{other: True}, **kw).validate()


def test_a_failed_store_is_a_miss_and_still_frees_the_blocks(lazy_mini, monkeypatch, caplog):
    m = lazy_mini
    a = FakeRequest("a", prompt(3 * CHUNK, seed=10))
    m.serve(a)

    def broken(*args, **kwargs):
        raise OSError("tier failed")

    monkeypatch.setattr(m.engine, "store", broken)
    m.idle_step()
    assert "a" not in m.held  # reported anyway: vLLM frees the blocks
    assert cached(m, a.prompt_token_ids) == 0
    assert "save of a failed" in caplog.text
