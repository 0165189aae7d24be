"""Worker-side half of the adapter: load cached KV before the forward, save after it.

Thread and blocking: every method runs on the worker thread that runs the forward
pass, in vLLM's order per step: ``bind`` -> ``start_load_kv`` -> per layer
(``wait_for_layer_load``, attention, ``save_kv_layer``) -> ``wait_for_save`` ->
``take_load_errors``. Copies are synchronous on CPU (on CUDA the GPU connector
synchronises its side streams before returning), so when ``start_load_kv`` returns
the KV is in vLLM's paged cache, and when ``wait_for_save`` returns it is in lmcache.

The mode is fixed when the connector is built (:class:`BulkSteps` or
:class:`LayerwiseSteps`, matching the engine's transfer path); the per-step methods
have no mode branches.

Bulk mode (``use_layerwise: false``): one ``LMCacheEngine.retrieve`` per loading
request in ``start_load_kv`` and one ``LMCacheEngine.store`` per saving request in
``wait_for_save``.

Layerwise mode: ``start_load_kv`` creates a ``retrieve_layer`` generator per loading
request and advances it twice (setup, layer 0); each ``wait_for_layer_load`` advances
every generator one step (the next layer; after the last layer the generator returns
the retrieved-token mask). The first ``save_kv_layer`` of a step creates a
``store_layer`` generator per saving request and every ``save_kv_layer`` advances them
one layer; ``wait_for_save`` makes the final call. A request that also loads in the
same step is stored whole in ``wait_for_save`` instead, once its load is known to be
complete, so a failed load can never put half-loaded KV into the cache.

Disaggregated prefill (a save marked ``durable``): the step's writes wait for room in the
remote tier's write budget instead of being dropped, and ``wait_for_save`` returns once
they are in the remote store (each wait bounded by ``pd_wait_timeout``).

Blending (``enable_blending``, :mod:`.blend_worker`): a load marked ``blend`` is computed,
not retrieved, in ``start_load_kv`` (both modes): the cached segments are read and the
selective recompute runs through the served model's layers before the forward; a step's
``segment_saves`` are stored under segment keys at the end of ``wait_for_save``, and its
``result_save`` (a blended prompt's approximate KV) under the blend-result keys
(``result_key_extras``), whole, after the step's other stores. A load marked
``load_result`` reads those keys instead of the exact prefix's.

Several KV cache groups (vLLM's hybrid KV cache manager, ``kv_groups``): each layer is
copied through its group's row of the slot mapping (the GPU connector's layer groups,
set at registration). Every load is asynchronous there, and a failed one is reported for
the whole request (:meth:`WorkerConnector.take_failed_loads`, vLLM's ``failed_recving``):
vLLM takes no block-level failures with several groups.

Recurrent state (a ``MambaSpec`` group: Mamba2 / gated-delta-net hybrids): those layers'
tensors are kept apart (``state_rows``: one byte row per vLLM block); a step's
``state_save`` stores the rows of its state block after the KV (:mod:`lmcache.v1.state_entries`),
and a load with ``state_load`` writes the stored rows into the request's state block once
its KV is in; a missing state fails the whole load (never a partial restore).

Failures: any exception, or a retrieve that returns fewer tokens than the scheduler
promised vLLM, turns into "blocks with load errors" for the missing range; vLLM
(``kv_load_failure_policy="recompute"``) then recomputes them. The request's saves
are skipped for that step (its KV is not trustworthy yet). One log line per kind of
failure; counters in ``CacheStats``.

Memory: the adapter keeps references to vLLM's KV tensors (registered once) and to
the step's metadata until the next ``bind``; lmcache memory objects are owned and
released by the engine.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import nullcontext
from dataclasses import dataclass, replace
from typing import Any

import numpy as np
import torch

from lmcache.integration.vllm.blend_worker import BlendOutcome, BlendRunner
from lmcache.integration.vllm.async_loads import AsyncLoads, CopyResult, PendingLoad
from lmcache.integration.vllm.connector_metadata import LMCacheConnectorMetadata, LoadSpec, ReqMeta, SaveSpec, StateRef
from lmcache.integration.vllm.failure_log import failure_logger
from lmcache.integration.vllm.kv_groups import KVGroups
from lmcache.integration.vllm.layer_order import ordered_layers
from lmcache.integration.vllm.request_inputs import blocks_of_tokens
from lmcache.v1.cache_engine import LMCacheEngine
from lmcache.v1.gpu_connector.layouts import detect_layout
from lmcache.v1.state_entries import boundary_key, get_state, put_state

logger = logging.getLogger(__name__)


def _byte_rows(t: torch.Tensor, name: str) -> torch.Tensor:
    """``[num_blocks, row_bytes]`` uint8 view of a recurrent layer's state tensor (vLLM hands
    the connector one raw view per layer: each block's conv and SSM state back to back)."""
    if not isinstance(t, torch.Tensor) or t.dim() < 2:
        raise ValueError(f"{name}: expected a [num_blocks, ...] state tensor, got {type(t).__name__}")
    flat = t.view(t.shape[0], -1)  # raises when a block's bytes are not one contiguous run
    if flat.stride(1) != 1:
        raise ValueError(f"{name}: a block's state is not contiguous (strides {tuple(t.stride())})")
    return flat.view(torch.uint8)


