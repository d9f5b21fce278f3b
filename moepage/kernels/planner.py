"""Device-side residency planner: one MoE layer's wave, placed by its policy, without host sync.

A call applies ``Residency.place``'s rule to a wave's distinct valid experts, updating in place the layer's int64 state
(views of ``DeviceResidency.table``): ``slot_expert`` [K], ``expert_slot`` [E], ``last_use`` [K], ``clock`` [1] and,
for a scored policy, ``score`` [E]. ``plan_step_triton`` is one single-program launch; ``plan_step_torch``, fixed-shape
torch ops for any device, is its reference. Both read the layer's ``residency.Policy`` and pack its victim key as
``residency.KEY`` lays it out (hits: ``KEY.never``; score -1 if empty, 0 without scores).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from ..residency import KEY, LRU, MAX_HALF_LIFE, Policy
from .runtime import launch, next_pow2, tl, triton, triton_available

__all__ = ["PlanBuffers", "PlannerState", "plan_step", "plan_step_torch", "plan_step_triton", "triton_available"]

_BIG_C = tl.constexpr(KEY.never) if tl is not None else None  # jit code may only read constexpr globals
_AVOID_C = tl.constexpr(KEY.avoid) if tl is not None else None

@dataclass(frozen=True)
class PlannerState:
    """One layer's residency arrays on the device, updated in place (int64): ``slot_expert`` [K],
    ``expert_slot`` [E], ``last_use`` [K], ``clock`` [1]; ``score`` [E] for a scored ``policy``."""

    slot_expert: Tensor
    expert_slot: Tensor
    last_use: Tensor
    clock: Tensor
    score: Tensor | None = None
    policy: Policy = LRU

    @property
    def half_life(self) -> int:
        return self.policy.half_life


@dataclass(frozen=True)
class PlanBuffers:
    """A planned wave: its misses (ascending id) and their slots in ``experts`` / ``slots`` [K], the
    first ``count`` valid, the rest -1; ``counters`` [4] (None: not counted) accumulates (steps,
    waves, distinct hits, misses)."""

    experts: Tensor
    slots: Tensor
    count: Tensor
    counters: Tensor | None

    @classmethod
    def new(cls, k: int, device: torch.device) -> PlanBuffers:
        i32 = dict(dtype=torch.int32, device=device)
        return cls(torch.full((k,), -1, **i32), torch.full((k,), -1, **i32), torch.zeros(1, **i32),
                   torch.zeros(4, dtype=torch.int64, device=device))


def planner_warps(block_slots: int) -> int:
    """The planner kernel's warps for a slot block of ``block_slots`` (measured on an H200)."""
    return 2 if block_slots <= 64 else 4 if block_slots <= 256 else 8


def _check(ids: Tensor, state: PlannerState, ranks: Tensor | None) -> tuple[int, int, int]:
    # Shape checks only: they read no tensor data, so they never synchronise.
    k, e, n = state.slot_expert.numel(), state.expert_slot.numel(), ids.numel()
    score, half_life = state.score, state.half_life
    if k > 1 << KEY.slot_bits:
        raise ValueError(f"the planners' victim key holds slots below {1 << KEY.slot_bits}, got K={k}")
    if not 0 <= half_life <= MAX_HALF_LIFE:
        raise ValueError(f"half_life must be in 0..{MAX_HALF_LIFE} waves, got {half_life}")
    if half_life and (score is None or score.numel() != e):
        raise ValueError(f"a frequency policy (half_life={half_life}) needs a score tensor of E={e} entries")
    if ranks is None and n > k and e > k:  # with K = E any step fits one wave
        raise ValueError(f"a device-planned wave takes at most K={k} routed entries without step ranks, got {n}")
    if ranks is not None and ranks.shape != ids.shape:
        raise ValueError(f"ranks {tuple(ranks.shape)} must have the shape of ids {tuple(ids.shape)}")
    check_ids(ids)
    return n, k, e


def check_ids(ids: Tensor) -> None:
    """Routing ids must be integers (any width; values outside 0..E-1 are padding)."""
    if ids.dtype.is_floating_point or ids.dtype == torch.bool:
        raise TypeError(f"ids must be an integer tensor, got {ids.dtype}")


def on_triton(ids: Tensor) -> bool:
    """Whether the kernels of ``ids``' step run in Triton: CUDA ids, where triton imports (else torch ops)."""
    return ids.is_cuda and triton is not None


