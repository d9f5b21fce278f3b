"""Step ranks: the wave order of a device-planned step of more entries than K slots.

Each routed entry's rank in ``residency.plan_waves``'s order (the step's resident experts first, then its missing
ones, each by id; -1 for padding); wave w of the step serves ranks ``[w*K, (w+1)*K)``. Computed once per step,
before its waves, without host sync. ``step_ranks_triton`` is one single-program launch; ``step_ranks_torch``, its
reference in fixed-shape torch ops, takes many small launches (bench/RESULTS.md, where the decode overhead goes).
"""

from __future__ import annotations

import torch
from torch import Tensor

from .planner import check_ids, on_triton, presence
from .runtime import launch, next_pow2, tl, triton

__all__ = ["step_ranks", "step_ranks_torch", "step_ranks_triton"]

_CHUNK = 1024  # entries a program reads at a time: any step size compiles to one kernel per E block


def step_ranks_torch(ids: Tensor, expert_slot: Tensor) -> Tensor:
    """The ranks in fixed-shape torch ops (capturable on CUDA); int64, shaped like ``ids``."""
    idx, present = presence(ids, expert_slot.numel(), expert_slot.device)
    resident = present & (expert_slot >= 0)
    missing = present & (expert_slot < 0)
    first = torch.cumsum(resident, 0) - 1
    then = resident.sum() + torch.cumsum(missing, 0) - 1
    rank = torch.where(resident, first, torch.where(missing, then, -1))
    return torch.cat([rank, rank.new_full((1,), -1)])[idx].view(ids.shape)


def _ranks_kernel(ids_ptr, n_ids, expert_slot_ptr, scratch_ptr, out_ptr, E, BN: tl.constexpr, BE: tl.constexpr):
    # One program; the phases exchange through ``scratch`` [E] (presence, then each expert's rank), with barriers.
    e = tl.arange(0, BE)
    tl.store(scratch_ptr + e, 0, mask=e < E)
    tl.debug_barrier()
    n = tl.arange(0, BN)
    for start in range(0, n_ids, BN):
        raw = tl.load(ids_ptr + start + n, mask=start + n < n_ids, other=-1)
        valid = (start + n < n_ids) & (raw >= 0) & (raw < E)
        tl.store(scratch_ptr + tl.where(valid, raw, 0), 1, mask=valid)
    tl.debug_barrier()
    present = tl.load(scratch_ptr + e, mask=e < E, other=0) > 0
    es = tl.load(expert_slot_ptr + e, mask=e < E, other=-1)
    resident = (present & (es >= 0)).to(tl.int32)
    missing = (present & (es < 0)).to(tl.int32)
    rank = tl.where(resident > 0, tl.cumsum(resident, 0) - 1,
                    tl.where(missing > 0, tl.sum(resident, 0) + tl.cumsum(missing, 0) - 1, -1))
    tl.debug_barrier()
    tl.store(scratch_ptr + e, rank, mask=e < E)
    tl.debug_barrier()
    for start in range(0, n_ids, BN):
        raw = tl.load(ids_ptr + start + n, mask=start + n < n_ids, other=-1)
        valid = (start + n < n_ids) & (raw >= 0) & (raw < E)
        r = tl.load(scratch_ptr + tl.where(valid, raw, 0), mask=valid, other=-1)
        tl.store(out_ptr + start + n, tl.where(valid, r, -1).to(tl.int64), mask=start + n < n_ids)


def step_ranks_triton(ids: Tensor, expert_slot: Tensor) -> Tensor:
    """The ranks in one single-program Triton launch; int64, shaped like ``ids``."""
    if triton is None:
        raise RuntimeError("step_ranks_triton needs triton")
    check_ids(ids)
    e, n = expert_slot.numel(), ids.numel()
    flat = ids.reshape(-1).contiguous()
    out = torch.empty(ids.shape, dtype=torch.int64, device=expert_slot.device)
    scratch = torch.empty(e, dtype=torch.int32, device=expert_slot.device)
    launch(_ranks_kernel, (1,), flat, n, expert_slot, scratch, out, e,
           BN=min(next_pow2(n, 16), _CHUNK), BE=next_pow2(e, 16), num_warps=4 if e <= 256 else 8,
           do_not_specialize=("n_ids", "E"))
    return out


def step_ranks(ids: Tensor, expert_slot: Tensor) -> Tensor:
    """Each entry's rank in the step's wave order: the Triton kernel for CUDA ids when triton imports, else torch."""
    impl = step_ranks_triton if on_triton(ids) else step_ranks_torch
    return impl(ids, expert_slot)
