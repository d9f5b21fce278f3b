"""Page-in of a step's plan: copy host row ``plan_experts[i]`` into slot ``plan_slots[i]``.

``gather_rows`` is one Triton launch per layer over a persistent grid, reading ``plan_count`` on the device (an empty
plan costs one launch of a few programs); ``gather_rows_torch`` is the fixed-shape fallback. Neither reads the plan on
the host: both can be graph-captured after the planner. ``PointerTable`` holds raw int64 addresses, cast to ``uint8``
pointers in the kernel (any dtype, any row size; CUDA host rows must be pinned, read under UVA). Triton sees no
alignment through that cast, so 16-byte-aligned rows take a ``tl.multiple_of`` branch (``v4.b32`` accesses), others a
byte branch. Under the interpreter (triton 3.8) the addresses are raw process addresses: CPU tables work (the CPU
tests run this kernel), CUDA ones need the compiled kernel.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

from .runtime import interpret_mode, launch, programs, tl, triton

__all__ = ["BACKGROUND", "STEP", "GatherGrid", "PointerTable", "gather_rows", "gather_rows_torch"]

_BLOCK = 4096  # bytes per tile: 4 warps x 32 threads x 2 x 16 bytes
_ITERS = 8  # tiles per work item: an item copies up to 32 KiB of one row


@dataclass(frozen=True)
class GatherGrid:
    """The persistent gather's grid: ``per_sm`` programs per multiprocessor, at most ``cap`` (tuning as data)."""

    per_sm: int = 4
    cap: int | None = None


STEP = GatherGrid()  # a step's page-in: enough programs to keep the link busy
BACKGROUND = GatherGrid(cap=16)  # a prefetch beside compute: a few programs reach link speed, leaving it the SMs


def check_readable(host: torch.Tensor, slots: torch.Tensor, first_slots: torch.Tensor) -> None:
    """The rules every gather kernel relies on for one host tensor and its slots: both contiguous, the
    slots on the layer's one device, and host rows a CUDA kernel reads pinned (or on the GPU)."""
    if not (host.is_contiguous() and slots.is_contiguous()):
        raise ValueError("paged tensors must be contiguous")
    if slots.device != first_slots.device:
        raise ValueError("all slot tensors of a layer must be on one device")
    if slots.is_cuda and not (host.is_cuda or host.is_pinned()):
        raise ValueError("host rows read by a CUDA kernel must be pinned (or on the GPU)")


class PointerTable:
    """One layer's paged tensors as a device int64 table ``[T, 3]`` of (host base, slot base,
    row bytes). Built once per layer; ``keep`` holds tensors whose memory the table points at."""

    def __init__(
        self,
        host_bases: Sequence[int],
        slot_bases: Sequence[int],
        row_bytes: Sequence[int],
        device: torch.device | str,
        keep: Sequence[torch.Tensor] = (),
    ) -> None:
        if not (len(host_bases) == len(slot_bases) == len(row_bytes)):
            raise ValueError("host_bases, slot_bases and row_bytes must have one entry per tensor")
        if any(int(b) <= 0 for b in row_bytes):
            raise ValueError("row sizes must be positive")
        rows = [[int(h), int(s), int(b)] for h, s, b in zip(host_bases, slot_bases, row_bytes)]
        self.table = torch.tensor(rows, dtype=torch.int64).reshape(-1, 3).to(device)
        self.num_tensors = len(rows)
        self.max_row_bytes = max((r[2] for r in rows), default=0)
        self.keep = tuple(keep)

    @classmethod
    def from_tensors(cls, host_tensors: Sequence[torch.Tensor], slot_tensors: Sequence[torch.Tensor]) -> PointerTable:
        """Table for ``host[i]`` ``[E, ...]`` -> ``slots[i]`` ``[K, ...]`` (same row shape, dtype)."""
        if len(host_tensors) != len(slot_tensors) or not slot_tensors:
            raise ValueError("need one slot tensor per host tensor, at least one")
        for h, s in zip(host_tensors, slot_tensors):
            if h.shape[1:] != s.shape[1:] or h.dtype != s.dtype:
                raise ValueError(f"host {tuple(h.shape)} {h.dtype} and slots {tuple(s.shape)} {s.dtype} differ per row")
            check_readable(h, s, slot_tensors[0])
        row_bytes = [s[0].numel() * s.element_size() for s in slot_tensors]
        return cls(
            [h.data_ptr() for h in host_tensors],
            [s.data_ptr() for s in slot_tensors],
            row_bytes,
            slot_tensors[0].device,
            keep=[*host_tensors, *slot_tensors],
        )