def presence(ids: Tensor, num_experts: int, device: torch.device, keep: Tensor | None = None) -> tuple[Tensor, Tensor]:
    """``(idx, present)``: entries' expert ids (padding and ones ``keep`` drops sent to E), and a bool [E] of those."""
    flat = ids.reshape(-1).to(device=device, dtype=torch.int64)
    valid = (flat >= 0) & (flat < num_experts)
    if keep is not None:
        valid &= keep
    idx = torch.where(valid, flat, num_experts)
    present = torch.zeros(num_experts + 1, dtype=torch.bool, device=device).index_fill_(0, idx, True)[:num_experts]
    return idx, present


def plan_step_torch(ids: Tensor, state: PlannerState, plan: PlanBuffers, *, out: Tensor | None = None,
                    pad: int = -1, ranks: Tensor | None = None, wave: int = 0, width: int | None = None) -> None:
    """The planner rule in fixed-shape torch ops (capturable on CUDA)."""
    _, k, e = _check(ids, state, ranks)
    w = _width(k, width)
    slot_expert, expert_slot, last_use, clock = state.slot_expert, state.expert_slot, state.last_use, state.clock
    score, half_life, dev = state.score, state.half_life, slot_expert.device
    keep = None  # a wave of a larger step: only the entries of its rank window
    if ranks is not None:
        r = ranks.reshape(-1).to(dev)
        keep = (r >= wave * w) & (r < (wave + 1) * w)
    idx, present = presence(ids, e, dev, keep)
    es = expert_slot.long()
    hit_e = present & (es >= 0)
    miss_e = present & (es < 0)
    hit_s = torch.zeros(k + 1, dtype=torch.bool, device=dev)
    hit_s = hit_s.index_fill_(0, torch.where(hit_e, es, k), True)[:k]
    n_hit = hit_s.sum()
    n_miss = miss_e.sum()
    busy = n_hit + n_miss > 0
    now = clock + 1
    clock.add_(busy.to(clock.dtype))  # an empty wave is no wave: the clock stays
    held = slot_expert.long()
    score_of = torch.zeros(k, dtype=torch.int64, device=dev)
    if half_life:  # decay on the clock's multiples of H, then every expert of the wave gains one
        score.copy_(torch.where(busy & (now % half_life == 0), score >> 1, score) + present.long())
        score_of = score.gather(0, held.clamp(min=0))
    score_of = torch.where(held >= 0, score_of, -1)

    # Victims: the smallest keys; slot ids make keys unique.
    slot_ids = torch.arange(k, device=dev)
    score_shift, use_shift = KEY.shifts(state.policy.recency_first)
    key = ((score_of + 1) << score_shift) + ((last_use + 1) << use_shift) + slot_ids
    if _avoids(w, k, wave):  # the previous wave's slots (stamped with the clock before this wave), last
        key = key + torch.where(last_use == now - 1, KEY.avoid, 0)
    victims = torch.sort(torch.where(hit_s, KEY.never, key)).indices
    take = slot_ids < n_miss
    # Miss of rank r (ascending id) goes to position r, non-misses to the dropped entry K.
    rank = torch.cumsum(miss_e.long(), 0) - 1
    new_e = torch.full((k + 1,), -1, dtype=torch.int64, device=dev)
    new_e.scatter_(0, torch.where(miss_e, rank, k), torch.arange(e, device=dev))
    new_e = new_e[:k]
    plan.experts.copy_(torch.where(take, new_e, -1))
    plan.slots.copy_(torch.where(take, victims, -1))
    plan.count.copy_(n_miss.reshape(1))

    # State updates; entries that do not apply go to a dropped extra entry.
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
    if out is not None:
        slot = torch.cat([expert_slot.long(), expert_slot.new_full((1,), pad).long()])[idx]
        out.copy_(slot.view(out.shape))
    if plan.counters is not None:
        first = torch.full_like(n_hit, int(wave == 0))
        plan.counters.add_(torch.stack([first, (n_hit + n_miss > 0).long(), n_hit, n_miss]).to(plan.counters.dtype))


