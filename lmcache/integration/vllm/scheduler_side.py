"""Scheduler-side half of the adapter: lookups, request tracking, connector metadata.

Runs on vLLM's scheduler thread. Lookups block for at most the lookup timeout per
tensor-parallel rank (see :mod:`.lookup_service`); everything else is bookkeeping.

A disaggregated decode (:mod:`.pd`, signed parameters only) whose KV has not arrived
answers None ("ask again"), until ``pd_wait_timeout``. Waiting costs the other requests
little: a waiting request is looked up again at most every :data:`PD_POLL_SECONDS`; the
scheduler pauses at most once per step, and only after a step that ran nothing (vLLM's
engine loop would otherwise spin); at most ``pd_max_waiting`` requests wait at once
(more are computed at once); and nobody waits while the remote tier's breaker is open.
Any exception is logged once per kind and answered as "nothing cached", so a broken
cache makes vLLM compute, never fail.

Repeated lookups: vLLM asks again for a request that stays waiting (no free blocks) on
every scheduler step. When the workers' engines live in this process, the chunk keys of a
request's tokens are kept per request id (:class:`LookupMemo`) and only re-probed against
the cache, so a repeated lookup costs a key probe instead of hashing the prompt again. The
memo is dropped when the request's tokens change (a different prompt list, a different
length, or different tokens after the prompt), when it finishes, and beyond
``MAX_MEMOS`` requests (oldest first).
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from typing import Any

from lmcache.integration.vllm.blend_planner import BlendOffer, BlendPlanner, BlendRules
from lmcache.integration.vllm.connector_metadata import LMCacheConnectorMetadata
from lmcache.integration.vllm.lookup_service import LookupClient
from lmcache.integration.vllm.metadata_builder import AdapterSettings, lazy_store_usable
from lmcache.integration.vllm.request_tracker import PlannerConfig, RequestPlanner, RequestTracker
from lmcache.integration.vllm.failure_log import failure_logger
from lmcache.integration.vllm.naming import engine_for, socket_path
from lmcache.integration.vllm.stats_registry import register_scheduler_stats, unregister_scheduler_stats

from lmcache.v1.request import KEY_EXTRA_NAMES
from lmcache.v1.tiers import Tier

logger = logging.getLogger(__name__)

MAX_MEMOS = 4096
MAX_STATE_CANDIDATES = 64
"""Recurrent-state boundaries probed per lookup (the longest ones)."""
PD_POLL_SECONDS = 0.005
"""Shortest interval between two lookups of one request waiting for a prefiller's KV."""
PD_IDLE_PAUSE_SECONDS = 0.002
"""Pause, at most once per scheduler step and only after a step that scheduled nothing,
while requests wait for a prefiller's KV (vLLM's engine loop asks again at once)."""


@dataclass(frozen=True, slots=True)
class Match:
    """What a lookup offers vLLM: ``tokens`` to skip (None: ask again later) and whether
    they are loaded asynchronously (the request waits while others run)."""

    tokens: int | None
    load_async: bool = False


@dataclass(slots=True)
class LookupMemo:
    """Chunk keys of one request's tokens, per in-process engine (scheduler thread only)."""

    prompt: object
    """The request's prompt token list (identity compared: vLLM never replaces it)."""
    num_tokens: int
    tail: list[int]
    """Tokens after the prompt (outputs of a preempted request) when the keys were made."""
    keys: list[Any]
    """One :class:`~lmcache.v1.token_database.PrefixKeys` per worker engine."""

    @staticmethod
    def view(request: Any) -> tuple[object, int, list[int]]:
        prompt = request.prompt_token_ids
        n = int(getattr(request, "num_tokens", len(request.all_token_ids)))
        tail = list(request.all_token_ids[len(prompt) : n]) if n > len(prompt) else []
        return prompt, n, tail

    def matches(self, request: Any) -> bool:
        prompt = request.prompt_token_ids
        if prompt is not self.prompt:
            return False
        n = int(getattr(request, "num_tokens", len(request.all_token_ids)))
        if n != self.num_tokens:
            return False
        return not self.tail or list(request.all_token_ids[len(prompt) : n]) == self.tail


