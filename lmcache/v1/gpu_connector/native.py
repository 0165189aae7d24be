"""Loader and ctypes binding of the optional native copy kernels built from ``csrc/``.

``setup.py`` builds two plain shared libraries next to the package (no Python or torch
headers involved, so ``pip install`` never needs a CUDA torch):

* ``lmcache/_c_ops_cpu.so`` from ``csrc/paged_copy.cpp`` whenever a C++ compiler exists;
* ``lmcache/_c_ops_cuda.so`` from ``csrc/paged_copy_cuda.cu`` only when nvcc and a CUDA
  torch exist at build time.

:func:`load` returns a :class:`NativeKernels` (or None, logged once, when the CPU library
is missing, stale or broken); :mod:`.copy_ops` then uses the torch fallback. Both methods
of :class:`NativeKernels` take the arguments of :func:`.copy_ops.paged_gather` /
:func:`.copy_ops.paged_scatter`. ctypes releases the GIL for the whole native call.

Environment:

* ``LMCACHE_NATIVE_LIB``: path of the CPU library to load instead of the packaged one
  (used to run a bounds-checked or sanitizer build);
* ``LMCACHE_NATIVE_THREADS``: worker threads per CPU call (default 1; more only helps on
  an idle machine with spare cores);
* ``LMCACHE_NATIVE_ISA=sse2`` / ``avx2``: read by the library when it loads; caps the
  instruction set its x86 paths use (default: the widest the CPU has, up to AVX-512BW; tests
  use it to cover the narrower paths);
* ``LMCACHE_USE_NATIVE=0`` (read by :mod:`.copy_ops` at import): always use the torch fallback.
"""

from __future__ import annotations

import array
import ctypes
import functools
import logging
import math
import os
from collections.abc import Sequence
from pathlib import Path

import torch

from lmcache.v1.gpu_connector.layouts import PagedGeometry

logger = logging.getLogger(__name__)

ABI_VERSION = 2  # csrc/paged_copy.h LMC_ABI_VERSION
PACKAGE_DIR = Path(__file__).resolve().parents[2]
CPU_LIBRARY = PACKAGE_DIR / "_c_ops_cpu.so"
CUDA_LIBRARY = PACKAGE_DIR / "_c_ops_cuda.so"

GATHER, SCATTER = 0, 1
NT_AUTO, NT_ALWAYS, NT_NEVER = 0, 1, 2
_OK, _ERR_ARGS, _ERR_SLOT, _ERR_BOUNDS, _ERR_CUDA, _ERR_NOMEM = 0, 1, 2, 3, 4, 5


class _Args(ctypes.Structure):
    """Mirror of ``LmcCopyArgs`` in csrc/paged_copy.h (field order matters)."""

    _fields_ = [
        (name, ctypes.c_int64)
        for name in (
            "direction",
            "elem_size",
            "num_layers",
            "num_comps",
            "num_chunks",
            "num_blocks",
            "block_size",
            "num_heads",
            "head_size",
            "num_slots",
            "num_threads",
            "flags",
            "unit_bytes",
            "total_tokens",
        )
    ] + [
        (name, ctypes.c_void_p)
        for name in (
            "comps",
            "layer_ptrs",
            "slots",
            "chunk_info",
            "mem_ptrs",
            "chunk_prefix",
            "layer_bounds",
            "mem_bounds",
            "error_info",
            "layer_blocks",
        )
    ]


_ARG_INDEX = {name: i for i, (name, _) in enumerate(_Args._fields_)}
"""Word index of each ``_Args`` field (every field is 8 bytes: the structure is an int64 array)."""
assert ctypes.sizeof(_Args) == 8 * len(_ARG_INDEX)


def _i64_array(values: Sequence[int]) -> ctypes.Array:
    return (ctypes.c_int64 * max(1, len(values)))(*values)


def _u64_array(values: Sequence[int]) -> ctypes.Array:
    return (ctypes.c_uint64 * max(1, len(values)))(*values)


def _slots_on(slot_mapping: torch.Tensor, device: torch.device) -> torch.Tensor:
    """``slot_mapping`` as the contiguous int64 tensor on ``device`` the kernels read."""
    if slot_mapping.dtype != torch.int64 or slot_mapping.device != device or not slot_mapping.is_contiguous():
        return slot_mapping.to(device=device, dtype=torch.int64).contiguous()
    return slot_mapping


