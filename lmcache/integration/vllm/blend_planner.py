"""Scheduler side of blending: when a prompt is blended, and which segments are stored.

Runs on vLLM's scheduler thread (pure logic; the segment lookups are done by the caller).
With ``enable_blending`` a prompt is split on the separator's token ids
(:func:`~lmcache.v1.blend.segments.split_segments`). For a prompt of at least
``blend_min_tokens`` tokens, each segment's own entries are looked up; the prompt is
*blended* when the tokens they cover (before the last token, which vLLM always computes)
outnumber the exact prefix hit. vLLM is then told that every token but the last is cached,
and the worker computes their KV by a blend (:mod:`.blend_worker`) instead of loading a
prefix.

Exactness: a blended prompt's KV is an approximation from its first reused token on. Only
the chunks before that token are stored under prefix keys (exact); its segments that were
not reused are stored under segment keys, which only a blend reads. Every prompt stores its
segments once it is complete (a prompt without a separator is one segment: sending a
document alone caches it for later blends).

Bounds (a prompt is hostile input): segments shorter than ``blend_min_segment_tokens`` are
neither looked up nor stored (their tokens are recomputed with the prompt's new text), and a
prompt with more than ``blend_max_segments`` segments is neither blended nor split for
storage, so no prompt can make the worker store thousands of tiny entries.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Sequence

from lmcache.integration.vllm.connector_metadata import BlendSpec, SegmentRef
from lmcache.log_once import LogOnce
from lmcache.v1.blend.segments import find_separators

logger = logging.getLogger(__name__)

__all__ = ["BlendPlanner", "BlendRules"]


@dataclass(frozen=True, slots=True)
class BlendRules:
    """What the scheduler needs of the blending config."""

    separator: tuple[int, ...]
    """The separator's token ids (tokenized without special tokens)."""
    min_tokens: int = 256
    min_segment_tokens: int = 16
    """Shorter segments are not cached as segments (``blend_min_segment_tokens``)."""
    max_segments: int = 64
    """Prompts with more segments are not blended (``blend_max_segments``)."""


class BlendPlanner:
    """Splits prompts and decides blends (scheduler thread; no state but a counter)."""

    def __init__(self, rules: BlendRules) -> None:
        if not rules.separator:
            raise ValueError("blend separator: expected at least one token id")
        self.rules = rules
        self.refused_prompts = 0
        """Prompts with more than ``max_segments`` segments (not blended, no segments stored)."""
        self._log_once = LogOnce(logger)

    def segments(self, prompt: Sequence[int]) -> list[tuple[int, int]]:
        """``(start, end)`` of each segment of ``prompt`` worth caching (separators and
        segments under ``min_segment_tokens`` excluded); ``[]`` for a prompt of more than
        ``max_segments`` segments."""
        m, n = len(self.rules.separator), len(prompt)
        cuts = find_separators(list(prompt), list(self.rules.separator))
        edges = [0] + [c + m for c in cuts]
        bounds = [(a, b) for a, b in zip(edges, cuts + [n]) if b > a]
        if len(bounds) > self.rules.max_segments:
            self.refused_prompts += 1
            self._log_once(logging.WARNING, "too-many", "lmcache: a prompt of %d tokens has %d segments, more than "
                           "blend_max_segments=%d: not blended, no segments stored (logged once)",
                           n, len(bounds), self.rules.max_segments)  # fmt: skip
            return []
        return [(a, b) for a, b in bounds if b - a >= self.rules.min_segment_tokens]

    def eligible(self, num_tokens: int, num_computed: int) -> bool:
        """Whether a prompt of ``num_tokens`` may be blended (nothing computed by vLLM yet)."""
        return num_tokens >= self.rules.min_tokens and num_computed == 0

    @staticmethod
    def plan(num_tokens: int, bounds: Sequence[tuple[int, int]], cached: Sequence[int], exact_hit: int) -> BlendSpec | None:
        """The blend of a ``num_tokens`` prompt whose segments ``bounds`` have ``cached``
        leading tokens in the cache, or None when the exact prefix hit is as good."""
        if len(bounds) != len(cached):
            raise ValueError(f"{len(bounds)} segments but {len(cached)} lookup results")
        refs = tuple(SegmentRef(a, b, max(0, min(int(c), b - a))) for (a, b), c in zip(bounds, cached))
        spec = BlendSpec(num_tokens - 1, refs)
        if spec.num_tokens <= 0 or spec.reused_tokens <= min(exact_hit, spec.num_tokens):
            return None
        return spec

    @staticmethod
    def to_store(bounds: Sequence[tuple[int, int]], spec: BlendSpec | None) -> tuple[SegmentRef, ...]:
        """Segments to store under segment keys once the prompt is computed: all of them but
        those a blend reused whole (a store skips chunks already cached anyway)."""
        whole = {(s.start, s.end) for s in spec.reused if s.cached >= s.end - s.start} if spec else set()
        return tuple(SegmentRef(a, b) for a, b in bounds if (a, b) not in whole)
