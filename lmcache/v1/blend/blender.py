"""CacheBlend's selective recompute: fuse separately cached KV with a little recomputation.

Input: a prompt's token ids and, for some of its tokens, KV computed *without* the text
that now precedes them (a cached document), already moved to the tokens' new positions
(:mod:`lmcache.v1.blend.rope`, :mod:`lmcache.v1.blend.reused`). Such KV lacks the
cross-attention to earlier documents; recomputing every token would fix it but costs a
full prefill. CacheBlend recomputes only the tokens whose KV deviates most:

1. Layers ``0 .. check`` run for every token (fresh KV for all of them).
2. At the check layer, right after its q/k/v, each reused token's deviation is the squared
   L2 distance between its fresh and its cached K and V. The reused tokens with the largest
   deviation, as many as bring the recomputed share of the documents' tokens to ``ratio``
   (each document's first word, recomputed anyway, counts towards it), every token without
   cached KV (new text, separators) and the last token stay *selected*; the others keep the
   check layer's fresh KV there and their cached KV from the next layer on. The check layer's attention and MLP
   already run for the selected tokens only (a token's output depends on the others only
   through their KV, which every token has at that point).
3. Each following layer computes q/k/v, attention and the MLP for the selected tokens only;
   their attention runs over all tokens' KV (fresh rows for the selected, cached rows for
   the others) with an exact causal mask by position, and their fresh KV is written.

Several check layers narrow the selection step by step (ratios non-increasing). With ratio
1 the result is a full prefill; with ratio 0 the reused tokens keep their cached KV in every
layer after the check layer. Pure torch; runs on whatever device the model and inputs are on.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass
from typing import Callable, Sequence

import torch

from lmcache.v1.blend.model import BlendModel, causal_attention
from lmcache.v1.blend.reused import ReusedKV

__all__ = ["BlendConfig", "BlendResult", "blend", "deviation", "full_prefill"]


@dataclass(frozen=True, slots=True)
class BlendConfig:
    """Which layers check deviations, and what fraction of the reused tokens each keeps.

    ``check_layers`` strictly increasing layer indices; ``recompute_ratios`` one per check
    layer, in ``[0, 1]``, non-increasing. Defaults: check after layer 1, keep 15 %."""

    recompute_ratios: tuple[float, ...] = (0.15,)
    check_layers: tuple[int, ...] = (1,)

    def __post_init__(self) -> None:
        ratios, layers = tuple(self.recompute_ratios), tuple(self.check_layers)
        object.__setattr__(self, "recompute_ratios", ratios)
        object.__setattr__(self, "check_layers", layers)
        if not layers or len(ratios) != len(layers):
            raise ValueError(
                f"check_layers={layers} and recompute_ratios={ratios}: expected one ratio per check layer (at least one)"
            )
        if any(isinstance(x, bool) or not isinstance(x, int) or x < 0 for x in layers):
            raise ValueError(f"check_layers={layers}: expected non-negative ints")
        if any(b <= a for a, b in zip(layers, layers[1:])):
            raise ValueError(f"check_layers={layers}: expected strictly increasing layers")
        if any(not (isinstance(r, (int, float)) and 0.0 <= r <= 1.0) for r in ratios):
            raise ValueError(f"recompute_ratios={ratios}: expected numbers in [0, 1]")
        if any(b > a for a, b in zip(ratios, ratios[1:])):
            raise ValueError(f"recompute_ratios={ratios}: expected non-increasing ratios")


@dataclass(frozen=True, slots=True, eq=False)
class BlendResult:
    """The prompt's KV and its last token's output. Tensors are new and owned by the caller."""

    keys: list[torch.Tensor]
    """Per layer, ``[num_tokens, num_kv_heads, head_dim]`` at the prompt's positions."""
    values: list[torch.Tensor]
    hidden: torch.Tensor
    """The last token's final-normed hidden state ``[hidden]``."""
    logits: torch.Tensor
    """The last token's logits ``[vocab]``."""
    recomputed: torch.Tensor
    """bool ``[num_tokens]``: tokens whose KV is fresh in the layers after the last check layer."""
    layer_seconds: tuple[float, ...] = ()
    """Wall time of each layer (a check layer's includes waiting for late cached KV)."""


def full_prefill(model: BlendModel, token_ids: torch.Tensor) -> BlendResult:
    """Every token through every layer (the reference a blend approximates)."""
    return blend(model, token_ids, None, BlendConfig((1.0,), (0,)))


