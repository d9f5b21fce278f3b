"""The residency state on the device: the one authoritative state of a layer whose steps may be planned there.

``DeviceResidency`` holds ``Residency``'s arrays in one int64 ``table`` on the slots' device, plus plan buffers for
steps and for prefetches (apart, so step counters stay critical-path figures). A device-planned wave updates it in
place, no host sync (so graph replays keep it current); a host-planned step ``pull``s it in the sync that reads its
routing and ``push``es its result back in stream order with its page-ins. No second copy of the state can go stale.
"""

from __future__ import annotations

import torch

from .kernels.planner import PlanBuffers, PlannerState, plan_step, presence
from .kernels.ranks import step_ranks
from .residency import Residency

__all__ = ["DeviceResidency", "PlanBuffers"]


class DeviceResidency:
    """Device tensors of one layer's residency, its steps' and its prefetches' plan buffers."""

    def __init__(self, host: Residency, device: torch.device):
        k, e = host.num_slots, host.num_experts
        self.num_slots, self.num_experts = k, e
        self.policy = host.policy  # the rule the planners apply, as the host's
        self.table = torch.tensor(host.table(), dtype=torch.int64, device=device)
        self.slot_expert = self.table[:k]
        self.expert_slot = self.table[k : k + e]
        self.last_use = self.table[k + e : 2 * k + e]
        self.clock = self.table[2 * k + e : 2 * k + e + 1]
        self.score = self.table[2 * k + e + 1 :]
        self.state = PlannerState(self.slot_expert, self.expert_slot, self.last_use, self.clock, self.score,
                                  self.policy)
        self.step_plan = PlanBuffers.new(k, device)
        self.prefetch_plan = PlanBuffers.new(k, device)
        self.counters = self.step_plan.counters  # steps, waves, hits, misses of device-planned steps

    def plans(self) -> tuple[PlanBuffers, PlanBuffers]:
        """The steps' and the prefetches' plan buffers."""
        return self.step_plan, self.prefetch_plan

    # -- host-planned steps --------------------------------------------------------------------
    def pull(self, host: Residency, ids: torch.Tensor | None = None) -> list[int]:
        """Load the state into ``host`` and return ``ids``' distinct valid experts: one device-to-host copy."""
        parts = [self.table]
        if ids is not None:
            parts.append(presence(ids, self.num_experts, self.table.device)[1].long())
        values = torch.cat(parts).tolist()
        n = self.table.numel()
        host.load_table(values[:n])
        return [x for x, present in enumerate(values[n:]) if present]

    def push(self, host: Residency) -> None:
        """Write ``host``'s state back after the current stream's queued work (staged: ``host`` may change)."""
        self.table.copy_(torch.tensor(host.table(), dtype=torch.int64, device="cpu"), non_blocking=True)

    # -- device-planned waves ------------------------------------------------------------------
    def ranks(self, ids: torch.Tensor) -> torch.Tensor:
        """Wave order of a step of more than K distinct experts (``kernels.ranks.step_ranks``)."""
        return step_ranks(ids, self.expert_slot)

    def plan(self, ids: torch.Tensor, pad: int, ranks: torch.Tensor | None = None, wave: int = 0,
             width: int | None = None, out: torch.Tensor | None = None) -> torch.Tensor:
        """Place one wave (of ``width`` experts, K by default) and write its plan; returns each entry's slot (``pad``:
        padding, other waves), in ``out`` if given."""
        if out is None:
            out = torch.empty(ids.shape, dtype=ids.dtype, device=ids.device)
        self._place(ids, self.step_plan, out=out, pad=pad, ranks=ranks, wave=wave, width=width)
        return out

    def plan_prefetch(self, ids: torch.Tensor) -> None:
        """Place ``ids``' experts into ``prefetch_plan`` as wave 0 of a step of those ids would be."""
        if ids.numel() > self.num_experts:
            # Only the set of experts matters: plan E entries, not a prefill's T x m (Triton loads all in one program).
            e = self.num_experts
            present = presence(ids, e, self.table.device)[1]
            ids = torch.where(present, torch.arange(e, device=self.table.device), -1)
        ranks = self.ranks(ids) if min(self.num_experts, ids.numel()) > self.num_slots else None
        self._place(ids, self.prefetch_plan, ranks=ranks)

    def _place(self, ids: torch.Tensor, into: PlanBuffers, **kwargs) -> None:
        plan_step(ids, self.state, into, **kwargs)