def _plan_kernel(
    ids_ptr, n_ids, slot_expert_ptr, expert_slot_ptr, last_use_ptr, clock_ptr,
    plan_e_ptr, plan_s_ptr, plan_c_ptr, counters_ptr, out_ptr, pad, rank_ptr, lo, width, avoid_prev, first_wave, K,
    E, score_ptr, half_life,
    HAS_COUNTERS: tl.constexpr, HAS_OUT: tl.constexpr, HAS_RANK: tl.constexpr, HAS_SCORE: tl.constexpr,
    BN: tl.constexpr, BK: tl.constexpr, BE: tl.constexpr, SCORE_SHIFT: tl.constexpr, USE_SHIFT: tl.constexpr,
):
    # One program; phases exchange through global memory, with barriers. Marks (<= -2) never occur in a valid state.
    now = tl.load(clock_ptr) + 1
    if HAS_COUNTERS:
        c0 = tl.load(counters_ptr)
        c1 = tl.load(counters_ptr + 1)
        c2 = tl.load(counters_ptr + 2)
        c3 = tl.load(counters_ptr + 3)
    # Phase A: mark hit slots (last_use = -2) and missed experts (expert_slot = -2 - entry; of an expert routed
    # several times one entry wins and represents it). Nothing is E-sized.
    n = tl.arange(0, BN)
    raw = tl.load(ids_ptr + n, mask=n < n_ids, other=0)
    valid = (n < n_ids) & (raw >= 0) & (raw < E)
    if HAS_RANK:  # a wave of a multi-wave step: only the entries of its rank window
        rk = tl.load(rank_ptr + n, mask=n < n_ids, other=-1)
        valid = valid & (rk >= lo) & (rk < lo + width)
    ex = tl.where(valid, raw, 0).to(tl.int64)
    es = tl.load(expert_slot_ptr + ex, mask=valid, other=-1)
    is_miss = valid & (es < 0)
    tl.store(last_use_ptr + es, -2, mask=valid & (es >= 0))
    tl.store(expert_slot_ptr + ex, -2 - n, mask=is_miss)
    busy = tl.sum(valid.to(tl.int32), axis=0) > 0  # an empty wave is no wave: nothing changes
    s = tl.arange(0, BK)
    held = tl.load(slot_expert_ptr + s, mask=s < K, other=-1)
    score_of = tl.zeros([BK], dtype=tl.int64)
    if HAS_SCORE:
        # Decay on the clock's multiples of H, E-wide, once (increments: phase C).
        if busy & ((now % half_life) == 0):
            e_all = tl.arange(0, BE)
            sc = tl.load(score_ptr + e_all, mask=e_all < E, other=0)
            tl.store(score_ptr + e_all, sc >> 1, mask=e_all < E)
        tl.debug_barrier()
        score_of = tl.load(score_ptr + held, mask=(s < K) & (held >= 0), other=0)
    tl.debug_barrier()
    # Phase B: victims = non-hit slots by key (slot in the low bits: unique, recoverable); misses = representatives
    # by id. Position p pairs the p-th miss with the p-th victim.
    lu = tl.load(last_use_ptr + s, mask=s < K, other=-2)
    hit_s = (lu == -2) & (s < K)
    score_of = tl.where(held >= 0, score_of, -1)
    key = ((score_of + 1) << SCORE_SHIFT) + ((lu + 1) << USE_SHIFT) + s  # last_use >= -1 here; the policy's order
    key = tl.where((lu == now - 1) & (avoid_prev != 0), key + _AVOID_C, key)  # the previous wave's slots, last
    key = tl.where(lu == -2, s.to(tl.int64) + _BIG_C, key)
    victim = (tl.sort(key) % BK).to(tl.int64)
    rep = is_miss & (tl.load(expert_slot_ptr + ex, mask=is_miss, other=0) == -2 - n)
    misses = tl.sort(tl.where(rep, ex, E))
    n_miss = tl.sum(rep.to(tl.int32), axis=0)
    n_hit = tl.sum(hit_s.to(tl.int32), axis=0)
    take = s < n_miss
    old = tl.load(slot_expert_ptr + victim, mask=take, other=-1)
    tl.store(plan_e_ptr + n, misses.to(plan_e_ptr.dtype.element_ty), mask=n < n_miss)
    tl.store(plan_e_ptr + s, -1, mask=(s >= n_miss) & (s < K))
    tl.store(plan_s_ptr + s, tl.where(take, victim, -1).to(plan_s_ptr.dtype.element_ty), mask=s < K)
    tl.store(plan_c_ptr, n_miss)
    if HAS_SCORE:  # every expert of the wave gains one: hits by their slots, misses once each
        tl.store(score_ptr + held, tl.load(score_ptr + held, mask=hit_s, other=0) + 1, mask=hit_s)
        tl.store(score_ptr + ex, tl.load(score_ptr + ex, mask=rep, other=0) + 1, mask=rep)
    tl.debug_barrier()
    # Phase C: the plan's experts come back in the victims' layout; write the new state.
    new_e = tl.load(plan_e_ptr + s, mask=take, other=0).to(tl.int64)
    tl.store(expert_slot_ptr + old, -1, mask=take & (old >= 0))
    tl.store(expert_slot_ptr + new_e, victim, mask=take)
    tl.store(slot_expert_ptr + victim, new_e, mask=take)
    tl.store(last_use_ptr + victim, now, mask=take)
    tl.store(last_use_ptr + s, now, mask=hit_s)
    tl.store(clock_ptr, tl.where(n_hit + n_miss > 0, now, now - 1))  # an empty wave is no wave
    if HAS_OUT:
        # Phase D: every entry's slot (``pad`` for padding and other waves' entries): the caller needs no lookup.
        tl.debug_barrier()
        slot = tl.load(expert_slot_ptr + ex, mask=valid, other=0)
        tl.store(out_ptr + n, tl.where(valid, slot, pad).to(out_ptr.dtype.element_ty), mask=n < n_ids)
    if HAS_COUNTERS:
        tl.store(counters_ptr, c0 + first_wave)
        tl.store(counters_ptr + 1, c1 + ((n_hit + n_miss) > 0).to(tl.int64))
        tl.store(counters_ptr + 2, c2 + n_hit)
        tl.store(counters_ptr + 3, c3 + n_miss)


