"""Device-side residency planner: one MoE layer's LRU step without host synchronisation.

Owns ``plan_step`` (dispatch), ``plan_step_torch`` (fixed-shape torch ops, any device; the
vendor-neutral planner and the reference for the kernel), ``plan_step_triton`` (one
single-program Triton launch, about 2-3 us captured on an H200 for K <= 128, 6.5 us at
K = N = 512) and ``launch``, the Triton launcher shared with ``gather``. All apply
``moepage.residency.Residency.place`` to the distinct valid experts of ``ids`` (``ids.numel()``
must be at most K) and update the shared state arrays in place:

``slot_expert`` int32 [K], ``expert_slot`` int32 [E], ``last_use`` int64 [K], ``clock`` int64 [1]
(``plan_step_torch`` also ``score`` int64 [E] and ``half_life``: the frequency policies of
``moepage.residency.Policy``; the Triton kernel is LRU only so far); the plan is ``plan_experts`` / ``plan_slots`` int32 [K] (first ``plan_count`` entries valid, misses
in ascending expert id, the rest -1) and ``plan_count`` int32 [1]. ``counters`` int64 [3], if
given, accumulates (steps, distinct hits, misses). Ids < 0 or >= E are padding.

Interpreter: ``triton.jit`` reads TRITON_INTERPRET when it decorates, and triton decorates its
own library (``tl.sort``, ``tl.sum``, ...) at ``import triton``. Kernels here are decorated
lazily per mode, and an interpreted launch routes library calls through the interpreter, so
setting the variable at any time before a launch is enough.
"""

from __future__ import annotations

import inspect
import os
from contextlib import contextmanager
from functools import lru_cache
from typing import Any, Iterator, Optional

import torch
from torch import Tensor

try:  # triton is optional: the torch planner serves every other case
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover - exercised only where triton is absent
    triton = None
    tl = None

__all__ = ["plan_step", "plan_step_torch", "plan_step_triton", "triton_available", "interpret_mode"]

_BIG = 1 << 62  # sort key of slots that cannot be victims (hit this step, or padding)
_BIG_C = tl.constexpr(_BIG) if tl is not None else None  # jit code may only read constexpr globals
NUM_WARPS: Optional[int] = None  # override of the planner kernel's warp count (benchmarks)


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


def _check(ids: Tensor, slot_expert: Tensor, expert_slot: Tensor) -> tuple[int, int, int]:
    # Shape checks only: they read no tensor data, so they never synchronise.
    k, e, n = slot_expert.numel(), expert_slot.numel(), ids.numel()
    if n > k:
        raise ValueError(f"a device-planned step takes at most K={k} routed entries, got {n}")
    if ids.dtype.is_floating_point or ids.dtype == torch.bool:
        raise TypeError(f"ids must be an integer tensor, got {ids.dtype}")
    return n, k, e


def plan_step_torch(
    ids: Tensor, slot_expert: Tensor, expert_slot: Tensor, last_use: Tensor, clock: Tensor,
    plan_experts: Tensor, plan_slots: Tensor, plan_count: Tensor, counters: Optional[Tensor] = None,
    score: Optional[Tensor] = None, half_life: int = 0,
) -> None:
    """The planner rule in fixed-shape torch ops (capturable on CUDA).

    With ``score`` (int64 [E]) and ``half_life`` H > 0 it applies ``Policy(half_life=H)``: scores
    halve when the clock reaches a multiple of H, every routed expert gains 1, and victims are
    ordered by (score of the slot's expert, -1 if empty; last_use; slot). Without: LRU.
    """
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
    frequency = score is not None and half_life > 0
    if frequency:
        score.copy_(torch.where(now % half_life == 0, score >> 1, score) + present.long())

    # Victims: non-hit slots by (last_use, slot); slot ids are unique, so keys are too.
    slot_ids = torch.arange(k, device=dev)
    key = torch.where(hit_s, _BIG, (last_use + 1) * k + slot_ids)
    if frequency:  # first by the score of the slot's expert (-1: empty), ties in that order
        by_lru = torch.sort(key).indices
        held = slot_expert.long()
        held_score = torch.where(hit_s, _BIG, torch.where(held >= 0, score.gather(0, held.clamp(min=0)), -1))
        victims = by_lru[torch.sort(held_score[by_lru], stable=True).indices]
    else:
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
    HAS_COUNTERS: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr,
):
    # One program. Global memory is the exchange between phases, with a barrier between them;
    # marks (values <= -2) never occur in a valid state, so they are told apart from it.
    now = tl.load(clock_ptr) + 1
    if HAS_COUNTERS:
        c0 = tl.load(counters_ptr)
        c1 = tl.load(counters_ptr + 1)
        c2 = tl.load(counters_ptr + 2)
    # Phase A: mark hit slots (last_use = -2) and missed experts (expert_slot = -2 - entry; for
    # an expert routed several times one entry wins and represents it). Nothing is E-sized.
    n = tl.arange(0, BN)
    raw = tl.load(ids_ptr + n, mask=n < n_ids, other=0)
    valid = (n < n_ids) & (raw >= 0) & (raw < E)
    ex = tl.where(valid, raw, 0).to(tl.int32)
    es = tl.load(expert_slot_ptr + ex, mask=valid, other=-1)
    is_miss = valid & (es < 0)
    tl.store(last_use_ptr + es, -2, mask=valid & (es >= 0))
    tl.store(expert_slot_ptr + ex, -2 - n, mask=is_miss)
    tl.debug_barrier()
    # Phase B: victims = non-hit slots sorted by (last_use, slot), the slot in the low bits;
    # misses = representatives sorted by id. Position p pairs the p-th miss with the p-th victim.
    s = tl.arange(0, BK)
    lu = tl.load(last_use_ptr + s, mask=s < K, other=-2)
    hit_s = (lu == -2) & (s < K)
    key = tl.where(lu == -2, s.to(tl.int64) + _BIG_C, (lu + 1) * BK + s)  # last_use >= -1 here
    victim = (tl.sort(key) % BK).to(tl.int32)
    rep = is_miss & (tl.load(expert_slot_ptr + ex, mask=is_miss, other=0) == -2 - n)
    misses = tl.sort(tl.where(rep, ex, E))
    n_miss = tl.sum(rep.to(tl.int32), axis=0)
    n_hit = tl.sum(hit_s.to(tl.int32), axis=0)
    take = s < n_miss
    old = tl.load(slot_expert_ptr + victim, mask=take, other=-1)
    tl.store(plan_e_ptr + n, misses, mask=n < n_miss)
    tl.store(plan_e_ptr + s, -1, mask=(s >= n_miss) & (s < K))
    tl.store(plan_s_ptr + s, tl.where(take, victim, -1), mask=s < K)
    tl.store(plan_c_ptr, n_miss)
    tl.debug_barrier()
    # Phase C: the plan's experts come back in the victims' layout; write the new state.
    new_e = tl.load(plan_e_ptr + s, mask=take, other=0)
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
def _jit(fn: Any, interpret: bool, do_not_specialize: tuple[str, ...]) -> Any:
    # triton.jit picks interpreter or compiler when it decorates, so decorate per mode, lazily.
    del interpret  # part of the cache key only
    return triton.jit(fn, do_not_specialize=do_not_specialize)


