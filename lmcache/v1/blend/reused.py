"""Cached KV placed into a new prompt: which tokens have it, and the (re-rotated) tensors.

A cached segment's keys were rotated for the positions it was computed at (usually
``0 .. len-1``, computed alone). :func:`assemble` copies each segment's KV into the rows
of the prompt where the segment now sits, re-rotating the keys to those positions
(:meth:`RopeSpec.rerotate`); values carry no position and are copied as they are.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol, Sequence

import torch

__all__ = ["CachedSegmentKV", "Rerotator", "ReusedKV", "assemble", "rerotate_layers"]


class Rerotator(Protocol):
    """Moves keys computed at ``old`` positions to ``new`` positions (a :class:`~.rope.RopeSpec`,
    or an engine adapter using the model's own rotary tables)."""

    def rerotate(self, keys: torch.Tensor, old: torch.Tensor, new: torch.Tensor) -> torch.Tensor:
        """``keys`` ``[n, heads, head_dim]``; ``heads`` may be any multiple of the model's KV
        heads (:func:`rerotate_layers` folds the layers into it)."""
        ...


def rerotate_layers(
    rope: Rerotator, keys: Sequence[torch.Tensor], old: torch.Tensor, new: torch.Tensor
) -> list[torch.Tensor]:
    """Every layer's keys (each ``[n, heads, head_dim]``, the same rows) moved from ``old`` to
    ``new`` positions in one call: the layers are laid side by side as heads, so the delta
    rotation's cos/sin are formed once for all layers instead of once per layer. New tensors."""
    if not keys:
        return []
    heads = keys[0].shape[1]
    moved = rope.rerotate(torch.cat(list(keys), dim=1), old, new)
    return list(moved.split(heads, dim=1))


@dataclass(frozen=True, slots=True, eq=False)
class ReusedKV:
    """KV for some tokens of a prompt, at the prompt's positions.

    ``mask`` bool ``[num_tokens]``: True where the token has cached KV. ``keys``/``values``:
    per layer ``[num_tokens, num_kv_heads, head_dim]``; rows where ``mask`` is False are
    ignored (their content is unspecified). ``documents``: the tokens of the documents these
    rows come from, their recomputed leading tokens included (the base of the recompute
    ratio); None: the cached rows alone."""

    mask: torch.Tensor
    keys: Sequence[torch.Tensor]
    values: Sequence[torch.Tensor]
    documents: int | None = None

    def check(self, num_tokens: int, num_layers: int) -> None:
        """Raise ValueError unless this covers ``num_tokens`` tokens in ``num_layers`` layers."""
        if self.mask.shape != (num_tokens,) or self.mask.dtype != torch.bool:
            raise ValueError(f"reused mask: expected bool [{num_tokens}], got {self.mask.dtype} {tuple(self.mask.shape)}")
        if len(self.keys) != num_layers or len(self.values) != num_layers:
            raise ValueError(f"reused KV has {len(self.keys)}/{len(self.values)} layers; the model {num_layers}")
        for k, v in zip(self.keys, self.values):
            if k.dim() != 3 or k.shape[0] != num_tokens or v.shape != k.shape:
                raise ValueError(f"reused KV layer of shape {tuple(k.shape)}/{tuple(v.shape)} for {num_tokens} tokens")


@dataclass(frozen=True, slots=True, eq=False)
class CachedSegmentKV:
    """One cached segment: its KV per layer (``[len, num_kv_heads, head_dim]``, keys rotated
    for positions ``old_start .. old_start + len - 1``) and where it sits in the new prompt.
    ``recomputed_before``: tokens of the same document right before ``start`` that are
    recomputed anyway (its first word, attention sinks); they count towards the recompute
    ratio's base (:attr:`ReusedKV.documents`)."""

    start: int
    keys: Sequence[torch.Tensor]
    values: Sequence[torch.Tensor]
    old_start: int = 0
    recomputed_before: int = 0

    def __len__(self) -> int:
        return self.keys[0].shape[0]


def assemble(num_tokens: int, segments: Sequence[CachedSegmentKV], rope: Rerotator) -> ReusedKV:
    """The :class:`ReusedKV` of a ``num_tokens`` prompt holding ``segments`` (new tensors;
    the segments' tensors are only read). Keys are re-rotated in one call per layer for all
    segments and layers together. Raises ValueError for overlapping segments, one past the prompt's end,
    or layer counts/shapes that disagree."""
    if not segments:
        raise ValueError("assemble: no segments")
    num_layers = len(segments[0].keys)
    shape = segments[0].keys[0].shape[1:]
    ref = segments[0].keys[0]
    mask = torch.zeros(num_tokens, dtype=torch.bool)
    old_pos = torch.arange(num_tokens)
    """Position each token's cached key was rotated for (its own position where none moves)."""
    keys = [torch.zeros((num_tokens, *shape), dtype=ref.dtype, device=ref.device) for _ in range(num_layers)]
    values = [torch.zeros_like(k) for k in keys]
    for seg in segments:
        n = len(seg)
        if len(seg.keys) != num_layers or len(seg.values) != num_layers:
            raise ValueError("segments disagree on the number of layers")
        if seg.start < 0 or seg.start + n > num_tokens:
            raise ValueError(f"segment [{seg.start}, {seg.start + n}) outside a {num_tokens}-token prompt")
        if mask[seg.start : seg.start + n].any():
            raise ValueError(f"segment [{seg.start}, {seg.start + n}) overlaps another")
        mask[seg.start : seg.start + n] = True
        old_pos[seg.start : seg.start + n] = torch.arange(seg.old_start, seg.old_start + n)
        for li in range(num_layers):
            k, v = seg.keys[li], seg.values[li]
            if k.shape != (n, *shape) or v.shape != k.shape:
                raise ValueError(f"segment KV of shape {tuple(k.shape)}/{tuple(v.shape)}; expected {(n, *shape)}")
            keys[li][seg.start : seg.start + n] = k
            values[li][seg.start : seg.start + n] = v
    moved = torch.nonzero(mask & (old_pos != torch.arange(num_tokens))).flatten()
    if moved.numel():
        new_pos, from_pos = moved, old_pos[moved]
        rows = moved.to(ref.device)
        rotated = rerotate_layers(rope, [k[rows] for k in keys], from_pos, new_pos)
        for k, r in zip(keys, rotated):
            k[rows] = r
    documents = int(mask.sum()) + sum(seg.recomputed_before for seg in segments)
    return ReusedKV(mask, keys, values, documents)
