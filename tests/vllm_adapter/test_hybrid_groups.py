"""Several KV cache groups (vLLM's hybrid KV cache manager): sliding-window + full attention.

With HMA on, vLLM gives each group its own block table; a sliding group's blocks leave as
the window moves (and a request admitted with cached tokens gets null blocks for the part
of its prefix already out of the window), a full-attention group keeps everything. The
planner hands the worker one slot row per group. :class:`HybridVLLM` replays vLLM's rules
per group (freed blocks go straight to the next request) and every slot the planner hands
the worker is checked against it.
"""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from lmcache.integration.vllm.kv_groups import KVGroup, KVGroups, UnsupportedModelError, WindowRule, read_kv_groups
from lmcache.integration.vllm.request_tracker import PlannerConfig, RequestPlanner

from .test_attention_layouts import NULL_BLOCK, SlidingWindowVLLM, _config, _spec
from .test_vllm_connector_unit import FakeRequest


def _hybrid_config(block_size=16, window=64):
    full = _spec("FullAttentionSpec", block_size=block_size)
    sliding = _spec("SlidingWindowSpec", sliding_window=window, block_size=block_size)
    cfg = SimpleNamespace(
        kv_cache_groups=[
            SimpleNamespace(kv_cache_spec=sliding, layer_names=["m.layers.0.attn", "m.layers.2.attn"]),
            SimpleNamespace(kv_cache_spec=full, layer_names=["m.layers.1.attn", "m.layers.3.attn"]),
        ]
    )
    return cfg


# ============================================================================ reading the groups
def test_sliding_and_full_groups_are_served_with_the_full_group_as_primary():
    groups = read_kv_groups(_hybrid_config(), "gemma-3-tiny")
    assert groups.hybrid and groups.block_size == 16
    assert groups.groups == (
        KVGroup("SlidingWindowSpec", 64, ("m.layers.0.attn", "m.layers.2.attn"), 16),
        KVGroup("FullAttentionSpec", None, ("m.layers.1.attn", "m.layers.3.attn"), 16),
    )
    assert groups.primary == 1
    assert groups.group_windows(16) == (WindowRule(64, 16), None)
    assert groups.layer_groups([f"m.layers.{i}.attn" for i in range(4)]) == (0, 1, 0, 1)
    assert groups.window_rule(16) is None  # no single all-sliding rule
    assert "2 x SlidingWindowSpec(window=64)" in groups.describe()
    with pytest.raises(ValueError, match="'m.layers.9.attn' is in none"):
        groups.layer_groups(["m.layers.9.attn"])


@pytest.mark.parametrize(
    "specs, named",
    [
        ([("FullAttentionSpec", {}), ("MambaSpec", {"mamba_cache_mode": "none"})], "needs 'align'"),
        ([("FullAttentionSpec", {}), ("MambaSpec", {}), ("MambaSpec", {})], "2 recurrent-state groups"),
        ([("SlidingWindowSpec", {"sliding_window": 8}), ("MambaSpec", {})], "no full-attention one"),
        ([("FullAttentionSpec", {}), ("CrossAttentionSpec", {})], "cache groups"),
        ([("MLAAttentionSpec", {}), ("SlidingWindowSpec", {"sliding_window": 8})], "MLA"),
        ([("SlidingWindowSpec", {"sliding_window": 8}), ("SlidingWindowSpec", {"sliding_window": 16})],
         "no full-attention one"),
    ],
)  # fmt: skip
def test_other_group_mixes_are_refused_naming_what(specs, named):
    cfg = _config(*[(_spec(kind, block_size=16, **kw), 2) for kind, kw in specs])
    with pytest.raises(UnsupportedModelError, match=named):
        read_kv_groups(cfg, "tiny")


def test_groups_with_different_block_sizes_are_refused():
    cfg = _config((_spec("FullAttentionSpec", block_size=16), 2), (_spec("SlidingWindowSpec", sliding_window=8,
                                                                         block_size=32), 2))  # fmt: skip
    with pytest.raises(UnsupportedModelError, match=r"different block sizes \[16, 32\]"):
        read_kv_groups(cfg, "tiny")


def test_single_group_layouts_are_unchanged():
    assert read_kv_groups(_config((_spec("FullAttentionSpec"), 4))) == KVGroups("FullAttentionSpec")
    assert not KVGroups("FullAttentionSpec").hybrid


