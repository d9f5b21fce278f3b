"""Device-side residency planner: one MoE layer's LRU step without host synchronisation.

Owns ``plan_step`` (dispatch), ``plan_step_torch`` (fixed-shape torch ops, any device; the
vendor-neutral planner and the reference for the kernel) and ``plan_step_triton`` (one
single-program Triton launch). All three apply ``moepage.residency.Residency.place`` to the
distinct valid experts of ``ids`` and update the shared state arrays in place:

``slot_expert`` int32 [K], ``expert_slot`` int32 [E], ``last_use`` int64 [K], ``clock`` int64 [1];
the plan is ``plan_experts`` / ``plan_slots`` int32 [K] (first ``plan_count`` entries valid, misses
in ascending expert id, the rest -1) and ``plan_count`` int32 [1]. ``counters`` int64 [3], if
given, accumulates (steps, distinct hits, misses). Ids < 0 or >= E are padding.
"""

from __future__ import annotations

import os
from functools import lru_cache
from typing import Any, Optional

import torch

try:  # triton is optional: the torch planner serves every other case
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover - exercised only where triton is absent
    triton = None
    tl = None

__all__ = ["plan_step", "plan_step_torch", "plan_step_triton", "triton_available", "interpret_mode"]

_BIG = 1 << 62  # sort key of slots that cannot be victims (hit this step, or padding)
_BIG_C = tl.constexpr(_BIG) if tl is not None else None  # jit code may only read constexpr globals


def triton_available() -> bool:
    return triton is not None


def interpret_mode() -> bool:
    """Whether ``triton.jit`` would build interpreter kernels now (it reads this at decoration)."""
    try:
        return bool(triton.knobs.runtime.interpret)  # type: ignore[union-attr]
    except AttributeError:
        return os.environ.get("TRITON_INTERPRET", "0").lower() in ("1", "true", "yes", "on", "y")


def next_pow2(n: int, floor: int = 1) -> int:
    return max(floor, 1 << max(0, int(n) - 1).bit_length())


def _check(ids: torch.Tensor, slot_expert: torch.Tensor, expert_slot: torch.Tensor) -> tuple[int, int, int]:
    # Shape checks only: they read no tensor data, so they never synchronise.
    k, e, n = slot_expert.numel(), expert_slot.numel(), ids.numel()
    if n > k:
        raise ValueError(f"a device-planned step takes at most K={k} routed entries, got {n}")
    if ids.dtype.is_floating_point or ids.dtype == torch.bool:
        raise TypeError(f"ids must be an integer tensor, got {ids.dtype}")
    return n, k, e


