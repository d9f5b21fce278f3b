"""The residency state on the device, for steps decided there (captured decode).

Same arrays and same LRU rule as ``residency.Residency`` (see its docstring): the device planner
(``moepage.kernels.planner``) updates them in place and writes a page-in plan, with no host
synchronisation. ``SharedResidency`` keeps the host and device copies coherent: whichever planner
ran last owns the state, and it crosses over only when the other planner runs next, so a run of
device-planned steps (or of host-planned ones) moves nothing between host and device.
"""

from __future__ import annotations

import torch

from .residency import Residency


class DeviceResidency:
    """Device tensors of one layer's residency, its plan buffers and its step counters."""

    def __init__(self, num_experts: int, num_slots: int, device: torch.device):
        i32 = dict(dtype=torch.int32, device=device)
        i64 = dict(dtype=torch.int64, device=device)
        self.slot_expert = torch.zeros(num_slots, **i32)
        self.expert_slot = torch.zeros(num_experts, **i32)
        self.last_use = torch.zeros(num_slots, **i64)
        self.clock = torch.zeros(1, **i64)
        self.plan_experts = torch.full((num_slots,), -1, **i32)
        self.plan_slots = torch.full((num_slots,), -1, **i32)
        self.plan_count = torch.zeros(1, **i32)
        self.counters = torch.zeros(3, **i64)  # steps, hits, misses of device-planned steps

    def plan(self, ids: torch.Tensor) -> None:
        from .kernels.planner import plan_step

        plan_step(
            ids, self.slot_expert, self.expert_slot, self.last_use, self.clock,
            self.plan_experts, self.plan_slots, self.plan_count, self.counters,
        )


class SharedResidency:
    """One layer's LRU state, owned by the host planner or the device planner."""

    def __init__(self, host: Residency, device: DeviceResidency | None):
        self.host = host
        self.device = device
        self.on_device = False

    def for_host(self) -> Residency:
        """The host state, current (one device->host read if the device planner ran last)."""
        d = self.device
        if self.on_device and d is not None:
            state = torch.cat([d.slot_expert.long(), d.last_use, d.clock]).tolist()
            k = self.host.num_slots
            self.host.load_state(state[:k], state[k : 2 * k], state[2 * k])
            self.on_device = False
        return self.host

    def for_device(self) -> DeviceResidency:
        """The device state, current (one host->device write if the host planner ran last)."""
        d = self.device
        assert d is not None
        if not self.on_device:
            if torch.cuda.is_available() and torch.cuda.is_current_stream_capturing():
                raise RuntimeError(
                    "moepage: the residency state is on the host while a CUDA graph is being "
                    "captured; run one eager step of the same shape before capturing"
                )
            h = self.host
            d.slot_expert.copy_(torch.tensor(h.slot_expert, dtype=torch.int32, device="cpu"))
            d.expert_slot.copy_(torch.tensor(h.expert_slot, dtype=torch.int32, device="cpu"))
            d.last_use.copy_(torch.tensor(h.last_use, dtype=torch.int64, device="cpu"))
            d.clock.fill_(h.clock)
            self.on_device = True
        return d