def _kernel_fields(
    direction: int, first: torch.Tensor, geom: PagedGeometry, slots: torch.Tensor, *,
    num_layers: int, num_chunks: int, num_threads: int, flags: int, **pointers: int,
) -> dict[str, int]:
    """The fields of one copy's argument block (``_Args``): geometry and sizes from
    ``geom``/``first``, plus the given array addresses (``comps=...``, ``error_info=...``)."""
    return dict(
        direction=direction,
        elem_size=first.element_size(),
        num_layers=num_layers,
        num_comps=len(geom.components),
        num_chunks=num_chunks,
        num_blocks=geom.num_blocks,
        block_size=geom.block_size,
        num_heads=geom.num_heads,
        head_size=geom.head_size,
        num_slots=slots.shape[0],
        num_threads=num_threads,
        flags=flags,
        slots=slots.data_ptr(),
        **pointers,
    )


def _dense_chunk_info(starts: Sequence[int], counts: Sequence[int], num_layers: int, hidden: int) -> list[int]:
    """``(start, count, component / layer / token element strides)`` per chunk whose memory
    is a contiguous ``[num_comps, num_layers, count, hidden]`` buffer."""
    info: list[int] = []
    for start, count in zip(starts, counts):
        info += (start, count, num_layers * count * hidden, count * hidden, hidden)
    return info


def _byte_extent(t: torch.Tensor) -> tuple[int, int]:
    """[lo, hi) bytes spanned by a tensor's elements (non-negative strides)."""
    lo = t.data_ptr()
    if t.numel() == 0:
        return lo, lo
    last = sum((n - 1) * s for n, s in zip(t.shape, t.stride()))
    return lo, lo + (last + 1) * t.element_size()


def _env_threads() -> int:
    raw = os.environ.get("LMCACHE_NATIVE_THREADS", "1")
    try:
        return max(1, int(raw))
    except ValueError:
        logger.warning("LMCACHE_NATIVE_THREADS=%r is not an integer; using 1 thread", raw)
        return 1