@torch.no_grad()
def blend(
    model: BlendModel,
    token_ids: torch.Tensor,
    reused: ReusedKV | Callable[[], ReusedKV | None] | None,
    config: BlendConfig = BlendConfig(),
    *,
    consume: bool = False,
) -> BlendResult:
    """Prefill ``token_ids`` (1-D, positions ``0..n-1``) reusing ``reused`` KV where given.

    ``reused`` may be a function returning it (or None): it is called once, when the first
    check layer needs the cached KV, so that reading it overlaps with the layers before
    (they run for every token and need none). Raises ValueError when shapes disagree or a
    check layer is past the last layer; an exception of the function propagates.

    ``consume=False`` leaves the cached KV as it was. ``consume=True`` lets the blend write
    each layer's fresh rows into the cached tensors (the result's tensors then *are* those
    tensors): for a caller that built ``reused`` for this call and reads at most its mask
    afterwards, it saves a copy of every layer's KV."""
    if token_ids.dim() != 1 or token_ids.shape[0] == 0:
        raise ValueError("token_ids: expected a non-empty 1-D tensor")
    layers = list(model.layers)
    if config.check_layers[-1] >= len(layers):
        raise ValueError(f"check layer {config.check_layers[-1]} of a {len(layers)}-layer model")
    n = token_ids.shape[0]
    device = token_ids.device
    pending = reused if callable(reused) else None
    cached: ReusedKV | None = None if pending is not None else reused  # type: ignore[assignment]
    is_reused, num_reused = _reused_mask(cached, n, len(layers), device)
    checks = dict(zip(config.check_layers, config.recompute_ratios))

    positions = torch.arange(n, device=device)
    sel = positions.clone()  # prompt indices of the tokens carried through the layers (sorted)
    hidden = model.embed(token_ids)
    out_k: list[torch.Tensor] = []
    out_v: list[torch.Tensor] = []
    layer_seconds: list[float] = []
    for li, layer in enumerate(layers):
        t0 = time.perf_counter()
        q, k, v = layer.qkv(layer.input_norm(hidden), positions[sel])
        if li in checks and pending is not None:
            cached, pending = pending(), None
            is_reused, num_reused = _reused_mask(cached, n, len(layers), device)
        keep = None
        if li in checks and num_reused and cached is not None:
            # chosen before this layer's KV is written: the deviation compares with the cached rows
            keep = _select(k, v, cached, li, sel, is_reused, _budget(checks[li], num_reused, cached.documents))
        if sel.shape[0] == n:
            k_all, v_all = k, v
        else:
            assert cached is not None
            k_all = _layer_rows(cached.keys[li], k, consume)
            v_all = _layer_rows(cached.values[li], v, consume)
            k_all[sel] = k
            v_all[sel] = v
        out_k.append(k_all)
        out_v.append(v_all)
        if keep is not None and keep.shape[0] < sel.shape[0]:
            q, sel, hidden = q[keep], sel[keep], hidden[keep]
        attn = causal_attention(q, k_all, v_all, positions[sel], positions, model.scaling)
        hidden = hidden + layer.o_proj(attn)
        hidden = hidden + layer.mlp(layer.post_norm(hidden))
        layer_seconds.append(time.perf_counter() - t0)
    normed = model.final_norm(hidden[-1:])
    recomputed = torch.zeros(n, dtype=torch.bool, device=device)
    recomputed[sel] = True
    return BlendResult(out_k, out_v, normed[0], model.logits(normed)[0], recomputed, tuple(layer_seconds))


def _layer_rows(cached: torch.Tensor, fresh: torch.Tensor, consume: bool) -> torch.Tensor:
    """A tensor for one layer's K or V of every token, starting from the cached rows, in
    ``fresh``'s dtype and device: the cached tensor itself when it may be consumed and
    already matches, else a copy."""
    out = cached.to(device=fresh.device, dtype=fresh.dtype)
    return out if consume or out is not cached else out.clone()


def _reused_mask(reused: ReusedKV | None, n: int, num_layers: int, device: torch.device) -> tuple[torch.Tensor, int]:
    """Which tokens have cached KV (never the last one, always recomputed), and how many."""
    if reused is None:
        return torch.zeros(n, dtype=torch.bool, device=device), 0
    reused.check(n, num_layers)
    mask = reused.mask.to(device).clone()
    mask[-1] = False
    return mask, int(mask.sum())


def _budget(ratio: float, num_reused: int, documents: int | None) -> int:
    """Reused tokens to recompute at a check layer: the recomputed share of the documents'
    tokens stays at most ``ratio``, counting the tokens recomputed anyway (each document's
    first word: ``documents - num_reused``); ``ratio`` 1 recomputes every reused token."""
    if ratio >= 1.0:
        return num_reused
    base = num_reused if documents is None else max(documents, num_reused)
    return max(0, min(num_reused, math.floor(ratio * base + 1e-9) - (base - num_reused)))


def _select(
    k: torch.Tensor,
    v: torch.Tensor,
    reused: ReusedKV,
    layer: int,
    sel: torch.Tensor,
    is_reused: torch.Tensor,
    budget: int,
) -> torch.Tensor:
    """Indices into ``sel`` (sorted) of the tokens to keep computing: every token of ``sel``
    without cached KV, plus the ``budget`` reused ones of ``sel`` whose fresh K/V deviate most
    from the cached K/V at ``layer``."""
    cand = is_reused[sel]
    dev_k = (k.float() - reused.keys[layer].to(k.device)[sel].float()).pow(2).sum(dim=(1, 2))
    dev_v = (v.float() - reused.values[layer].to(v.device)[sel].float()).pow(2).sum(dim=(1, 2))
    dev = torch.where(cand, dev_k + dev_v, torch.tensor(-1.0, device=k.device))
    budget = min(budget, int(cand.sum()))
    keep = ~cand
    if budget:
        keep[torch.topk(dev, budget).indices] = True
    return torch.nonzero(keep).flatten()


def deviation(result: BlendResult, reference: BlendResult, layers: Sequence[int] | None = None) -> float:
    """Mean squared difference of ``result``'s K and V from ``reference``'s over ``layers``
    (all by default): the quality measure of a blend against a full prefill."""
    idx = range(len(reference.keys)) if layers is None else layers
    total, count = 0.0, 0
    for li in idx:
        for a, b in ((result.keys[li], reference.keys[li]), (result.values[li], reference.values[li])):
            total += float((a.float() - b.float()).pow(2).sum())
            count += a.numel()
    return total / max(count, 1)
