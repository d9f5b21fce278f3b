"""How a paged ``FusedMoE`` layer runs a wave and reduces a step: SGLang's Triton and Marlin contracts (``compat``, as
they are), ``NativeContract`` for the torch-native path, and ``LayerWaves`` (the step's ``StepComputation``). A wave is
``slots [tokens, top_k]`` (an entry's slot where the wave holds its expert, else -1); a contract computes those entries
into one merged ``[tokens, top_k, hidden]`` buffer and leaves the others, so the reduction sees the same values
whatever the waves. Triton/Marlin run the format's ``runner_method`` on a base runner from SGLang's ``runner_config``
(router-weighted per-entry outputs, no top-k sum) and finish with the runner's own sum. Every Marlin wave runs the
whole batch on the slot table (``MarlinOnSlots``), so decode graphs capture Marlin steps as they do Triton's. The
native path (e.g. CPU, which SGLang's paged experts does not serve) has no ``no_combine``: one entry
per row with weight 1 gives each unweighted output exactly; then ``moe_forward_native``'s tail: to the weight dtype,
times the router weight (per wave, elementwise: the same bits), sum over top_k, cast back."""

from __future__ import annotations

import torch

from ...contract import order_for_sort, sort_rank
from ...step import StepWave
from .compat import MARLIN, TRITON, contract_for, run_on_slots


class MarlinOnSlots:
    """SGLang's Marlin runner as a contract of fixed shapes: every wave runs the whole batch on the slot table
    (SGLang's ``run_on_slots``: entries outside the wave on slot 0 at weight 0) and keeps its own entries; the step
    ends with Marlin's own sum. Each wave has the unpaged layer's batch shape, and no entry count is read on the host,
    so CUDA graphs capture a step of any number of waves. (SGLang's ``MARLIN`` contract compacts each wave instead,
    reading its entry count on the host; its ``TRITON`` one sends other waves' entries to id -1, which the Triton
    runner skips.) Measured on an H200 within Marlin's batch noise, see docs/formats.md."""

    repacks = True

    def run_wave(self, base_method, layer, dispatch_output, slots, merged):
        partial = run_on_slots(base_method, layer, dispatch_output, slots)
        return partial if merged is None else torch.where((slots < 0).unsqueeze(-1), merged, partial, out=merged)

    def finish(self, merged, hidden_states, routed_scaling_factor):
        return MARLIN.finish(merged, hidden_states, routed_scaling_factor)


MARLIN_ON_SLOTS = MarlinOnSlots()


class NativeContract:
    """SGLang's torch-native MoE path as a runner contract (``run_wave`` / ``finish``)."""

    repacks = False

    @staticmethod
    def _in_unpaged_order(topk_ids: torch.Tensor, slots: torch.Tensor) -> torch.Tensor:
        """The wave's entries, arranged so that the native path's own ``argsort`` of their slot ids hands every expert
        its tokens in the unpaged run's order (that ``argsort``'s tie order is not stable: reproduced, not assumed)."""
        rank = sort_rank(topk_ids)  # the unpaged call's order, on the same tensor
        entries = (slots >= 0).flatten().nonzero().squeeze(1)
        ids = slots.flatten()[entries].to(topk_ids.dtype)  # as the native path will sort them
        return entries[order_for_sort(ids, rank[entries], rank.numel())]

    def run_wave(self, base_method, layer, dispatch_output, slots, merged):
        t, k = slots.shape
        topk = dispatch_output.topk_output
        entries = self._in_unpaged_order(topk.topk_ids, slots)
        if entries.numel() == 0:
            return merged
        tokens = entries // k
        ids = slots.flatten()[entries].to(topk.topk_ids.dtype).unsqueeze(1)
        ones = torch.ones(entries.numel(), 1, dtype=topk.topk_weights.dtype, device=slots.device)
        logits = None if topk.router_logits is None else topk.router_logits[tokens]
        wave = dispatch_output._replace(
            hidden_states=dispatch_output.hidden_states[tokens],
            topk_output=topk._replace(topk_ids=ids, topk_weights=ones, router_logits=logits),
        )
        out = base_method.apply(layer=layer, dispatch_output=wave).hidden_states
        w = topk.topk_weights.flatten()[entries]
        if merged is None:
            merged = torch.zeros(t, k, out.shape[-1], dtype=w.dtype, device=out.device)
        merged.view(t * k, -1)[entries] = out.type(w.dtype).mul_(w.unsqueeze(-1))
        return merged

    def finish(self, merged, hidden_states, routed_scaling_factor):
        # The tail of sglang's moe_forward_native; like it, no routed_scaling_factor here.
        return merged.sum(dim=1).type(hidden_states.dtype)