def chunk_mask(n: int, skip: int, chunk_size: int) -> torch.Tensor | None:
    """Engine mask for ``n`` tokens whose first ``skip`` (rounded down to chunks) are left alone."""
    skip -= skip % chunk_size
    if skip <= 0:
        return None
    mask = torch.ones(n, dtype=torch.bool)
    mask[:skip] = False
    return mask


ASYNC_IDLE_WAIT_SECONDS = 0.01
"""In a step that scheduled nothing, how long the worker waits for an asynchronous load to
settle before returning to vLLM (which would otherwise run its next empty step at once)."""


@dataclass(slots=True)
class _Retrieval:
    req: ReqMeta
    gen: Iterator[torch.Tensor | None]
    errors_before: int
    done: bool = False


@dataclass(slots=True)
class _Storage:
    req: ReqMeta
    gen: Iterator[None]


class BulkSteps:
    """Bulk mode: a whole retrieve per load in ``start_load_kv``; nothing per layer."""

    name = "bulk"

    def start_loads(self, w: WorkerConnector, loads: list[ReqMeta]) -> None:
        for req in loads:
            w._load_bulk(req)

    def save_layer(self, w: WorkerConnector) -> None:
        """Saves happen whole, in ``wait_for_save``."""


class LayerwiseSteps:
    """Layerwise mode: retrieve generators advanced per layer; store generators started at the first layer."""

    name = "layerwise"

    def start_loads(self, w: WorkerConnector, loads: list[ReqMeta]) -> None:
        for i, req in enumerate(loads):
            w._start_retrieval(req, last=i == len(loads) - 1)

    def save_layer(self, w: WorkerConnector) -> None:
        if w._storages is None:
            w._storages = []
            streaming = [
                r
                for r in w._reqs
                if r.save is not None and r.load is None and not r.finished_store and r.req_id not in w._failed
            ]
            for i, req in enumerate(streaming):
                w._start_storage(req, first=i == 0)
        for s in list(w._storages):
            w._advance_storage(s)