# ============================================================================ the adapter's settings
def _settings(tmp_path, extra=None):
    from lmcache.integration.vllm.metadata_builder import settings_from_vllm

    from .test_vllm_connector_unit import fake_vllm_config

    return settings_from_vllm(fake_vllm_config(tmp=str(tmp_path), extra=extra), _hybrid_config(block_size=8))


def test_the_scheduler_plans_every_group(tmp_path):
    from lmcache.integration.vllm.vllm_v1_adapter import LMCacheConnectorV1Impl

    from .test_vllm_connector_unit import fake_vllm_config

    parent = SimpleNamespace(_kv_cache_config=_hybrid_config(block_size=8))
    impl = LMCacheConnectorV1Impl(fake_vllm_config(tmp=str(tmp_path)), "SCHEDULER", parent)
    try:
        cfg = impl.scheduler.planner.config
        assert cfg.hybrid and cfg.group_windows == (WindowRule(64, 8), None) and cfg.window is None
    finally:
        impl.close()


def test_layerwise_is_refused_with_several_groups(tmp_path):
    from lmcache.v1.config import ConfigError

    with pytest.raises(ConfigError, match="use_layerwise: true is not supported .* several cache groups"):
        _settings(tmp_path, extra={"lmcache.use_layerwise": True})


def test_the_dynamic_connector_keeps_vllms_hybrid_manager_on():
    from lmcache.integration.vllm.lmcache_connector_v1 import LMCacheConnectorV1Dynamic
    from lmcache.integration.vllm.vllm_compat import SupportsHMA

    assert issubclass(LMCacheConnectorV1Dynamic, SupportsHMA)


