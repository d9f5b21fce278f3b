"""One paged step of one SGLang ``FusedMoE`` layer: plan -> page-in -> run waves -> merge -> reduce.

``PagedExperts`` composes the core's ``LayerPager`` (rows, slots, the layer's one residency
state, counters, the host and device wave loops) with how a FusedMoE layer runs over slot ids and
reduces: the runner contract (``runner.py``).

- ``device_forward`` is the step a decode CUDA graph captures: planned and paged on the device
  with no host synchronisation, in ⌈min(E, entries) / K⌉ waves fixed by the batch size, so every
  decode batch size can be captured. Tests call it directly.
- ``host_forward`` plans on the host, in as many waves as the step needs (eager prefill, or an
  eager break of the breakable prefill graph, ``method.py``).

``forward`` takes the device path for steps of at most K routed entries and for any step while a
graph is being captured, the host path otherwise. With ``link`` (a ``moepage.prefetch.PrefetchLink``,
set by ``prefetch.link_model``), both paths prefetch the next paged layer's predicted experts from
the hidden state this layer receives, once the first wave's page-in is issued.
"""

from __future__ import annotations

import torch

from ...errors import ConfigError
from ...pager import AfterPageIn, LayerPager
from ...prefetch import PrefetchLink
from ...residency import Wave


class PagedExperts:
    """Paging state of one ``FusedMoE`` layer and its forward step."""

    def __init__(self, pager: LayerPager, contract, method, routed_scaling_factor: float | None):
        self.pager = pager
        self.contract = contract
        self.method = method  # what waves run through: the base method (or its Marlin runner)
        self.routed_scaling_factor = routed_scaling_factor
        self.link: PrefetchLink | None = None  # the next paged layer's prefetch (prefetch.link_model)

    @torch.no_grad()
    def forward(self, layer, dispatch_output) -> torch.Tensor:
        topk_ids = dispatch_output.topk_output.topk_ids
        if topk_ids.shape[1] > self.pager.num_slots:
            raise ConfigError(
                f"layer {self.pager.name}: top_k={topk_ids.shape[1]} exceeds "
                f"--paged-experts-num-resident={self.pager.num_slots}"
            )
        if self.pager.plans_on_device(topk_ids.numel()):
            return self.device_forward(layer, dispatch_output)
        return self.host_forward(layer, dispatch_output)

    @torch.no_grad()
    def device_forward(self, layer, dispatch_output) -> torch.Tensor:
        """The captured step: reads and writes device state only, never synchronises."""
        merged = None

        def run_wave(slots: torch.Tensor, w: int, n: int) -> None:
            nonlocal merged
            merged = self.contract.run(self.method, layer, dispatch_output, slots, merged)

        self.pager.device_waves(dispatch_output.topk_output.topk_ids, -1, run_wave, self._after_page_in(dispatch_output))
        return self._reduce(merged, dispatch_output)

    @torch.no_grad()
    def host_forward(self, layer, dispatch_output) -> torch.Tensor:
        """A step planned on the host, in as many waves as its distinct experts need."""
        topk_ids = dispatch_output.topk_output.topk_ids
        e = self.pager.num_experts
        ids = torch.where((topk_ids >= 0) & (topk_ids < e), topk_ids, e).long()
        merged = None

        def run_wave(wave: Wave, to_slot: torch.Tensor, count: int) -> None:
            nonlocal merged
            slots = to_slot[ids].to(torch.int32)
            merged = self.contract.run(self.method, layer, dispatch_output, slots, merged)

        self.pager.host_waves(topk_ids, run_wave, self._after_page_in(dispatch_output))
        return self._reduce(merged, dispatch_output)

    def _after_page_in(self, dispatch_output) -> AfterPageIn | None:
        return None if self.link is None else self.link.after_page_in(dispatch_output.hidden_states)

    def _reduce(self, merged, dispatch_output) -> torch.Tensor:
        if merged is None:  # nothing routed: every entry is padding
            t, k = dispatch_output.topk_output.topk_ids.shape
            hidden = dispatch_output.hidden_states
            merged = hidden.new_zeros(t, k, hidden.shape[-1])
        return self.contract.reduce(merged, dispatch_output, self.routed_scaling_factor)