def plan_step_torch(
    ids: torch.Tensor,
    slot_expert: torch.Tensor,
    expert_slot: torch.Tensor,
    last_use: torch.Tensor,
    clock: torch.Tensor,
    plan_experts: torch.Tensor,
    plan_slots: torch.Tensor,
    plan_count: torch.Tensor,
    counters: Optional[torch.Tensor] = None,
) -> None:
    """The planner rule in fixed-shape torch ops (capturable on CUDA)."""
    _, k, e = _check(ids, slot_expert, expert_slot)
    dev = slot_expert.device
    flat = ids.reshape(-1).to(device=dev, dtype=torch.int64)
    # Presence over E+1 entries: padding lands in the extra one, which is dropped.
    idx = torch.where((flat >= 0) & (flat < e), flat, e)
    present = torch.zeros(e + 1, dtype=torch.bool, device=dev).index_fill_(0, idx, True)[:e]
    es = expert_slot.long()
    hit_e = present & (es >= 0)
    miss_e = present & (es < 0)
    hit_s = torch.zeros(k + 1, dtype=torch.bool, device=dev)
    hit_s = hit_s.index_fill_(0, torch.where(hit_e, es, k), True)[:k]
    n_hit = hit_s.sum()
    n_miss = miss_e.sum()
    now = clock + 1
    clock.copy_(now)

    # Victims: non-hit slots by (last_use, slot); slot ids are unique, so keys are too.
    slot_ids = torch.arange(k, device=dev)
    key = torch.where(hit_s, _BIG, (last_use + 1) * k + slot_ids)
    victims = torch.sort(key).values.remainder(k)
    pos = slot_ids
    take = pos < n_miss
    # Miss of rank r (ascending id) goes to position r; non-misses go to the dropped entry K.
    rank = torch.cumsum(miss_e.long(), 0) - 1
    new_e = torch.full((k + 1,), -1, dtype=torch.int64, device=dev)
    new_e.scatter_(0, torch.where(miss_e, rank, k), torch.arange(e, device=dev))
    new_e = new_e[:k]
    plan_experts.copy_(torch.where(take, new_e, -1))
    plan_slots.copy_(torch.where(take, victims, -1))
    plan_count.copy_(n_miss.reshape(1))

    # State updates; entries that do not apply are sent to a dropped extra entry.
    old = slot_expert.long().gather(0, victims)
    ext_es = torch.cat([expert_slot, expert_slot.new_full((1,), -1)])
    ext_es.scatter_(0, torch.where(take & (old >= 0), old, e), -1)
    ext_es.scatter_(0, torch.where(take, new_e, e), torch.where(take, victims, -1).to(ext_es.dtype))
    expert_slot.copy_(ext_es[:e])
    ext_se = torch.cat([slot_expert, slot_expert.new_full((1,), -1)])
    ext_se.scatter_(0, torch.where(take, victims, k), new_e.to(ext_se.dtype))
    slot_expert.copy_(ext_se[:k])
    stamped = torch.zeros(k + 1, dtype=torch.bool, device=dev)
    stamped = stamped.index_fill_(0, torch.where(take, victims, k), True)[:k] | hit_s
    last_use.copy_(torch.where(stamped, now, last_use))
    if counters is not None:
        counters.add_(torch.stack([torch.ones_like(n_hit), n_hit, n_miss]).to(counters.dtype))


def _plan_kernel(
    ids_ptr, n_ids, slot_expert_ptr, expert_slot_ptr, last_use_ptr, clock_ptr,
    plan_e_ptr, plan_s_ptr, plan_c_ptr, counters_ptr, K, E,
    HAS_COUNTERS: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, RK: tl.constexpr, HE: tl.constexpr,
):
    # Phase A: read state, split the step's experts, choose victims, write the plan.
    now = tl.load(clock_ptr) + 1
    n = tl.arange(0, BN)
    raw = tl.load(ids_ptr + n, mask=n < n_ids, other=0)
    valid = (n < n_ids) & (raw >= 0) & (raw < E)
    ex = tl.where(valid, raw, 0).to(tl.int32)
    es = tl.load(expert_slot_ptr + ex, mask=valid, other=-1)
    is_hit = valid & (es >= 0)
    is_miss = valid & (es < 0)
    # Histograms dedupe without E x N tiles; padding goes to the unused bin K (resp. E).
    hist_hit = tl.histogram(tl.where(is_hit, es, K), RK * BK)
    hist_miss = tl.histogram(tl.where(is_miss, ex, E), HE)
    s = tl.arange(0, BK)
    rows = tl.reshape(hist_hit, (RK, BK))
    hit_cnt = tl.sum(tl.where(tl.arange(0, RK)[:, None] == 0, rows, 0), axis=0)
    hit_s = (hit_cnt > 0) & (s < K)
    lu = tl.load(last_use_ptr + s, mask=s < K, other=0)
    free = (s < K) & (hit_cnt == 0)
    key = tl.where(free, (lu + 1) * BK + s, s.to(tl.int64) + _BIG_C)  # last_use >= -1 keeps keys >= 0
    victim = (tl.sort(key) % BK).to(tl.int32)  # victim at position p, in position layout
    x = tl.arange(0, HE)
    miss_x = (hist_miss > 0) & (x < E)
    rank = tl.cumsum(miss_x.to(tl.int32), axis=0) - 1
    n_miss = tl.sum(miss_x.to(tl.int32), axis=0)
    n_hit = tl.sum(hit_s.to(tl.int32), axis=0)
    tl.store(plan_e_ptr + rank, x, mask=miss_x)
    tl.store(plan_e_ptr + s, -1, mask=(s >= n_miss) & (s < K))
    tl.store(plan_s_ptr + s, tl.where(s < n_miss, victim, -1), mask=s < K)
    tl.store(plan_c_ptr, n_miss)
    if HAS_COUNTERS:
        c0 = tl.load(counters_ptr)
        c1 = tl.load(counters_ptr + 1)
        c2 = tl.load(counters_ptr + 2)
    # Phase B: the plan's experts come back in position layout (global memory is the exchange).
    tl.debug_barrier()
    take = s < n_miss
    new_e = tl.load(plan_e_ptr + s, mask=take, other=0)
    old = tl.load(slot_expert_ptr + victim, mask=take, other=-1)
    # Phase C: write the state; every read above is done, so no thread sees a half update.
    tl.debug_barrier()
    tl.store(expert_slot_ptr + old, -1, mask=take & (old >= 0))
    tl.store(expert_slot_ptr + new_e, victim, mask=take)
    tl.store(slot_expert_ptr + victim, new_e, mask=take)
    tl.store(last_use_ptr + victim, now, mask=take)
    tl.store(last_use_ptr + s, now, mask=hit_s)
    tl.store(clock_ptr, now)
    if HAS_COUNTERS:
        tl.store(counters_ptr, c0 + 1)
        tl.store(counters_ptr + 1, c1 + n_hit)
        tl.store(counters_ptr + 2, c2 + n_miss)


