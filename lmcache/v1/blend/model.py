"""The model interface the blender drives, and exact causal attention over positions.

The blender needs a decoder-only, pre-norm transformer taken apart into its steps, so
that it can run a layer for a *subset* of the tokens while attending over every token's
KV. :class:`BlendModel` and :class:`BlendLayer` are that interface (structural protocols:
an adapter implements them without inheriting). Tensors are per sequence, without a batch
dimension: hidden states ``[n, hidden]``, queries ``[n, num_heads, head_dim]``, keys and
values ``[n, num_kv_heads, head_dim]``; positions are 1-D int64.
"""

from __future__ import annotations

from typing import Protocol, Sequence

import torch
import torch.nn.functional as F

__all__ = ["BlendLayer", "BlendModel", "causal_attention"]


class BlendLayer(Protocol):
    """One decoder layer: ``h += o_proj(attn(input_norm(h)))``, then ``h += mlp(post_norm(h))``."""

    def input_norm(self, hidden: torch.Tensor) -> torch.Tensor:
        """The attention block's input normalisation."""
        ...

    def qkv(self, normed: torch.Tensor, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Query, key, value of the tokens at ``positions``, RoPE applied to q and k."""
        ...

    def o_proj(self, attn: torch.Tensor) -> torch.Tensor:
        """Output projection of the attention result ``[n, num_heads * head_dim]``."""
        ...

    def post_norm(self, hidden: torch.Tensor) -> torch.Tensor:
        """The MLP block's input normalisation."""
        ...

    def mlp(self, normed: torch.Tensor) -> torch.Tensor:
        """The feed-forward block."""
        ...


class BlendModel(Protocol):
    """A decoder-only model as the blender sees it."""

    @property
    def layers(self) -> Sequence[BlendLayer]:
        """The decoder layers, in order."""
        ...

    @property
    def scaling(self) -> float:
        """Attention score scale (usually ``head_dim ** -0.5``)."""
        ...

    def embed(self, token_ids: torch.Tensor) -> torch.Tensor:
        """Input embeddings ``[n, hidden]`` of 1-D token ids."""
        ...

    def final_norm(self, hidden: torch.Tensor) -> torch.Tensor:
        """The normalisation after the last layer."""
        ...

    def logits(self, normed: torch.Tensor) -> torch.Tensor:
        """Vocabulary logits of final-normed hidden states."""
        ...


def causal_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    q_positions: torch.Tensor,
    kv_positions: torch.Tensor,
    scaling: float,
) -> torch.Tensor:
    """Attention of ``q`` (``[m, Hq, D]``) over ``k``/``v`` (``[n, Hkv, D]``, ``Hq`` a multiple
    of ``Hkv``): query ``i`` sees key ``j`` iff ``kv_positions[j] <= q_positions[i]`` (exact
    causal mask by position, so any subset of queries can be computed). Returns ``[m, Hq * D]``."""
    assert q.shape[1] % k.shape[1] == 0, "query heads must be a multiple of KV heads"
    # [1, heads, tokens, dim]: the batched layout takes torch's fused CPU/GPU kernels; grouped
    # query heads share their KV head inside the kernel (enable_gqa), without copies of K/V
    qb, kb, vb = (t.transpose(0, 1).unsqueeze(0) for t in (q, k, v))
    if q_positions.shape == kv_positions.shape and torch.equal(q_positions, kv_positions) and _increasing(kv_positions):
        out = F.scaled_dot_product_attention(qb, kb, vb, is_causal=True, scale=scaling, enable_gqa=True)
    elif _increasing(q_positions) and _increasing(kv_positions):
        out = _blocked(qb, kb, vb, q_positions, kv_positions, scaling)
    else:
        out = _masked(qb, kb, vb, q_positions, kv_positions, scaling)
    return out[0].transpose(0, 1).reshape(q.shape[0], -1)


QUERY_BLOCKS = 8
"""Blocks of a sorted query subset attended separately: each block reads only the keys up to
its last query's position, about half the work of one masked pass over all keys."""


def _masked(
    qb: torch.Tensor, kb: torch.Tensor, vb: torch.Tensor, q_pos: torch.Tensor, kv_pos: torch.Tensor, scaling: float
) -> torch.Tensor:
    allowed = kv_pos[None, :] <= q_pos[:, None]
    bias = torch.zeros(allowed.shape, dtype=qb.dtype, device=qb.device).masked_fill_(~allowed, float("-inf"))
    return F.scaled_dot_product_attention(qb, kb, vb, attn_mask=bias[None, None], scale=scaling, enable_gqa=True)


def _blocked(
    qb: torch.Tensor, kb: torch.Tensor, vb: torch.Tensor, q_pos: torch.Tensor, kv_pos: torch.Tensor, scaling: float
) -> torch.Tensor:
    """:func:`_masked` for sorted positions, one block of queries at a time over its visible keys."""
    m = q_pos.shape[0]
    step = -(-m // QUERY_BLOCKS)
    ends = torch.searchsorted(kv_pos, q_pos[step - 1 :: step].contiguous(), right=True).tolist()
    if len(ends) < -(-m // step):
        ends.append(int(torch.searchsorted(kv_pos, q_pos[-1:], right=True)[0]))
    parts = []
    for i, end in enumerate(ends):
        a, b = i * step, min(m, (i + 1) * step)
        parts.append(_masked(qb[:, :, a:b], kb[:, :, :end], vb[:, :, :end], q_pos[a:b], kv_pos[:end], scaling))
    return torch.cat(parts, dim=2)


def _increasing(positions: torch.Tensor) -> bool:
    """Strictly increasing positions: index order is position order (a plain causal mask)."""
    return positions.shape[0] < 2 or bool((positions[1:] > positions[:-1]).all())
