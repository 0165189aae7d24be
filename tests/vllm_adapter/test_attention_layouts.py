"""All-sliding-window models: the planner never reads or writes KV through freed blocks.

vLLM frees the blocks of tokens that left the window of every future query
(``remove_skipped_blocks``, before a step's allocation) and admits a request with cached
tokens by padding the out-of-window part of its prefix with null blocks. A connector that
stores a chunk through block ids it saw in earlier steps, or loads into null blocks,
serves another request's KV. :class:`SlidingWindowVLLM` below replays vLLM's block rules
for one request (freed blocks go straight to the next request, like a small pool) and
checks every slot the planner hands the worker.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from types import SimpleNamespace

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from lmcache.integration.vllm.kv_groups import (
    KVGroups,
    UnsupportedModelError,
    WindowRule,
    read_kv_groups,
    refuse_unsupported_model,
)
from lmcache.integration.vllm.request_tracker import PlannerConfig, RequestPlanner

from .test_vllm_connector_unit import FakeRequest, sched_output

NULL_BLOCK = 0


# ============================================================================ the rule
@given(window=st.integers(1, 300), block=st.sampled_from([1, 2, 8, 16, 32]), n=st.integers(0, 2000))
def test_live_start_is_vllms_skipped_blocks(window, block, n):
    rule = WindowRule(window, block)
    skipped_tokens = max(0, n - window + 1)  # vLLM: SlidingWindowManager.get_num_skipped_tokens
    assert rule.live_start(n) == (skipped_tokens // block) * block


@given(window=st.integers(1, 300), block=st.sampled_from([1, 2, 8, 16, 32]))
def test_max_admitted_is_the_longest_prefix_without_null_blocks(window, block):
    rule = WindowRule(window, block)
    assert rule.live_start(rule.max_admitted) == 0
    assert rule.live_start(rule.max_admitted + 1) > 0


def test_window_rule_rejects_nonsense():
    with pytest.raises(ValueError, match="window=0"):
        WindowRule(0, 16)


# ============================================================================ groups
def _spec(kind: str, **fields):
    return type(kind, (), fields)()


def _config(*groups):
    return SimpleNamespace(
        kv_cache_groups=[SimpleNamespace(kv_cache_spec=spec, layer_names=[f"l{i}" for i in range(n)]) for spec, n in groups]
    )


def test_one_full_attention_group_is_served():
    assert read_kv_groups(_config((_spec("FullAttentionSpec"), 4))) == KVGroups("FullAttentionSpec")
    assert read_kv_groups(None) == KVGroups("FullAttentionSpec")


def test_one_sliding_window_group_gives_the_window():
    groups = read_kv_groups(_config((_spec("SlidingWindowSpec", sliding_window=64), 2)))
    assert groups.sliding_window == 64
    assert groups.window_rule(32) == WindowRule(64, 32)
    assert "window=64" in groups.describe()


def test_uniform_wrapper_of_sliding_layers_is_unpacked():
    inner = {f"l{i}": _spec("SlidingWindowSpec", sliding_window=128) for i in range(3)}
    groups = read_kv_groups(_config((_spec("UniformTypeKVCacheSpecs", kv_cache_specs=inner), 3)))
    assert groups.sliding_window == 128


@pytest.mark.parametrize(
    "groups, named",
    [
        (((_spec("FullAttentionSpec"), 6), (_spec("CrossAttentionSpec"), 2)), "2 cache groups"),
        (((_spec("MambaSpec"), 2),), "2 x MambaSpec"),
        (((_spec("CrossAttentionSpec"), 2),), "CrossAttentionSpec"),
        (((_spec("ChunkedLocalAttentionSpec"), 2),), "ChunkedLocalAttentionSpec"),
        (((_spec("SinkFullAttentionSpec"), 2),), "SinkFullAttentionSpec"),
    ],
)
def test_other_layouts_are_refused_naming_the_layer_kinds(groups, named):
    with pytest.raises(UnsupportedModelError, match=named) as err:
        read_kv_groups(_config(*groups), "tiny-model")
    assert "tiny-model" in str(err.value) and "supports" in str(err.value)


def test_hybrid_model_is_refused_before_vllm_builds_its_groups():
    cfg = SimpleNamespace(
        model_config=SimpleNamespace(
            model="granite-hybrid",
            is_hybrid=True,
            is_attention_free=False,
            hf_config=SimpleNamespace(layer_types=["mamba", "attention", "mamba"]),
        )
    )
    with pytest.raises(UnsupportedModelError, match=r"granite-hybrid: layer types \['attention', 'mamba'\].*Dynamic"):
        refuse_unsupported_model(cfg)  # vLLM's built-in wrapper: no hybrid KV cache manager
    refuse_unsupported_model(cfg, hma=True)  # LMCacheConnectorV1Dynamic: the state groups are read later
    cfg.model_config.is_attention_free = True
    with pytest.raises(UnsupportedModelError, match="attention-free"):
        refuse_unsupported_model(cfg, hma=True)
    cfg.model_config.is_hybrid = cfg.model_config.is_attention_free = False
    refuse_unsupported_model(cfg)  # plain attention model: accepted


# ============================================================================ vLLM's block rules, replayed
@dataclass
class SlidingWindowVLLM:
    """One request's block table under vLLM's sliding-window rules (a fake block pool that
    hands a freed block to the next request at once)."""

    rule: WindowRule
    blocks: list[int] = field(default_factory=list)
    freed: set[int] = field(default_factory=set)
    next_id: int = 1

    def _new(self) -> int:
        self.next_id += 1
        return self.next_id

    def admit(self, num_computed: int, num_tokens: int) -> list[int]:
        """First allocation: null blocks for the skipped prefix, real ones up to ``num_tokens``."""
        skipped = max(0, num_computed - self.rule.window + 1) // self.rule.block_size
        self.blocks = [NULL_BLOCK] * skipped
        return self._grow(num_tokens)

    def step(self, num_computed: int, num_tokens: int) -> list[int]:
        """A later step: free what left the window, then allocate; returns the new block ids."""
        skipped = max(0, num_computed - self.rule.window + 1) // self.rule.block_size
        for i in range(min(skipped, len(self.blocks))):
            if self.blocks[i] != NULL_BLOCK:
                self.freed.add(self.blocks[i])
                self.blocks[i] = NULL_BLOCK
        return self._grow(num_tokens)

    def _grow(self, num_tokens: int) -> list[int]:
        bs = self.rule.block_size
        new = [self._new() for _ in range(-(-num_tokens // bs) - len(self.blocks))]
        self.blocks.extend(new)
        return new

    def assert_live(self, slots, start: int, end: int, what: str) -> None:
        bs = self.rule.block_size
        for t in range(start, end):
            slot = int(slots[t])
            assert slot >= 0, f"{what}: token {t} has no slot"
            block = slot // bs
            assert block != NULL_BLOCK, f"{what}: token {t} goes through a null block"
            assert block not in self.freed, f"{what}: token {t} goes through freed block {block}"
            assert self.blocks[t // bs] == block, f"{what}: token {t} is not in the request's block {t // bs}"


@settings(max_examples=300, deadline=None)
@given(
    window=st.integers(8, 200),
    block=st.sampled_from([4, 8, 16]),
    chunk_blocks=st.integers(1, 6),
    prompt_len=st.integers(2, 600),
    hit_frac=st.floats(0, 1),
    steps=st.lists(st.integers(1, 150), min_size=1, max_size=60),
)
def test_planner_never_reads_or_writes_freed_or_null_blocks(window, block, chunk_blocks, prompt_len, hit_frac, steps):
    chunk = block * chunk_blocks
    rule = WindowRule(window, block)
    planner = RequestPlanner(PlannerConfig(chunk_size=chunk, block_size=block, reuse_block_size=block, window=rule))
    req = FakeRequest("r0", list(range(100, 100 + prompt_len)))
    cached = int(hit_frac * prompt_len) // block * block  # what the cache holds (block reuse)
    external = planner.offer(req, 0, cached)
    assert external <= rule.max_admitted
    planner.on_alloc(req, external)
    vllm = SlidingWindowVLLM(rule)

    computed, saved_upto, first = external, 0, True
    pending = iter(steps)
    while computed < prompt_len:
        n = min(next(pending, 150), prompt_len - computed)
        if first:
            vllm.admit(computed, computed + n)
            out = planner.build(sched_output(new=[("r0", vllm.blocks, computed)], num_scheduled={"r0": n}))
            first = False
        else:
            new = vllm.step(computed, computed + n)
            out = planner.build(sched_output(cached=[("r0", new, computed)], num_scheduled={"r0": n}))
        for meta in out:
            if meta.load is not None:
                vllm.assert_live(meta.slot_mapping, meta.load.num_local, meta.load.end, "load")
            if meta.save is not None:
                vllm.assert_live(meta.slot_mapping, meta.save.skip, meta.save.end, "save")
                saved_upto = max(saved_upto, meta.save.end)
        computed += n
    if window >= chunk:  # every chunk is still in the window when it completes: the whole prompt is saved
        assert planner.counters["window_dropped_saves"] == 0
        assert saved_upto == prompt_len


def test_short_window_drops_a_chunk_computed_over_several_steps():
    """Window 64 < chunk 256, prefill in steps of 64 (the defect's configuration): the first
    chunk completes at token 256, when tokens before 128 are already freed: not stored."""
    rule = WindowRule(64, 32)
    planner = RequestPlanner(PlannerConfig(chunk_size=256, block_size=32, window=rule))
    req = FakeRequest("r1", list(range(300)))
    planner.offer(req, 0, 0)
    planner.on_alloc(req, 0)
    vllm = SlidingWindowVLLM(rule)
    vllm.admit(0, 64)
    planner.build(sched_output(new=[("r1", vllm.blocks, 0)], num_scheduled={"r1": 64}))
    saves = []
    for computed in (64, 128, 192):
        new = vllm.step(computed, computed + 64)
        saves += [m.save for m in planner.build(sched_output(cached=[("r1", new, computed)], num_scheduled={"r1": 64}))]
    assert saves == []
    assert planner.counters["window_dropped_saves"] == 1


def test_full_attention_planning_is_unchanged_by_the_window_code():
    planner = RequestPlanner(PlannerConfig(chunk_size=16, block_size=8))
    req = FakeRequest("r2", list(range(40)))
    assert planner.offer(req, 0, 32) == 32
    planner.on_alloc(req, 32)
    (meta,) = planner.build(sched_output(new=[("r2", [1, 2, 3, 4, 5], 32)], num_scheduled={"r2": 8}))
    assert meta.load.end == 32 and (meta.slot_mapping[:32] >= 0).all()


# ============================================================================ the adapter
def test_the_connector_refuses_an_unsupported_group_mix_at_construction(tmp_path):
    from lmcache.integration.vllm.vllm_v1_adapter import LMCacheConnectorV1Impl

    from .test_vllm_connector_unit import fake_vllm_config

    parent = SimpleNamespace(_kv_cache_config=_config((_spec("FullAttentionSpec"), 2), (_spec("CrossAttentionSpec"), 2)))
    with pytest.raises(UnsupportedModelError, match="2 cache groups"):
        LMCacheConnectorV1Impl(fake_vllm_config(tmp=str(tmp_path)), "SCHEDULER", parent)


def test_the_scheduler_plans_with_the_window_of_a_sliding_group(tmp_path):
    from lmcache.integration.vllm.vllm_v1_adapter import LMCacheConnectorV1Impl

    from .test_vllm_connector_unit import fake_vllm_config

    parent = SimpleNamespace(_kv_cache_config=_config((_spec("SlidingWindowSpec", sliding_window=64), 2)))
    impl = LMCacheConnectorV1Impl(fake_vllm_config(tmp=str(tmp_path)), "SCHEDULER", parent)
    try:
        assert impl.scheduler.planner.config.window == WindowRule(64, 8)
    finally:
        impl.close()


# ============================================================================ MLA
def _mla_settings(tmp_path, tp: int = 2, extra=None):
    from lmcache.integration.vllm.metadata_builder import settings_from_vllm

    from .test_vllm_connector_unit import fake_vllm_config

    cfg = fake_vllm_config(tmp=str(tmp_path), tp=tp, extra=extra)
    cfg.model_config.use_mla = True
    return settings_from_vllm(cfg, _config((_spec("MLAAttentionSpec"), 2)))


def test_mla_entries_are_shared_by_every_rank_and_tp_size(tmp_path):
    from lmcache.integration.vllm.metadata_builder import build_engine_metadata
    from lmcache.v1.token_database import ChunkedTokenDatabase

    settings = _mla_settings(tmp_path)
    assert settings.save_only_first_rank and settings.whole_prompt_hits  # MLA on CPU
    assert settings.config.save_unfull_chunk  # whole prompts need their exact tails
    keys = []
    for tp, rank in ((2, 0), (2, 1), (1, 0)):
        md = build_engine_metadata(_mla_settings(tmp_path, tp=tp), rank)
        assert (md.world_size, md.worker_id) == (1, 0)
        keys.append([k for _, _, k in ChunkedTokenDatabase(settings.config, md).process_tokens(list(range(64)))])
    assert keys[0] == keys[1] == keys[2]


def test_save_only_first_rank_can_be_turned_off(tmp_path):
    from lmcache.integration.vllm.metadata_builder import build_engine_metadata

    settings = _mla_settings(tmp_path, extra={"lmcache.extra_config": {"save_only_first_rank": False}})
    assert not settings.save_only_first_rank
    assert (build_engine_metadata(settings, 1).world_size, build_engine_metadata(settings, 1).worker_id) == (2, 1)


def test_ranks_that_do_not_save_drop_the_save_specs():
    import numpy as np

    from lmcache.integration.vllm.connector_metadata import LMCacheConnectorMetadata, LoadSpec, ReqMeta, SaveSpec
    from lmcache.integration.vllm.worker_side import WorkerConnector

    engine = SimpleNamespace(config=SimpleNamespace(chunk_size=16))
    req = ReqMeta("r", np.arange(32, dtype=np.int32), np.arange(32), 16, LoadSpec(0, 16, 16), SaveSpec(16, 32))
    worker = WorkerConnector(engine, layerwise=False, saves=False)  # type: ignore[arg-type]
    worker.bind(LMCacheConnectorMetadata([req]))
    assert [(r.load, r.save) for r in worker._reqs] == [(LoadSpec(0, 16, 16), None)]


def test_whole_prompt_only_offers_all_but_the_last_token_or_nothing():
    planner = RequestPlanner(PlannerConfig(chunk_size=16, block_size=16, whole_prompt_only=True))
    assert planner.offer(FakeRequest("a", list(range(40))), 0, 32) == 0  # a partial prefix: no
    assert planner.offer(FakeRequest("b", list(range(40))), 0, 40) == 39
    assert planner.offer(FakeRequest("c", list(range(40))), 0, 39) == 39


# ============================================================================ decode-phase saves
def test_decode_saves_store_each_completed_block_when_asked():
    planner = RequestPlanner(PlannerConfig(chunk_size=16, block_size=4, reuse_block_size=4, save_decode=True))
    req = FakeRequest("d", list(range(10)))
    planner.offer(req, 0, 0)
    planner.on_alloc(req, 0)
    (meta,) = planner.build(sched_output(new=[("d", [1, 2, 3], 0)], num_scheduled={"d": 10}))
    assert (meta.save.skip, meta.save.end) == (0, 10)  # the prompt (its tail is cut to blocks by the engine)
    saves = []
    for computed in range(10, 20):  # one token per decode step; the sampled token is already appended
        req.output.append(500 + computed)
        new = [4] if computed % 4 == 0 and computed >= 12 else None
        out = planner.build(sched_output(cached=[("d", new, computed)], num_scheduled={"d": 1}))
        saves += [(computed, m.save.skip, m.save.end) for m in out if m.save is not None]
    # blocks complete at 12, 16 and 20; the chunk [0, 16) is written whole once it completes
    assert saves == [(11, 0, 12), (15, 0, 16), (19, 16, 20)]


def test_decode_saves_are_off_by_default():
    planner = RequestPlanner(PlannerConfig(chunk_size=16, block_size=4, reuse_block_size=4))
    req = FakeRequest("e", list(range(10)))
    planner.offer(req, 0, 0)
    planner.on_alloc(req, 0)
    planner.build(sched_output(new=[("e", [1, 2, 3], 0)], num_scheduled={"e": 10}))
    req.output.append(7)
    req.output.append(8)
    assert planner.build(sched_output(cached=[("e", None, 11)], num_scheduled={"e": 1})) == []