@lru_cache(maxsize=None)
def _jit(fn: Any, interpret: bool) -> Any:
    # triton.jit picks interpreter or compiler when it decorates, so decorate per mode, lazily.
    del interpret  # part of the cache key only
    return triton.jit(fn)


def plan_step_triton(
    ids: torch.Tensor,
    slot_expert: torch.Tensor,
    expert_slot: torch.Tensor,
    last_use: torch.Tensor,
    clock: torch.Tensor,
    plan_experts: torch.Tensor,
    plan_slots: torch.Tensor,
    plan_count: torch.Tensor,
    counters: Optional[torch.Tensor] = None,
) -> None:
    """The planner rule in one single-program Triton launch (K, E up to 512)."""
    if triton is None:
        raise RuntimeError("plan_step_triton needs triton")
    n, k, e = _check(ids, slot_expert, expert_slot)
    flat = ids.reshape(-1)
    if not flat.is_contiguous():
        flat = flat.contiguous()
    bk = next_pow2(k, 16)
    hk = next_pow2(k + 1, 32)  # bins 0..K-1 are slots, bin K collects padding
    kernel = _jit(_plan_kernel, interpret_mode())
    kernel[(1,)](
        flat, n, slot_expert, expert_slot, last_use, clock, plan_experts, plan_slots, plan_count,
        counters if counters is not None else clock, k, e,
        HAS_COUNTERS=counters is not None, BN=next_pow2(n, 16), BK=bk, RK=hk // bk,
        HE=next_pow2(e + 1, 32), num_warps=4,
    )


def plan_step(
    ids: torch.Tensor,
    slot_expert: torch.Tensor,
    expert_slot: torch.Tensor,
    last_use: torch.Tensor,
    clock: torch.Tensor,
    plan_experts: torch.Tensor,
    plan_slots: torch.Tensor,
    plan_count: torch.Tensor,
    counters: Optional[torch.Tensor] = None,
) -> None:
    """Plan one step: the Triton kernel for CUDA ids when triton imports, else the torch ops."""
    impl = plan_step_triton if (ids.is_cuda and triton is not None) else plan_step_torch
    impl(ids, slot_expert, expert_slot, last_use, clock, plan_experts, plan_slots, plan_count, counters)
