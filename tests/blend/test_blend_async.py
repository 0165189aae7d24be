"""Blends as asynchronous loads (``enable_async_loading``), driven like vLLM drives them:
the request waits (not scheduled) while the worker's blend thread computes its KV, the
worker reports it in ``get_finished``, and only then is it scheduled, with every token but
the last computed. The KV equals the synchronous blend's, and what is stored afterwards is
the same (exact prefix chunks, the blend result, segments)."""

from __future__ import annotations

from typing import Any

import torch

from tests.blend.test_blend_connector import (
    BLOCK, CHUNK, LAYERS, MiniBlendVLLM, _ids, expected_blend, precache, rag, sched_output,
)  # fmt: skip
from tests.vllm_adapter.test_vllm_connector_unit import FakeRequest


class _Blocks:
    def __init__(self, ids: list[int]) -> None:
        self.ids = ids

    def get_block_ids(self) -> tuple[list[int], ...]:
        return (self.ids,)


def serve_async(mini: MiniBlendVLLM, req: FakeRequest, *, fail: bool = False) -> dict[str, Any]:
    """vLLM's asynchronous path: match -> alloc -> (steps without the request until the worker
    reports it) -> the request scheduled with its external tokens computed."""
    n = req.num_tokens
    external, load_async = mini.scheduler.match(req, 0)
    if not load_async:
        return {"async": False, **mini.serve(req)}
    blocks, mini.free = mini.free[: -(-(n + 1) // BLOCK)], mini.free[-(-(n + 1) // BLOCK) :]
    mini.scheduler.update_state_after_alloc(req, external, _Blocks(blocks).get_block_ids())
    steps, finished, errors = 0, set(), set()
    while req.request_id not in finished:
        steps += 1
        assert steps < 10_000, "the asynchronous blend never finished"
        meta = mini.scheduler.build_connector_meta(sched_output("other", [], 0, 0, new=True))
        mini.worker.bind_connector_metadata(meta)
        mini.worker.start_load_kv(None)
        mini.worker.wait_for_save()
        _, recving = mini.worker.get_finished(set())
        finished |= recving or set()
        errors |= mini.worker.get_block_ids_with_load_errors()
        pending = mini.worker.worker.async_loads._pending.get(req.request_id)
        if recving is None and pending is not None:  # wait for the blend thread, not by sleeping
            pending.future.exception(60)
    kv_after_load = mini.paged(blocks, external)
    computed = 0 if errors else external
    meta = mini.scheduler.build_connector_meta(sched_output(req.request_id, blocks, computed, n - computed, new=True))
    mini.worker.bind_connector_metadata(meta)
    mini.worker.start_load_kv(None)
    mini._forward(req, blocks, computed, n - computed)
    mini.worker.wait_for_save()
    mini.scheduler.request_finished(req, blocks)
    mini.free.extend(blocks)
    return {"async": True, "external": external, "errors": errors, "kv_after_load": kv_after_load, "steps": steps}


def async_mini(tmp_path, model, monkeypatch) -> MiniBlendVLLM:
    return MiniBlendVLLM(str(tmp_path), model, monkeypatch, extra={"lmcache.enable_async_loading": True})


def test_a_blend_runs_while_the_request_waits_and_gives_the_synchronous_kv(tmp_path, model, monkeypatch, hermetic_env):
    mini = async_mini(tmp_path, model, monkeypatch)
    try:
        precache(mini)
        prompt, starts = rag([2, 0, 1])
        out = serve_async(mini, FakeRequest(f"rag-{next(_ids)}", prompt))
        assert out["async"] and out["external"] == len(prompt) - 1 and not out["errors"]
        want = expected_blend(model, prompt, dict(zip([2, 0, 1], starts)), len(prompt) - 1)
        for li in range(LAYERS):
            torch.testing.assert_close(out["kv_after_load"][0][li], want.keys[li], atol=1e-5, rtol=1e-5)
            torch.testing.assert_close(out["kv_after_load"][1][li], want.values[li], atol=1e-5, rtol=1e-5)
        stats = mini.engine.stats
        assert stats.blend_requests == 1 and stats.async_loads == 1
        # stored as after a synchronous blend: exact chunks before the first reused token only,
        # the whole prompt as a blend result
        assert mini.engine.lookup(prompt) <= starts[0] - starts[0] % CHUNK
        assert stats.blend_stored_result_tokens >= len(prompt) - len(prompt) % CHUNK
        again = mini.serve(FakeRequest(f"again-{next(_ids)}", prompt))  # its blend result, from the CPU tier
        assert again["external"] >= len(prompt) - len(prompt) % CHUNK and stats.blend_requests == 1
    finally:
        mini.close()


def test_a_failing_asynchronous_blend_is_reported_and_recomputed(tmp_path, model, monkeypatch, hermetic_env):
    from lmcache.integration.vllm import blend_worker

    mini = async_mini(tmp_path, model, monkeypatch)
    try:
        precache(mini)
        prompt, _ = rag([1, 2, 0])

        def boom(*a, **k):
            raise RuntimeError("injected")

        monkeypatch.setattr(blend_worker, "blend", boom)
        out = serve_async(mini, FakeRequest(f"rag-{next(_ids)}", prompt))
        assert out["async"] and out["errors"]  # every block of the request: vLLM recomputes it
        assert mini.engine.stats.blend_failures == 1
        assert mini.engine.lookup(prompt) >= CHUNK  # recomputed exactly: its prefix is stored
    finally:
        mini.close()