# ============================================================================ the planner, against vLLM's rules
class HybridVLLM:
    """One request's block tables, one per group: a full-attention group keeps its blocks,
    a sliding group follows :class:`SlidingWindowVLLM`. Block ids are unique across groups
    (as a shared pool hands them out)."""

    def __init__(self, windows: tuple[WindowRule | None, ...], block: int) -> None:
        self.block = block
        self.rules = windows
        self.next_id = 1
        self.tables: list[SlidingWindowVLLM | list[int]] = []
        for rule in windows:
            self.tables.append(SlidingWindowVLLM(rule) if rule is not None else [])

    def _grow(self, g: int, num_tokens: int) -> list[int]:
        table = self.tables[g]
        blocks = table.blocks if isinstance(table, SlidingWindowVLLM) else table
        new = []
        for _ in range(-(-num_tokens // self.block) - len(blocks)):
            self.next_id += 1
            new.append(self.next_id)
        blocks.extend(new)
        return new

    def admit(self, num_computed: int, num_tokens: int) -> list[list[int]]:
        out = []
        for g, table in enumerate(self.tables):
            if isinstance(table, SlidingWindowVLLM):
                skipped = max(0, num_computed - table.rule.window + 1) // self.block
                table.blocks = [NULL_BLOCK] * skipped
            self._grow(g, num_tokens)
            out.append(list(self.blocks(g)))
        return out

    def step(self, num_computed: int, num_tokens: int) -> list[list[int]]:
        out = []
        for g, table in enumerate(self.tables):
            if isinstance(table, SlidingWindowVLLM):
                skipped = max(0, num_computed - table.rule.window + 1) // self.block
                for i in range(min(skipped, len(table.blocks))):
                    if table.blocks[i] != NULL_BLOCK:
                        table.freed.add(table.blocks[i])
                        table.blocks[i] = NULL_BLOCK
            out.append(self._grow(g, num_tokens))
        return out

    def blocks(self, g: int) -> list[int]:
        table = self.tables[g]
        return table.blocks if isinstance(table, SlidingWindowVLLM) else table

    def check(self, slots: np.ndarray, start: int, end: int, what: str, *, need_all: bool) -> None:
        """Every non-negative slot of ``[start, end)`` is in the request's live block of its
        group; ``need_all``: every group has every token (a save), else the full groups do
        and a sliding group has its window's (a load)."""
        assert slots.ndim == 2 and slots.shape[0] == len(self.tables), f"{what}: one slot row per group"
        for g, table in enumerate(self.tables):
            rule = self.rules[g]
            blocks = self.blocks(g)
            freed = table.freed if isinstance(table, SlidingWindowVLLM) else set()
            live = 0 if (need_all or rule is None) else rule.live_start(end)
            for t in range(start, end):
                slot = int(slots[g, t])
                if t < live:
                    assert slot < 0, f"{what}: group {g} token {t} written into a null block"
                    continue
                assert slot >= 0, f"{what}: group {g} token {t} has no slot"
                block = slot // self.block
                assert block != NULL_BLOCK, f"{what}: group {g} token {t} goes through a null block"
                assert block not in freed, f"{what}: group {g} token {t} goes through freed block {block}"
                assert blocks[t // self.block] == block, f"{what}: group {g} token {t} is not in its block"


def _sched(new=(), cached=(), num_scheduled=None) -> SimpleNamespace:
    """Like ``sched_output``, with per-group block lists."""
    return SimpleNamespace(
        scheduled_new_reqs=[SimpleNamespace(req_id=r, block_ids=tuple(b), num_computed_tokens=c) for r, b, c in new],
        scheduled_cached_reqs=SimpleNamespace(
            req_ids=[r for r, _, _ in cached],
            resumed_req_ids=set(),
            new_block_ids=[None if b is None else tuple(b) for _, b, _ in cached],
            num_computed_tokens=[c for _, _, c in cached],
        ),
        num_scheduled_tokens=dict(num_scheduled or {}),
    )


@settings(max_examples=300, deadline=None)
@given(
    windows=st.lists(st.one_of(st.none(), st.integers(8, 200)), min_size=2, max_size=4).filter(
        lambda ws: any(w is None for w in ws)
    ),
    block=st.sampled_from([4, 8, 16]),
    chunk_blocks=st.integers(1, 6),
    prompt_len=st.integers(2, 600),
    hit_frac=st.floats(0, 1),
    steps=st.lists(st.integers(1, 150), min_size=1, max_size=60),
)
def test_every_slot_handed_to_the_worker_is_live_in_its_group(windows, block, chunk_blocks, prompt_len, hit_frac, steps):
    chunk = block * chunk_blocks
    rules = tuple(None if w is None else WindowRule(w, block) for w in windows)
    planner = RequestPlanner(PlannerConfig(chunk_size=chunk, block_size=block, reuse_block_size=block,
                                           group_windows=rules))  # fmt: skip
    req = FakeRequest("r0", list(range(100, 100 + prompt_len)))
    cached = int(hit_frac * prompt_len) // block * block
    external = planner.offer(req, 0, cached)
    assert external == max(0, min(cached, prompt_len - 1))  # no window cap: hybrid loads are asynchronous
    vllm = HybridVLLM(rules, block)
    computed = 0
    if external:
        planner.get("r0").async_offer = True  # what the scheduler side does for every hybrid hit
        assert planner.on_alloc(req, external, vllm.admit(external, external))
        (meta,) = planner.build(_sched())
        assert meta.load_async and meta.load.end == external
        vllm.check(meta.slot_mapping, meta.load.num_local, meta.load.end, "load", need_all=False)
        computed = external
    saved_upto, first = 0, True
    pending = iter(steps)
    while computed < prompt_len:
        n = min(next(pending, 150), prompt_len - computed)
        if first and not external:
            blocks = vllm.admit(computed, computed + n)
            out = planner.build(_sched(new=[("r0", blocks, computed)], num_scheduled={"r0": n}))
        elif first:  # the asynchronous load is done: vLLM schedules the request as new, its blocks grown
            vllm.step(computed, computed + n)
            blocks = [list(vllm.blocks(g)) for g in range(len(rules))]
            out = planner.build(_sched(new=[("r0", blocks, computed)], num_scheduled={"r0": n}))
        else:
            new = vllm.step(computed, computed + n)
            out = planner.build(_sched(cached=[("r0", new, computed)], num_scheduled={"r0": n}))
        first = False
        for meta in out:
            assert meta.load is None, "a hybrid load is never synchronous"
            if meta.save is not None:
                vllm.check(meta.slot_mapping, meta.save.skip, meta.save.end, "save", need_all=True)
                saved_upto = max(saved_upto, meta.save.end)
        computed += n
    shortest = min((w for w in windows if w is not None), default=None)
    if shortest is None or shortest >= chunk:  # every chunk completes inside every window
        assert planner.counters["window_dropped_saves"] == 0
        assert saved_upto == prompt_len


def test_a_failed_plan_fails_the_whole_hybrid_request_not_its_blocks():
    rules = (WindowRule(32, 8), None)
    planner = RequestPlanner(PlannerConfig(chunk_size=16, block_size=8, group_windows=rules))
    req = FakeRequest("f", list(range(64)))
    assert planner.offer(req, 0, 48) == 48
    planner.get("f").async_offer = True
    assert planner.on_alloc(req, 48, [[1, 2, 3, 4, 5, 6], [7, 8, 9, 10, 11, 12]])
    planner.get("f").request = None  # token ids unreadable: planning raises
    (meta,) = planner.build(_sched())
    assert meta.load_failed and meta.load_async and meta.invalid_block_ids == ()


def test_a_different_number_of_groups_than_announced_is_an_error():
    planner = RequestPlanner(PlannerConfig(chunk_size=16, block_size=8, group_windows=(WindowRule(32, 8), None)))
    req = FakeRequest("g", list(range(64)))
    planner.offer(req, 0, 0)
    planner.on_alloc(req, 0)
    with pytest.raises(ValueError, match="block_ids: 1 KV cache groups, expected 2"):
        planner.build(_sched(new=[("g", [[1, 2]], 0)], num_scheduled={"g": 16}))


# ============================================================================ a recurrent-state group
class StateTable:
    """vLLM's state group of one request (``MambaManager``, align mode): one column per
    ``block`` tokens; before a step, columns before ``(num_computed - 1) // block`` become
    null; an admitted request with ``n`` cached tokens gets null columns and a real one at
    ``n // block - 1`` (where the state after ``n`` tokens goes)."""

    def __init__(self, block: int, ids) -> None:
        self.block, self.ids, self.cols = block, ids, []

    def admit(self, n: int, end: int) -> list[int]:
        self.cols = [NULL_BLOCK] * max(0, n // self.block - 1)
        return self.grow(end)

    def step(self, num_computed: int, end: int) -> list[int]:
        for i in range(min(len(self.cols), max(0, num_computed - 1) // self.block)):
            self.cols[i] = NULL_BLOCK
        return self.grow(end)

    def grow(self, end: int) -> list[int]:
        new = [next(self.ids) for _ in range(-(-end // self.block) - len(self.cols))]
        self.cols.extend(new)
        return new


@settings(max_examples=200, deadline=None)
@given(
    state_blocks=st.integers(1, 4),
    chunk_blocks=st.integers(1, 4),
    prompt_len=st.integers(2, 700),
    hit_frac=st.floats(0, 1),
    steps=st.lists(st.sampled_from([8, 16, 32, 64, 128]), min_size=1, max_size=60),
)
def test_state_refs_name_the_state_block_of_their_boundary(state_blocks, chunk_blocks, prompt_len, hit_frac, steps):
    import itertools

    block = 8
    m, chunk = block * state_blocks, block * chunk_blocks
    planner = RequestPlanner(PlannerConfig(chunk_size=chunk, block_size=block, group_windows=(None, None),
                                           state_group=0, state_block_size=m))  # fmt: skip
    every = planner.config.state_every
    ids = itertools.count(1)
    state, full = StateTable(m, ids), []
    req = FakeRequest("s", list(range(100, 100 + prompt_len)))
    external = planner.offer(req, 0, int(hit_frac * prompt_len))
    assert external % every == 0 and external < prompt_len  # a state boundary, short of the last token
    computed = 0
    if external:
        planner.get("s").async_offer = True
        full = [next(ids) for _ in range(-(-external // block))]
        state.admit(external, external)
        assert planner.on_alloc(req, external, [list(state.cols), full])
        (meta,) = planner.build(_sched())
        assert meta.state_load is not None and meta.state_load.boundary == external
        assert meta.state_load.block == state.cols[external // m - 1] != NULL_BLOCK
        computed = external
    first = True
    pending = iter(steps)
    while computed < prompt_len:
        n = min(next(pending, 64), prompt_len - computed)
        end = computed + n
        if first:
            new_state = state.step(computed, end) if external else state.admit(0, end)
            more = [next(ids) for _ in range(-(-end // block) - len(full))]
            full += more
            out = planner.build(_sched(new=[("s", [list(state.cols), list(full)], computed)], num_scheduled={"s": n}))
            first = False
        else:
            new_state = state.step(computed, end)
            more = [next(ids) for _ in range(-(-end // block) - len(full))]
            full += more
            out = planner.build(_sched(cached=[("s", [new_state, more], computed)], num_scheduled={"s": n}))
        saved = [m_.state_save for m_ in out if m_.state_save is not None]
        if end % every == 0 and any(m_.save is not None and m_.save.skip < end <= m_.save.end for m_ in out):
            assert [s.boundary for s in saved] == [end]
        else:
            assert saved == []
        for ref in saved:
            assert ref.block == state.cols[ref.boundary // m - 1] != NULL_BLOCK, "the state is read from its block"
        computed = end
