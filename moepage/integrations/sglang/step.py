"""One paged step of one SGLang ``FusedMoE`` layer: plan -> page-in -> run waves -> merge -> reduce.

``PagedExperts`` is the core's ``LayerPager`` (rows, slots, residency shared by the host and
device planners, counters, the host wave loop and the device-planned wave) plus how a FusedMoE
layer runs over slot ids and reduces: the runner contract (``runner.py``).

Steps whose routed entries fit the K slots (tokens x top_k <= K) are decided on the device when
the store can gather a device-made plan: no host synchronisation, so a full decode CUDA graph can
capture them. Other steps are planned on the host, in as many waves as they need; under a
breakable prefill graph they run as an eager break (``method.py``).
"""

from __future__ import annotations

import torch

from ...errors import ConfigError
from ...pager import LayerPager
from ...residency import Wave
from ...store import PagedExpertStore, RowSpec


class PagedExperts(LayerPager):
    """Paging state of one ``FusedMoE`` layer and its forward step."""

    def __init__(
        self,
        name: str,
        store: PagedExpertStore,
        specs: dict[str, RowSpec],
        num_experts: int,
        num_slots: int,
        contract,
        method,
        routed_scaling_factor: float | None,
        device_planner: bool,
        verify: bool = False,
    ):
        super().__init__(name, store, specs, num_experts, num_slots, verify, device_planner)
        self.contract = contract
        self.method = method  # what waves run through: the base method (or its Marlin runner)
        self.routed_scaling_factor = routed_scaling_factor

    @torch.no_grad()
    def forward(self, layer, dispatch_output) -> torch.Tensor:
        topk_ids = dispatch_output.topk_output.topk_ids
        if topk_ids.shape[1] > self.num_slots:
            raise ConfigError(
                f"layer {self.name}: top_k={topk_ids.shape[1]} exceeds --paged-experts-num-resident={self.num_slots}"
            )
        if self.plans_on_device(*topk_ids.shape, topk_ids.is_cuda):
            slots = self.device_slots(topk_ids, pad=-1)
            merged = self.contract.run(self.method, layer, dispatch_output, slots, None)
        else:
            merged = self._host_step(layer, dispatch_output)
        if merged is None:  # nothing routed: every entry is padding
            t, k = topk_ids.shape
            hidden = dispatch_output.hidden_states
            merged = hidden.new_zeros(t, k, hidden.shape[-1])
        return self.contract.reduce(merged, dispatch_output, self.routed_scaling_factor)

    def _host_step(self, layer, dispatch_output) -> torch.Tensor | None:
        topk_ids = dispatch_output.topk_output.topk_ids
        e = self.num_experts
        valid = (topk_ids >= 0) & (topk_ids < e)
        distinct = torch.unique(topk_ids[valid]).tolist()
        ids = torch.where(valid, topk_ids, e).long()
        merged = None

        def run_wave(wave: Wave, to_slot: torch.Tensor, _count: int) -> None:
            nonlocal merged
            slots = to_slot[ids].to(torch.int32)
            merged = self.contract.run(self.method, layer, dispatch_output, slots, merged)

        self.host_waves(distinct, run_wave)
        return merged