class WorkerConnector:
    """Loads and saves KV for the requests of each step (see the module docstring)."""

    def __init__(
        self,
        engine: LMCacheEngine,
        *,
        layerwise: bool,
        saves: bool = True,
        blend_runner: Callable[[], BlendRunner | None] | None = None,
        kv_groups: KVGroups | None = None,
    ) -> None:
        self.engine = engine
        self.kv_groups = kv_groups if kv_groups is not None and kv_groups.hybrid else None
        """vLLM's KV cache groups when there are several (hybrid KV cache manager), else None."""
        self._failed_loads: set[str] = set()
        """Requests whose load failed as a whole (several groups), for :meth:`take_failed_loads`."""
        self.state_rows: list[torch.Tensor] = []
        """The recurrent layers' blocks as ``[num_blocks, row_bytes]`` uint8 views (a state group)."""
        self._make_runner = blend_runner
        self._runner: BlendRunner | None = None
        """Blending (:mod:`.blend_worker`), made on first use by ``blend_runner``."""
        self.saves = saves
        """False on tensor-parallel ranks other than 0 with ``save_only_first_rank``: loads only."""
        self.steps: BulkSteps | LayerwiseSteps = LayerwiseSteps() if layerwise else BulkSteps()
        self.chunk_size = engine.config.chunk_size
        self.kvcaches: list[torch.Tensor] | None = None
        self.layer_names: list[str] = []
        self._layer_set: set[str] = set()
        self.enabled = True
        self._reqs: list[ReqMeta] = []
        self._failed: set[str] = set()
        self._load_errors: set[int] = set()
        self._retrievals: list[_Retrieval] = []
        self._storages: list[_Storage] | None = None
        self.warn = failure_logger(logger)
        self.events: Any = None
        """A :class:`~.kv_events.KVEventRecorder` when vLLM publishes KV events."""
        cfg = engine.config
        on = getattr(cfg, "enable_async_loading", False)  # integrators' engines may predate the key
        self.async_loads = AsyncLoads(engine, cfg.async_load_timeout) if on else None
        """Asynchronous loads in flight (``enable_async_loading``; :mod:`.async_loads`)."""
        self._copying: list[PendingLoad] = []
        """Asynchronous loads being copied into their blocks, a budget of tokens per step."""
        self._idle = False
        """This step's metadata says vLLM scheduled no tokens (``LMCacheConnectorMetadata.idle``)."""
        self._blend_lock = threading.Lock()
        """One blend at a time (the blend thread's and, past ``async_max_loads``, the step's)."""
        self._async_done: set[str] = set()
        """Asynchronous loads settled outside :meth:`finish_async` (failed at once), to report."""

    def _describe(self, req: ReqMeta, n: int) -> None:
        """Describe the first ``n`` tokens' chunks to the KV-event recorder (if any)."""
        if self.events is None:
            return
        from lmcache.integration.vllm.kv_events import describe_request

        try:
            describe_request(self.events, self.engine, req.token_ids[:n], req.key_extras)
        except Exception as exc:  # noqa: BLE001 - events never break loads or saves
            self.warn("events", "lmcache: KV events unavailable for %s (%s: %s)", req.req_id, type(exc).__name__, exc)

    # ------------------------------------------------------------------ setup
    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        """Take vLLM's per-layer KV tensors (model order is recovered from the names); a
        hybrid model's recurrent layers are kept apart (:attr:`state_rows`)."""
        state_names = self.kv_groups.state_layers() if self.kv_groups is not None else ()
        if state_names:
            try:
                self.state_rows = [_byte_rows(kv_caches[n], n) for n in state_names]
            except (KeyError, RuntimeError, ValueError) as exc:
                self.enabled = False
                logger.error("lmcache disabled for this worker: recurrent-state layers unusable (%s: %s); vLLM runs "
                             "without the cache", type(exc).__name__, exc)  # fmt: skip
                return
            kv_caches = {k: v for k, v in kv_caches.items() if k not in set(state_names)}
        names = ordered_layers(kv_caches)
        tensors = [kv_caches[n] for n in names]
        md = self.engine.metadata
        problem = None
        layout_name = "?"
        groups: tuple[int, ...] | None = None
        if len(tensors) != md.num_layers:
            problem = f"{len(tensors)} KV layers registered, the model config says {md.num_layers}"
        elif tensors[0].dtype != md.kv_dtype:
            problem = f"KV dtype {tensors[0].dtype} differs from the expected {md.kv_dtype}"
        else:
            try:
                layout = detect_layout(tensors[0], use_mla=md.use_mla)
                layout.geometry(tensors[0])
                layout_name = layout.name
                groups = self.kv_groups.layer_groups(names) if self.kv_groups is not None else None
            except ValueError as exc:
                problem = str(exc)
        if problem is not None:
            self.enabled = False
            logger.error("lmcache disabled for this worker: %s; vLLM runs without the cache", problem)
            return
        self.kvcaches = tensors
        self.layer_names = names
        self._layer_set = set(names)
        if self.engine.gpu_connector is not None:
            self.engine.gpu_connector.register_kv_caches(tensors)
            if groups is not None:
                assert self.kv_groups is not None
                self.engine.gpu_connector.set_layer_groups(groups, primary=self.kv_groups.primary)
        logger.info(
            "lmcache: registered %d KV layers, layout %s, shape %s, dtype %s (%s mode)",
            len(tensors),
            layout_name,
            tuple(tensors[0].shape),
            tensors[0].dtype,
            self.steps.name,
        )

    def unregister_kv_caches(self) -> None:
        """Forget vLLM's KV tensors (vLLM 0.33's sleep hook): no reference to them is kept,
        here or in the GPU connector, and the cache is off (lookups over the socket answer 0, a
        load the scheduler still plans is reported as failed and recomputed, saves are skipped).
        Idempotent."""
        self._close_generators()
        self._reqs = []
        self.kvcaches = None
        self.layer_names = []
        self._layer_set = set()
        self.enabled = False
        connector = self.engine.gpu_connector
        if connector is not None:
            connector.kvcaches = None

    # ------------------------------------------------------------------ per step
    def bind(self, metadata: Any) -> None:
        """New step: take its metadata and reset the per-step state."""
        self._close_generators()
        self._reqs = list(metadata.requests) if isinstance(metadata, LMCacheConnectorMetadata) else []
        self._idle = isinstance(metadata, LMCacheConnectorMetadata) and metadata.idle
        if not self.saves:
            self._reqs = [replace(r, save=None, segment_saves=(), result_save=None) for r in self._reqs]
        self._failed = set()
        for req in self._reqs:
            if req.invalid_block_ids or req.load_failed:
                self._load_errors.update(req.invalid_block_ids)
                self._failed.add(req.req_id)
                if req.load_failed:
                    self._failed_loads.add(req.req_id)
                if req.load_async:  # vLLM waits for it: report it settled (failed)
                    self._async_done.add(req.req_id)

    def _usable(self) -> bool:
        return self.enabled and self.kvcaches is not None

    def start_load_kv(self) -> None:
        loads = [r for r in self._reqs if r.load is not None and r.req_id not in self._failed]
        if not loads:
            return
        if not self._usable():
            for req in loads:
                self._fail(
                    req,
                    req.load.num_local,
                    "disabled",
                    "lmcache: cache unusable on this worker; recomputing %s",
                    req.req_id,
                )
                if req.load_async:
                    self._async_done.add(req.req_id)
            return
        for req in loads:
            if req.blend is not None and req.load_async:
                self._start_async_blend(req)
            elif req.blend is not None:
                self._blend(req)
            elif req.load_async:
                self._start_async(req)
        self.steps.start_loads(self, [r for r in loads if r.blend is None and not r.load_async])

    # ------------------------------------------------------------------ asynchronous loads
    def _start_async(self, req: ReqMeta) -> None:
        """Prefetch ``req``'s hit in the background (the request waits in vLLM meanwhile)."""
        if self.async_loads is None:  # scheduler and worker disagree: load now, report it done
            self._load_bulk(req)
            self._async_done.add(req.req_id)
            return
        self.async_loads.start(req, self._copy_in_background if self._background_copies() else None)
        self.engine.stats.add(async_loads=1)

    def _background_copies(self) -> bool:
        """Whether the prefetch thread copies a load into its blocks itself: CPU KV (no stream
        to order the copy against the forward pass) and ``async_copy_in_background``."""
        caches = self.kvcaches
        return (
            bool(getattr(self.engine.config, "async_copy_in_background", False))
            and caches is not None
            and len(caches) > 0
            and caches[0].device.type == "cpu"
        )

    def _copy_in_background(self, req: ReqMeta, start: int, stop: int) -> torch.Tensor:
        """Prefetch thread, as its reads land: copy tokens ``[start, stop)`` of ``req``'s load
        into its blocks (vLLM does not touch them while the request waits for its KV). Only
        chunks the CPU tier holds are read (the range is cut at the first one it does not
        hold), so this does not wait on a lower tier, except for the load's last part: a
        block-granular tail of another entry, which is not prefetched (docs/async_loading.md).
        Returns ``CacheEngine.retrieve``'s mask; the worker thread records the whole copy
        (:meth:`_record_copy`)."""
        spec = req.load
        assert spec is not None
        held = self._resident_end(req)
        if stop < spec.end or held < spec.load_len - spec.load_len % self.chunk_size:
            stop = min(stop, held)
        if stop <= start:
            return torch.zeros(0, dtype=torch.bool)
        part = LoadSpec(start, stop - start, spec.load_len if stop >= spec.end else stop)
        tokens, mask, kwargs = self._load_args(replace(req, load=part))
        return self.engine.retrieve(tokens, mask, **kwargs)

    def _record_copy(self, req: ReqMeta, result: CopyResult) -> None:
        """Worker thread: account for a load the prefetch thread copied (failed blocks, state)."""
        assert req.load is not None
        if result.load is None:
            self._fail(req, req.load.num_local, "async-miss", "lmcache: nothing of %s's hit in the CPU tier after its "
                       "prefetch; recomputing", req.req_id)  # fmt: skip
            return
        if result.error is not None:
            self.engine.stats.add(load_errors=1)
            self._fail_load(req, result.error)
            return
        assert result.written is not None
        self.engine.stats.add(async_background_copies=1)
        self._describe(req, result.load.load_len)
        self._loaded(replace(req, load=result.load), result.written)

    def _start_async_blend(self, req: ReqMeta) -> None:
        """Blend ``req`` on the blend thread while vLLM runs the other requests."""
        assert req.blend is not None
        runner = self._blend_runner()
        if self.async_loads is None or runner is None or self.kvcaches is None:
            self._blend(req)  # reports the failure when there is no runner
            self._async_done.add(req.req_id)
            return
        spec, kvcaches = req.blend, self.kvcaches

        def work() -> BlendOutcome:
            with self._blend_lock, torch.inference_mode():
                return runner.run(req, spec, kvcaches)

        self.async_loads.start_blend(req, work)
        self.engine.stats.add(async_loads=1)

    def finished_store_ids(self) -> set[str]:
        """The finished requests whose store (``lazy_store``) is in this step's metadata."""
        return {r.req_id for r in self._reqs if r.finished_store}

    def store_finished(self) -> set[str]:
        """vLLM's worker thread, once per step (``get_finished``, with or without a forward):
        store the finished requests of this step's metadata (``lazy_store``; vLLM holds their
        blocks until then) and return their ids, stored or not (a failed store is logged and
        is a future miss; vLLM frees the blocks either way)."""
        done = self.finished_store_ids()
        if done and self._usable():
            for req in self._reqs:
                if req.finished_store and req.save is not None:
                    self._store_whole(req)  # a failure is logged there and skipped
        return done

    def finish_async(self) -> set[str]:
        """vLLM's worker thread, once per step (``get_finished``): copy the asynchronous loads
        that are ready (prefetched, or past ``async_load_timeout``) into their blocks. Returns
        the ids of every asynchronous load settled since the last call (loaded or failed: a
        failure's blocks are among :meth:`take_load_errors`)."""
        done, self._async_done = self._async_done, set()
        if self.async_loads is None:
            return done
        if self._idle and not done and not self._copying:
            # a step that ran nothing: vLLM would step again at once, and its empty steps in a
            # tight loop take the interpreter from the prefetch threads; wait for them a little
            self.async_loads.wait_settled(ASYNC_IDLE_WAIT_SECONDS)
        if len(self.async_loads):
            self._copying.extend(self.async_loads.ready())
        budget = self.engine.config.async_copy_step_tokens
        still: list[PendingLoad] = []
        for pending in self._copying:
            finished = True
            try:
                if budget > 0 or pending.blend:
                    budget, finished = self._copy_async(pending, budget)
                else:
                    finished = False  # this step's copy budget is spent: the next step goes on
            except Exception as exc:  # noqa: BLE001 - a cache failure is a recompute
                self._fail_load(pending.req, exc)
            if finished or pending.req.req_id in self._failed:
                done.add(pending.req.req_id)  # vLLM holds the request until it is reported
                self.engine.latency["async_load"].observe(time.monotonic() - pending.started)
                pending.release()
            else:
                still.append(pending)
        self._copying = still
        return done

    def _copy_async(self, pending: PendingLoad, budget: int) -> tuple[int, bool]:
        """Copy the next part of ``pending`` (at most ``budget`` tokens, whole chunks; a
        blend's result is in the blocks already). Returns (budget left, whether it is done)."""
        req = pending.req
        spec = req.load
        assert spec is not None
        if pending.blend:
            assert pending.future is not None
            try:
                outcome = pending.future.result()
            except Exception as exc:  # noqa: BLE001 - a failed blend is a recompute, never wrong KV kept
                self._blend_failed(req, exc)
                return budget, True
            self._blend_done(req, outcome)
            return budget, True
        if not self._usable():
            self._fail(req, spec.num_local, "disabled", "lmcache: cache unusable on this worker; recomputing %s",
                       req.req_id)  # fmt: skip
            return budget, True
        if pending.copy is not None:  # the prefetch thread copied it
            self._record_copy(req, pending.copy)
            return budget, True
        if pending.timed_out and pending.progress is not None:  # a background copy, stopped at the deadline
            self._async_timed_out(req)
            self._record_copy(req, pending.progress)
            return budget, True
        if pending.copied == 0 and pending.timed_out:  # only what the CPU tier holds: a frozen tier must not block
            self._async_timed_out(req)
            part = self._resident_part(req)
            if part is None:
                self._fail(req, spec.num_local, "async-miss", "lmcache: nothing of %s's hit in the CPU tier at its "
                           "deadline; recomputing", req.req_id)  # fmt: skip
                return budget, True
            pending.req = req = part
            spec = part.load
            assert spec is not None
        start = max(spec.num_local, pending.copied)
        c = self.chunk_size
        stop = min(spec.end, start - start % c + max(c, budget - budget % c))  # whole chunks, at least one
        last = stop >= spec.end
        part = LoadSpec(start, stop - start, spec.load_len if last else stop)
        self._load_bulk(replace(req, load=part))
        if req.req_id in self._failed and not last:  # the rest is not loaded either
            self._fail(req, stop, "short", "lmcache: %s: the rest of its asynchronous load is recomputed", req.req_id)
        pending.copied = stop
        return budget - (stop - start), last

    def _async_timed_out(self, req: ReqMeta) -> None:
        """Account for an asynchronous load cut at ``async_load_timeout`` (logged once)."""
        self.engine.stats.add(async_load_timeouts=1)
        self.warn("async-timeout", "lmcache: asynchronous load of %s not done within async_load_timeout=%s s; "
                  "loading what the CPU tier holds, recomputing the rest", req.req_id,
                  self.engine.config.async_load_timeout)  # fmt: skip
        self.engine.storage_manager.suspect_remote("an asynchronous load was not read within async_load_timeout")

    def _resident_end(self, req: ReqMeta) -> int:
        """Leading tokens of ``req``'s load whose whole chunks the CPU tier holds now."""
        assert req.load is not None
        pk = self.engine.prefix_keys(req.token_ids[: req.load.load_len], **req.load_key_extras)
        return self.engine.resident_prefix(pk, req.load.load_len)

    def _resident_part(self, req: ReqMeta) -> ReqMeta | None:
        """``req`` with its load cut to what the CPU tier holds now (the rest is then reported
        failed by the copy's check), or None when that is nothing."""
        spec = req.load
        assert spec is not None
        held = self._resident_end(req)
        if held <= spec.num_local:
            return None
        return replace(req, load=LoadSpec(spec.num_local, spec.num_external, min(spec.load_len, held)))

    def close_async(self) -> None:
        """Shutting down: drop the pending loads (vLLM is stopping; nothing waits for them)."""
        if self.async_loads is not None:
            self.async_loads.close()

    def wait_for_layer_load(self, layer_name: str) -> None:
        if not self._retrievals or layer_name not in self._layer_set:
            return
        for r in self._retrievals:
            self._advance_retrieval(r)

    def save_kv_layer(self, layer_name: str) -> None:
        if layer_name not in self._layer_set or not self._usable():
            return
        self.steps.save_layer(self)

    def wait_for_save(self) -> None:
        # a retrieval the forward did not drive to its end (safety net)
        for r in self._retrievals:
            while not r.done:
                self._advance_retrieval(r)
        self._retrievals = []
        if not self._usable():
            self._storages = None
            return
        durable = [r.req_id for r in self._reqs if r.durable and r.save is not None and r.req_id not in self._failed]
        cfg = self.engine.config
        with self.engine.storage_manager.waiting_writes(cfg.pd_wait_timeout, cfg.pd_buffer_size) if durable else nullcontext():
            streamed: set[str] = set()
            for s in self._storages or ():
                streamed.add(s.req.req_id)
                self._finish_storage(s)
            self._storages = None
            for req in self._reqs:
                if req.save is None or req.finished_store or req.req_id in self._failed or req.req_id in streamed:
                    continue
                self._store_whole(req)
                if req.state_save is not None and self.state_rows:
                    self._store_state(req, req.state_save)
        if durable:
            self._make_durable(durable)
        for req in self._reqs:
            if req.req_id in self._failed:
                continue
            if req.result_save is not None:
                self._store_result(req)
            if req.segment_saves:
                self._store_segments(req)

    def _make_durable(self, req_ids: list[str]) -> None:
        """Disaggregated prefill: return only when this step's writes are in the remote store
        (bounded by ``pd_wait_timeout``), so the prefiller's answer implies its KV is there."""
        timeout = self.engine.config.pd_wait_timeout
        if not self.engine.storage_manager.flush(timeout):
            self.warn(
                "pd-flush",
                "lmcache PD: writes of %s not durable in the remote tier within pd_wait_timeout=%s s; "
                "a decoder may compute them itself",
                ", ".join(req_ids),
                timeout,
            )

    def fail_all_loads(self, exc: BaseException) -> None:
        """An unexpected error in a load phase: every load of this step becomes a recompute."""
        self._close_generators()
        for req in self._reqs:
            if req.load is not None and req.req_id not in self._failed:
                self._fail_load(req, exc)

    def take_load_errors(self) -> set[int]:
        """Block ids whose load failed since the last call (vLLM recomputes them)."""
        out, self._load_errors = self._load_errors, set()
        return out

    def take_failed_loads(self) -> set[str]:
        """Requests whose (asynchronous) load failed as a whole since the last call (several
        KV cache groups; each is also among the loads :meth:`finish_async` reports settled)."""
        out, self._failed_loads = self._failed_loads, set()
        return out

    # ------------------------------------------------------------------ loads
    def _load_args(self, req: ReqMeta) -> tuple[np.ndarray, torch.Tensor | None, dict[str, Any]]:
        spec = req.load
        assert spec is not None
        n = spec.load_len
        slots = torch.as_tensor(np.array(req.slot_mapping[..., :n], dtype=np.int64))  # a row per group if several
        slots[..., : spec.num_local] = -1  # vLLM's own prefix-cache blocks: never written
        slots[..., spec.end :] = -1  # computed by this step's forward anyway
        kwargs = dict(req.load_key_extras, kvcaches=self.kvcaches, slot_mapping=slots)
        return req.token_ids[:n], chunk_mask(n, spec.num_local, self.chunk_size), kwargs

    def _load_bulk(self, req: ReqMeta) -> None:
        assert req.load is not None
        self._describe(req, req.load.load_len)
        try:
            tokens, mask, kwargs = self._load_args(req)
            ret = self.engine.retrieve(tokens, mask, **kwargs)
        except Exception as exc:  # noqa: BLE001 - a cache failure is a recompute
            self.engine.stats.add(load_errors=1)
            self._fail_load(req, exc)
            return
        self._loaded(req, ret)

    def _loaded(self, req: ReqMeta, written: torch.Tensor) -> None:
        """After ``req``'s KV was retrieved into its blocks (``written``: the tokens written):
        fail what is missing, then load the recurrent state at the load's end, if any."""
        assert req.load is not None
        self._check_loaded(req, written, count=True)
        state = req.state_load
        if state is not None and req.load.end == state.boundary and req.req_id not in self._failed:
            self._load_state(req, state)

    def _load_state(self, req: ReqMeta, state: StateRef) -> None:
        """Write the recurrent state stored at ``state.boundary`` into its block (a missing or
        unreadable state fails the whole load: KV without its state cannot resume)."""
        try:
            key = boundary_key(self.engine, req.token_ids, state.boundary, req.load_key_extras)
            shape = (len(self.state_rows), self.state_rows[0].shape[1]) if self.state_rows else (0, 0)
            rows = get_state(self.engine, key, shape) if self.state_rows else None
            if rows is None:
                raise LookupError(f"no recurrent state stored at token {state.boundary}")
            for view, row in zip(self.state_rows, rows):
                view[state.block].copy_(row)
            self.engine.stats.add(recurrent_states_loaded=1)
        except Exception as exc:  # noqa: BLE001 - a cache failure is a recompute
            self.engine.stats.add(load_errors=1)
            self._fail_load(req, exc)

    def _store_state(self, req: ReqMeta, state: StateRef) -> None:
        """Store the recurrent state of ``state.block`` as the state after ``state.boundary``."""
        try:
            rows = torch.stack([view[state.block] for view in self.state_rows])
            key = boundary_key(self.engine, req.token_ids, state.boundary, req.key_extras)
            if put_state(self.engine, key, rows):
                self.engine.stats.add(recurrent_states_stored=1)
            else:
                self.warn("state-full", "lmcache: no pool memory for a recurrent state (%d bytes); not stored",
                          rows.numel())  # fmt: skip
        except Exception as exc:  # noqa: BLE001 - a failed save is a future miss
            self.warn("state-save", "lmcache: storing the recurrent state of %s failed (%s: %s); skipped",
                      req.req_id, type(exc).__name__, exc)  # fmt: skip

    def _check_loaded(self, req: ReqMeta, ret: torch.Tensor, *, count: bool) -> None:
        spec = req.load
        assert spec is not None
        got = ret[spec.num_local : spec.end]
        if got.numel() == spec.num_external and bool(got.all()):
            logger.debug("lmcache: %s loaded tokens [%d, %d)", req.req_id, spec.num_local, spec.end)
            return
        bad = (~got).nonzero()
        first_bad = spec.num_local + (int(bad[0, 0]) if bad.numel() else got.numel())
        if count:
            self.engine.stats.add(load_errors=1)
        self._fail(
            req,
            first_bad,
            "short",
            "lmcache: %s got %d of %d promised tokens from the cache (entry lost or corrupt); recomputing the rest",
            req.req_id,
            first_bad - spec.num_local,
            spec.num_external,
        )

    def _fail_load(self, req: ReqMeta, exc: BaseException) -> None:
        """A load raised: none of the request's external tokens can be trusted."""
        assert req.load is not None
        self._fail(
            req,
            req.load.num_local,
            "load",
            "lmcache: load of %s failed (%s: %s); recomputing",
            req.req_id,
            type(exc).__name__,
            exc,
        )

    def _fail(self, req: ReqMeta, first_bad: int, kind: str, msg: str, *args: Any) -> None:
        spec = req.load
        assert spec is not None
        self._failed.add(req.req_id)
        self.warn(kind, msg, *args)
        if self.kv_groups is None:
            self._load_errors.update(blocks_of_tokens(req.slot_mapping, req.block_size, first_bad, spec.end))
        elif req.load_async:  # several groups: the whole request, recomputed from its start
            self._failed_loads.add(req.req_id)
        else:  # the scheduler side loads asynchronously only with several groups
            logger.error("lmcache: synchronous load of %s failed with several KV cache groups; vLLM cannot be told "
                         "(its KV may be wrong): please report this", req.req_id)  # fmt: skip

    def _start_retrieval(self, req: ReqMeta, *, last: bool) -> None:
        assert req.load is not None
        self._describe(req, req.load.load_len)
        before = self.engine.stats.load_errors
        try:
            tokens, mask, kwargs = self._load_args(req)
            gen = self.engine.retrieve_layer(tokens, mask, sync=last, **kwargs)
        except Exception as exc:  # noqa: BLE001
            self._retrieval_failed(req, exc)
            return
        r = _Retrieval(req, gen, before)
        self._retrievals.append(r)
        self._advance_retrieval(r)  # setup
        self._advance_retrieval(r)  # layer 0

    def _advance_retrieval(self, r: _Retrieval) -> None:
        if r.done:
            return
        try:
            out = next(r.gen)
        except Exception as exc:  # noqa: BLE001 - StopIteration too: the generator ended early
            r.done = True
            self._retrieval_failed(r.req, exc)
            return
        if isinstance(out, torch.Tensor):
            r.done = True
            r.gen.close()  # type: ignore[attr-defined]
            self._check_loaded(r.req, out, count=self.engine.stats.load_errors == r.errors_before)

    def _retrieval_failed(self, req: ReqMeta, exc: BaseException) -> None:
        self.engine.stats.add(load_errors=1)
        self._fail(
            req,
            req.load.num_local,
            "layer-load",
            "lmcache: layerwise load of %s failed (%s: %s); recomputing",
            req.req_id,
            type(exc).__name__,
            exc,
        )

    # ------------------------------------------------------------------ blending
    def _blend_runner(self) -> BlendRunner | None:
        if self._runner is None and self._make_runner is not None:
            self._runner = self._make_runner()
            self._make_runner = None  # one try: a model that cannot blend never will
        return self._runner

    def _blend(self, req: ReqMeta) -> None:
        """Compute a blended prompt's KV into its blocks (failure: vLLM recomputes them)."""
        assert req.load is not None and req.blend is not None and self.kvcaches is not None
        runner = self._blend_runner()
        if runner is None:
            self.engine.stats.add(blend_failures=1)
            self._fail(req, 0, "blend-off", "lmcache: blending unavailable on this worker; recomputing %s", req.req_id)
            return
        try:
            with self._blend_lock:
                out = runner.run(req, req.blend, self.kvcaches)
        except Exception as exc:  # noqa: BLE001 - a failed blend is a recompute, never wrong KV kept
            self._blend_failed(req, exc)
            return
        self._blend_done(req, out)

    def _blend_failed(self, req: ReqMeta, exc: BaseException) -> None:
        self.engine.stats.add(blend_failures=1)
        self._fail(req, 0, "blend", "lmcache: blend of %s failed (%s: %s); recomputing", req.req_id,
                   type(exc).__name__, exc)  # fmt: skip

    def _blend_done(self, req: ReqMeta, out: BlendOutcome) -> None:
        self.engine.stats.add(
            blend_requests=1, blend_reused_tokens=out.reused, blend_recomputed_tokens=out.recomputed
        )
        self.engine.latency["blend"].observe(out.seconds)
        logger.debug(
            "lmcache: blended %s: %d tokens, %d reused, %d recomputed, %.3f s",
            req.req_id, out.num_tokens, out.reused, out.recomputed, out.seconds,
        )  # fmt: skip

    def _store_segments(self, req: ReqMeta) -> None:
        runner = self._blend_runner()
        if runner is None or not self._usable():
            return
        assert self.kvcaches is not None
        try:
            stored = runner.store_segments(req, req.segment_saves, self.kvcaches)
        except Exception as exc:  # noqa: BLE001 - a failed save is a future miss
            self.warn("segment-save", "lmcache: storing the segments of %s failed (%s: %s); skipped", req.req_id,
                      type(exc).__name__, exc)  # fmt: skip
            return
        if stored:
            self.engine.stats.add(blend_stored_segment_tokens=stored)

    def _store_result(self, req: ReqMeta) -> None:
        """Store a blended request's KV under the blend-result keys (no KV events: these are
        not prefixes any exact lookup can hit)."""
        spec = req.result_save
        assert spec is not None and req.result_key_extras is not None
        try:
            tokens, mask, kwargs = self._save_args(req, spec, req.result_key_extras)
            stored = self.engine.store(tokens, mask, **kwargs)
        except Exception as exc:  # noqa: BLE001 - a failed save is a future miss
            self.warn("result-save", "lmcache: storing the blend result of %s failed (%s: %s); skipped", req.req_id,
                      type(exc).__name__, exc)  # fmt: skip
            return
        if stored:
            self.engine.stats.add(blend_stored_result_tokens=stored)

    # ------------------------------------------------------------------ saves
    def _save_args(
        self, req: ReqMeta, spec: SaveSpec | None = None, extras: dict[str, Any] | None = None
    ) -> tuple[np.ndarray, torch.Tensor | None, dict[str, Any]]:
        spec = spec or req.save
        assert spec is not None
        slots = torch.as_tensor(np.array(req.slot_mapping[..., : spec.end], dtype=np.int64))
        kwargs = dict(req.key_extras if extras is None else extras, kvcaches=self.kvcaches, slot_mapping=slots)
        return req.token_ids[: spec.end], chunk_mask(spec.end, spec.skip, self.chunk_size), kwargs

    def _store_whole(self, req: ReqMeta) -> None:
        assert req.save is not None
        self._describe(req, req.save.end)
        try:
            tokens, mask, kwargs = self._save_args(req)
            stored = self.engine.store(tokens, mask, **kwargs)  # the layerwise engine runs a whole generator
            spec = req.save
            logger.debug("lmcache: %s stored %d new tokens of [%d, %d)", req.req_id, stored, spec.skip, spec.end)
        except Exception as exc:  # noqa: BLE001 - a failed save is a future miss
            self.warn("save", "lmcache: save of %s failed (%s: %s); skipped", req.req_id, type(exc).__name__, exc)

    def _start_storage(self, req: ReqMeta, *, first: bool) -> None:
        assert req.save is not None
        self._describe(req, req.save.end)
        try:
            tokens, mask, kwargs = self._save_args(req)
            gen = self.engine.store_layer(tokens, mask, sync=first, **kwargs)
        except Exception as exc:  # noqa: BLE001
            self.warn("save", "lmcache: save of %s failed (%s: %s); skipped", req.req_id, type(exc).__name__, exc)
            return
        assert self._storages is not None
        self._storages.append(_Storage(req, gen))

    def _advance_storage(self, s: _Storage) -> None:
        try:
            next(s.gen)
        except Exception as exc:  # noqa: BLE001 - StopIteration too (more layers than the engine knows)
            self._drop_storage(s, exc)

    def _finish_storage(self, s: _Storage) -> None:
        try:
            for _ in s.gen:  # the remaining calls, normally just the final one
                pass
        except Exception as exc:  # noqa: BLE001
            self._drop_storage(s, exc)

    def _drop_storage(self, s: _Storage, exc: BaseException) -> None:
        close = getattr(s.gen, "close", None)
        if close is not None:
            close()
        if self._storages is not None and s in self._storages:
            self._storages.remove(s)
        self.warn(
            "layer-save",
            "lmcache: layerwise save of %s failed (%s: %s); skipped",
            s.req.req_id,
            type(exc).__name__,
            exc,
        )

    # ------------------------------------------------------------------ cleanup
    def _close_generators(self) -> None:
        for r in self._retrievals:
            r.gen.close()  # type: ignore[attr-defined]
        for s in self._storages or ():
            s.gen.close()  # type: ignore[attr-defined]
        self._retrievals = []
        self._storages = None
