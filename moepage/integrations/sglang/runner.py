"""The SGLang runner contract: how a ``FusedMoE`` quant method runs one wave over the slot table
without its top-k sum, and how the merged per-entry buffer is reduced exactly as SGLang reduces it.

A wave is given as ``slots`` ``[tokens, top_k]``: the slot id of every routed entry whose expert
this wave holds, -1 for every other entry (another wave's, or padding). ``run`` computes the
wave's entries and writes them into ``merged`` (``[tokens, top_k, hidden]``; None before the
first wave), leaving every other entry as it was: each entry is written by the one wave that
holds its expert, so the reduction sees the same values whatever the waves were.

- ``TritonContract`` (CUDA, Triton runner): the base method runs with ``no_combine`` and the
  router weight kept (``runner_config``) and returns router-weighted ``[T, k, H]``; the final sum
  is SGLang's ``moe_combine_topk`` with the layer's ``routed_scaling_factor``.
- ``MarlinContract`` (CUDA, Marlin runner: GPTQ/AWQ): the wave's entries only, compacted to one
  entry per row, so the kernel never sees masked rows; final sum: ``moe_sum_reduce`` as
  ``fused_marlin_moe`` ends with.
- ``NativeContract`` (torch-native path, e.g. CPU): SGLang's ``moe_forward_native`` has no
  ``no_combine``. Fed one entry per row (top_k = 1) with weight 1 it returns each entry's
  unweighted output exactly (x * 1 summed over one term). Every expert sees the same token set
  in the same order as unpaged: the entries are arranged so that the native path's own
  (unstable) ``argsort`` reproduces the unpaged run's within-expert order. The reduction is the tail of ``moe_forward_native``: cast to the
  weight dtype, multiply by the router weight, sum over top_k, cast back.
"""

from __future__ import annotations

from dataclasses import replace

import torch
import torch.nn.functional as F

from ...runners import order_for_sort, sort_rank


def runner_config(config, num_slots: int):
    """The base method's runner config under paging: K local experts, per-entry outputs."""
    return replace(
        config,
        num_local_experts=num_slots,
        inplace=False,
        no_combine=True,
        no_combine_keep_router_weight=True,
    )


def _wave_input(dispatch_output, topk_ids: torch.Tensor, topk_weights: torch.Tensor, **changes):
    topk = dispatch_output.topk_output._replace(topk_ids=topk_ids, topk_weights=topk_weights)
    return dispatch_output._replace(topk_output=topk, **changes)


class SglangRunner:
    """Base of the contracts. ``repacks``: the runner reads a layout the post-load step repacks
    the experts into, so that step runs over the host rows K experts at a time."""

    name = "base"
    repacks = False

    def run(self, method, layer, dispatch_output, slots: torch.Tensor, merged):
        raise NotImplementedError

    def reduce(self, merged: torch.Tensor, dispatch_output, routed_scaling_factor) -> torch.Tensor:
        raise NotImplementedError


class TritonContract(SglangRunner):
    name = "triton"

    def run(self, method, layer, dispatch_output, slots, merged):
        config = runner_of(method, layer).config
        # With K < E the runner filters ids of -1 (its expert-parallel path); with K = E it does
        # not, so masked entries go to slot 0 with weight 0 and are discarded below.
        filters = config.num_experts is None or config.num_experts != config.num_local_experts
        masked = slots < 0
        weights = dispatch_output.topk_output.topk_weights.masked_fill(masked, 0)
        ids = slots if filters else slots.masked_fill(masked, 0)
        out = method.apply(layer=layer, dispatch_output=_wave_input(dispatch_output, ids.to(torch.int32), weights))
        out = out.hidden_states
        if merged is None:
            return out
        return torch.where(masked.unsqueeze(-1), merged, out, out=merged)

    def reduce(self, merged, dispatch_output, routed_scaling_factor):
        from sglang.srt.layers.moe.moe_runner.triton_utils.fused_moe import moe_combine_topk

        hidden = dispatch_output.hidden_states
        out = hidden.new_empty(merged.shape[0], merged.shape[-1])
        moe_combine_topk(
            intermediate_cache3=merged, out_hidden_states=out, routed_scaling_factor=routed_scaling_factor
        )
        return out