def plan_step_triton(ids: Tensor, state: PlannerState, plan: PlanBuffers, *, out: Tensor | None = None,
                     pad: int = -1, ranks: Tensor | None = None, wave: int = 0, width: int | None = None,
                     num_warps: int | None = None) -> None:
    """The planner rule in one single-program Triton launch (K, E up to 512); ``num_warps`` is for benchmarks."""
    if triton is None:
        raise RuntimeError("plan_step_triton needs triton")
    n, k, e = _check(ids, state, ranks)
    w = _width(k, width)
    clock, counters, half_life = state.clock, plan.counters, state.half_life
    flat = ids.reshape(-1)
    if not flat.is_contiguous():
        flat = flat.contiguous()
    if out is not None and not out.is_contiguous():
        raise ValueError("out must be contiguous")
    bk = next_pow2(k, 16)
    score_shift, use_shift = KEY.shifts(state.policy.recency_first)
    launch(
        _plan_kernel,
        (1,),
        flat, n, state.slot_expert, state.expert_slot, state.last_use, clock, plan.experts, plan.slots, plan.count,
        counters if counters is not None else clock, out if out is not None else flat, pad,
        ranks if ranks is not None else flat, wave * w, w, int(_avoids(w, k, wave)), int(wave == 0), k, e,
        state.score if half_life else clock, max(half_life, 1),
        HAS_COUNTERS=counters is not None, HAS_OUT=out is not None, HAS_RANK=ranks is not None,
        HAS_SCORE=bool(half_life), BN=next_pow2(n, 16), BK=bk, BE=next_pow2(e, 16) if half_life else 16,
        SCORE_SHIFT=score_shift, USE_SHIFT=use_shift,
        num_warps=num_warps or planner_warps(bk),
        do_not_specialize=("n_ids", "pad", "lo", "width", "avoid_prev", "first_wave", "K", "E", "half_life"),
    )


def plan_step(ids: Tensor, state: PlannerState, plan: PlanBuffers, *, out: Tensor | None = None, pad: int = -1,
              ranks: Tensor | None = None, wave: int = 0, width: int | None = None) -> None:
    """Plan one wave into ``plan``: the Triton kernel for CUDA ids when triton imports, else the torch ops.
    ``out`` (shaped like ``ids``) receives every entry's slot after placement, ``pad`` for padding. Ids outside
    0..E-1 are padding. ``ids`` holds at most K entries unless ``ranks`` (``kernels.ranks.step_ranks``) and
    ``wave`` pick one wave of a larger step: ranks ``[wave * width, (wave + 1) * width)``, ``width`` K by default.
    Waves narrower than K (overlapped: ``residency.plan_waves``'s ``wave_size``) evict the previous wave's slots
    last, as the host rule does, so a wave's page-in can run beside the previous wave's computation."""
    impl = plan_step_triton if on_triton(ids) else plan_step_torch
    impl(ids, state, plan, out=out, pad=pad, ranks=ranks, wave=wave, width=width)


def _width(k: int, width: int | None) -> int:
    if width is None:
        return k
    if not 1 <= width <= k:
        raise ValueError(f"a wave's width must be in 1..K={k}, got {width}")
    return width


def _avoids(width: int, k: int, wave: int) -> bool:
    """Whether this wave evicts the previous wave's slots last: overlapped (narrower than K) waves after the first."""
    return width < k and wave > 0