def _gather_kernel(
    table_ptr, plan_e_ptr, plan_s_ptr, plan_c_ptr, num_tensors, chunks, BLOCK: tl.constexpr, ITERS: tl.constexpr
):
    # Persistent grid over work items (entry, tensor, chunk of its row) up to the plan's length, read only here.
    total = tl.load(plan_c_ptr).to(tl.int64) * num_tensors * chunks
    for item in range(tl.program_id(0).to(tl.int64), total, tl.num_programs(0).to(tl.int64)):
        chunk = item % chunks
        t = (item // chunks) % num_tensors
        i = item // (chunks * num_tensors)
        rb = tl.load(table_ptr + t * 3 + 2)
        start = chunk * (BLOCK * ITERS)
        # Past the end of a row shorter than the longest: n <= 0 masks every access.
        n = tl.minimum(rb - start, BLOCK * ITERS)
        src = tl.load(table_ptr + t * 3) + tl.load(plan_e_ptr + i).to(tl.int64) * rb + start
        dst = tl.load(table_ptr + t * 3 + 1) + tl.load(plan_s_ptr + i).to(tl.int64) * rb + start
        offs = tl.arange(0, BLOCK)
        if ((src | dst | n) & 15) == 0:
            # The vectoriser sees no divisibility through an int->ptr cast: hint a cast made in this branch only.
            sp = tl.multiple_of(((src >> 4) * 16).to(tl.pointer_type(tl.uint8)), 16)
            dp = tl.multiple_of(((dst >> 4) * 16).to(tl.pointer_type(tl.uint8)), 16)
            n16 = (n >> 4) * 16
            for k in range(ITERS):
                o = k * BLOCK + offs
                tl.store(dp + o, tl.load(sp + o, mask=o < n16), mask=o < n16)
        else:
            sp = src.to(tl.pointer_type(tl.uint8))
            dp = dst.to(tl.pointer_type(tl.uint8))
            for k in range(ITERS):
                o = k * BLOCK + offs
                tl.store(dp + o, tl.load(sp + o, mask=o < n), mask=o < n)


def grid_programs(device: torch.device, work: int, grid: GatherGrid) -> int:
    """``grid``'s programs for ``work`` items on ``device``."""
    return programs(device, work, grid.per_sm, grid.cap)


def gather_rows(
    table: PointerTable,
    plan_experts: torch.Tensor,
    plan_slots: torch.Tensor,
    plan_count: torch.Tensor,
    max_count: int,
    grid: GatherGrid = STEP,
) -> None:
    """Copy host row ``plan_experts[i]`` to slot ``plan_slots[i]`` for ``i < plan_count`` (read on the device), every
    tensor, one launch; ``max_count`` (<= ``plan_experts.numel()``) sizes the grid, ``BACKGROUND`` is beside compute."""
    if triton is None:
        raise RuntimeError("gather_rows needs triton; use gather_rows_torch")
    if not 0 <= max_count <= plan_experts.numel():
        raise ValueError(f"max_count {max_count} outside [0, {plan_experts.numel()}]")
    if max_count == 0 or table.num_tensors == 0:
        return
    if interpret_mode() and table.table.is_cuda:
        raise RuntimeError("the Triton interpreter cannot dereference CUDA addresses")
    chunks = triton.cdiv(table.max_row_bytes, _BLOCK * _ITERS)
    grid = (grid_programs(table.table.device, max_count * table.num_tensors * chunks, grid),)
    launch(
        _gather_kernel, grid,
        table.table, plan_experts, plan_slots, plan_count, table.num_tensors, chunks,
        BLOCK=_BLOCK, ITERS=_ITERS, num_warps=4, do_not_specialize=("num_tensors", "chunks"),
    )


def gather_rows_torch(
    host_tensors: Sequence[torch.Tensor],
    slot_tensors: Sequence[torch.Tensor],
    plan_experts: torch.Tensor,
    plan_slots: torch.Tensor,
    plan_count: torch.Tensor,
    max_count: int | None = None,
    decoders: Sequence[Callable[[torch.Tensor], torch.Tensor] | None] = (),
) -> None:
    """Fixed-shape torch page-in of ``max_count`` (default K) rows per tensor whatever ``plan_count`` is. Host
    tensors must be on the plan's device (CPU, or a device mirror): torch cannot index pinned memory without a sync.
    ``decoders[i]`` (fixed-shape too) turns tensor i's host rows into slot rows (coded rows; None: as they are)."""
    m = plan_experts.numel() if max_count is None else max_count
    if m == 0:
        return
    pe, ps = plan_experts[:m].long(), plan_slots[:m].long()
    pos = torch.arange(m, device=pe.device)
    take = pos < plan_count
    any_ = (plan_count > 0).reshape(())
    # Entries past the count repeat entry 0 (identical duplicate writes); with none, slot 0 gets its own contents back.
    src = torch.where(take, pe, torch.where(any_, pe[0], 0))
    dst = torch.where(take, ps, torch.where(any_, ps[0], 0))
    for i, (h, s) in enumerate(zip(host_tensors, slot_tensors)):
        if h.device != pe.device or s.device != pe.device:
            raise ValueError(f"host {h.device} / slots {s.device} must be on the plan's device {pe.device}")
        decode = decoders[i] if i < len(decoders) else None
        if decode is None and s.dtype.is_floating_point and s.dtype.itemsize == 1:
            h, s = h.view(torch.uint8), s.view(torch.uint8)  # FP8: the same bytes (torch's CPU index ops lack it)
        rows = h.index_select(0, src)
        if decode is not None:
            rows = decode(rows)
        keep = s[0:1].expand_as(rows)
        rows = torch.where(any_.reshape([1] * rows.dim()), rows, keep)
        s.index_copy_(0, dst, rows)
