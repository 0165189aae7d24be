"""Rotary position embedding (RoPE) for blending: apply it, and move cached keys to new positions.

A cached key was rotated for the position its token had when it was computed. To reuse it
at another position it is rotated again, by the angle difference: rotations of one plane
compose (``R(b) R(a) = R(a + b)``), so rotating a key computed at ``old`` by ``new - old``
gives the key computed at ``new``, up to float rounding. Angles are formed in float64
(``position * inv_freq``) and only their cos/sin are rounded to float32, so a re-rotation
adds a few float32 ulps of error and does not grow with the position.

Only the standard ("default") RoPE of Llama, Mistral and Qwen2 is supported: full-width
rotation with the neox (``rotate_half``) pairing, dimension ``i`` paired with ``i + d/2``.
Scaled variants (linear, dynamic, yarn, llama3, longrope...) and partial rotary embeddings
raise :class:`UnsupportedRope` so the caller can turn blending off instead of producing
wrong keys.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import torch

__all__ = ["RopeSpec", "UnsupportedRope", "rerotate_with_tables", "rotate_half"]


class UnsupportedRope(ValueError):
    """The model's rotary embedding is not the standard one this module can re-rotate."""


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    """``[-x2, x1]`` for ``x = [x1, x2]`` split in halves along the last dimension."""
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def _apply(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """``x`` rotated by the angles whose cos/sin are given (broadcast over heads), in float32
    or wider, returned in ``x``'s dtype."""
    work = torch.promote_types(x.dtype, torch.float32)
    xf = x.to(work)
    return (xf * cos.to(work) + rotate_half(xf) * sin.to(work)).to(x.dtype)


@dataclass(frozen=True, slots=True, eq=False)
class RopeSpec:
    """Standard RoPE of one model: ``head_dim`` and its ``head_dim / 2`` inverse frequencies.

    Tensors handled here are laid out ``[num_tokens, num_heads, head_dim]`` (any leading
    dimensions work as long as the token dimension is third from the end); positions are a
    1-D integer tensor of ``num_tokens`` entries. Inputs are not modified; results are new
    tensors owned by the caller.
    """

    head_dim: int
    inv_freq: torch.Tensor
    """float64, ``head_dim // 2`` entries, on the CPU."""

    def __post_init__(self) -> None:
        if self.head_dim <= 0 or self.head_dim % 2:
            raise ValueError(f"head_dim={self.head_dim}: expected a positive even number")
        if self.inv_freq.shape != (self.head_dim // 2,):
            raise ValueError(f"inv_freq has shape {tuple(self.inv_freq.shape)}; expected ({self.head_dim // 2},)")
        object.__setattr__(self, "inv_freq", self.inv_freq.detach().to("cpu", torch.float64))

    @classmethod
    def from_base(cls, head_dim: int, base: float) -> RopeSpec:
        """The default RoPE with ``inv_freq[i] = base ** (-2i / head_dim)``, computed in float32
        as Hugging Face and vLLM compute it (so the frequencies match theirs bit for bit)."""
        if not (isinstance(base, (int, float)) and math.isfinite(base) and base > 1):
            raise ValueError(f"rope base={base!r}: expected a finite number > 1")
        if head_dim <= 0 or head_dim % 2:
            raise ValueError(f"head_dim={head_dim}: expected a positive even number")
        inv_freq = 1.0 / (base ** (torch.arange(0, head_dim, 2, dtype=torch.float32) / head_dim))
        return cls(head_dim, inv_freq)

    @classmethod
    def from_hf_config(cls, config: Any) -> RopeSpec:
        """The RoPE of a Hugging Face text config (Llama, Mistral, Qwen2 style).

        Reads ``rope_parameters`` (transformers >= 5) or ``rope_theta``/``rope_scaling``
        (older). Raises :class:`UnsupportedRope` for a scaled rope type or a partial
        rotary factor other than 1, ValueError for a config without the needed fields."""
        params = getattr(config, "rope_parameters", None) or {}
        scaling = getattr(config, "rope_scaling", None) or {}
        if scaling is params:
            scaling = {}
        rope_type = params.get("rope_type") or params.get("type") or scaling.get("rope_type") or scaling.get("type")
        if rope_type not in (None, "default"):
            raise UnsupportedRope(f"rope_type={rope_type!r}: only the default (unscaled) RoPE can be re-rotated")
        partial = params.get("partial_rotary_factor", getattr(config, "partial_rotary_factor", 1.0))
        if partial not in (None, 1, 1.0):
            raise UnsupportedRope(f"partial_rotary_factor={partial!r}: only full-width RoPE can be re-rotated")
        base = params.get("rope_theta", getattr(config, "rope_theta", None))
        if base is None:
            raise ValueError("the config names no rope_theta")
        head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
        return cls.from_base(int(head_dim), float(base))

    def cos_sin(self, positions: torch.Tensor, device: torch.device | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """float32 ``(cos, sin)`` of shape ``[len(positions), 1, head_dim]`` (broadcast over
        heads); angles are formed in float64. Positions may be negative (a delta)."""
        if positions.dim() != 1 or positions.dtype.is_floating_point:
            raise ValueError("positions: expected a 1-D integer tensor")
        angles = positions.to("cpu", torch.float64)[:, None] * self.inv_freq[None, :]
        angles = torch.cat((angles, angles), dim=-1)[:, None, :]
        cos, sin = angles.cos().to(torch.float32), angles.sin().to(torch.float32)
        if device is not None:
            cos, sin = cos.to(device), sin.to(device)
        return cos, sin

    def apply(self, x: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """``x`` (``[..., n, heads, head_dim]``, not yet rotated) rotated for ``positions``."""
        self._check(x, positions)
        cos, sin = self.cos_sin(positions, x.device)
        return _apply(x, cos, sin)

    def rerotate(self, keys: torch.Tensor, old_positions: torch.Tensor, new_positions: torch.Tensor) -> torch.Tensor:
        """Keys rotated for ``old_positions``, moved to ``new_positions`` (one rotation by the
        difference; equal to computing them at ``new_positions`` within float32 rounding)."""
        self._check(keys, old_positions)
        if new_positions.shape != old_positions.shape:
            raise ValueError(
                f"new_positions has shape {tuple(new_positions.shape)}; old_positions {tuple(old_positions.shape)}"
            )
        delta = new_positions.to(torch.int64) - old_positions.to(torch.int64)
        cos, sin = self.cos_sin(delta, keys.device)
        return _apply(keys, cos, sin)

    def shift(self, keys: torch.Tensor, offset: int) -> torch.Tensor:
        """Keys of consecutive tokens moved by ``offset`` positions (a segment moved as a whole)."""
        n = keys.shape[-3]
        zero = torch.zeros(n, dtype=torch.int64)
        return self.rerotate(keys, zero, zero + offset)

    def _check(self, x: torch.Tensor, positions: torch.Tensor) -> None:
        if x.dim() < 3 or x.shape[-1] != self.head_dim:
            raise ValueError(f"tensor of shape {tuple(x.shape)}: expected [..., num_tokens, heads, {self.head_dim}]")
        if positions.dim() != 1 or positions.shape[0] != x.shape[-3]:
            raise ValueError(f"positions of shape {tuple(positions.shape)} for {x.shape[-3]} tokens")


def rerotate_with_tables(
    keys: torch.Tensor,
    cos_old: torch.Tensor,
    sin_old: torch.Tensor,
    cos_new: torch.Tensor,
    sin_new: torch.Tensor,
) -> torch.Tensor:
    """Re-rotate keys with a model's own cos/sin tables (e.g. an inference engine's cache).

    ``cos_*``/``sin_*``: ``[n, head_dim]`` (neox layout, halves repeated) or ``[n, head_dim/2]``,
    for each key's old and new position. The delta rotation is formed by the angle-difference
    identities in float64 (``cos(b - a) = cos b cos a + sin b sin a``,
    ``sin(b - a) = sin b cos a - cos b sin a``), so the only error beyond the tables' own is
    float32 rounding of the final product."""
    tables = [t.to(torch.float64) for t in (cos_old, sin_old, cos_new, sin_new)]
    if len({t.shape for t in tables}) != 1 or tables[0].dim() != 2 or tables[0].shape[0] != keys.shape[-3]:
        raise ValueError("cos/sin tables: expected four [num_tokens, dim] tensors matching the keys")
    co, so, cn, sn = tables
    cos_d = cn * co + sn * so
    sin_d = sn * co - cn * so
    if cos_d.shape[-1] * 2 == keys.shape[-1]:
        cos_d, sin_d = torch.cat((cos_d, cos_d), dim=-1), torch.cat((sin_d, sin_d), dim=-1)
    if cos_d.shape[-1] != keys.shape[-1]:
        raise ValueError(f"cos/sin tables of width {cos_d.shape[-1]} for head_dim {keys.shape[-1]}")
    return _apply(keys, cos_d[:, None, :].to(keys.device), sin_d[:, None, :].to(keys.device))
