"""The scheduler -> worker message of one step: per-request load and save specs.

Plain picklable data (numpy arrays, ints, strings): vLLM ships it to every worker
process with the scheduler output. Built by
:class:`lmcache.integration.vllm.request_tracker.RequestPlanner`, consumed by
:class:`lmcache.integration.vllm.worker_side.WorkerConnector`.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import numpy as np

try:  # vLLM's marker base class (through the version shims); the data below does not depend on it
    from lmcache.integration.vllm.vllm_compat import KVConnectorMetadata as _VLLMMetadata
except ImportError:  # pragma: no cover - vLLM is optional for the pure logic

    class _VLLMMetadata:  # type: ignore[no-redef]
        pass


@dataclass(frozen=True, slots=True)
class LoadSpec:
    """Write cached KV into the paged cache for tokens ``[num_local, num_local + num_external)``.

    ``num_local``: tokens vLLM already has in its own prefix cache (never written).
    ``num_external``: tokens vLLM was told it need not compute.
    ``load_len``: length of the token prefix whose chunk keys are fetched (a chunk
    boundary at or after the end of the external range, or the prompt end for a
    cached partial chunk).
    """

    num_local: int
    num_external: int
    load_len: int

    @property
    def end(self) -> int:
        return self.num_local + self.num_external


@dataclass(frozen=True, slots=True)
class SaveSpec:
    """Store the KV of tokens ``[skip, end)``; ``skip`` is a multiple of the chunk size."""

    skip: int
    end: int


@dataclass(frozen=True, slots=True)
class StateRef:
    """A hybrid model's recurrent state after ``boundary`` tokens, in vLLM's state block
    ``block`` (the Mamba group's block of column ``boundary // block_size - 1``)."""

    boundary: int
    block: int


@dataclass(frozen=True, slots=True)
class SegmentRef:
    """A segment (document) of a prompt: tokens ``[start, end)``; ``cached`` leading tokens
    of it have segment entries (blending, :mod:`lmcache.v1.blend`). ``lead``: the text
    folded into its key before ``start`` (its first word; :class:`~lmcache.v1.blend.segments.Segment`),
    ``lead_tokens`` the tokens of that word (recomputed when the segment is reused; they count
    towards the recompute ratio's base).
    ``storable``: the prompt's first segment, ended by a separator: its KV was computed from
    the prompt's start, as if sent alone, and the separator marks it as a document (only
    such segments are stored)."""

    start: int
    end: int
    cached: int = 0
    lead: bytes = b""
    storable: bool = False
    lead_tokens: int = 0

    @property
    def bound(self) -> tuple[int, int, bytes]:
        """``(start, end, lead)`` as segment lookups take it."""
        return (self.start, self.end, self.lead)


@dataclass(frozen=True, slots=True)
class BlendSpec:
    """Blend the KV of tokens ``[0, num_tokens)`` from the cached ``segments`` (those with
    ``cached > 0``) plus a selective recompute, instead of loading an exact prefix."""

    num_tokens: int
    segments: tuple[SegmentRef, ...]

    @property
    def reused(self) -> tuple[SegmentRef, ...]:
        return tuple(s for s in self.segments if s.cached > 0 and s.start < self.num_tokens)

    @property
    def reused_tokens(self) -> int:
        return sum(min(s.cached, self.num_tokens - s.start) for s in self.reused)

    @property
    def first_reused(self) -> int:
        """The first token whose KV is not exact (``num_tokens`` when nothing is reused)."""
        return min((s.start for s in self.reused), default=self.num_tokens)


@dataclass(frozen=True, slots=True)
class ReqMeta:
    """One request's work in one step.

    ``token_ids`` and ``slot_mapping`` cover the first ``max(load_len, save.end)``
    tokens. ``slot_mapping[i] = block_id * block_size + offset``; -1 where no block is
    allocated. With several KV cache groups (vLLM's hybrid KV cache manager) it has one
    row per group (``[groups, tokens]``; each layer uses its group's row). ``key_extras`` go into the chunk keys (``cache_salt``, ``extra_keys``).
    ``invalid_block_ids``: blocks vLLM counts as loaded but the scheduler side could
    not plan a load for; the worker reports them as load errors (recompute).
    ``durable``: a decoder waits for this save (disaggregated prefill): the worker's
    writes wait for room instead of being dropped, and ``wait_for_save`` returns once
    they are in the remote store.
    ``blend``: the load is a blend (tokens ``[0, blend.num_tokens)``), not an exact prefix.
    ``segment_saves``: segments whose KV is stored under segment keys after this step's
    forward (the prompt is complete in the paged cache then).
    ``result_key_extras``: the key extras of blend results (blending on): an earlier
    blend's approximate KV, kept apart from exact prefixes. ``load_result``: the load reads
    blend results, not exact prefixes. ``result_save``: tokens stored as blend results
    after this step's forward (a blended request's KV, which ``save`` never stores past its
    first reused token).
    ``load_async``: the request waits in vLLM while its hit is prefetched into the CPU tier and
    then copied (``enable_async_loading``, :mod:`.async_loads`); the worker reports it in
    ``get_finished``. It is not part of this step's forward.
    ``state_load`` / ``state_save``: a hybrid model's recurrent state to write into its block
    after the load (the load ends at its boundary) / to store after this step's forward.
    ``load_failed``: the scheduler side could not plan this (asynchronous) load; the worker
    reports the whole request failed (several KV cache groups: vLLM takes no block-level
    failures there, and recomputes the request from its start).
    ``finished_store``: a finished request's store (``lazy_store``): vLLM holds its blocks
    until every worker reports the request in ``get_finished``'s sending set, which the
    worker does once it stored ``save`` (or could not), in the step this arrives.
    """

    req_id: str
    token_ids: np.ndarray
    slot_mapping: np.ndarray
    block_size: int
    load: LoadSpec | None = None
    save: SaveSpec | None = None
    key_extras: dict[str, Any] = field(default_factory=dict)
    invalid_block_ids: tuple[int, ...] = ()
    durable: bool = False
    blend: BlendSpec | None = None
    segment_saves: tuple[SegmentRef, ...] = ()
    result_key_extras: dict[str, Any] | None = None
    load_result: bool = False
    result_save: SaveSpec | None = None
    load_async: bool = False
    load_failed: bool = False
    state_load: StateRef | None = None
    state_save: StateRef | None = None
    finished_store: bool = False

    @property
    def load_key_extras(self) -> dict[str, Any]:
        """The key extras the load reads (blend results or exact prefixes)."""
        if self.load_result:
            assert self.result_key_extras is not None
            return self.result_key_extras
        return self.key_extras


@dataclass
class LMCacheConnectorMetadata(_VLLMMetadata):
    """All requests with a load or a save in this step."""

    requests: list[ReqMeta] = field(default_factory=list)
    idle: bool = False
    """vLLM's scheduler scheduled no tokens this step (a step run only for connectors, such as
    requests waiting for their asynchronous loads): the worker may wait a little for a load
    to settle instead of returning at once into vLLM's next empty step."""

    def __len__(self) -> int:
        return len(self.requests)
