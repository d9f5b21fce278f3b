"""Page-in of coded rows (``moepage.compress``): decode host row ``plan_experts[i]`` into slot ``plan_slots[i]``.

``gather_coded`` is one Triton launch per layer over a persistent grid, like ``gather.gather_rows``: work items are
(entry, tensor, part) up to ``plan_count``, read on the device. A part is a chunk of the row's weights or, the last,
its escape patch. A chunk writes every weight it decodes except escapes (code 15); the patch writes only the escapes,
from the row's exception list up to the row's own count (read on the device). No two items write one byte and none
waits for another: no barrier, no host sync, capturable. ``CodedTable`` holds raw addresses like ``PointerTable``
(CUDA host rows pinned and read under UVA; CPU process addresses under the interpreter), and each tensor's 16
exponents. Rows and slots 16-byte aligned (every real shape) take hinted vector accesses (``ALIGNED``).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from ..compress import TensorCode
from .gather import STEP, GatherGrid, check_readable, grid_programs
from .runtime import interpret_mode, launch, tl, triton

__all__ = ["CodedTable", "gather_coded"]

_BLOCK = 2048  # weights per tile: 4 warps x 32 threads x 16 (one 16-byte load of sign|mantissa bytes each)
_ITERS = 8  # tiles per chunk: a chunk reads 24 KiB of a coded row, writes 32 KiB of its slot
_EBLOCK = 256  # escapes patched per iteration


class CodedTable:
    """One layer's coded tensors as a device int64 table ``[T, 8]`` (addresses, sizes and section
    offsets) and int32 exponents ``[T, 16]``; ``keep`` holds the tensors the table points at."""

    def __init__(self, *, hosts: Sequence[torch.Tensor], slots: Sequence[torch.Tensor],
                 codes: Sequence[TensorCode]) -> None:
        if not (len(hosts) == len(slots) == len(codes)) or not codes:
            raise ValueError("need one slot tensor and one code per coded host tensor, at least one")
        rows = []
        for h, s, c in zip(hosts, slots, codes):
            if h.dtype != torch.uint8 or tuple(h.shape[1:]) != (c.nbytes,):
                raise ValueError(f"coded host rows must be uint8 [E, {c.nbytes}], got {h.dtype} {tuple(h.shape)}")
            if s.dtype != torch.bfloat16 or tuple(s.shape[1:]) != c.shape:
                raise ValueError(f"slots {s.dtype} {tuple(s.shape)} do not hold bf16 rows {c.shape}")
            check_readable(h, s, slots[0])
            lay = c.layout
            rows.append([h.data_ptr(), s.data_ptr(), c.nbytes, c.weights, lay.codes, lay.count, lay.indices,
                         lay.values])
        device = slots[0].device
        self.table = torch.tensor(rows, dtype=torch.int64).to(device)
        self.exponents = torch.tensor([c.exponents for c in codes], dtype=torch.int32).to(device)
        self.num_tensors = len(rows)
        self.max_weights = max(c.weights for c in codes)
        # Every address a chunk starts at is then a multiple of 16 (coded rows and sections are).
        self.aligned = all(r[0] % 16 == 0 and r[1] % 16 == 0 and (2 * r[3]) % 16 == 0 for r in rows)
        self.keep = (*hosts, *slots)


def _decode_kernel(table_ptr, exp_ptr, plan_e_ptr, plan_s_ptr, plan_c_ptr, num_tensors, chunks,
                   BLOCK: tl.constexpr, ITERS: tl.constexpr, EBLOCK: tl.constexpr, ALIGNED: tl.constexpr):
    parts = chunks + 1  # the row's chunks, then its escape patch
    total = tl.load(plan_c_ptr).to(tl.int64) * num_tensors * parts
    for item in range(tl.program_id(0).to(tl.int64), total, tl.num_programs(0).to(tl.int64)):
        part = item % parts
        t = (item // parts) % num_tensors
        i = item // (parts * num_tensors)
        row = table_ptr + t * 8  # CodedTable.table's 8 columns
        n = tl.load(row + 3)
        src = tl.load(row) + tl.load(plan_e_ptr + i).to(tl.int64) * tl.load(row + 2)
        dst = tl.load(row + 1) + tl.load(plan_s_ptr + i).to(tl.int64) * (2 * n)
        if part == chunks:
            count = tl.load((src + tl.load(row + 5)).to(tl.pointer_type(tl.int32)))
            ip = (src + tl.load(row + 6)).to(tl.pointer_type(tl.int32))
            vp = (src + tl.load(row + 7)).to(tl.pointer_type(tl.uint16))
            dp = dst.to(tl.pointer_type(tl.uint16))
            for j0 in range(0, count, EBLOCK):
                j = j0 + tl.arange(0, EBLOCK)
                m = j < count
                at = tl.load(ip + j, mask=m, other=0)
                tl.store(dp + at, tl.load(vp + j, mask=m, other=0), mask=m)
        else:
            codes = src + tl.load(row + 4)
            if ALIGNED:
                # The vectoriser sees no divisibility through an int->ptr cast: hint it (true by the layout).
                sp = tl.multiple_of(((src >> 4) * 16).to(tl.pointer_type(tl.uint8)), 16)
                cp = tl.multiple_of(((codes >> 4) * 16).to(tl.pointer_type(tl.uint8)), 16)
                dp = tl.multiple_of(((dst >> 4) * 16).to(tl.pointer_type(tl.uint16)), 16)
            else:
                sp = src.to(tl.pointer_type(tl.uint8))
                cp = codes.to(tl.pointer_type(tl.uint8))
                dp = dst.to(tl.pointer_type(tl.uint16))
            half = (n + 1) // 2
            for k in range(ITERS):
                first = part * (BLOCK * ITERS) + k * BLOCK
                o = first + tl.arange(0, BLOCK)
                p = first // 2 + tl.arange(0, BLOCK // 2)
                pairs = tl.load(cp + p, mask=p < half, other=0).to(tl.int32)
                code = tl.interleave(pairs & 15, pairs >> 4)
                m = o < n
                sm = tl.load(sp + o, mask=m, other=0).to(tl.int32)
                e = tl.load(exp_ptr + t * 16 + code)
                bits = ((sm & 0x80) << 8) | (e << 7) | (sm & 0x7F)
                tl.store(dp + o, bits.to(tl.uint16), mask=m & (code != 15))


def gather_coded(table: CodedTable, plan_experts: torch.Tensor, plan_slots: torch.Tensor, plan_count: torch.Tensor,
                 max_count: int, grid: GatherGrid = STEP) -> None:
    """Decode host row ``plan_experts[i]`` into slot ``plan_slots[i]`` for ``i < plan_count`` (read on the device),
    every coded tensor, one launch; ``max_count`` (<= ``plan_experts.numel()``) sizes the grid."""
    if triton is None:
        raise RuntimeError("gather_coded needs triton; use gather.gather_rows_torch with compress.decode_rows")
    if not 0 <= max_count <= plan_experts.numel():
        raise ValueError(f"max_count {max_count} outside [0, {plan_experts.numel()}]")
    if max_count == 0:
        return
    if interpret_mode() and table.table.is_cuda:
        raise RuntimeError("the Triton interpreter cannot dereference CUDA addresses")
    chunks = triton.cdiv(table.max_weights, _BLOCK * _ITERS)
    programs = grid_programs(table.table.device, max_count * table.num_tensors * (chunks + 1), grid)
    launch(
        _decode_kernel, (programs,),
        table.table, table.exponents, plan_experts, plan_slots, plan_count, table.num_tensors, chunks,
        BLOCK=_BLOCK, ITERS=_ITERS, EBLOCK=_EBLOCK, ALIGNED=table.aligned, num_warps=4,
        do_not_specialize=("num_tensors", "chunks"),
    )
