"""Worker side of blending: compute a blended prompt's KV into vLLM's paged cache, and
store prompts' segments under segment keys.

Runs on the worker thread, inside ``start_load_kv`` (blends) and ``wait_for_save``
(segment stores), blocking; vLLM 0.32 has no per-token recompute hook, so a blend runs
before the forward pass: it reads the reused segments' entries and moves their keys to the
segments' new positions with the model's own rotary tables (on a reader thread, while the
layers before the first check layer run: they need no cached KV), runs the selective recompute
(:func:`lmcache.v1.blend.blend`) through the served model's layers (:mod:`.blend_model`),
and writes the KV of tokens ``[0, num_tokens)`` into the request's blocks. vLLM then
computes only the last token, attending over that KV.

A segment whose entry is missing, evicted, corrupt or short is simply not reused: its
tokens are recomputed like new text, so the KV written is the blend of what could be read.
Any exception propagates to the caller, which reports the request's blocks as failed loads
(vLLM recomputes them); a blend never writes anything under prefix keys.

Memory: the tensors of a blend are temporaries of the call; pool objects are released
by the segment store before it returns.
"""

from __future__ import annotations

import logging
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any, Sequence

import torch

from lmcache.integration.vllm.connector_metadata import BlendSpec, ReqMeta, SegmentRef
from lmcache.v1.blend import BlendConfig, CachedSegmentKV, ReusedKV, assemble, blend, rerotate_layers
from lmcache.v1.blend.segments import Segment
from lmcache.v1.blend.segment_store import SegmentStore
from lmcache.v1.gpu_connector.layouts import component_tensors
from lmcache.v1.request import KeyExtras

logger = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class BlendOutcome:
    """What one blend did (for the counters)."""

    num_tokens: int
    reused: int
    """Tokens whose cached KV was kept after the last check layer."""
    recomputed: int
    """Tokens computed through every layer (new text, separators, selected reused tokens)."""
    seconds: float