class LookupDispatcher:
    """Answers "how many leading tokens are cached?" for the scheduler.

    Uses the workers' engines directly when all of them live in this process
    (single-process vLLM), otherwise the workers' lookup servers. Returns None when
    no answer can be had (the caller treats it as a miss).
    """

    def __init__(self, settings: AdapterSettings) -> None:
        self.engine_id = settings.engine_id
        self.world_size = settings.world_size
        self.paths = [socket_path(settings.socket_dir, settings.engine_id, r) for r in range(settings.world_size)]
        self.timeout = settings.lookup_timeout
        self._client: LookupClient | None = None
        self.used_socket = False

    def _engines(self) -> list[Any] | None:
        engines = [engine_for(self.engine_id, r) for r in range(self.world_size)]
        return engines if all(e is not None for e in engines) else None

    def lookup(self, tokens: list[int], extras: dict[str, Any]) -> int | None:
        return self.lookup_keyed(tokens, extras)[0]

    def lookup_keyed(self, tokens: list[int], extras: dict[str, Any]) -> tuple[int | None, list[Any] | None]:
        """(hit, per-engine keys for :meth:`lookup_again`, or None over sockets)."""
        engines = self._engines()
        if engines is not None:
            keys = [e.prefix_keys(tokens, **extras) for e in engines]
            return min(e.lookup_prefix(pk) for e, pk in zip(engines, keys)), keys
        if self._client is None:
            self._client = LookupClient(self.paths, timeout=self.timeout)
        self.used_socket = True
        return self._client.lookup(tokens, extras), None

    def resident(self, tokens: list[int], extras: dict[str, Any], end: int) -> int | None:
        """Leading tokens, up to ``end``, whose whole chunks every rank's CPU tier holds
        (in process, or over the workers' lookup sockets); None when a rank cannot answer."""
        engines = self._engines()
        if engines is not None:
            return min(e.resident_prefix(e.prefix_keys(tokens, **extras), end) for e in engines)
        if self._client is None:
            self._client = LookupClient(self.paths, timeout=self.timeout)
        self.used_socket = True
        return self._client.resident(tokens, extras, end)

    def state_boundary(self, tokens: list[int], extras: dict[str, Any], boundaries: list[int]) -> int | None:
        """Hybrid models: the longest of ``boundaries`` whose recurrent state every rank holds
        (0: none; None: a rank could not answer), in process or over the lookup sockets;
        ranks that hold different sets are narrowed to a common boundary
        (:func:`~lmcache.integration.vllm.lookup_service.common_state_boundary`)."""
        from lmcache.integration.vllm.lookup_service import common_state_boundary
        from lmcache.v1.state_entries import latest_state

        engines = self._engines()
        if engines is not None:
            return common_state_boundary(
                lambda cands: [latest_state(e, tokens, cands, extras) for e in engines], boundaries, len(tokens)
            )
        if self._client is None:
            self._client = LookupClient(self.paths, timeout=self.timeout)
        self.used_socket = True
        return self._client.state(tokens, extras, boundaries)

    def lookup_segments(self, tokens: list[int], bounds: list[tuple[int, int, bytes]],
                        extras: dict[str, Any]) -> list[int] | None:  # fmt: skip
        """Cached leading tokens of each ``(start, end, lead)`` segment's own entries (minimum
        over ranks); None when no answer can be had."""
        engines = self._engines()
        if engines is not None:
            per = [e.lookup_segments(tokens, bounds, **extras) for e in engines]
            return [min(col) for col in zip(*per)] if bounds else []
        if self._client is None:
            self._client = LookupClient(self.paths, timeout=self.timeout)
        self.used_socket = True
        return self._client.lookup_segments(tokens, bounds, extras)

    def remote_available(self) -> bool | None:
        """Whether the workers' remote tier takes calls (False: its breaker is open or it is
        disabled); None when unknown (no in-process engines, or no remote tier)."""
        engines = self._engines()
        if engines is None:
            return None
        states = [b.available for e in engines for b in e.storage_manager.backends if b.tier == Tier.REMOTE]
        return all(states) if states else None

    def lookup_again(self, keys: list[Any]) -> int | None:
        """Probe keys from :meth:`lookup_keyed` again; None when the engines changed."""
        engines = self._engines()
        if engines is None or len(engines) != len(keys):
            return None
        return min(e.lookup_prefix(pk) for e, pk in zip(engines, keys))

    @property
    def last_error(self) -> str | None:
        return self._client.last_error if self._client is not None else None

    def close(self) -> None:
        if self._client is not None:
            self._client.close()