class NativeKernels:
    """ctypes binding of one build of the csrc kernels.

    CPU calls block until the copy is complete and run on the calling thread (plus
    ``num_threads - 1`` short-lived workers). CUDA calls enqueue one kernel on the
    current CUDA stream of the KV device and return; memory objects may live on that
    device or in pinned host memory. The caller owns every tensor before and after.
    """

    def __init__(self, cpu: ctypes.CDLL, cuda: ctypes.CDLL | None = None, *, path: str = "") -> None:
        self.path = path
        self._cpu = cpu
        self._cuda = cuda
        self.bounds_checked = bool(cpu.lmc_bounds_checked())
        self.num_threads = _env_threads()
        self.nt_mode = NT_AUTO

    @property
    def has_cuda(self) -> bool:
        return self._cuda is not None

    # ------------------------------------------------------------------ public API
    def paged_gather(
        self,
        kv_layers: Sequence[torch.Tensor],
        geom: PagedGeometry,
        slot_mapping: torch.Tensor,
        starts: Sequence[int],
        dsts: Sequence[torch.Tensor],
    ) -> None:
        """Paged KV -> cache memory (semantics of :func:`.copy_ops.paged_gather`)."""
        self._copy(GATHER, kv_layers, geom, slot_mapping, starts, dsts)

    def paged_scatter(
        self,
        kv_layers: Sequence[torch.Tensor],
        geom: PagedGeometry,
        slot_mapping: torch.Tensor,
        starts: Sequence[int],
        srcs: Sequence[torch.Tensor],
    ) -> None:
        """Cache memory -> paged KV (semantics of :func:`.copy_ops.paged_scatter`)."""
        self._copy(SCATTER, kv_layers, geom, slot_mapping, starts, srcs)

    def layer_plan(
        self,
        direction: int,
        kv_layers: Sequence[torch.Tensor],
        geom: PagedGeometry,
        slot_mapping: torch.Tensor,
        starts: Sequence[int],
        counts: Sequence[int],
    ) -> LayerCopyPlan:
        """A :class:`LayerCopyPlan` for one request's per-layer copies (CPU tensors only).

        ``kv_layers`` are the request's layer tensors (same shape, strides, dtype and
        device, as :class:`~lmcache.v1.gpu_connector.paged_kv.PagedKV` guarantees; checked here);
        chunk ``k`` holds tokens ``[starts[k], starts[k] + counts[k])``. ValueError on
        malformed arguments.
        """
        return LayerCopyPlan(self, direction, kv_layers, geom, slot_mapping, starts, counts)

    def paged_copy_at(
        self,
        direction: int,
        kv_layers: Sequence[torch.Tensor],
        geom: PagedGeometry,
        slot_mapping: torch.Tensor,
        starts: Sequence[int],
        counts: Sequence[int],
        mem_ptrs: Sequence[int],
    ) -> None:
        """:meth:`paged_gather` / :meth:`paged_scatter` of CPU KV with each chunk's memory
        given by address (no tensor per chunk): ``mem_ptrs[k]`` is a contiguous
        ``[num_comps, num_layers, counts[k], hidden]`` buffer of the layers' dtype that
        stays alive for the call. The caller checks that from the memory objects'
        metadata (:func:`lmcache.v1.gpu_connector.paged.pool_addresses`); the slots and
        spans are checked here as in the tensor calls."""
        if direction not in (GATHER, SCATTER):
            raise ValueError(f"direction={direction!r}: expected {GATHER} (gather) or {SCATTER} (scatter)")
        if not len(starts) == len(counts) == len(mem_ptrs):
            raise ValueError(f"starts/counts/mem_ptrs: lengths differ ({len(starts)}, {len(counts)}, {len(mem_ptrs)})")
        if not mem_ptrs:
            return
        layers = list(kv_layers)
        if not layers or layers[0].device.type != "cpu":
            raise ValueError("kv_layers: paged_copy_at needs CPU layer tensors")
        num_layers, hidden = len(layers), geom.hidden
        row = len(geom.components) * num_layers
        chunk_info = _dense_chunk_info(starts, counts, num_layers, hidden)
        es = layers[0].element_size()
        extents = [(p, p + row * n * hidden * es) for p, n in zip(mem_ptrs, counts)]
        self._run(direction, layers, geom, slot_mapping, chunk_info, list(mem_ptrs), extents)

    # ------------------------------------------------------------------ internals
    def _copy(
        self,
        direction: int,
        kv_layers: Sequence[torch.Tensor],
        geom: PagedGeometry,
        slot_mapping: torch.Tensor,
        starts: Sequence[int],
        mems: Sequence[torch.Tensor],
    ) -> None:
        mems = list(mems)
        if not mems:
            return
        if len(starts) != len(mems):
            raise ValueError(f"starts: {len(starts)} entries for {len(mems)} memory tensors")
        layers = list(kv_layers)
        if not layers:
            raise ValueError("kv_layers: expected at least one layer tensor")
        first = layers[0]
        num_comps, num_layers, hidden = len(geom.components), len(layers), geom.hidden
        chunk_info: list[int] = []
        for i, (start, mem) in enumerate(zip(starts, mems)):
            if mem.dim() != 4 or mem.shape[0] != num_comps or mem.shape[1] != num_layers or mem.shape[3] != hidden:
                raise ValueError(
                    f"dsts/srcs[{i}]: shape {tuple(mem.shape)}, expected [{num_comps}, {num_layers}, T, {hidden}]"
                )
            if mem.dtype != first.dtype:
                raise TypeError(f"dsts/srcs[{i}]: dtype {mem.dtype} does not match the KV dtype {first.dtype}")
            if mem.stride(3) != 1 and hidden > 1:
                raise ValueError(f"dsts/srcs[{i}]: last dim must be contiguous, strides {mem.stride()}")
            chunk_info += [int(start), mem.shape[2], mem.stride(0), mem.stride(1), mem.stride(2)]
        mem_ptrs = [t.data_ptr() for t in mems]
        extents = [_byte_extent(t) for t in mems] if self.bounds_checked and first.device.type == "cpu" else None
        self._run(direction, layers, geom, slot_mapping, chunk_info, mem_ptrs, extents)

    def _run(
        self,
        direction: int,
        layers: list[torch.Tensor],
        geom: PagedGeometry,
        slot_mapping: torch.Tensor,
        chunk_info: list[int],
        mem_ptrs: list[int],
        mem_extents: Sequence[tuple[int, int]] | None,
    ) -> None:
        """Check the layers and the chunks' token spans, then run one kernel call.
        ``chunk_info`` holds ``(start, count, comp/layer/token element strides)`` per chunk;
        ``mem_extents`` the chunks' byte ranges (used by the bounds-checked build)."""
        first = layers[0]
        blocks = layer_block_counts(layers, geom)
        for i, layer in enumerate(layers):
            if layer.dtype != first.dtype or layer.device != first.device or layer.stride() != first.stride():
                raise ValueError(
                    f"kv_layers[{i}]: dtype/device/strides {layer.dtype}/{layer.device}/{layer.stride()} differ "
                    f"from layer 0 ({first.dtype}/{first.device}/{first.stride()})"
                )
        slots = _slots_on(slot_mapping, first.device)
        num_slots = slots.shape[0]
        for k in range(0, len(chunk_info), 5):
            start, count = chunk_info[k], chunk_info[k + 1]
            if count < 0 or start < 0 or start + count > num_slots:
                raise ValueError(f"slot_mapping: has {num_slots} entries, chunk needs [{start}, {start + count})")
        comps = [v for c in geom.components for v in c.as_tuple()]
        error_info = _i64_array([0, 0])
        arrays: dict[str, ctypes.Array] = {"error_info": error_info, "layer_blocks": _i64_array(blocks)}
        args = _Args(**_kernel_fields(
            direction, first, geom, slots, num_layers=len(layers), num_chunks=len(mem_ptrs),
            num_threads=self.num_threads, flags=self.nt_mode, error_info=ctypes.addressof(error_info),
        ))
        layer_ptrs = [t.data_ptr() for t in layers]
        if first.device.type == "cuda":
            self._launch_cuda(args, first, comps, layer_ptrs, chunk_info, mem_ptrs, geom, blocks)
            return
        if self.bounds_checked:
            assert mem_extents is not None
            arrays["layer_bounds"] = _u64_array([b for t in layers for b in _byte_extent(t)])
            arrays["mem_bounds"] = _u64_array([b for ext in mem_extents for b in ext])
        arrays.update(
            comps=_i64_array(comps),
            layer_ptrs=_u64_array(layer_ptrs),
            chunk_info=_i64_array(chunk_info),
            mem_ptrs=_u64_array(mem_ptrs),
        )
        for name, arr in arrays.items():
            setattr(args, name, ctypes.addressof(arr))
        rc = self._cpu.lmc_paged_copy(ctypes.byref(args))
        self._raise_for(rc, error_info, geom)

    def _launch_cuda(
        self,
        args: _Args,
        first: torch.Tensor,
        comps: list[int],
        layer_ptrs: list[int],
        chunk_info: list[int],
        mem_ptrs: list[int],
        geom: PagedGeometry,
        blocks: list[int],
    ) -> None:
        assert self._cuda is not None, "caller checks supports() first"
        counts = chunk_info[1::5]
        prefix = [0]
        for n in counts:
            prefix.append(prefix[-1] + n)
        # error_info (device memory) gets {1, slot} if the kernel skipped a slot outside a
        # layer; the host-side request validation makes that unreachable for engine calls
        parts = [comps, layer_ptrs, chunk_info, mem_ptrs, prefix, blocks, [0, 0]]
        # Staged through pinned memory and copied on the current stream without blocking:
        # a pageable source would make torch synchronise the stream (a CPU stall that
        # serialises the layerwise pipeline). torch's host allocator keeps the pinned
        # staging block alive until the copy has run.
        staged = torch.tensor([v for p in parts for v in p], dtype=torch.int64, pin_memory=True)
        meta = staged.to(first.device, non_blocking=True)
        base, offset = meta.data_ptr(), 0
        names = ("comps", "layer_ptrs", "chunk_info", "mem_ptrs", "chunk_prefix", "layer_blocks", "error_info")
        for name, part in zip(names, parts):
            setattr(args, name, base + 8 * offset)
            offset += len(part)
        args.total_tokens = prefix[-1]
        args.unit_bytes = _cuda_unit_bytes(first.element_size(), geom, comps, layer_ptrs, mem_ptrs, chunk_info)
        stream = torch.cuda.current_stream(first.device).cuda_stream
        rc = self._cuda.lmc_paged_copy_cuda(ctypes.byref(args), first.device.index or 0, ctypes.c_void_p(stream))
        if rc == _ERR_CUDA:
            raise RuntimeError(f"native CUDA copy failed: {self._cuda.lmc_cuda_last_error().decode()}")
        self._raise_for(rc, None, geom)

    @staticmethod
    def _raise_for(rc: int, error_info: Sequence[int] | None, geom: PagedGeometry) -> None:
        if rc == _OK:
            return
        if rc == _ERR_SLOT and error_info is not None:
            raise IndexError(
                f"slot_mapping[{error_info[0]}] = {error_info[1]}: outside the paged cache "
                f"({geom.num_blocks} blocks x {geom.block_size} slots)"
            )
        if rc == _ERR_BOUNDS:
            raise RuntimeError("native copy: out-of-bounds access detected by the bounds-checked build")
        if rc == _ERR_NOMEM:
            raise MemoryError("native copy: could not allocate its work arrays")
        raise ValueError(f"native copy rejected its arguments (code {rc})")