class BlendRunner:
    """Runs blends and segment stores for one worker (see the module docstring).

    ``model``: the served model as a blend model (``rerotate(keys, old, new)`` plus the
    :class:`~lmcache.v1.blend.model.BlendModel` protocol)."""

    def __init__(self, model: Any, store: SegmentStore, config: BlendConfig, sink_tokens: int = 0) -> None:
        self.model = model
        self.store = store
        self.config = config
        self.sink_tokens = sink_tokens
        """The first cached tokens of each reused segment that are recomputed (``blend_sink_tokens``)."""
        self._reader = ThreadPoolExecutor(max_workers=1, thread_name_prefix="lmcache-blend-read")
        """Reads a blend's segments while its first layers run (one blend at a time)."""

    # ------------------------------------------------------------------ blends
    def run(self, req: ReqMeta, spec: BlendSpec, kvcaches: Sequence[torch.Tensor]) -> BlendOutcome:
        """Blend tokens ``[0, spec.num_tokens)`` of ``req`` and write their KV into ``kvcaches``."""
        t0 = time.perf_counter()
        n = spec.num_tokens
        if n <= 0 or req.token_ids.shape[0] < n or req.slot_mapping.shape[0] < n:
            raise ValueError(f"blend of {n} tokens for a request with {req.token_ids.shape[0]} tokens")
        slots = torch.as_tensor(req.slot_mapping[:n], dtype=torch.long)
        if bool((slots < 0).any()):
            raise ValueError("blend: some tokens have no block")
        extras = KeyExtras.from_kwargs(dict(req.key_extras))
        tokens = req.token_ids[:n]
        device = kvcaches[0].device
        # the segments are read (and their keys moved) while the layers before the first check
        # layer run: those need no cached KV
        reading = self._reader.submit(self._reused, tokens, spec, extras, device)
        ids = torch.as_tensor(tokens, dtype=torch.long, device=device)
        result = blend(self.model, ids, reading.result, self.config, consume=True)
        reused = reading.result()  # resolved by the blend's first check layer
        kept = int((reused.mask.to(result.recomputed.device) & ~result.recomputed).sum()) if reused is not None else 0
        self._write(kvcaches, slots, result.keys, result.values)
        return BlendOutcome(n, kept, n - kept, time.perf_counter() - t0)

    def _reused(self, tokens: Any, spec: BlendSpec, extras: KeyExtras, device: torch.device) -> ReusedKV | None:
        """The cached segments placed at their positions (None when none could be read)."""
        n = spec.num_tokens
        pieces = [p for p in (self._read(tokens, ref, n, extras, device) for ref in spec.reused) if p is not None]
        return assemble(n, pieces, self.model) if pieces else None

    def _read(
        self, tokens: Any, ref: SegmentRef, limit: int, extras: KeyExtras, device: torch.device
    ) -> CachedSegmentKV | None:
        """The cached part of one segment, keys still at positions ``0 ..`` (assemble moves them)."""
        end = min(ref.end, limit)  # the prompt's last token is vLLM's: a segment holding it is cut
        seg = Segment(ref.start, end, tuple(int(t) for t in tokens[ref.start : end]), ref.lead)
        kv = self.store.get(seg, min(ref.cached, end - ref.start), extras)
        sink = self.sink_tokens
        if kv.num_tokens <= sink:
            return None
        keys = [k[sink:].to(device) for k in kv.keys]  # the first `sink` tokens are recomputed
        values = [v[sink:].to(device) for v in kv.values]
        return CachedSegmentKV(ref.start + sink, keys, values, old_start=sink, recomputed_before=ref.lead_tokens + sink)

    @staticmethod
    def _write(
        kvcaches: Sequence[torch.Tensor], slots: torch.Tensor, keys: Sequence[torch.Tensor], values: Sequence[torch.Tensor]
    ) -> None:
        n = slots.shape[0]
        for layer, k, v in zip(kvcaches, keys, values):
            k_view, v_view = component_tensors(layer)
            bs = k_view.shape[1]
            b, o = slots // bs, slots % bs
            k_view[b, o] = k[:n].to(k_view.dtype)
            v_view[b, o] = v[:n].to(v_view.dtype)

    # ------------------------------------------------------------------ stores
    def store_segments(self, req: ReqMeta, refs: Sequence[SegmentRef], kvcaches: Sequence[torch.Tensor]) -> int:
        """Store each segment of ``refs`` from the paged cache under its segment keys (keys
        moved to positions ``0 ..``: one gather per layer, then one re-rotation for every layer
        and every segment not cached yet). Returns the tokens newly stored."""
        extras = KeyExtras.from_kwargs(dict(req.key_extras))
        todo: list[tuple[Segment, torch.Tensor]] = []
        for ref in refs:
            if ref.end > req.token_ids.shape[0] or ref.end > req.slot_mapping.shape[0]:
                continue
            slots = torch.as_tensor(req.slot_mapping[ref.start : ref.end], dtype=torch.long)
            if bool((slots < 0).any()):
                continue
            seg = Segment(ref.start, ref.end, tuple(int(t) for t in req.token_ids[ref.start : ref.end]), ref.lead)
            if self.store.lookup(seg, extras) < len(seg):
                todo.append((seg, slots))
        if not todo:
            return 0
        slots = torch.cat([s for _, s in todo])
        old = torch.cat([torch.arange(seg.start, seg.end) for seg, _ in todo])
        new = torch.cat([torch.arange(0, len(seg)) for seg, _ in todo])
        moved = bool((old != new).any())
        keys, values = [], []
        for layer in kvcaches:
            k_view, v_view = component_tensors(layer)
            bs = k_view.shape[1]
            b, o = slots // bs, slots % bs
            keys.append(k_view[b, o])
            values.append(v_view[b, o])
        if moved:
            keys = rerotate_layers(self.model, keys, old, new)
        sizes = [len(seg) for seg, _ in todo]
        per_layer_k = [k.split(sizes) for k in keys]
        per_layer_v = [v.split(sizes) for v in values]
        stored = 0
        for i, (seg, _) in enumerate(todo):
            stored += self.store.put(seg, [k[i] for k in per_layer_k], [v[i] for v in per_layer_v], extras)
        return stored


def make_runner(engine: Any, engine_id: str) -> BlendRunner | None:
    """The blend runner of a worker whose served model is registered in
    :class:`~.blend_model.VLLMModelTracker` (by the ``vllm.general_plugins`` hook, or by
    the integrator); None, logged once, when the model is missing or cannot blend."""
    from lmcache.integration.vllm.blend_model import UnsupportedBlendModel, blend_model_for, model_for

    cfg = engine.config
    if engine.segments is None:
        return None
    model = model_for(engine_id)
    if model is None:
        logger.warning(
            "lmcache: blending unavailable on this worker: the served model is not registered "
            "(install lmcache so vLLM loads its 'vllm.general_plugins' entry point, or call "
            "VLLMModelTracker.register_model); blended prompts are recomputed"
        )
        return None
    try:
        bm = blend_model_for(model)
        config = BlendConfig(cfg.blend_ratios, cfg.blend_layers)
        if config.check_layers[-1] >= bm.num_layers:
            raise UnsupportedBlendModel(
                f"blend_check_layers={list(config.check_layers)} reaches past the model's {bm.num_layers} layers"
            )
    except (UnsupportedBlendModel, ValueError) as exc:
        logger.warning("lmcache: blending unavailable on this worker: %s; blended prompts are recomputed", exc)
        return None
    logger.info("lmcache: blending ready (%d layers, check layers %s)", bm.num_layers, list(config.check_layers))
    return BlendRunner(bm, engine.segments, config, cfg.blend_sink_tokens)