def _compact(dispatch_output, slots: torch.Tensor, pad_to: int = 1):
    """The entries of a wave as one entry per row: (rows, entry index, compacted input)."""
    entries = (slots >= 0).flatten().nonzero().squeeze(1)
    num = entries.numel()
    pad = -num % pad_to
    k = slots.shape[1]
    tokens = F.pad(entries // k, (0, pad))
    topk = dispatch_output.topk_output
    logits = None if topk.router_logits is None else topk.router_logits[tokens]
    ids = F.pad(slots.flatten()[entries], (0, pad)).unsqueeze(1).to(topk.topk_ids.dtype)
    return entries, tokens, topk, logits, ids, pad


class MarlinContract(SglangRunner):
    name = "marlin"
    repacks = True

    def run(self, method, layer, dispatch_output, slots, merged):
        if dispatch_output.hidden_states_scale is not None:
            raise NotImplementedError("moepage: the Marlin contract needs unquantized MoE inputs")
        num = int((slots >= 0).sum())
        if num == 0:
            return merged
        # A few padded sizes per power of two: fewer distinct shapes for the kernel; padding rows
        # go to slot 0 with weight 0 and are dropped.
        step = max(16, 1 << max(0, num.bit_length() - 4))
        entries, tokens, topk, logits, ids, pad = _compact(dispatch_output, slots, step)
        weights = F.pad(topk.topk_weights.flatten()[entries], (0, pad)).unsqueeze(1)
        wave = dispatch_output._replace(
            hidden_states=dispatch_output.hidden_states[tokens],
            topk_output=topk._replace(topk_ids=ids, topk_weights=weights, router_logits=logits),
        )
        out = method.apply(layer=layer, dispatch_output=wave).hidden_states
        width = out.shape[-1]
        if merged is None:
            merged = out.new_zeros(*slots.shape, width)
        merged.view(-1, width)[entries] = out.reshape(-1, width)[:num]
        return merged

    def reduce(self, merged, dispatch_output, routed_scaling_factor):
        from sglang.srt.layers.moe.fused_moe_triton.fused_marlin_moe import moe_sum_reduce

        hidden = dispatch_output.hidden_states
        out = hidden.new_empty(merged.shape[0], merged.shape[-1])
        moe_sum_reduce(merged, out, 1.0 if routed_scaling_factor is None else routed_scaling_factor)
        return out[..., : hidden.shape[-1]]


class NativeContract(SglangRunner):
    name = "native"

    @staticmethod
    def _in_unpaged_order(topk_ids: torch.Tensor, slots: torch.Tensor) -> torch.Tensor:
        """The wave's entries, arranged so that the native path's own ``argsort`` of their slot
        ids hands every expert its tokens in the order the unpaged run's ``argsort`` of the
        expert ids did (its tie order is not stable, so both sorts are reproduced, not assumed)."""
        rank = sort_rank(topk_ids)  # the unpaged call's order, on the same tensor
        entries = (slots >= 0).flatten().nonzero().squeeze(1)
        ids = slots.flatten()[entries].to(topk_ids.dtype)  # as the native path will sort them
        return entries[order_for_sort(ids, rank[entries], rank.numel())]

    def run(self, method, layer, dispatch_output, slots, merged):
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
        out = method.apply(layer=layer, dispatch_output=wave).hidden_states
        if merged is None:
            merged = out.new_zeros(t, k, out.shape[-1])
        merged.view(t * k, -1)[entries] = out
        return merged

    def reduce(self, merged, dispatch_output, routed_scaling_factor):
        w = dispatch_output.topk_output.topk_weights
        # The tail of sglang's moe_forward_native; like it, no routed_scaling_factor here.
        return merged.type(w.dtype).mul_(w.unsqueeze(-1)).sum(dim=1).type(merged.dtype)


TRITON = TritonContract()
MARLIN = MarlinContract()
NATIVE = NativeContract()


def uses_native_path(method) -> bool:
    """Whether the base method runs SGLang's torch-native MoE (no CUDA kernels), which is what
    ``apply`` does for unquantized experts where the platform is not CUDA/ROCm/XPU/NPU."""
    from sglang.srt.layers.quantization.unquant import UnquantizedFusedMoEMethod

    if not isinstance(method, UnquantizedFusedMoEMethod):
        return False
    resolve = getattr(method, "_resolve_forward_method", None)
    if resolve is None:
        return False
    chosen = getattr(resolve(), "__name__", "")
    return chosen in ("forward_native", "forward_cpu")


def contract_for(method, runner) -> SglangRunner:
    """The contract for the runner the base method built (``runner`` may be None)."""
    if uses_native_path(method):
        return NATIVE
    backend = getattr(runner, "runner_backend", None)
    if backend is not None and backend.is_triton():
        return TRITON
    if backend is not None and backend.is_marlin() and not backend.is_experimental_sgl_marlin():
        return MARLIN
    raise RuntimeError(
        "moepage: paged experts run on SGLang's triton or Marlin MoE runner (or its torch-native "
        f"path); this layer's method uses {getattr(backend, 'value', backend)!r}. Select one with "
        "--moe-runner-backend triton|marlin if the quantization method supports it"
    )


def runner_of(method, layer):
    """The MoeRunner the base method built: its own, its scheme's, or the scheme kernel's."""
    scheme = getattr(layer, "scheme", None)
    for owner in (method, scheme, getattr(scheme, "kernel", None)):
        runner = getattr(owner, "runner", None)
        if runner is not None:
            return runner
    return None