class LayerCopyPlan:
    """One request's per-layer CPU copies with the argument marshalling done once.

    The layerwise pipeline copies the same chunks once per layer; only the layer tensor
    and the chunks' memory objects change. The plan checks the slot mapping and the spans
    once and builds the ctypes argument block; :meth:`run` then fills in one layer's
    pointers and calls the kernel (a few microseconds of Python per layer instead of a
    full :meth:`NativeKernels._copy` set-up). Each layer tensor is checked against layer
    0 (shape, strides, dtype, device) when it is first copied.

    Memory side contract of :meth:`run`: ``mem_ptrs[k]`` is the address of a contiguous
    ``[num_comps, 1, counts[k], hidden]`` tensor of the layers' dtype that stays alive
    for the call (the caller checks this from the memory objects' metadata). The slot
    runs are still checked against the layer's blocks by the kernel on every call.

    Thread: the caller's; one plan is not shared between threads. Blocking: CPU copies
    complete before :meth:`run` returns (the GIL is released meanwhile).
    """

    def __init__(
        self,
        kernels: NativeKernels,
        direction: int,
        kv_layers: Sequence[torch.Tensor],
        geom: PagedGeometry,
        slot_mapping: torch.Tensor,
        starts: Sequence[int],
        counts: Sequence[int],
    ) -> None:
        layers = list(kv_layers)
        if not layers:
            raise ValueError("kv_layers: expected at least one layer tensor")
        if direction not in (GATHER, SCATTER):
            raise ValueError(f"direction={direction!r}: expected {GATHER} (gather) or {SCATTER} (scatter)")
        if len(starts) != len(counts):
            raise ValueError(f"starts/counts: lengths differ ({len(starts)}, {len(counts)})")
        first = layers[0]
        if first.device.type != "cpu":
            raise ValueError(f"kv_layers: a layer plan needs CPU tensors, got {first.device}")
        slots = _slots_on(slot_mapping, first.device)
        hidden, num_comps, num_slots = geom.hidden, len(geom.components), slots.shape[0]
        for k, (start, count) in enumerate(zip(starts, counts)):
            if count < 0 or start < 0 or start + count > num_slots:
                raise ValueError(f"chunk {k}: tokens [{start}, {start + count}) outside the slot mapping ({num_slots} entries)")
        chunk_info = _dense_chunk_info(starts, counts, 1, hidden)
        row_bytes = num_comps * hidden * first.element_size()
        self.mem_bytes = [count * row_bytes for count in counts]
        """Bytes of each chunk's memory tensor (what :meth:`run` may touch from its pointer)."""
        self._kernels = kernels
        self._slots = slots  # keeps the converted slot tensor alive while the plan exists
        self._layers = layers
        self._like = (first.shape, first.stride(), first.dtype, first.device)
        self._checked = [False] * len(layers)
        self._num_chunks = len(counts)
        # One int64 array holds the argument block (``_Args``, all 8-byte fields) and every
        # small array it points to: one allocation instead of a ctypes structure and six
        # ctypes arrays. Layout: args | components' views | this layer's pointer, its block
        # count | error info | chunk infos | one memory pointer per chunk.
        comps = [v for c in geom.components for v in c.as_tuple()]
        head = len(_Args._fields_)
        self._comps_at = head
        self._layer_at = head + len(comps)
        self._error_at = self._layer_at + 2
        self._mem_at = self._error_at + 2 + len(chunk_info)
        buf = self._buf = array.array("q", bytes(8 * head))
        buf.extend(comps)
        buf.extend((0, layer_block_counts([first], geom)[0], 0, 0))
        buf.extend(chunk_info)
        buf.frombytes(bytes(8 * max(1, self._num_chunks)))  # the memory pointers, zeroed
        base = buf.buffer_info()[0]
        fields = _kernel_fields(
            direction, first, geom, slots, num_layers=1, num_chunks=self._num_chunks,
            num_threads=kernels.num_threads, flags=kernels.nt_mode,
            comps=base + 8 * self._comps_at, layer_ptrs=base + 8 * self._layer_at,
            layer_blocks=base + 8 * (self._layer_at + 1), error_info=base + 8 * self._error_at,
            chunk_info=base + 8 * (self._error_at + 2), mem_ptrs=base + 8 * self._mem_at,
        )
        for name, value in fields.items():
            buf[_ARG_INDEX[name]] = value
        self._geom = geom
        self._args = _Args.from_address(base)  # a view of buf's head (buf keeps it alive)

    @property
    def num_chunks(self) -> int:
        return self._num_chunks

    def run(self, layer: int, mem_ptrs: Sequence[int]) -> None:
        """Copy layer ``layer`` for the first ``len(mem_ptrs)`` chunks (see the class docstring)."""
        k = len(mem_ptrs)
        if k == 0:
            return
        if k > self._num_chunks:
            raise ValueError(f"mem_ptrs: {k} pointers for a plan of {self._num_chunks} chunks")
        args = self._args
        layer_t = self._layers[layer]
        if not self._checked[layer]:  # each layer once, when first copied (not all upfront)
            like = (layer_t.shape, layer_t.stride(), layer_t.dtype, layer_t.device)
            if like != self._like:
                raise ValueError(
                    f"kv_layers[{layer}]: shape/strides/dtype/device {like} differ from layer 0 ({self._like})"
                )
            self._checked[layer] = True
        buf, at = self._buf, self._mem_at
        buf[self._layer_at] = layer_t.data_ptr()
        for i, ptr in enumerate(mem_ptrs, at):
            buf[i] = ptr
        args.num_chunks = k
        keep = None
        if self._kernels.bounds_checked:
            keep = (
                _u64_array(list(_byte_extent(layer_t))),
                _u64_array([b for p, n in zip(mem_ptrs, self.mem_bytes) for b in (p, p + n)]),
            )
            args.layer_bounds = ctypes.addressof(keep[0])
            args.mem_bounds = ctypes.addressof(keep[1])
        rc = self._kernels._cpu.lmc_paged_copy(ctypes.byref(args))
        NativeKernels._raise_for(rc, self._buf[self._error_at : self._error_at + 2], self._geom)