class SchedulerConnector:
    """The scheduler-role methods of ``LMCacheConnectorV1Impl``."""

    def __init__(
        self,
        settings: AdapterSettings,
        *,
        lookups: LookupDispatcher | None = None,
        blend_rules: BlendRules | None = None,
    ) -> None:
        self.settings = settings
        self.blender = BlendPlanner(blend_rules) if blend_rules is not None and settings.config.enable_blending else None
        """Blending's planner (None: blending off)."""
        self.planner = RequestPlanner(
            PlannerConfig(
                chunk_size=settings.chunk_size,
                block_size=settings.block_size,
                save_unfull_chunk=settings.config.save_unfull_chunk,
                reuse_block_size=settings.reuse_block_size,
                enable_load=settings.enable_load,
                enable_save=settings.enable_save,
                save_decode=settings.config.save_decode_cache,
                whole_prompt_only=settings.whole_prompt_hits,
                window=settings.window,
                group_windows=settings.kv_groups.group_windows(settings.block_size) if settings.hybrid else (),
                state_group=settings.kv_groups.state_group,
                state_block_size=settings.kv_groups.groups[settings.kv_groups.state_group].block_size
                if settings.kv_groups.state_group is not None else 0,
                pd=settings.pd,
                blend=self.blender is not None,
                lazy_store=lazy_store_usable(settings),
            )
        )
        self.fingerprint = settings.fingerprint
        self.lookups = lookups if lookups is not None else LookupDispatcher(settings)
        self._memos: dict[str, LookupMemo] = {}
        self._async: set[str] = set()
        """Requests waiting in vLLM for their asynchronous load (at most ``async_max_loads``)."""
        self._pd_waiting: set[str] = set()
        """Requests waiting for a prefiller's KV (at most ``pd_max_waiting``)."""
        self._step_idle = True
        """The last scheduler step scheduled nothing (set in :meth:`build_connector_meta`)."""
        self._paused = False
        """The scheduler paused for PD waiters since the last step."""
        self.warn = failure_logger(logger)
        self.counters = {
            "lookups": 0,
            "repeated_lookups": 0,
            "lookup_failures": 0,
            "offered_tokens": 0,
            "accepted_tokens": 0,
            "pd_sent_requests": 0,
            "pd_received_requests": 0,
            "pd_waits": 0,
            "pd_fallbacks": 0,
            "pd_fingerprint_mismatches": 0,
            "pd_wait_refused": 0,
            "pd_remote_down": 0,
            "blend_lookups": 0,
            "blend_offers": 0,
            "blend_offered_reused_tokens": 0,
            "blend_result_offers": 0,
            "blend_result_offered_tokens": 0,
            "async_loads": 0,
            "hybrid_sync_refused": 0,
            "state_cut_tokens": 0,
        }
        """Scheduler-side counters (scheduler thread only); see :meth:`snapshot`."""
        register_scheduler_stats(settings.engine_id, self.snapshot)

    def snapshot(self) -> dict[str, int]:
        """Counters of this scheduler side and its planner, ``scheduler_``-prefixed."""
        merged = {**self.counters, **self.planner.counters}
        if self.blender is not None:
            merged["blend_refused_prompts"] = self.blender.refused_prompts
        return {f"scheduler_{k}": int(v) for k, v in merged.items()}

    def get_num_new_matched_tokens(self, request: Any, num_computed_tokens: int) -> int | None:
        """External tokens vLLM may load for ``request``, synchronously; None (disaggregated
        decode only): the announced KV has not arrived yet, ask again later."""
        return self.match(request, num_computed_tokens).tokens

    def match(self, request: Any, num_computed_tokens: int, *, allow_async: bool = False) -> Match:
        """:meth:`get_num_new_matched_tokens`, and whether vLLM is to load them
        asynchronously (``allow_async``: the caller can report loads in ``get_finished``)."""
        offered = self._offer(request, num_computed_tokens)
        if offered and self.planner.config.hybrid:
            return self._hybrid_match(request, offered, allow_async)
        if not (allow_async and offered and self._load_async(request, num_computed_tokens, offered)):
            return Match(offered, False)
        return Match(offered, True)

    def _hybrid_match(self, request: Any, offered: int, allow_async: bool) -> Match:
        """Several KV cache groups: vLLM cannot take block-level load failures there (its
        scheduler raises), so a hit is loaded asynchronously, where a failure fails the whole
        request (recomputed from its start), or not at all: a miss past ``async_max_loads``
        loads in flight, or for a caller that cannot load asynchronously."""
        tracker = self.planner.get(request.request_id)
        if not allow_async or tracker is None or len(self._async) >= self.settings.config.async_max_loads:
            self.counters["hybrid_sync_refused"] += 1
            return Match(0, False)
        tracker.async_offer = True
        return Match(offered, True)

    def _load_async(self, request: Any, num_computed: int, offered: int) -> bool:
        """Whether ``offered`` tokens after ``num_computed`` are worth an asynchronous load:
        a blend, or a hit with whole chunks outside the CPU tier, at least ``async_min_tokens``
        of them (a CPU-tier hit is one memcpy, a short lower-tier part a short read: loaded in
        the step); never for disaggregated prefill; fewer than ``async_max_loads`` in flight.
        Marks the tracker's offer asynchronous."""
        cfg = self.settings.config
        tracker = self.planner.get(request.request_id)
        if not cfg.enable_async_loading or tracker is None or tracker.pd is not None:
            return False
        if self.planner.config.window is not None or len(self._async) >= cfg.async_max_loads:
            return False
        if tracker.blend is not None:  # a blend is compute (seconds): always off the step
            tracker.async_offer = True
            return True
        try:
            extras = tracker.result_extras if tracker.result_offer else tracker.key_extras
            allowed = {k: v for k, v in (extras or {}).items() if k in KEY_EXTRA_NAMES}
            end = num_computed + offered
            resident = self.lookups.resident(list(request.all_token_ids[:end]), allowed, end)
        except Exception as exc:  # noqa: BLE001 - unknown residency: load in the step
            self.warn("async-probe", "lmcache: CPU-tier probe failed (%s: %s); loading synchronously",
                      type(exc).__name__, exc)  # fmt: skip
            return False
        whole = end - end % self.planner.config.chunk_size  # a block-granular tail counts as resident
        if resident is None or resident >= whole or whole - max(resident, num_computed) < cfg.async_min_tokens:
            return False
        tracker.async_offer = True
        return True

    def _offer(self, request: Any, num_computed_tokens: int) -> int | None:
        try:
            if self._pd_poll_later(request):
                return None
            hit = self._lookup_again(request)
            if hit is None:
                tokens = self.planner.lookup_tokens(request)
                if tokens is None:
                    return 0
                tracker = self.planner.track(request)
                extras = {k: v for k, v in (tracker.key_extras if tracker else {}).items() if k in KEY_EXTRA_NAMES}
                self.counters["lookups"] += 1
                hit, keys = self.lookups.lookup_keyed(tokens, extras)
                if keys is not None:
                    self._remember(request, keys)
            if hit is None:
                self.counters["lookup_failures"] += 1
                self.warn("lookup", "lmcache: lookup unavailable (%s); treating as a miss", self.lookups.last_error)
                hit = 0
            tracker = self.planner.get(request.request_id)
            if tracker is not None and tracker.pd is not None and tracker.pd.receive:
                hit = self._wait_for_prefiller(tracker, hit)
                if hit is None:
                    return None
            if hit and self.planner.config.state_group is not None:
                hit = self._state_hit(request, tracker, hit)
            choice = self._plan_blend(request, tracker, num_computed_tokens, hit) if self.blender is not None else None
            if choice is not None and choice.result_hit:
                offered = self.planner.offer(request, num_computed_tokens, choice.result_hit, result=True)
            else:
                offered = self.planner.offer(request, num_computed_tokens, hit, choice.blend if choice else None)
            logger.debug(
                "lmcache: lookup %s: %d of %d tokens cached, %d offered to vLLM",
                request.request_id, hit, int(getattr(request, "num_tokens", 0)), offered,
            )  # fmt: skip
        except Exception as exc:  # noqa: BLE001 - a cache failure is a miss
            self.counters["lookup_failures"] += 1
            self.warn("lookup", "lmcache: lookup failed (%s: %s); treating as a miss", type(exc).__name__, exc)
            return 0
        self.counters["offered_tokens"] += offered
        return offered

    def _state_hit(self, request: Any, tracker: RequestTracker | None, hit: int) -> int:
        """A hybrid model's hit cut to the longest state boundary (a multiple of the planner's
        ``state_every``, short of the last token) whose recurrent state every worker holds:
        without its state, cached KV cannot resume the request (0: none)."""
        every = self.planner.config.state_every
        n = int(getattr(request, "num_tokens", len(request.all_token_ids)))
        top = min(hit, n - 1)
        cands = list(range(top - top % every, 0, -every))[:MAX_STATE_CANDIDATES]
        if not cands:
            return 0
        extras = {k: v for k, v in (tracker.key_extras if tracker else {}).items() if k in KEY_EXTRA_NAMES}
        found = self.lookups.state_boundary(list(request.all_token_ids[: cands[0]]), extras, cands)
        if found is None:
            self.warn("state-lookup", "lmcache: recurrent-state lookup unavailable (%s); treating as a miss",
                      self.lookups.last_error)  # fmt: skip
            return 0
        if found < hit:
            self.counters["state_cut_tokens"] += hit - found
        return found

    def _plan_blend(self, request: Any, tracker: RequestTracker | None, num_computed: int, hit: int) -> BlendOffer | None:
        """What to offer instead of the exact ``hit``: a blend or an earlier blend's result
        (None: the exact path). Splits the prompt into segments once (every prompt: its
        segments are stored when complete)."""
        blender = self.blender
        assert blender is not None
        if tracker is None or tracker.pd is not None:
            return None
        prompt = list(request.prompt_token_ids)
        if tracker.segments is None:
            tracker.segments = blender.segments(prompt)
        n = int(getattr(request, "num_tokens", len(request.all_token_ids)))
        if n != len(prompt) or not blender.eligible(n, num_computed) or len(tracker.segments) < 1:
            return None
        extras = {k: v for k, v in tracker.key_extras.items() if k in KEY_EXTRA_NAMES}
        if tracker.result_extras is None:
            tracker.result_extras = blender.result_extras(extras)
        self.counters["blend_lookups"] += 1
        cached = self.lookups.lookup_segments(prompt, [seg.bound for seg in tracker.segments], extras)
        if cached is None:
            self.warn("blend-lookup", "lmcache: segment lookup unavailable (%s); not blending", self.lookups.last_error)
            return None
        spec = blender.plan(n, tracker.segments, cached, hit, blender.rules.cost)
        result_hit = 0
        if hit < n - 1:  # an earlier blend of this prompt (or of its beginning)
            result_hit, _ = self.lookups.lookup_keyed(prompt, tracker.result_extras)
            result_hit = result_hit or 0
        choice = blender.choose(n, hit, spec, result_hit, blender.rules.cost)
        if choice is not None and choice.result_hit:
            self.counters["blend_result_offers"] += 1
            self.counters["blend_result_offered_tokens"] += choice.result_hit
            logger.debug(
                "lmcache: %s: %d of %d tokens from an earlier blend (exact prefix: %d, a new blend: %d reused)",
                request.request_id, choice.result_hit, n, hit, spec.reused_tokens if spec else 0,
            )  # fmt: skip
            return choice
        if spec is not None:
            self.counters["blend_offers"] += 1
            self.counters["blend_offered_reused_tokens"] += spec.reused_tokens
            logger.debug(
                "lmcache: blend %s: %d of %d tokens from %d cached segments (exact prefix: %d)",
                request.request_id, spec.reused_tokens, n, len(spec.reused), hit,
            )  # fmt: skip
        return choice

    def _pd_poll_later(self, request: Any) -> bool:
        """True when ``request`` waits for a prefiller's KV and was looked up less than
        :data:`PD_POLL_SECONDS` ago (answer "ask again" without a lookup)."""
        tracker = self.planner.get(request.request_id)
        if tracker is None or tracker.pd is None or tracker.pd_deadline is None:
            return False
        if time.monotonic() >= tracker.pd_next_poll:
            return False
        self._idle_pause()
        return True

    def _idle_pause(self) -> None:
        """Pause once per step while requests wait, only after a step that ran nothing."""
        if self._step_idle and not self._paused:
            self._paused = True
            time.sleep(PD_IDLE_PAUSE_SECONDS)

    def _wait_for_prefiller(self, tracker: RequestTracker, hit: int) -> int | None:
        """Decoder side of disaggregated prefill: ``hit`` once the tokens the prefiller
        announced are found (or on a fingerprint mismatch, with the remote tier down, with
        ``pd_max_waiting`` requests already waiting, or after ``pd_wait_timeout``: a counted
        fallback, the rest is computed here); None while still waiting."""
        pd = tracker.pd
        assert pd is not None
        cfg = self.settings.config
        if tracker.pd_deadline is None:
            self.counters["pd_received_requests"] += 1
            diffs = self.fingerprint.differences(pd.fingerprint) if pd.fingerprint is not None else []
            if diffs:
                self.counters["pd_fingerprint_mismatches"] += 1
                self.warn(
                    "pd-fingerprint:" + "; ".join(diffs),
                    "lmcache PD: request %s: the prefiller's KV cannot be used by this decoder (%s); "
                    "computing the prompt here",
                    tracker.req_id,
                    "; ".join(diffs),
                )
                tracker.pd = None
                return hit
        expected = min(pd.expected_tokens if pd.expected_tokens is not None else tracker.prompt_len, tracker.prompt_len)
        if hit >= expected:
            return self._pd_done(tracker, hit)
        if self.lookups.remote_available() is False:
            self.counters["pd_remote_down"] += 1
            self.warn("pd-remote-down", "lmcache PD: request %s: the remote tier is unavailable (breaker open); "
                      "computing the prompt here without waiting", tracker.req_id)  # fmt: skip
            return self._pd_done(tracker, hit, fallback=True)
        now = time.monotonic()
        if tracker.pd_deadline is None:
            self._pd_waiting = {r for r in self._pd_waiting if self.planner.get(r) is not None}  # drop the gone
            if len(self._pd_waiting) >= cfg.pd_max_waiting:
                self.counters["pd_wait_refused"] += 1
                self.warn("pd-wait-refused", "lmcache PD: request %s: %d requests already wait for a prefiller's "
                          "KV (pd_max_waiting); computing the prompt here", tracker.req_id, len(self._pd_waiting))
                return self._pd_done(tracker, hit, fallback=True)
            tracker.pd_deadline = now + cfg.pd_wait_timeout
            self._pd_waiting.add(tracker.req_id)
        if now < tracker.pd_deadline:
            self.counters["pd_waits"] += 1
            tracker.pd_next_poll = now + PD_POLL_SECONDS
            self._idle_pause()
            return None
        self.warn(
            "pd-timeout",
            "lmcache PD: request %s: %d of the %d tokens the prefiller announced were found within "
            "pd_wait_timeout=%s s; computing the rest here",
            tracker.req_id,
            hit,
            expected,
            cfg.pd_wait_timeout,
        )
        return self._pd_done(tracker, hit, fallback=True)

    def _pd_done(self, tracker: RequestTracker, hit: int, *, fallback: bool = False) -> int:
        """End ``tracker``'s wait with ``hit`` (a counted fallback when the KV did not all come)."""
        if fallback:
            self.counters["pd_fallbacks"] += 1
        self._pd_waiting.discard(tracker.req_id)
        tracker.pd = None
        return hit

    def _lookup_again(self, request: Any) -> int | None:
        """Hit of a repeated lookup from the request's memo; None without a valid memo."""
        memo = self._memos.get(request.request_id)
        if memo is None:
            return None
        if not memo.matches(request):
            del self._memos[request.request_id]
            return None
        hit = self.lookups.lookup_again(memo.keys)
        if hit is None:
            del self._memos[request.request_id]
            return None
        self.counters["lookups"] += 1
        self.counters["repeated_lookups"] += 1
        return hit

    def _remember(self, request: Any, keys: list[Any]) -> None:
        prompt, n, tail = LookupMemo.view(request)
        self._memos.pop(request.request_id, None)
        while len(self._memos) >= MAX_MEMOS:
            del self._memos[next(iter(self._memos))]
        self._memos[request.request_id] = LookupMemo(prompt, n, tail, keys)

    def update_state_after_alloc(self, request: Any, num_external_tokens: int, block_ids: Any = None) -> None:
        """vLLM allocated ``request``'s blocks (``block_ids``: one list per KV cache group,
        given by the Dynamic connector; needed for an asynchronous load)."""
        try:
            if self.planner.on_alloc(request, num_external_tokens, block_ids):
                self._async.add(request.request_id)
                self.counters["async_loads"] += 1
            self.counters["accepted_tokens"] += max(0, int(num_external_tokens))
        except Exception as exc:  # noqa: BLE001
            self.warn("alloc", "lmcache: tracking request failed (%s: %s)", type(exc).__name__, exc)

    def build_connector_meta(self, scheduler_output: Any) -> LMCacheConnectorMetadata:
        self._step_idle = not getattr(scheduler_output, "total_num_scheduled_tokens", 0)
        self._paused = False
        if self._async:  # a request scheduled again has its KV: its asynchronous load is over
            self._async.difference_update(r.req_id for r in scheduler_output.scheduled_new_reqs)
        try:
            return LMCacheConnectorMetadata(self.planner.build(scheduler_output), idle=self._step_idle)
        except Exception as exc:  # noqa: BLE001
            self.warn(
                "meta",
                "lmcache: building connector metadata failed (%s: %s); nothing loaded or saved this step",
                type(exc).__name__,
                exc,
            )
            return LMCacheConnectorMetadata()

    def request_finished(self, request: Any, block_ids: list[int]) -> tuple[bool, dict[str, Any] | None]:
        """Saves are synchronous (done in ``wait_for_save``): blocks can be freed at once.
        With ``lazy_store`` the request's KV is stored now, once: vLLM keeps its blocks
        until the workers report the store (True). A prefill for a remote decoder returns the
        decoder leg's ``kv_transfer_params`` (its KV is durable in the remote store by now:
        its saves were waited for)."""
        tracker = self.planner.get(request.request_id)
        params = None
        if tracker is not None and tracker.pd is not None and tracker.pd.send:
            params = self.fingerprint.transfer_params(list(request.prompt_token_ids))
            self.counters["pd_sent_requests"] += 1
        delay = False
        if self.planner.config.lazy_store:
            try:
                delay = self.planner.defer_store(request)
            except Exception as exc:  # noqa: BLE001 - a store not planned is a future miss
                self.warn("lazy", "lmcache: planning the store of finished %s failed (%s: %s); not stored",
                          request.request_id, type(exc).__name__, exc)  # fmt: skip
        self.planner.finish(request.request_id)
        self._memos.pop(request.request_id, None)
        self._pd_waiting.discard(request.request_id)
        self._async.discard(request.request_id)
        return delay, params

    def close(self) -> None:
        unregister_scheduler_stats(self.settings.engine_id, self.snapshot)
        self.lookups.close()
