"""The residency state on the device: the one authoritative state of a layer whose steps may be
planned there (captured decode).

``DeviceResidency`` holds the arrays of ``residency.Residency`` in one int64 ``table`` on the
slots' device and two sets of ``PlanBuffers`` (plan and counters): the steps' own and the
prefetches' (``moepage.prefetch``), kept apart so that a step's counters stay the critical-path
figures. Whatever runs, a step starts from what these arrays say and leaves its result in them:

- a device-planned wave (``plan``, ``moepage.kernels.planner``) updates them in place, with no
  host synchronisation, so a CUDA-graph replay, which runs no Python, keeps them current;
- a host-planned step ``pull`` s them into its host ``Residency`` (one small device-to-host copy,
  in the same synchronisation that reads the step's routing), plans its waves there and ``push`` es
  the result back before it returns, in stream order with its page-ins.

So eager host-planned steps, eager device-planned steps and graph replays can interleave in any
order: there is never a second copy of the state to go stale.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .kernels.planner import plan_step, presence, step_ranks
from .residency import Residency
from .telemetry import DEVICE_COUNTERS


@dataclass(frozen=True)
class PlanBuffers:
    """Where a device-planned wave writes its page-in plan (``experts`` / ``slots`` [K], first
    ``count`` [1] valid) and accumulates its ``counters`` (``telemetry.DEVICE_COUNTERS``)."""

    experts: torch.Tensor
    slots: torch.Tensor
    count: torch.Tensor
    counters: torch.Tensor

    @classmethod
    def new(cls, k: int, device: torch.device) -> "PlanBuffers":
        i32 = dict(dtype=torch.int32, device=device)
        return cls(torch.full((k,), -1, **i32), torch.full((k,), -1, **i32), torch.zeros(1, **i32),
                   torch.zeros(len(DEVICE_COUNTERS), dtype=torch.int64, device=device))


class DeviceResidency:
    """Device tensors of one layer's residency, its steps' and its prefetches' plan buffers."""

    def __init__(self, host: Residency, device: torch.device):
        k, e = host.num_slots, host.num_experts
        self.num_slots, self.num_experts = k, e
        self.half_life = host.policy.half_life  # the policy the planner applies (0: LRU)
        self.table = torch.tensor(host.table(), dtype=torch.int64, device=device)
        self.slot_expert = self.table[:k]
        self.expert_slot = self.table[k : k + e]
        self.last_use = self.table[k + e : 2 * k + e]
        self.clock = self.table[2 * k + e : 2 * k + e + 1]
        self.score = self.table[2 * k + e + 1 :]
        self.step_plan = PlanBuffers.new(k, device)
        self.prefetch_plan = PlanBuffers.new(k, device)
        # The step's buffers by their historical names (tests and benchmarks read them).
        self.plan_experts, self.plan_slots = self.step_plan.experts, self.step_plan.slots
        self.plan_count, self.counters = self.step_plan.count, self.step_plan.counters

    def plans(self) -> tuple[PlanBuffers, PlanBuffers]:
        """The steps' and the prefetches' plan buffers."""
        return self.step_plan, self.prefetch_plan

    # -- host-planned steps --------------------------------------------------------------------
    def pull(self, host: Residency, ids: torch.Tensor | None = None) -> list[int]:
        """Load the current state into ``host`` and return the distinct valid experts of ``ids``
        (ascending), both read in one device-to-host copy."""
        parts = [self.table]
        if ids is not None:
            parts.append(presence(ids, self.num_experts, self.table.device)[1].long())
        values = torch.cat(parts).tolist()
        n = self.table.numel()
        host.load_table(values[:n])
        return [x for x, present in enumerate(values[n:]) if present]

    def push(self, host: Residency) -> None:
        """Write ``host``'s state back, ordered after the work already queued on the current
        stream (pageable source: staged at once, so the host list may change right after)."""
        self.table.copy_(torch.tensor(host.table(), dtype=torch.int64, device="cpu"), non_blocking=True)

    # -- device-planned waves ------------------------------------------------------------------
    def ranks(self, ids: torch.Tensor) -> torch.Tensor:
        """Wave order of a step of more than K distinct experts (``kernels.planner.step_ranks``)."""
        return step_ranks(ids, self.expert_slot)

    def plan(self, ids: torch.Tensor, pad: int, ranks: torch.Tensor | None = None, wave: int = 0) -> torch.Tensor:
        """Place one wave on the device and write its page-in plan; returns every entry's slot
        (shaped like ``ids``, ``pad`` for padding and for entries of other waves)."""
        out = torch.empty(ids.shape, dtype=ids.dtype, device=ids.device)
        self._place(ids, self.step_plan, out=out, pad=pad, ranks=ranks, wave=wave)
        return out

    def plan_prefetch(self, ids: torch.Tensor) -> None:
        """Place the experts of ``ids`` as one wave into ``prefetch_plan``, by the rule of a real
        wave: at most K of them, chosen as wave 0 of a step of those ids (resident ones first)."""
        if ids.numel() > self.num_experts:
            # The placement depends on the set of experts alone: plan E entries, not a prefill's
            # T x m (the Triton planner loads every entry in one program).
            e = self.num_experts
            present = presence(ids, e, self.table.device)[1]
            ids = torch.where(present, torch.arange(e, device=self.table.device), -1)
        ranks = self.ranks(ids) if min(self.num_experts, ids.numel()) > self.num_slots else None
        self._place(ids, self.prefetch_plan, ranks=ranks)

    def _place(self, ids: torch.Tensor, into: PlanBuffers, **kwargs) -> None:
        plan_step(
            ids, self.slot_expert, self.expert_slot, self.last_use, self.clock,
            into.experts, into.slots, into.count, into.counters,
            score=self.score, half_life=self.half_life, **kwargs,
        )