@contextmanager
def _interpreter_guard() -> Iterator[None]:
    """Run an interpreted launch so that it works, and leaves triton as it found it.

    Triton decorates its library (tl.sort, tl.sum, ...) when it is imported; imported before
    TRITON_INTERPRET=1 was set, those are compiler-only JITFunctions that refuse calls, so route
    them through the interpreter. Nested interpreted calls also leave interpreter patches on
    triton.language (a triton leak) that would break later compiled launches: undo them after.
    """
    from triton.runtime.interpreter import InterpretedFunction
    from triton.runtime.jit import JITFunction

    patched = [tl, tl.core, tl.math, tl.core.tensor, tl.core.dtype, getattr(tl.core, "tensor_descriptor_base", None)]
    saved = [(obj, dict(vars(obj))) for obj in patched if obj is not None]
    original = JITFunction.__call__
    wrapped: dict[Any, Any] = {}

    def call(self: Any, *args: Any, **kwargs: Any) -> Any:
        if self.fn not in wrapped:
            wrapped[self.fn] = InterpretedFunction(self.fn)
        return wrapped[self.fn](*args, **kwargs)

    JITFunction.__call__ = call
    try:
        yield
    finally:
        JITFunction.__call__ = original
        for obj, attrs in saved:
            for name in [n for n, v in vars(obj).items() if n not in attrs and not inspect.ismodule(v)]:
                delattr(obj, name)
            for name, value in attrs.items():
                if vars(obj).get(name) is not value:
                    setattr(obj, name, value)


def launch(fn: Any, grid: tuple[int, ...], *args: Any, do_not_specialize: tuple[str, ...] = (), **kwargs: Any) -> None:
    """Launch the jit kernel ``fn`` in the mode TRITON_INTERPRET names now."""
    interpret = interpret_mode()
    kernel = _jit(fn, interpret, do_not_specialize)
    if not interpret:
        kernel[grid](*args, **kwargs)
        return
    with _interpreter_guard():
        kernel[grid](*args, **kwargs)


def plan_step_triton(
    ids: Tensor, slot_expert: Tensor, expert_slot: Tensor, last_use: Tensor, clock: Tensor,
    plan_experts: Tensor, plan_slots: Tensor, plan_count: Tensor, counters: Optional[Tensor] = None,
) -> None:
    """The planner rule in one single-program Triton launch (K, E up to 512)."""
    if triton is None:
        raise RuntimeError("plan_step_triton needs triton")
    n, k, e = _check(ids, slot_expert, expert_slot)
    flat = ids.reshape(-1)
    if not flat.is_contiguous():
        flat = flat.contiguous()
    bk = next_pow2(k, 16)
    launch(
        _plan_kernel,
        (1,),
        flat, n, slot_expert, expert_slot, last_use, clock, plan_experts, plan_slots, plan_count,
        counters if counters is not None else clock, k, e,
        HAS_COUNTERS=counters is not None, BN=next_pow2(n, 16), BK=bk,
        num_warps=NUM_WARPS or (2 if bk <= 64 else 4 if bk <= 256 else 8),  # measured on H200
        do_not_specialize=("n_ids", "K", "E"),  # one compile per block shape, not per value
    )


def plan_step(
    ids: Tensor, slot_expert: Tensor, expert_slot: Tensor, last_use: Tensor, clock: Tensor,
    plan_experts: Tensor, plan_slots: Tensor, plan_count: Tensor, counters: Optional[Tensor] = None,
) -> None:
    """Plan one step: the Triton kernel for CUDA ids when triton imports, else the torch ops."""
    impl = plan_step_triton if (ids.is_cuda and triton is not None) else plan_step_torch
    impl(ids, slot_expert, expert_slot, last_use, clock, plan_experts, plan_slots, plan_count, counters)