def layer_block_counts(layers: Sequence[torch.Tensor], geom: PagedGeometry) -> list[int]:
    """Blocks of each layer that lie wholly inside that layer tensor's own elements.

    ``geom`` comes from one layer; a layer whose strides match but which holds fewer
    blocks (a shorter view of a shared buffer) gets its own, smaller count, so the
    kernels never address past it. Pure arithmetic, per layer and component.
    """
    out = []
    for t in layers:
        extent = 1 + sum((n - 1) * st for n, st in zip(t.shape, t.stride())) if t.numel() else 0
        fit = geom.num_blocks
        for c in geom.components:
            span = (
                c.offset
                + (geom.block_size - 1) * c.token_stride
                + (geom.num_heads - 1) * c.head_stride
                + (geom.head_size - 1) * c.dim_stride
            )
            if span >= extent:
                fit = 0
            elif c.block_stride > 0:
                fit = min(fit, (extent - 1 - span) // c.block_stride + 1)
        out.append(max(0, fit))
    return out


def _cuda_unit_bytes(
    es: int,
    geom: PagedGeometry,
    comps: list[int],
    layer_ptrs: list[int],
    mem_ptrs: list[int],
    chunk_info: list[int],
) -> int:
    """Widest load/store (<= 16 bytes) that divides every offset the CUDA kernel forms."""
    if geom.head_size > 1 and any(c.dim_stride != 1 for c in geom.components):
        return es
    unit = 16
    strides = [v for i, v in enumerate(comps) if i % 5 != 4] + [v for i, v in enumerate(chunk_info) if i % 5 >= 2]
    for v in [geom.head_size * es, *layer_ptrs, *mem_ptrs, *(s * es for s in strides)]:
        unit = math.gcd(unit, v)
    return max(unit, es)


def _bind(lib: ctypes.CDLL, *, cuda: bool) -> None:
    lib.lmc_abi_version.restype = ctypes.c_int
    lib.lmc_abi_version.argtypes = []
    if cuda:
        lib.lmc_paged_copy_cuda.restype = ctypes.c_int
        lib.lmc_paged_copy_cuda.argtypes = [ctypes.POINTER(_Args), ctypes.c_int, ctypes.c_void_p]
        lib.lmc_cuda_last_error.restype = ctypes.c_char_p
        lib.lmc_cuda_last_error.argtypes = []
    else:
        lib.lmc_bounds_checked.restype = ctypes.c_int
        lib.lmc_bounds_checked.argtypes = []
        lib.lmc_paged_copy.restype = ctypes.c_int
        lib.lmc_paged_copy.argtypes = [ctypes.POINTER(_Args)]
    version = lib.lmc_abi_version()
    if version != ABI_VERSION:
        raise RuntimeError(f"ABI version {version}, expected {ABI_VERSION} (rebuild with `pip install -e .`)")


def load_library(cpu_path: str | os.PathLike[str], cuda_path: str | os.PathLike[str] | None = None) -> NativeKernels:
    """Load one build of the kernels; raises OSError/RuntimeError/AttributeError when unusable.

    The CUDA library is optional: when ``cuda_path`` is given but cannot be loaded, the
    result has ``has_cuda == False`` (logged once).
    """
    cpu = ctypes.CDLL(str(cpu_path))
    _bind(cpu, cuda=False)
    cuda = None
    if cuda_path is not None:
        try:
            cuda = ctypes.CDLL(str(cuda_path))
            _bind(cuda, cuda=True)
        except (OSError, AttributeError, RuntimeError) as exc:
            logger.info("lmcache native CUDA kernels unavailable (%s); CUDA copies use the torch fallback", exc)
            cuda = None
    return NativeKernels(cpu, cuda, path=str(cpu_path))


@functools.cache
def load() -> NativeKernels | None:
    """The native kernels, or None (logged once) when they are unavailable."""
    cpu_path = Path(os.environ.get("LMCACHE_NATIVE_LIB") or CPU_LIBRARY)
    cuda_path = CUDA_LIBRARY if CUDA_LIBRARY.exists() and torch.cuda.is_available() else None
    try:
        return load_library(cpu_path, cuda_path)
    except (OSError, AttributeError, RuntimeError) as exc:
        logger.info("lmcache native copy kernels unavailable (%s); using the torch fallback", exc)
        return None


def supports(mod: NativeKernels, kv: torch.Tensor, mems: torch.Tensor | Sequence[torch.Tensor]) -> bool:
    """Whether ``mod`` has kernels for KV on ``kv.device`` and these memory tensors.

    CPU kernels need everything on the CPU. CUDA kernels need each memory tensor on the
    KV device or in pinned host memory (reached through unified addressing).
    """
    mem_list = [mems] if isinstance(mems, torch.Tensor) else list(mems)
    if kv.device.type == "cpu":
        return all(m.device.type == "cpu" for m in mem_list)
    if kv.device.type == "cuda" and mod.has_cuda:
        return all(m.device == kv.device or (m.device.type == "cpu" and m.is_pinned()) for m in mem_list)
    return False