NATIVE = NativeContract()


def uses_native_path(method) -> bool:
    """Whether the base method runs SGLang's torch-native MoE (unquantized experts off CUDA/ROCm/XPU/NPU)."""
    from sglang.srt.layers.quantization.unquant import UnquantizedFusedMoEMethod

    if not isinstance(method, UnquantizedFusedMoEMethod):
        return False
    resolve = getattr(method, "_resolve_forward_method", None)
    if resolve is None:
        return False
    return getattr(resolve(), "__name__", "") in ("forward_native", "forward_cpu")


def layer_contract(method, runner):
    """The contract for the runner the base method built (``runner`` may be None)."""
    if uses_native_path(method):
        return NATIVE
    contract = contract_for(runner)
    return MARLIN_ON_SLOTS if contract is MARLIN else contract


class LayerWaves:
    """A paged ``FusedMoE`` layer's step (a ``moepage.step.StepComputation``): waves through its contract, reduced."""

    direct = False  # the contract's finish is the step's reduction, one wave or many

    def __init__(self, contract, method, layer, dispatch_output, routed_scaling_factor: float):
        self.contract, self.method, self.layer = contract, method, layer
        self.dispatch_output, self.routed_scaling_factor = dispatch_output, routed_scaling_factor
        self.merged: torch.Tensor | None = None

    def run(self, wave: StepWave) -> None:
        slots = wave.slots.to(torch.int32)
        self.merged = self.contract.run_wave(self.method, self.layer, self.dispatch_output, slots, self.merged)

    @property
    def hidden(self) -> torch.Tensor:
        return self.dispatch_output.hidden_states

    def join(self, entries: torch.Tensor, out: torch.Tensor) -> None:
        """The CPU's entries (``split.SplitComputation``), router-weighted as the contracts keep theirs, in the merged
        entries' dtype (the native path's: the router weights'; the runners': the hidden states')."""
        hidden, topk = self.dispatch_output.hidden_states, self.dispatch_output.topk_output
        if self.merged is None:  # no wave ran: every routed entry is the CPU's
            dtype = topk.topk_weights.dtype if self.contract is NATIVE else hidden.dtype
            self.merged = torch.zeros(*topk.topk_ids.shape, hidden.shape[-1], dtype=dtype, device=hidden.device)
        rows = entries.to(hidden.device)
        w = topk.topk_weights.reshape(-1)[rows].float().unsqueeze(-1)
        flat = self.merged.view(-1, self.merged.shape[-1])
        flat[rows, : out.shape[-1]] = (out.to(hidden.device) * w).to(flat.dtype)

    def finish(self) -> torch.Tensor:
        hidden, topk = self.dispatch_output.hidden_states, self.dispatch_output.topk_output
        merged = self.merged
        if merged is None:  # nothing routed: every entry is padding
            merged = hidden.new_zeros(*topk.topk_ids.shape, hidden.shape[-1])
        return self.contract.finish(merged=merged, hidden_states=hidden,
                                    routed_scaling_factor=self.routed_scaling_factor)


__all__ = ["LayerWaves", "MARLIN", "MARLIN_ON_SLOTS", "NATIVE", "TRITON", "MarlinOnSlots", "layer_contract",
           "uses_native_path"]
